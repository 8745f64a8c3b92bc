"""advantage ``gdpo``: GDPO, Group reward-Decoupled normalization Policy Optimization (Liu, Dong,
Lu, Diao, Belcak, Liu, Chen, Yin, Wang, Cheng, Choi, Kautz, Molchanov; NVIDIA, 2026;
arXiv 2601.05242; reference code ``NVlabs/GDPO``, ``trl-GDPO``).

GRPO sums a rollout's reward components and normalises the sum in its group, which maps
different component combinations to the same advantage (the paper's "reward collapse"). GDPO
normalises every component separately. With ``r_k`` the group's values of component ``k``
(``Rollout.reward_components``, written by a verifier) and ``w_k`` its weight (1 unless
``weights`` says otherwise):

1. per group and component: ``A_k = (r_k - mean(r_k)) / (std(r_k) + eps)``;
2. per rollout: ``A_sum = sum_k w_k A_k``;
3. over the whole batch (every rollout of every group the update receives):
   ``A = (A_sum - mean_batch(A_sum)) / (std_batch(A_sum) + eps)``, which keeps the scale from
   growing with the number of components.

``std`` is the unbiased sample std and ``eps`` is 1e-4, as the reference's TRL trainer computes
both steps. Step 3 is batch-level, so the estimator defines ``estimate_batch(groups, pool)``
(the update calls it); ``estimate(group)`` treats one group as the whole batch.

With a single component GDPO is GRPO's ``mean_std`` advantage re-standardised over the batch:
within one group that only divides by the std of the z-scores (``s / (s + eps)``, about 1),
across groups it rescales every advantage by one batch-wide factor (groups whose rewards are
all equal count as zeros in that std).

The scalar ``Rollout.reward`` is not used (it is still checked, so unscored rollouts are
refused). Every rollout of a group must carry the same component names: a rollout missing a
component the others have is a ValueError naming the group and rollout, as is a group with no
components at all. With ``weights`` set, every component present must have a weight (0 leaves
it out) and every weighted component must be present.

Deviations:
- a group with nothing to compare (one rollout, or all its components equal) gets exactly
  0.0; the reference gives it ``-mean_batch / std_batch``, which is 0 up to rounding because
  each group's normalised components are centred, so the batch mean is 0;
- a single-component batch still gets step 3 (the reference's TRL trainer falls back to plain
  GRPO when there is one reward function);
- batch statistics count each rollout once, as the TRL reference does; the reference's verl
  port whitens over tokens (longer rollouts weigh more) and uses 1e-6 / 1e-8 for ``eps``;
- NaN components and unscored rollouts raise ValueError naming the group (the reference maps
  NaN to 0).

Example (two groups of two rollouts with components ``correct`` and ``format``: GRPO on the
sums gives both groups ``+-0.71``; GDPO tells "format only" from "correct and formatted"):

>>> from gfcr.stages.testing import scored_group
>>> def scored(prompt, components):
...     group = scored_group(prompt, [sum(c.values()) for c in components])
...     for rollout, c in zip(group.rollouts, components):
...         rollout.reward_components = c
...     return group
>>> a = scored("p:0", [{"correct": 0.0, "format": 0.0}, {"correct": 0.0, "format": 1.0}])
>>> b = scored("p:1", [{"correct": 0.0, "format": 0.0}, {"correct": 1.0, "format": 1.0}])
>>> [[round(v, 2) for v in out.values] for out in GDPO(GDPO.Config()).estimate_batch([a, b], None)]
[[-0.55, 0.55], [-1.1, 1.1]]

YAML:

.. code-block:: yaml

    update:
      use: update.grpo
      from: reward
      with: {advantage: {use: gdpo, with: {weights: {correct: 1.0, format: 0.5}}}}
"""

from __future__ import annotations

from typing import Annotated, Any, Sequence

import numpy as np
from pydantic import Field

from gfcr.records import RolloutGroup
from gfcr.stages.components.advantage.base import Advantages, EstimatorConfig, checked_rewards, has_no_baseline
from gfcr.stages.components.advantage.group_stats import standardised


