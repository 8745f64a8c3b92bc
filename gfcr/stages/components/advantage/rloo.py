"""advantage ``rloo``: REINFORCE Leave-One-Out (Ahmadian et al., 2024, "Back to Basics: Revisiting
REINFORCE Style Optimization for Learning from Human Feedback in LLMs", arXiv 2402.14740; the
estimator of Kool et al., 2019, "Buy 4 REINFORCE Samples, Get a Baseline for Free!", ICLR
workshop, no arXiv id confirmed).

With ``r`` the group's ``G`` rewards, each rollout's baseline is the mean reward of the OTHER
``G - 1`` rollouts:

    A_i = r_i - (1 / (G - 1)) * sum_{j != i} r_j  =  r_i - (sum(r) - r_i) / (G - 1)

which equals ``G / (G - 1) * (r_i - mean(r))``: the mean baseline, scaled up so that no
rollout's own reward lowers its baseline (the estimate is unbiased). No std division and no
batch normalisation (OpenRLHF's ``rloo`` and TRL's ``RLOOTrainer`` default agree).

Fidelity: checked against volcengine/verl@b178a3c: 33/36 cases, 3 documented deviations
(``tests/fidelity/rloo.json``; ``compute_rloo_outcome_advantage``); with ``single_rollout: verl``
all 36 agree.

Deviations:
- the paper folds a KL penalty into the sequence reward (``r - beta * KL``); in gfcr the KL
  is a term of the loss (``update.with.kl_coef``), so ``r`` is the verifier's reward alone;
- a group of one rollout (no other rollout to be a baseline) gets exactly 0.0; verl leaves its
  reward unchanged, ``A = r`` (3 reference cases: rewards 1, 0.5 and -2; a reward of 0 agrees):
  ``single_rollout: verl`` gives verl's;
- a group whose rewards are all equal gets exactly 0.0, as in verl; unscored rollouts (NaN
  rewards) raise ValueError naming the group.

Example (``[1, 0, 0, 0]``: rollout 0's baseline is 0, the others' is 1/3):

>>> from gfcr.stages.testing import scored_group
>>> [round(a, 4) for a in RLOO(RLOO.Config()).estimate(scored_group("p:0", [1.0, 0.0, 0.0, 0.0])).values]
[1.0, -0.3333, -0.3333, -0.3333]

YAML:

.. code-block:: yaml

    update: {use: update.grpo, from: keep, with: {advantage: {use: rloo}}}
"""

from __future__ import annotations

from pydantic import Field

from gfcr.records import RolloutGroup
from gfcr.stages.components.advantage.base import (SINGLE_ROLLOUT_HELP, Advantages, EstimatorConfig, SingleRollout,
                                                   checked_rewards, has_no_baseline, lone_reward)


class RLOO:
    """Each reward minus the mean of the other rewards of its group."""

    class Config(EstimatorConfig):
        single_rollout: SingleRollout = Field("zero", description=SINGLE_ROLLOUT_HELP)

    def __init__(self, config: Config):
        self.config = config

    def estimate(self, group: RolloutGroup) -> Advantages:
        r = checked_rewards(group)  # [G]
        if lone_reward(r, self.config.single_rollout):
            return Advantages.scalars(r.copy())
        if has_no_baseline(r):
            return Advantages.scalars(r * 0.0)
        leave_one_out = (r.sum() - r) / (len(r) - 1)  # [G] the mean of the other G - 1 rewards
        return Advantages.scalars(r - leave_one_out)
