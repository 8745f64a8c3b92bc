"""advantage ``mean``: Dr. GRPO's mean-centred advantage (Liu et al., 2025, arXiv 2503.20783).

With ``r`` the group's rewards, ``A = r - mean(r)``: no division by the std, which Dr. GRPO
shows biases the update towards too easy and too hard questions.

Fidelity: checked against volcengine/verl@b178a3c: 33/36 cases, 3 documented deviations
(``tests/fidelity/mean.json``; ``compute_grpo_outcome_advantage`` with
``norm_adv_by_std_in_grpo=False``, verl's Dr.GRPO setting); with ``single_rollout: verl`` all
36 agree.

Deviations:
- a group of one rollout gets exactly 0.0: a lone rollout has no baseline here; verl gives it
  its raw reward ``r`` (mean 0) (3 reference cases: rewards 1, 0.5 and -2; a reward of 0 agrees):
  ``single_rollout: verl`` gives verl's;
- a group whose rewards are all equal gets exactly 0.0, as in verl (the mean's rounding would
  otherwise leave tiny non-zero values for non-binary rewards);
- unscored rollouts (NaN rewards) raise ValueError naming the group.

Example:

>>> from gfcr.stages.testing import scored_group
>>> Mean(Mean.Config()).estimate(scored_group("p:0", [1.0, 0.0, 0.0, 0.0])).values
(0.75, -0.25, -0.25, -0.25)

YAML:

.. code-block:: yaml

    update: {use: update.grpo, from: keep, with: {advantage: {use: mean}}}
"""

from __future__ import annotations

from pydantic import Field

from gfcr.records import RolloutGroup
from gfcr.stages.components.advantage.base import (SINGLE_ROLLOUT_HELP, Advantages, EstimatorConfig, SingleRollout,
                                                   checked_rewards, has_no_baseline, lone_reward)


class Mean:
    """Dr. GRPO: rewards centred on the group mean."""

    class Config(EstimatorConfig):
        single_rollout: SingleRollout = Field("zero", description=SINGLE_ROLLOUT_HELP)

    def __init__(self, config: Config):
        self.config = config

    def estimate(self, group: RolloutGroup) -> Advantages:
        r = checked_rewards(group)  # [G]
        if lone_reward(r, self.config.single_rollout):
            return Advantages.scalars(r.copy())
        return Advantages.scalars(r * 0.0 if has_no_baseline(r) else r - r.mean())
