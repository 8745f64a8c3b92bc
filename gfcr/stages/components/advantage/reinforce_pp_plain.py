"""advantage ``reinforce_pp_plain``: plain REINFORCE++, without a group baseline (Hu et al., 2025,
"REINFORCE++: A Simple and Efficient Approach for Aligning Large Language Models",
arXiv 2501.03262), as OpenRLHF computes it (``--advantage_estimator reinforce``;
``openrlhf/trainer/ppo_utils/experience_maker.py``, ``compute_advantages_and_returns``).

The paper's REINFORCE++ without the ``-baseline`` suffix: no per-prompt baseline, only the
normalisation across the update's batch. Every response token carries its
response's reward ``r_i`` (OpenRLHF's return with ``gamma = 1`` and the reward on the last
token), and with ``n_i`` the tokens of response ``i`` that count in the loss and
``N = sum_i n_i``:

    mu  = sum_i n_i r_i / N,   var = sum_i n_i (r_i - mu)^2 / N,   A_i = (r_i - mu) / sqrt(max(var, 1e-8))

``std_norm: false`` (OpenRLHF's ``--no_advantage_std_norm``) keeps ``A_i = r_i - mu``. The
estimator ``reinforce_pp`` is the variant with a group baseline (REINFORCE++-baseline), for
several rollouts per prompt. Both need the whole batch, so the update calls
``estimate_batch(groups, pool)``; ``estimate(group)`` alone normalises the batch of that one
group.

Fidelity: checked against OpenRLHF/OpenRLHF@3c3be62: 38/38 cases
(``tests/fidelity/reinforce_pp_plain.json``; ``compute_advantages_and_returns``,
estimator ``reinforce``, gamma 1, with and without ``--no_advantage_std_norm``, single-rollout
groups and masked tokens included); checked against volcengine/verl@b178a3c: 0/18 cases, 18
documented deviations (``tests/fidelity/reinforce_pp_plain_verl.json``;
``compute_reinforce_plus_plus_outcome_advantage``, the ``std_norm`` cases); with ``variance:
unbiased`` all 18 agree.

Deviations:
- verl's ``masked_whiten`` divides by the unbiased token variance plus 1e-8 (OpenRLHF: the
  population variance, floored at 1e-8), so verl's advantages are ``sqrt((N - 1) / N)`` times
  these (18 verl reference cases): ``variance: unbiased`` gives verl's. verl always whitens
  (no ``std_norm: false``);
- verl resets its return at every token its response mask leaves out (its loop is written for
  the end of the response), so with a loss mask that has holes verl's tokens before a hole get
  return 0 and another advantage; here every counted token gets the response's (as in
  OpenRLHF). No setting gives verl's; the 2 such inputs are not verl reference cases;
- the KL is not in the reward: OpenRLHF folds ``-kl_coef * KL_t`` into each token's reward
  unless ``--use_kl_loss``; in gfcr the KL is a term of the loss (``update.with.kl_coef``), so
  every token of a response has the same advantage;
- ``gamma`` is 1 (OpenRLHF's default): a discounted return, which would give each token its
  own advantage, is not offered;
- ``n_i`` counts the response tokens the rollout's own ``loss_mask`` keeps (all when it has
  none), OpenRLHF's ``action_mask``; computed in float64 (OpenRLHF: float32); unscored
  rollouts (NaN rewards) raise ValueError naming the group.

Example (one-token responses with rewards 1, 0, 0, 1: mu = 0.5, var = 0.25):

>>> from gfcr.stages.testing import scored_group
>>> estimator = ReinforcePPPlain(ReinforcePPPlain.Config())
>>> estimator.estimate_batch([scored_group("p:0", [1.0, 0.0]), scored_group("p:1", [0.0, 1.0])], None)[0].values
(1.0, -1.0)
>>> estimator.estimate(scored_group("p:2", [1.0])).values  # a batch of one response: nothing to compare
(0.0,)

YAML:

.. code-block:: yaml

    update: {use: update.grpo, from: keep, with: {advantage: {use: reinforce_pp_plain, with: {std_norm: true}}}}
"""

from __future__ import annotations

from typing import Any, Sequence

from gfcr.records import RolloutGroup
from gfcr.stages.components.advantage.base import Advantages, checked_rewards
from gfcr.stages.components.advantage.group_stats import batch_whitened
from gfcr.stages.components.advantage.reinforce_pp import ReinforcePP, WhiteningConfig


class ReinforcePPPlain(ReinforcePP):
    """Rewards whitened over the tokens of the update's batch; no group baseline (``reinforce_pp``
    without its ``group_centred`` step: the same whitening and its settings)."""

    class Config(WhiteningConfig):
        pass

    def estimate_batch(self, groups: Sequence[RolloutGroup], pool: Any) -> list[Advantages]:
        return batch_whitened(groups, [checked_rewards(g) for g in groups], self.config.std_norm,
                              self.config.variance == "unbiased")
