"""filter.nonzero_variance: drop groups whose rewards are all equal.

With a group-normalised advantage, a zero-variance group (all correct or all wrong) has
zero advantage everywhere and adds no policy gradient. This is the filtering half of DAPO's
dynamic sampling (Yu et al., 2025, arXiv 2503.14476); the top-up half is the loop block
with ``filter.dynamic_sampling``.

Deviations: DAPO compares the standard deviation to 0 exactly; here rewards are "equal"
when ``max - min <= tolerance`` (default 0, i.e. exact). Groups with fewer than two scored
rollouts are dropped too, since they have no variance to measure.

Fidelity: checked against volcengine/verl@004c888: 10/12 cases, 2 documented deviations

The cases (``tests/fidelity/nonzero_variance.json``) run the keep rule of verl's DAPO recipe
(``recipe/dapo/dapo_ray_trainer.py``, ``RayDAPOTrainer.fit``) on one generation batch; the two
deviations are the two listed above (a group of one; a rounding-level ``np.std``).

Example:

>>> from gfcr.stages.testing import scored_group
>>> from gfcr.records import RolloutGroups
>>> kept = NonzeroVariance(NonzeroVariance.Config()).run(
...     RolloutGroups([scored_group("p:0", [1, 1, 1]), scored_group("p:1", [0, 1, 0])]))
>>> [g.prompt_id for g in kept]
['p:1']

YAML:

.. code-block:: yaml

    keep: {use: filter.nonzero_variance, from: reward}
"""

from __future__ import annotations

from typing import Annotated, ClassVar

import numpy as np
from pydantic import Field

from gfcr.records import RolloutGroup, RolloutGroups
from gfcr.registry import StageConfig


def zero_variance_reason(group: RolloutGroup, tolerance: float) -> str | None:
    """Why ``group`` has no reward variance, or None if it has some."""
    rewards = group.rewards
    if np.isnan(rewards).any():
        raise ValueError(f"group {group.group_id} has unscored rollouts; put a verifier stage before this filter")
    if len(rewards) < 2:
        return f"fewer than 2 rollouts ({len(rewards)})"
    if rewards.max() - rewards.min() <= tolerance:
        kind = "all correct" if all(r.correct for r in group.rollouts) else (
            "all wrong" if not any(r.correct for r in group.rollouts) else "all equal")
        return f"zero variance: every reward = {rewards[0]:g} ({kind})"
    return None


class NonzeroVariance:
    """Keep only groups whose rewards differ (max - min > tolerance)."""

    class Config(StageConfig):
        reads_rewards: ClassVar[bool] = True  # a capability (gfcr.registry.ReadsRewards): a verifier must be upstream
        per_group: ClassVar[bool] = True  # a capability (gfcr.registry.PerGroup): each group's own reward range
        tolerance: Annotated[float, Field(ge=0.0, description="rewards within this range count as equal")] = 0.0

    def __init__(self, config: Config):
        self.config = config

    def run(self, groups: RolloutGroups) -> RolloutGroups:
        kept = []
        for group in groups:
            reason = zero_variance_reason(group, self.config.tolerance)
            if reason is None:
                kept.append(group)
            else:
                group.drop(reason)
        return RolloutGroups(kept)
