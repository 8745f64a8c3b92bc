"""Judge models other than the policy (``filter.judge`` with ``model: <alias or folder>``).

``JudgeModels`` is what the runtime lends as ``Lent.judges``: each model is loaded once, on first
use (``HFPolicy``, float32 on the CPU), frozen (eval mode, no gradients, never updated or synced),
and served by a ``TransformersEngine`` of its own. A second vLLM engine beside the policy's is not
started: on the CPU, vLLM runs its worker in the trainer's process, and two in one process share
its global state; a judge on vLLM is the policy's own engine (``model: policy``).
"""

from __future__ import annotations

import threading
from typing import Any


class JudgeModels:
    """``judges(model) -> (frozen policy, engine)``, loading each model once."""

    def __init__(self) -> None:
        self._loaded: dict[str, tuple[Any, Any]] = {}
        self._lock = threading.Lock()

    def __call__(self, model: str) -> tuple[Any, Any]:
        with self._lock:
            if model not in self._loaded:
                self._loaded[model] = load_judge(model)
            return self._loaded[model]


def load_judge(model: str) -> tuple[Any, Any]:
    """``(HFPolicy, TransformersEngine)`` of ``model``, frozen (torch is imported here, on first use)."""
    from gfcr.engines.hf import TransformersEngine
    from gfcr.engines.models import resolve_model
    from gfcr.engines.policy import HFPolicy

    policy = HFPolicy(model, resolve_model(model))
    policy.model.eval()
    for parameter in policy.model.parameters():
        parameter.requires_grad_(False)
    return policy, TransformersEngine(policy, replica=f"judge-{model}")
