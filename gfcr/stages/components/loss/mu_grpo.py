"""loss ``mu_grpo``: mu-GRPO's stabilisers for very stale rollouts (Tian, Xie, Wei, "How
Off-Policy Can GRPO Be? mu-GRPO for Efficient LLM Reinforcement Learning", arXiv 2605.17570),
relaxed clipping and the negative-advantage veto, on PPO's token-level clipped surrogate,
from the abstract.

mu-GRPO trains in a few long generate-optimize phases, so most tokens are many versions
stale. Two rules keep that stable:

- relaxed clipping: PPO's ``l_t = -min(r_t A_t, clip(r_t, 1 - eps_low, 1 + eps_high) A_t)``
  with a wider interval than on-policy GRPO's, so stale tokens keep their gradient;
- the negative-advantage veto: in a response with ``A < 0``, the *trigger* is its first
  counted token whose ratio ``r_t = pi_theta(y_t) / mu(y_t)`` fell below ``veto_ratio``
  (the current policy gives that token less than ``veto_ratio`` of the probability it was
  sampled with: it has already moved away from this response there). The tokens after the
  trigger, a suffix the current policy would hardly reach, get no loss; the trigger itself and
  the prefix keep theirs. ``veto_ratio: null`` turns the veto off.

A vetoed token's loss is 0 but it stays in the aggregation's denominator (the veto removes
updates, not tokens); its ``clipped`` flag is PPO's.

The lifecycle half of mu-GRPO, few long phases and high staleness by design, is a pipeline:
``pipelines/examples/mu_grpo_async_arith.yaml`` (``lifecycle: {mode: async, max_staleness: 8}``).

Fidelity: from the abstract: no public code (searched for mu-GRPO, Mu-GRPO, the veto's name and
the authors' repositories; the project page has no code). The abstract states: a small number
(e.g. four) of large sequential generation-optimization stages; relaxed clipping "which
preserves useful stale-rollout gradients"; a veto that "removes destabilizing post-trigger
suffix updates in negative-advantage responses".

Deviations (choices the abstract leaves open):
- the trigger rule is this component's, the "ratio-drop trigger" above with
  ``veto_ratio: 0.5``: the abstract does not say what triggers the veto;
- ``clip: [0.4, 0.4]``, twice on-policy GRPO's 0.2: the abstract gives no values;
- the suffix starts after the trigger token (the trigger's own term is kept, and with
  ``r_t < 1 - eps_low`` PPO's clip already gives it no gradient);
- the phases: gfcr's ``async`` lifecycle bounds staleness with a sliding window (no rollout
  starts more than ``max_staleness`` versions ahead of the update that trains it), so the
  shipped recipe's tokens are up to K versions stale step after step, not the sawtooth of
  phases that generate all their rollouts first and then optimize on them;
- the ratio is the loss's log-ratio, against ``mu`` under the corrections ``none``,
  ``staleness`` and ``freshness`` (the ones the veto means; under a decoupled correction it is against
  ``pi_old``, where nothing would trigger: refused by ``gfcr validate``).

Example (a negative-advantage response whose second token's ratio fell to 0.4: the third and
fourth tokens are vetoed; a positive-advantage response is never vetoed):

>>> import math, torch
>>> loss = MuGRPO(MuGRPO.Config())
>>> log_ratio = torch.log(torch.tensor([[1.0, 0.4, 1.0, 1.1], [1.0, 0.4, 1.0, 1.1]]))
>>> adv = torch.tensor([[-1.0] * 4, [1.0] * 4])
>>> loss.vetoed(log_ratio, adv, torch.ones(2, 4)).tolist()
[[False, False, True, True], [False, False, False, False]]

YAML:

.. code-block:: yaml

    update: {use: update.grpo, from: reward, with: {loss: {use: mu_grpo, with: {clip: [0.4, 0.4], veto_ratio: 0.5}}, correction: {use: staleness, with: {max_staleness: 8}}}}
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import Field

from gfcr.stages.components.base import Requirement
from gfcr.stages.components.loss.base import LossConfig, LossTerms


class MuGRPO:
    """PPO's clipped surrogate with a relaxed interval and the negative-advantage veto."""

    requires = (Requirement("correction", ("none", "staleness", "freshness"),
                            "mu-GRPO's veto reads the ratio against the behaviour policy"),)

    class Config(LossConfig):
        clip: tuple[Annotated[float, Field(ge=0.0)], Annotated[float, Field(ge=0.0)]] = Field(
            (0.4, 0.4), description="(eps_low, eps_high) of the relaxed clip (0.4: a choice, the abstract gives none)")
        veto_ratio: Annotated[float, Field(gt=0.0, lt=1.0)] | None = Field(
            0.5, description="in a negative-advantage response, the tokens after the first whose ratio is below this "
                             "get no loss; null: no veto")

    def __init__(self, config: Config):
        self.config = config

    def terms(self, log_ratio: Any, advantages: Any, weight: Any) -> LossTerms:
        import torch

        eps_low, eps_high = self.config.clip
        ratio = torch.exp(log_ratio)
        per_token = -torch.min(ratio * advantages, torch.clamp(ratio, 1 - eps_low, 1 + eps_high) * advantages)
        per_token = torch.where(self.vetoed(log_ratio, advantages, weight), torch.zeros_like(per_token), per_token)
        detached = ratio.detach()
        return LossTerms(per_token, detached, (detached < 1 - eps_low) | (detached > 1 + eps_high))

    def vetoed(self, log_ratio: Any, advantages: Any, weight: Any) -> Any:
        """``[B, R]`` bool: the tokens after each negative-advantage response's trigger."""
        import math

        import torch

        if self.config.veto_ratio is None:
            return torch.zeros_like(log_ratio, dtype=torch.bool)
        trigger = (weight > 0) & (advantages < 0) & (log_ratio.detach() < math.log(self.config.veto_ratio))
        seen = trigger.to(torch.int64).cumsum(1)  # [B, R]: triggers at or before each position
        return (seen - trigger.to(torch.int64)) > 0  # strictly after the first trigger
