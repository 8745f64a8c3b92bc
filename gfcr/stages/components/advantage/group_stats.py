"""Group statistics several estimators share (numpy only): the group z-score, the rollouts'
correctness flags, and REINFORCE++'s token-weighted whitening across the update's batch.

>>> standardised(np.array([0.0, 1.0]), eps=0.0).tolist()
[-0.7071067811865475, 0.7071067811865475]
>>> standardised(np.array([0.1, 0.1, 0.1]), eps=1e-6).tolist()
[0.0, 0.0, 0.0]
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from gfcr.records import Rollout, RolloutGroup
from gfcr.stages.components.advantage.base import Advantages, has_no_baseline


def standardised(values: np.ndarray, eps: float, ddof: int = 1) -> np.ndarray:
    """``(v - mean(v)) / (std(v) + eps)``; exactly 0.0 where there is nothing to compare (one
    value, or all equal), so rounding in the mean leaves no residue."""
    values = np.asarray(values, dtype=np.float64)
    if has_no_baseline(values):
        return np.zeros_like(values)
    return (values - values.mean()) / (values.std(ddof=ddof) + eps)


VAR_FLOOR = 1e-8  # OpenRLHF's var.clamp(min=1e-8) before rsqrt


def counted_tokens(rollout: Rollout) -> int:
    """The response tokens that count in the loss (OpenRLHF's ``action_mask``)."""
    return len(rollout) if rollout.loss_mask is None else int(np.count_nonzero(rollout.loss_mask))


def token_whitened(c: np.ndarray, n: np.ndarray, std_norm: bool, unbiased: bool = False) -> np.ndarray:
    """``[B*G]``: each response's value ``c_i`` whitened over the batch's tokens, a response
    weighing its ``n_i`` counted tokens (OpenRLHF's masked whitening with ``gamma = 1``):
    ``(c_i - mu) / sqrt(max(var, 1e-8))`` with the token mean ``mu`` and population variance
    ``var``; ``c - mu`` when not ``std_norm``; 0.0 when no token counts. ``unbiased``: verl's
    ``masked_whiten``, ``(c_i - mu) / sqrt(var * N / (N - 1) + 1e-8)``."""
    total = n.sum()
    if total == 0:
        return c * 0.0
    mu = float((n * c).sum() / total)
    if not std_norm:
        return c - mu
    var = float((n * (c - mu) ** 2).sum() / total)
    if unbiased:  # verl's Bessel correction over the N counted tokens, the 1e-8 added, not a floor
        return (c - mu) / np.sqrt(var * total / max(total - 1, 1) + VAR_FLOOR)
    return (c - mu) / np.sqrt(max(var, VAR_FLOOR))


def batch_whitened(groups: Sequence[RolloutGroup], values: list[np.ndarray], std_norm: bool,
                   unbiased: bool = False) -> list[Advantages]:
    """Per group, its rollouts' ``values`` whitened over the tokens of the whole batch."""
    c = np.concatenate(values) if values else np.zeros(0)  # [B*G]
    n = np.array([counted_tokens(r) for g in groups for r in g.rollouts], dtype=np.float64)  # [B*G]
    a = token_whitened(c, n, std_norm, unbiased)
    bounds = np.cumsum([len(x) for x in values])[:-1]
    return [Advantages.scalars(part) for part in np.split(a, bounds)]


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
