"""Engines behind one protocol (``gfcr.stages.resources.Engine``): the transformers engine on
CPU, sharing the trained model object, and the vLLM engine on GPU, which loads the trained
weights after every update. The names below import torch when first used (not on importing
this package, so ``gfcr validate`` can check a model with ``gfcr.engines.models`` alone); vLLM
is imported only when a ``VLLMEngine`` starts."""

from __future__ import annotations

import importlib
from typing import Any

_WHERE = {
    "FakeEngine": "fake", "TransformersEngine": "hf", "ALIASES": "models", "ModelError": "models",
    "check_model": "models", "resolve_model": "models", "HFPolicy": "policy", "load_policy": "policy",
    "EngineError": "vllm_engine", "VLLMEngine": "vllm_engine", "require_vllm": "vllm_engine",
}

__all__ = sorted(_WHERE)


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{_WHERE[name]}"), name)
    globals()[name] = value
    return value
