"""What ``update.grpo`` saves of each step's batch when its ``save_batches`` names a folder: the
numbers its loss saw, so that another trainer's formulas can be run on the very same batch
(``tests/fidelity/test_verl_steps.py`` recomputes them with verl's ``core_algos``).

One JSON file a step, ``<save_batches>/batch-<version>.json`` (``version`` the policy version
the batch was prepared at, the step's number in a synchronous run)::

    {"format": "gfcr.update_batch/1", "version": 3, "skip_reason": null,
     "update": {"advantage": {...}, "loss": {...}, "aggregation": {...}, "correction": {...},
                "micro_batch_size": 16, "temperature": 1.0, "kl_coef": 0.0},
     "rollouts": [{"id": "...", "group": "...", "reward": 1.0, "length": 5,
                   "advantage": 0.93, "weights": null, "forward": true}, ...],
     "micro_batches": [{"rows": ["<rollout id>", ...], "log_prob": ["<hex>", ...],
                        "old_log_prob": [...], "behaviour_log_prob": [...], "advantage": [...],
                        "weight": [...], "loss": 0.0012}, ...],
     "loss": 0.0063}

``rollouts`` is every rollout of the included groups in batch order (a Row of the aggregation
each), with the advantage the update gave it (a float, or a hex row when per-token) and its token
weights (null: every token weighs 1); ``forward`` says whether it entered the forward pass (one
whose advantage is zero on every counted token does not, and its loss is 0). ``micro_batches``
are the forward passes in order: their rollouts, then per rollout the ``[T]`` float32 arrays the
loss was built from: ``log_prob`` (the current policy, the gradient pass's own), ``old_log_prob``
(what the ratio was taken against: ``behaviour_log_prob`` under the correction ``none``, the
correction's proximal log-probs otherwise), ``behaviour_log_prob`` (``mu``, the engine's),
``advantage`` and ``weight`` as the loss got them, ``ref_log_prob`` (the frozen initial policy's,
only with a ``kl_coef``), and the micro-batch's ``loss`` (the KL term included); the step's
``loss`` is their sum plus any once-a-step term of the aggregation. Arrays are hex strings of
big-endian float32 (8 hex digits a value), which round-trip exactly; under trainer ranks each
rank's micro-batches follow the previous rank's.

Saving costs nothing when ``save_batches`` is unset (nothing is recorded), and saving changes no
number the step computes.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

FORMAT = "gfcr.update_batch/1"


def to_hex(values: Any) -> str:
    """A 1-D array as big-endian float32 hex (8 digits a value): exact, and a few times smaller
    than decimal JSON."""
    return np.asarray(values, dtype=">f4").tobytes().hex()


def from_hex(text: str) -> np.ndarray:
    """The float32 array ``to_hex`` wrote."""
    return np.frombuffer(bytes.fromhex(text), dtype=">f4").astype(np.float32)


def micro_batch_record(ids: list[str], lengths: list[int], tensors: dict[str, Any], loss: float) -> dict[str, Any]:
    """One micro-batch's record: each ``[B, R]`` tensor of ``tensors`` cut to its rows' lengths."""
    record: dict[str, Any] = {"rows": list(ids)}
    for name, tensor in tensors.items():
        array = tensor.detach().float().cpu().numpy()  # [B, R]
        record[name] = [to_hex(array[b, :n]) for b, n in enumerate(lengths)]
    record["loss"] = float(loss)
    return record


def saved_rollout(item: Any, forward: bool) -> dict[str, Any]:
    """One rollout of the batch (an ``update.grpo`` batch item) as the file holds it."""
    r, g, a = item.rollout, item.group, item.advantage
    return {"id": r.rollout_id, "group": g.group_id if g else "", "reward": r.reward, "length": len(r),
            "advantage": to_hex(a) if isinstance(a, np.ndarray) else float(a),
            "weights": None if item.weights is None else to_hex(item.weights), "forward": forward}


def save_step(folder: str | Path, batch: Any, shards: list[Any]) -> Path:
    """Write a step: its ``TrainBatch``'s saved part, the shards' micro-batches (in rank order)
    and the step's loss (None where the step was skipped before training)."""
    micro = [m for s in shards for m in (s.batch_trace or [])]
    return write_step(folder, batch.version, {**(batch.saved or {}), "skip_reason": batch.skip_reason,
                                              "micro_batches": micro, "loss": shards[0].loss if shards else None})


def write_step(folder: str | Path, version: int, record: dict[str, Any]) -> Path:
    """Write one step's record as ``batch-<version>.json`` under ``folder`` (made if missing)."""
    path = Path(folder) / f"batch-{version:06d}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"format": FORMAT, "version": version, **record}, sort_keys=True) + "\n")
    return path


def read_steps(folder: str | Path) -> list[dict[str, Any]]:
    """Every saved step of ``folder``, in version order."""
    steps = [json.loads(p.read_text()) for p in sorted(Path(folder).glob("batch-*.json"))]
    for step in steps:
        if step.get("format") != FORMAT:
            raise ValueError(f"{folder}: batch-{step.get('version')} is not a {FORMAT} file")
    return steps
