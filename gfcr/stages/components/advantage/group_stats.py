"""Group statistics several estimators share (numpy only): the group z-score and the rollouts'
correctness flags.

>>> standardised(np.array([0.0, 1.0]), eps=0.0).tolist()
[-0.7071067811865475, 0.7071067811865475]
>>> standardised(np.array([0.1, 0.1, 0.1]), eps=1e-6).tolist()
[0.0, 0.0, 0.0]
"""

from __future__ import annotations

import numpy as np

from gfcr.records import RolloutGroup
from gfcr.stages.components.advantage.base import has_no_baseline


def standardised(values: np.ndarray, eps: float, ddof: int = 1) -> np.ndarray:
    """``(v - mean(v)) / (std(v) + eps)``; exactly 0.0 where there is nothing to compare (one
    value, or all equal), so rounding in the mean leaves no residue."""
    values = np.asarray(values, dtype=np.float64)
    if has_no_baseline(values):
        return np.zeros_like(values)
    return (values - values.mean()) / (values.std(ddof=ddof) + eps)


def correct_flags(group: RolloutGroup, alias: str) -> np.ndarray:
    """``[G]`` bool: each rollout's ``correct``; ValueError naming the group if a verifier has
    not set it on every rollout."""
    missing = [r.rollout_id for r in group.rollouts if r.correct is None]
    if missing:
        raise ValueError(
            f"group {group.group_id}: {len(missing)} of {len(group.rollouts)} rollouts have no `correct` "
            f"(first: {missing[0]}); advantage `{alias}` reads each rollout's correctness, which a verifier "
            "writes: put filter.verify between generation and the update")
    return np.array([bool(r.correct) for r in group.rollouts], dtype=bool)
