"""loss ``gspo_token``: GSPO-token, the token-level form of Group Sequence Policy Optimization
(Zheng et al., 2025, arXiv 2507.18071, section 4, "GSPO-token"), for per-token advantages.

Every token carries the value of the sequence ratio but the gradient of its own log-prob:

    s_it = sg[s_i] * pi_theta(y_it) / sg[pi_theta(y_it)]
         = exp( sg[mean_t' log_ratio_it'] + log_ratio_it - sg[log_ratio_it] )
    l_it = -min(s_it A_it, clip(s_it, 1 - eps_low, 1 + eps_high) A_it)

with ``sg`` the stop-gradient and the mean over the response's counted tokens
(``weight > 0``). Aggregated by ``seq_mean_token_mean`` (required, as for ``gspo``), the
objective is the paper's ``1/G sum_i 1/|y_i| sum_t``. When ``A_it = A_i`` on every token the
value, the clip decision and the gradient equal ``gspo``'s (as the paper remarks;
verl's ``loss_mode: gspo`` computes this form).

Defaults ``eps_low = 3e-4``, ``eps_high = 4e-4`` (the paper's, section 5.1). No per-token
importance weight is defined, so the corrections ``tis``, ``decoupled_clip`` and
``recompute_old`` are refused (``token_corrections = False``).

Fidelity: checked against volcengine/verl@b178a3c: 24/24 cases (``tests/fidelity/gspo_token.json``;
``compute_policy_loss_gspo``: the loss and its gradient); checked against
volcengine/verl@b178a3c: 2/6 cases, 4 documented deviations (``tests/fidelity/gspo_token_cap.json``;
responses past verl's log-ratio cap; with ``log_ratio_cap: 10.0`` all 30 verl cases agree).

Deviations: verl caps ``log s_it`` at 10 for numerics (past it the ratio is ``e^10`` and no
token of the response has a gradient); by default it is not capped here, so a response that
far off-policy with a negative advantage gets a larger loss and a gradient (4 reference
cases): ``log_ratio_cap: 10.0`` gives verl's.

Example (a single token: ``s = e^0.1`` is above ``1 + 4e-4``; with a negative advantage the
unclipped term is the minimum, so the loss is ``-s A``):

>>> import math, torch
>>> loss = GSPOToken(GSPOToken.Config())
>>> t = loss.terms(torch.tensor([[0.1]]), torch.tensor([[-1.0]]), torch.ones(1, 1))
>>> round(float(t.per_token), 4) == round(math.exp(0.1), 4), bool(t.clipped)
(True, True)

YAML:

.. code-block:: yaml

    update: {use: update.grpo, from: keep, with: {loss: {use: gspo_token}, aggregation: {use: seq_mean_token_mean}}}
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import Field

from gfcr.stages.components.base import Requirement
from gfcr.stages.components.loss.base import LossConfig, LossTerms, sequence_mean
from gfcr.stages.components.loss.gspo import capped, clipped_surrogate


class GSPOToken:
    """GSPO's sequence ratio as a value, each token's own log-prob as the gradient."""

    requires = (Requirement("aggregation", ("seq_mean_token_mean",), "GSPO-token's objective is a mean over "
                                                                    "responses"),)
    token_corrections = False

    class Config(LossConfig):
        clip: tuple[Annotated[float, Field(ge=0.0)], Annotated[float, Field(ge=0.0)]] = Field(
            (3e-4, 4e-4), description="(eps_low, eps_high) of the sequence-ratio clip (the paper's 3e-4, 4e-4)")
        log_ratio_cap: Annotated[float, Field(gt=0.0)] | None = Field(
            None, description="cap on the log sequence ratio (no gradient past it); verl's is 10.0")

    def __init__(self, config: Config):
        self.config = config

    def terms(self, log_ratio: Any, advantages: Any, weight: Any) -> LossTerms:
        import torch

        counted = (weight > 0).to(log_ratio.dtype)
        log_s = sequence_mean(log_ratio, counted).detach()  # [B, 1]: sg[log s_i]
        # [B, R]: value s_i, gradient of log pi_it (verl caps this sum, so past the cap no token has a gradient)
        ratio = torch.exp(capped(log_s + log_ratio - log_ratio.detach(), self.config.log_ratio_cap))
        return clipped_surrogate(ratio, advantages, self.config.clip)
