"""Group-relative advantage estimators for outcome rewards: the rewards of ONE group in, one
scalar advantage per rollout out (numpy only; an Update stage turns them into a loss).

With ``r`` a group's ``G`` rewards:

- ``mean_std``, GRPO (Shao et al., 2024, arXiv 2402.03300):
  ``A = (r - mean(r)) / (std(r) + eps)``. ``std`` is the unbiased sample std
  (``std_ddof=1``), as TRL, verl (``torch.std``) and the peer hand loop compute it;
  ``std_ddof=0`` gives the population std. ``eps`` defaults to verl's 1e-6 (TRL uses 1e-4).
- ``mean``, Dr. GRPO (Liu et al., 2025, arXiv 2503.20783): ``A = r - mean(r)``, no std.
- ``median``, MC-GRPO (arXiv 2601.22582; ``lotusroot-kim/MC-GRPO``): ``A = r - m``, where
  ``m`` is the LOWER middle of the sorted rewards when ``G`` is even, as ``torch.median``
  returns in the reference code. ``mad_scale=True`` divides by
  ``median(|r - m|) + 1e-3`` (again the lower median), as the reference does.
- ``gapo``, GAPO (arXiv 2510.21830; ``TsingZ0/verl-GAPO``): sort ``r``, take the shortest
  contiguous window of the sorted rewards that holds ``k = ceil(gapo_fraction * G)`` values
  (the leftmost one when several are equally short: the reference keeps the first window
  with a strictly smaller span), ``Q`` = the median of that window (the average of the two
  middle values for an even-length window, as the reference computes it), and
  ``A = (r - Q) / (sqrt(sum((r - Q)^2) / (G - 1)) + eps)``.

Deviations:
- Every estimator returns exactly 0.0 for a group whose rewards are all equal, and for a
  group of one rollout. The references give tiny non-zero values for equal non-binary
  rewards (``mean`` rounding divided by ``eps``), and verl (GRPO and GAPO) returns the raw
  reward for a singleton group (mean 0, std 1); a lone rollout has no group baseline, so it
  gets no advantage here.
- MC-GRPO's pivot exclusion (the median rollout gets no gradient) and its rescale of the
  non-zero advantages by ``(G+1) / #nonzero`` are not implemented; they change which
  rollouts reach the loss and their weight, which is an Update stage's decision. MAD scaling
  is off by default: with binary rewards the MAD is usually 0 and the advantages become
  +-1000 (the research note's warning; ambiguity 2 of the note).
- GAPO's window size is ``ceil(gapo_fraction * G)`` computed with a 1e-9 tolerance, so
  ``0.3 * 10`` gives a window of 3 values, where the reference's float arithmetic gives 4.
- Unscored rollouts (NaN rewards) raise ValueError instead of propagating NaN.

Example:

>>> import numpy as np
>>> group_advantages(np.array([0.0, 1.0]), "mean_std").round(4).tolist()
[-0.7071, 0.7071]
>>> group_advantages(np.array([0.0, 0.0, 1.0, 1.0]), "median").tolist()
[0.0, 0.0, 1.0, 1.0]
>>> group_advantages(np.array([1.0, 1.0, 1.0]), "gapo").tolist()
[0.0, 0.0, 0.0]
"""

from __future__ import annotations

import math
from typing import Literal

import numpy as np

from gfcr.records import RolloutGroups

Estimator = Literal["mean_std", "mean", "median", "gapo"]
ESTIMATORS: tuple[str, ...] = ("mean_std", "mean", "median", "gapo")
MAD_EPS = 1e-3  # MC-GRPO's MAD floor, from the reference code


def lower_median(values: np.ndarray) -> float:
    """The middle of the sorted values; the lower of the two middles when their count is even
    (``torch.median`` semantics)."""
    ordered = np.sort(values)
    return float(ordered[(len(ordered) - 1) // 2])


def shortest_window(sorted_rewards: np.ndarray, size: int) -> np.ndarray:
    """The leftmost of the shortest windows of ``size`` consecutive values of a sorted array."""
    spans = sorted_rewards[size - 1 :] - sorted_rewards[: len(sorted_rewards) - size + 1]
    start = int(np.argmin(spans))  # argmin returns the first minimum: the leftmost window
    return sorted_rewards[start : start + size]


def _check(rewards: np.ndarray) -> np.ndarray:
    rewards = np.asarray(rewards, dtype=np.float64)
    if rewards.ndim != 1:
        raise ValueError(f"rewards must be one group's rewards, shape [G]; got shape {rewards.shape}")
    if np.isnan(rewards).any():
        raise ValueError(
            f"{int(np.isnan(rewards).sum())} of {len(rewards)} rewards are NaN (unscored rollouts); "
            "put a verifier stage before the update, or drop the unscored rollouts"
        )
    return rewards


def group_advantages(rewards: np.ndarray, estimator: Estimator = "mean_std", *, eps: float = 1e-6,
                     std_ddof: int = 1, mad_scale: bool = False, gapo_fraction: float = 0.5) -> np.ndarray:
    """Advantages ``[G]`` float64 of one group's rewards ``[G]``; see the module docstring."""
    r = _check(rewards)  # [G]
    if estimator not in ESTIMATORS:
        raise ValueError(f"unknown advantage estimator {estimator!r}; choose one of {', '.join(ESTIMATORS)}")
    if not 0.0 < gapo_fraction <= 1.0:
        raise ValueError(f"gapo_fraction must be in (0, 1], got {gapo_fraction}")
    if len(r) < 2 or r.max() == r.min():
        return np.zeros_like(r)  # no baseline to compare against, or nothing to prefer
    if estimator == "mean_std":
        return (r - r.mean()) / (r.std(ddof=std_ddof) + eps)
    if estimator == "mean":
        return r - r.mean()
    if estimator == "median":
        centred = r - lower_median(r)
        return centred / (lower_median(np.abs(centred)) + MAD_EPS) if mad_scale else centred
    size = max(1, math.ceil(gapo_fraction * len(r) - 1e-9))
    q = float(np.median(shortest_window(np.sort(r), size)))
    centred = r - q
    return centred / (math.sqrt(float(np.sum(centred**2)) / (len(r) - 1)) + eps)


def assign_advantages(groups: RolloutGroups, estimator: Estimator = "mean_std", **kwargs) -> int:
    """Write ``rollout.advantage`` (a float) on every rollout of the included groups; return
    how many rollouts got a non-zero advantage. ``kwargs`` go to ``group_advantages``."""
    nonzero = 0
    for group in groups.included():
        try:
            advantages = group_advantages(group.rewards, estimator, **kwargs)
        except ValueError as exc:
            raise ValueError(f"group {group.group_id}: {exc}") from exc
        for rollout, advantage in zip(group.rollouts, advantages):
            rollout.advantage = float(advantage)
        nonzero += int(np.count_nonzero(advantages))
    return nonzero
