"""advantage ``reinforce_pp``: REINFORCE++ with baseline (Hu et al., 2025, "REINFORCE++: A Simple
and Efficient Approach for Aligning Large Language Models", arXiv 2501.03262; some versions are
titled "... An Efficient RLHF Algorithm with Robustness to Both Prompt and Reward Models"), as
OpenRLHF computes it (``--advantage_estimator reinforce_baseline``;
``openrlhf/trainer/ppo_utils/experience_maker.py``, ``compute_advantages_and_returns``).

It needs the whole batch, so the update calls ``estimate_batch(groups, pool)``:

1. per group, ``c_i = r_i - mean(r)`` (the group mean as baseline, no std division);
2. every response token carries its response's ``c_i`` (OpenRLHF's return with ``gamma = 1``
   and the reward on the last token), so across the update's batch of groups, with ``n_i``
   the tokens of response ``i`` that count in the loss and ``N = sum_i n_i``:

       mu    = sum_i n_i c_i / N                   (a token mean: a response weighs its length)
       var   = sum_i n_i (c_i - mu)^2 / N          (population variance over tokens)
       A_i   = (c_i - mu) / sqrt(max(var, 1e-8))

   The batch mean IS subtracted again (it is not 0 once responses differ in length), and
   ``std_norm: false`` (OpenRLHF's ``--no_advantage_std_norm``) keeps ``A_i = c_i - mu``.

``estimate(group)`` alone normalises the batch of that one group.

Fidelity: checked against OpenRLHF/OpenRLHF@3c3be62: 38/38 cases
(``tests/fidelity/reinforce_pp.json``; ``compute_advantages_and_returns``, estimator
``reinforce_baseline``, with and without ``--no_advantage_std_norm``, single-rollout groups
and masked tokens included). Also checked against volcengine/verl@b178a3c: 1/20 cases, 19
documented deviations (``tests/fidelity/reinforce_pp_verl.json``;
``compute_reinforce_plus_plus_baseline_outcome_advantage`` on the same inputs): verl's
``masked_whiten`` divides by the unbiased token variance (times ``N / (N - 1)``, ``N`` the
batch's counted tokens), so its advantages are ``sqrt((N - 1) / N)`` times these (18 cases),
and it gives a group of one rollout its raw reward before the whitening (1 case). gfcr
follows OpenRLHF, the trainer of REINFORCE++'s authors; with ``variance: unbiased`` and
``single_rollout: verl`` all 20 verl cases agree.

Deviations:
- verl's ``masked_whiten`` divides by the unbiased token variance plus 1e-8 (OpenRLHF: the
  population variance, floored at 1e-8), so verl's advantages are ``sqrt((N - 1) / N)`` times
  these (18 verl reference cases): ``variance: unbiased`` gives verl's;
- verl gives a group of one rollout its raw reward (mean 0) before the whitening, which also
  moves the batch's mean and variance (1 verl reference case): ``single_rollout: verl`` gives
  verl's;
- the KL is not in the reward: OpenRLHF's REINFORCE++ folds ``-kl_coef * KL_t`` into each
  token's reward (so the per-token returns differ) unless ``--use_kl_loss``; in gfcr the KL is
  a term of the loss (``update.with.kl_coef``), so every token of a response has the same
  advantage;
- ``n_i`` counts the response tokens the rollout's own ``loss_mask`` keeps (all when it has
  none), OpenRLHF's ``action_mask``; the update's other token weights (a tree's shared-prefix
  weights, the staleness limit) are not seen by the estimator;
- a group whose rewards are all equal, or a group of one rollout, has ``c = 0`` exactly before
  the batch step (it can still get ``-mu / std`` from the batch, as in OpenRLHF); a batch with
  no counted token gets 0.0; computed in float64 (OpenRLHF: float32); unscored rollouts (NaN
  rewards) raise ValueError naming the group.

Example (one group of one-token responses: c = [0.5, -0.5, -0.5, 0.5], mu = 0, var = 0.25):

>>> from gfcr.stages.testing import scored_group
>>> ReinforcePP(ReinforcePP.Config()).estimate(scored_group("p:0", [1.0, 0.0, 0.0, 1.0])).values
(1.0, -1.0, -1.0, 1.0)

YAML:

.. code-block:: yaml

    update: {use: update.grpo, from: keep, with: {advantage: {use: reinforce_pp, with: {std_norm: true}}}}
"""

from __future__ import annotations

from typing import Any, Literal, Sequence

import numpy as np
from pydantic import Field

from gfcr.records import RolloutGroup
from gfcr.stages.components.advantage.base import (SINGLE_ROLLOUT_HELP, Advantages, EstimatorConfig, SingleRollout,
                                                   checked_rewards, has_no_baseline, lone_reward)
from gfcr.stages.components.advantage.group_stats import batch_whitened


def group_centred(group: RolloutGroup, single_rollout: SingleRollout = "zero") -> np.ndarray:
    """``r - mean(r)`` ``[G]``; exactly 0 for a group with no baseline (``r`` for a lone rollout
    under ``single_rollout: verl``)."""
    r = checked_rewards(group)
    if lone_reward(r, single_rollout):
        return r.copy()
    return r * 0.0 if has_no_baseline(r) else r - r.mean()


class WhiteningConfig(EstimatorConfig):
    """The batch whitening's settings, shared with ``reinforce_pp_plain``."""

    std_norm: bool = Field(True, description="divide by the batch's token std (OpenRLHF's default; "
                                             "false: --no_advantage_std_norm)")
    variance: Literal["population", "unbiased"] = Field(
        "population", description="the token variance: OpenRLHF's population one, floored at 1e-8; `unbiased`: "
                                  "verl's masked_whiten (times N / (N - 1), plus 1e-8)")


class ReinforcePP:
    """Group-mean baseline, then token-weighted whitening across the update's batch."""

    class Config(WhiteningConfig):
        single_rollout: SingleRollout = Field("zero", description=SINGLE_ROLLOUT_HELP)

    def __init__(self, config: Config):
        self.config = config

    def estimate(self, group: RolloutGroup) -> Advantages:
        return self.estimate_batch([group], None)[0]

    def estimate_batch(self, groups: Sequence[RolloutGroup], pool: Any) -> list[Advantages]:
        centred = [group_centred(g, self.config.single_rollout) for g in groups]
        return batch_whitened(groups, centred, self.config.std_norm, self.config.variance == "unbiased")
