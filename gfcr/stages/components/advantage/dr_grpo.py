"""advantage ``dr_grpo``: Dr.GRPO's advantage (Liu et al., 2025, "Understanding R1-Zero-Like
Training: A Critical Perspective", arXiv 2503.20783, section 3.1), paired with its aggregation.

With ``r`` the group's rewards, ``A = r - mean(r)``: GRPO's advantage without the division by
the group's std, which the paper shows weights too easy and too hard questions more.

Dr.GRPO has a second half: each response's token losses are summed and divided by a constant
(the generation's maximum length), not by the response's own length, which removes GRPO's
preference for long wrong answers. In gfcr that half is the aggregation
``seq_mean_token_sum``, and ``dr_grpo`` requires it: ``gfcr validate`` refuses ``dr_grpo``
with any other aggregation. The estimator ``mean`` computes the same centring without the
pairing, for ablations that combine it with another aggregation.

Fidelity: checked against volcengine/verl@b178a3c: 33/36 cases, 3 documented deviations
(``tests/fidelity/dr_grpo.json``; ``compute_grpo_outcome_advantage`` with
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
>>> DrGRPO(DrGRPO.Config()).estimate(scored_group("p:0", [1.0, 0.0, 0.0, 0.0])).values
(0.75, -0.25, -0.25, -0.25)

YAML (``constant`` is the generation's ``max_new_tokens``):

.. code-block:: yaml

    update:
      use: update.grpo
      from: keep
      with:
        advantage: {use: dr_grpo}
        aggregation: {use: seq_mean_token_sum, with: {constant: 1024}}
"""

from __future__ import annotations

from pydantic import Field

from gfcr.records import RolloutGroup
from gfcr.stages.components.advantage.base import (SINGLE_ROLLOUT_HELP, Advantages, EstimatorConfig, SingleRollout,
                                                   checked_rewards, has_no_baseline, lone_reward)
from gfcr.stages.components.base import Requirement


class DrGRPO:
    """Rewards centred on the group mean; the aggregation must be Dr.GRPO's."""

    requires = (Requirement(
        "aggregation", ("seq_mean_token_sum",),
        "`dr_grpo` is half of Dr.GRPO (arXiv 2503.20783); its other half divides each response's "
        "summed token losses by a constant, not by the response's length"),)

    class Config(EstimatorConfig):
        single_rollout: SingleRollout = Field("zero", description=SINGLE_ROLLOUT_HELP)

    def __init__(self, config: Config):
        self.config = config

    def estimate(self, group: RolloutGroup) -> Advantages:
        r = checked_rewards(group)  # [G]
        if lone_reward(r, self.config.single_rollout):
            return Advantages.scalars(r.copy())
        return Advantages.scalars(r * 0.0 if has_no_baseline(r) else r - r.mean())
