"""loss ``gspo``: Group Sequence Policy Optimization (Zheng et al., 2025, "Group Sequence Policy
Optimization", arXiv 2507.18071, section 4).

One importance ratio per response, the length-normalised sequence likelihood ratio, clipped as
a whole:

    s_i = (pi_theta(y_i | x) / pi_prox(y_i | x)) ** (1 / |y_i|) = exp( mean_t log_ratio_it )
    l_i = -min(s_i A_i, clip(s_i, 1 - eps_low, 1 + eps_high) A_i)

where the mean runs over the response's counted tokens (``weight > 0``: padding and masked
tokens are not part of ``y_i``). ``l_i`` is written on every token of the response; with the
``seq_mean_token_mean`` aggregation (which GSPO requires) the update's loss is then
``(1/N) sum_i l_i``, GSPO's ``1/G sum_i`` over the batch. The gradient is

    grad l_i = -s_i A_i (1/|y_i|) sum_t grad log pi_theta(y_it)   (0 where the clip is active)

The clip range is tiny because ``s_i`` is a per-token geometric mean: the paper's defaults
(v2, section 5.1, also TRL's paper index) are ``eps_low = 3e-4``, ``eps_high = 4e-4``.

GSPO defines no per-token importance weight, so the update's corrections ``tis``,
``decoupled_clip`` and ``recompute_old`` are refused by ``gfcr validate``
(``token_corrections = False``); ``staleness`` masks tokens and pairs with it.

Fidelity: checked against volcengine/verl@b178a3c: 24/24 cases (``tests/fidelity/gspo.json``;
``compute_policy_loss_gspo``, which computes GSPO-token: the loss and its gradient agree for
per-response advantages, clip (3e-4, 4e-4) and (0.2, 0.2), padding and masked tokens);
checked against volcengine/verl@b178a3c: 2/6 cases, 4 documented deviations
(``tests/fidelity/gspo_cap.json``; responses past verl's log-ratio cap; with ``log_ratio_cap:
10.0`` all 30 verl cases agree);
checked against huggingface/trl@f2cd577: 10/12 cases, 2 documented deviations
(``tests/fidelity/gspo_trl.json``; ``GRPOTrainer._compute_loss`` with
``importance_sampling_level: sequence``, ``loss_type: grpo``).

Deviations: with ``seq_mean_token_mean``, a response whose every token is masked out of the
loss is left out of the mean over responses, as verl leaves it out; TRL's mean over rows
counts it (2 TRL reference cases). None otherwise for scalar (per-response) advantages, which every built-in estimator gives. A
per-token advantage ``A_it`` enters each token's term with the sequence ratio,
``-min(s_i A_it, clip(s_i) A_it)`` (the paper defines only sequence advantages). verl
caps the log sequence ratio at 10 for numerics (past it the ratio is ``e^10`` and carries no
gradient); by default it is not capped here, so a response that far off-policy with a
negative advantage gets a larger loss and a gradient (4 ``gspo_cap`` reference cases):
``log_ratio_cap: 10.0`` gives verl's.

Example (one response of two tokens whose log-ratios are 0.0002 and 0.0008: ``s = e^0.0005``,
above ``1 + 4e-4``, so with a positive advantage the loss is the clipped one, ``-1.0004 A``):

>>> import torch
>>> loss = GSPO(GSPO.Config())
>>> t = loss.terms(torch.tensor([[2e-4, 8e-4]]), torch.tensor([[2.0, 2.0]]), torch.ones(1, 2))
>>> [round(float(v), 4) for v in t.per_token[0]], bool(t.clipped.all())
([-2.0008, -2.0008], True)

YAML:

.. code-block:: yaml

    update: {use: update.grpo, from: keep, with: {loss: {use: gspo, with: {clip: [3.0e-4, 4.0e-4]}}, aggregation: {use: seq_mean_token_mean}}}
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import Field

from gfcr.stages.components.base import Requirement
from gfcr.stages.components.loss.base import LossConfig, LossTerms, sequence_mean


class GSPO:
    """Sequence-level clipped surrogate with the length-normalised sequence ratio."""

    requires = (Requirement("aggregation", ("seq_mean_token_mean",), "GSPO's objective is a mean over responses"),)
    token_corrections = False

    class Config(LossConfig):
        clip: tuple[Annotated[float, Field(ge=0.0)], Annotated[float, Field(ge=0.0)]] = Field(
            (3e-4, 4e-4), description="(eps_low, eps_high) of the sequence-ratio clip (the paper's 3e-4, 4e-4)")
        log_ratio_cap: Annotated[float, Field(gt=0.0)] | None = Field(
            None, description="cap on the log sequence ratio (no gradient past it); verl's is 10.0")

    def __init__(self, config: Config):
        self.config = config

    def terms(self, log_ratio: Any, advantages: Any, weight: Any) -> LossTerms:
        ratio = sequence_ratio(log_ratio, weight, self.config.log_ratio_cap)  # [B, R]
        return clipped_surrogate(ratio, advantages, self.config.clip)


def sequence_ratio(log_ratio: Any, weight: Any, cap: float | None) -> Any:
    """``[B, R]``: each response's length-normalised sequence ratio s_i (the exp of its tokens' mean
    log-ratio, capped at ``cap``) on each of its tokens."""
    import torch

    counted = (weight > 0).to(log_ratio.dtype)  # [B, R]: the tokens of y_i
    log_s = capped(sequence_mean(log_ratio, counted), cap)  # [B, 1]
    return torch.exp(log_s).expand_as(log_ratio)


def capped(log_s: Any, cap: float | None) -> Any:
    """``log_s`` clamped at ``cap`` from above (verl's numerical cap: no gradient past it)."""
    import torch

    return log_s if cap is None else torch.clamp(log_s, max=cap)


def clipped_surrogate(ratio: Any, advantages: Any, clip: tuple[float, float]) -> LossTerms:
    """``-min(ratio A, clip(ratio, 1 - eps_low, 1 + eps_high) A)`` per token, for GSPO's ratios."""
    import torch

    eps_low, eps_high = clip
    per_token = -torch.min(ratio * advantages, torch.clamp(ratio, 1 - eps_low, 1 + eps_high) * advantages)
    detached = ratio.detach()
    return LossTerms(per_token, detached, (detached < 1 - eps_low) | (detached > 1 + eps_high))
