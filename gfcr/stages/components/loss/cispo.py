"""loss ``cispo``: CISPO, Clipped IS-weight Policy Optimization (MiniMax, 2025, "MiniMax-M1:
Scaling Test-Time Compute Efficiently with Lightning Attention", arXiv 2506.13585, section 3.1).

REINFORCE with a clipped, detached importance-sampling weight: rather than clipping a token's
update away (PPO), CISPO clips the weight and keeps every token's gradient.

    r_t     = pi_theta(y_t) / pi_prox(y_t)
    r_hat_t = clip(r_t, 1 - eps_low, 1 + eps_high)
    l_t     = -sg(r_hat_t) A_t log pi_theta(y_t),     grad l_t = -r_hat_t A_t grad log pi_theta(y_t)

The paper normalises by the batch's token count (``1 / sum_i |o_i|``): the ``token_mean``
aggregation, the default. ``clipped`` marks the tokens whose weight was clipped.

Defaults: the paper imposes no lower bound ("we did not impose a lower bound on the IS weight
by setting eps_low to a large value; instead, we only tuned eps_high"), so ``eps_low`` is
None (no lower clip). The paper does not publish its ``eps_high``, so ``eps_high`` has no
default and must be set: a guessed bound would silently change which tokens are reweighted.

Fidelity: checked against volcengine/verl@b178a3c: 40/40 cases (``tests/fidelity/cispo.json``;
``compute_policy_loss_cispo``: the gradient of the aggregated loss and the clipped fraction,
with and without a lower bound, per-response and per-token advantages, ``token_mean`` and
``seq_mean_token_mean``). verl's lower bound defaults to its ``clip_ratio`` (0.2) where
``clip_ratio_low`` is unset; gfcr's ``eps_low`` defaults to none, the paper's. Also
checked against huggingface/trl@f2cd577: 12/12 cases (``tests/fidelity/cispo_trl.json``;
``GRPOTrainer._compute_loss`` with ``loss_type: cispo``, whose ``epsilon_high`` is the cap
itself: TRL's 5.0 is ``eps_high: 4.0`` here).

Deviations:
- verl's lower clip defaults to its ``clip_ratio`` (0.2) where ``clip_ratio_low`` is unset;
  ``eps_low`` defaults to none here, the paper's: ``eps_low: 0.2`` gives verl's default;
- the loss value uses ``log_ratio = log pi_theta - log pi_prox`` in place of
  ``log pi_theta`` (the two differ by a constant, so the gradient is the same; the reported loss
  is 0 at the behaviour policy instead of the sequence's negative log-likelihood);
- the paper's generalised form with a PPO-style token mask ``M_t`` (its ablation) is not
  offered: ``M_t = 1``, CISPO as trained.

Example (a token whose probability doubled: its weight is clipped to ``1 + eps_high = 1.5``,
and the gradient of the loss with respect to ``log pi`` is ``-1.5 A``):

>>> import math, torch
>>> loss = CISPO(CISPO.Config(eps_high=0.5))
>>> log_ratio = torch.tensor([[math.log(2.0)]], requires_grad=True)
>>> t = loss.terms(log_ratio, torch.tensor([[1.0]]), torch.ones(1, 1))
>>> t.per_token.sum().backward()
>>> float(log_ratio.grad), bool(t.clipped)
(-1.5, True)

YAML:

.. code-block:: yaml

    update: {use: update.grpo, from: keep, with: {loss: {use: cispo, with: {eps_high: 4.0}}}}
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import Field

from gfcr.stages.components.loss.base import LossConfig, LossTerms


class CISPO:
    """REINFORCE weighted by the clipped, detached token IS ratio."""

    class Config(LossConfig):
        eps_high: Annotated[float, Field(gt=0.0, description="upper clip of the IS weight, 1 + eps_high (the paper "
                                                             "tunes it and does not publish a value)")]
        eps_low: Annotated[float, Field(gt=0.0, le=1.0)] | None = Field(
            None, description="lower clip 1 - eps_low of the IS weight; null: no lower bound (the paper's)")

    def __init__(self, config: Config):
        self.config = config

    def terms(self, log_ratio: Any, advantages: Any, weight: Any) -> LossTerms:
        import torch

        ratio = torch.exp(log_ratio).detach()
        low = None if self.config.eps_low is None else 1 - self.config.eps_low
        clipped_weight = torch.clamp(ratio, min=low, max=1 + self.config.eps_high)  # sg(r_hat)
        per_token = -clipped_weight * advantages * log_ratio
        return LossTerms(per_token, ratio, clipped_weight != ratio)