def component_table(group: RolloutGroup, required: set[str] | None = None) -> tuple[list[str], np.ndarray]:
    """The group's component names (sorted) and their values ``[G, K]``; ValueError naming the
    group when a rollout lacks a component, a value is NaN, or there are none."""
    present = set().union(*(r.reward_components for r in group.rollouts)) if group.rollouts else set()
    names = sorted(present | (required or set()))
    if not names:
        raise ValueError(f"group {group.group_id}: no rollout has reward_components; gdpo normalises each "
                         "component separately, so score with a verifier that writes them (filter.verify "
                         "writes `correct` and `format`), or use advantage mean_std for a single reward")
    for r in group.rollouts:
        missing = [n for n in names if n not in r.reward_components]
        if missing:
            raise ValueError(f"group {group.group_id}: rollout {r.rollout_id} has no reward component "
                             f"{', '.join(f'`{n}`' for n in missing)}, which {_whose(missing, required)}; every "
                             "rollout must be scored by the same verifier (rescore replayed or cached rollouts)")
    table = np.array([[r.reward_components[n] for n in names] for r in group.rollouts], dtype=np.float64)
    if np.isnan(table).any():
        raise ValueError(f"group {group.group_id}: {int(np.isnan(table).any(axis=1).sum())} rollouts have NaN "
                         "reward components; the verifier must score every component")
    return names, table.reshape(len(group.rollouts), len(names))


def _whose(missing: list[str], required: set[str] | None) -> str:
    if required and all(n in required for n in missing):
        return "`weights` names"
    return "other rollouts of the group have"


def batch_standardised(summed: list[np.ndarray], eps: float) -> list[np.ndarray]:
    """Step 3: standardise every group's ``A_sum`` by the whole batch's mean and sample std; a
    group whose ``A_sum`` is all zero (nothing to compare) stays exactly 0.0."""
    flat = np.concatenate(summed) if summed else np.zeros(0)
    if has_no_baseline(flat):
        return [np.zeros_like(a) for a in summed]
    mean, std = float(flat.mean()), float(flat.std(ddof=1))
    return [(a - mean) / (std + eps) if np.any(a != 0.0) else np.zeros_like(a) for a in summed]


class GDPO:
    """Each reward component normalised in its group, weighted sum, batch standardisation."""

    class Config(EstimatorConfig):
        weights: dict[str, float] | None = Field(
            None, description="weight of each reward component (every component present needs one; 0 leaves it "
                              "out); None: weight 1 for every component")
        eps: Annotated[float, Field(ge=0.0, description="added to both stds (the TRL reference's 1e-4)")] = 1e-4

    def __init__(self, config: Config):
        self.config = config

    def estimate(self, group: RolloutGroup) -> Advantages:
        return self.estimate_batch([group], None)[0]

    def estimate_batch(self, groups: Sequence[RolloutGroup], pool: Any) -> list[Advantages]:
        summed = [self.summed(g) for g in groups]  # per group [G]
        return [Advantages.scalars(a) for a in batch_standardised(summed, self.config.eps)]

    def summed(self, group: RolloutGroup) -> np.ndarray:
        """Steps 1 and 2: ``A_sum = sum_k w_k A_k`` for each rollout of the group ``[G]``."""
        checked_rewards(group)
        if not group.rollouts:
            return np.zeros(0)
        weights = self.config.weights
        names, table = component_table(group, set(weights) if weights is not None else None)
        w = np.array([self._weight(group, n) for n in names], dtype=np.float64)  # [K]
        z = np.stack([standardised(table[:, k], self.config.eps) for k in range(len(names))], axis=1)  # [G, K]
        return z @ w

    def _weight(self, group: RolloutGroup, name: str) -> float:
        if self.config.weights is None:
            return 1.0
        if name not in self.config.weights:
            raise ValueError(f"group {group.group_id}: reward component `{name}` has no weight in gdpo's `weights` "
                             f"({', '.join(sorted(self.config.weights))}); give every component a weight "
                             f"(`{name}: 0.0` leaves it out)")
        return float(self.config.weights[name])
