"""loss ``tr_grpo``: TR-GRPO's probability-shaped token weights on GRPO's clipped surrogate
(Le, Bui, Ngo Van and Le, "Token-Regulated Group Relative Policy Optimization for Stable
Reinforcement Learning in Large Language Models", arXiv 2511.00066; v2 "Sharpness-Controlled
Group Relative Policy Optimization with Token-Level Probability Shaping").

In GRPO, low-probability tokens have the largest per-token gradients and dominate the update.
TR-GRPO multiplies each token's term by a weight that grows with the token's probability under
the current policy, ``p_t = pi_theta(y_t)`` (detached: the weight carries no gradient):

    w_t = clip( alpha * (sigmoid(p_t / tau) - mu), L, U )
    l_t = -w_t * min(r_t A_t, clip(r_t, 1 - eps_low, 1 + eps_high) A_t)

``r_t`` the token's ratio against the behaviour policy, as ``ppo_clip``. ``sigmoid(p / tau)``
is increasing in ``p``, so the weight is monotone, as the paper's "monotone probability shaping
function" requires; the clip bounds it to ``[L, U]``.

Where the rules come from: the weighting principle is the paper's abstract (token weights
"positively correlated with the model's predicted probability", a "monotone probability shaping
function"). The paper's body could not be read from gfcr's build machine; the formula for
``w_t`` and the values ``alpha = 2``, ``mu = 0.25``, ``L = 1``, ``U = 1.4`` are the one public
transcription found (grpo-composer, ``configs/papers/tr_grpo.yaml`` and
``grpo_composer/aggregation/weighted_token.py``, unreproduced by its authors). Its ``tau = 9``
cannot be right with that formula: ``p / 9`` stays in ``[0, 0.11]``, so ``alpha * (sigmoid -
mu)`` stays in ``[0.5, 0.56]`` and every weight is clipped to ``L = 1``, plain GRPO. ``tau``
therefore has no default and must be set, and ``gfcr validate`` refuses any setting whose weight
is the same for every probability (a TR-GRPO that silently is GRPO). ``tau = 1/9`` (that is,
``sigmoid(9 p)``) gives weights rising from 1 at ``p <= 0.12`` to 1.4 at ``p >= 0.33``.

Deviations:
- the formula and constants are a transcription, as above, to be checked against the paper;
- the transcription also weights the KL term; gfcr's KL (``kl_coef``) is the update's own and is
  not weighted;
- the weight multiplies the token's whole clipped term (the transcription multiplies the ratio
  inside the min, which also moves where the clip binds); gfcr's form is the weighted gradient
  ``w_t * grad`` that the transcription's docstring states.

The update hands this loss the detached log-probabilities of the current policy
(``needs_logprobs = True``).

Fidelity: from the abstract: no public code (grpo-composer's TR-GRPO is a third-party no-op);
the rules above are this component's reading.

Example (two tokens of probability 0.05 and 0.6 on the behaviour policy, ratio 1, ``A = 1``,
``tau = 1/9``: the first weight ``2 (sigmoid(0.45) - 0.25) = 0.72`` is clipped up to 1, the
second ``2 (sigmoid(5.4) - 0.25) = 1.49`` down to 1.4):

>>> import math, torch
>>> loss = TRGRPO(TRGRPO.Config(tau=1 / 9))
>>> logp = torch.log(torch.tensor([[0.05, 0.6]]))
>>> t = loss.terms(torch.zeros(1, 2), torch.ones(1, 2), torch.ones(1, 2), logprobs=logp)
>>> [round(float(v), 4) for v in t.per_token[0]]
[-1.0, -1.4]

YAML:

.. code-block:: yaml

    update: {use: update.grpo, from: reward, with: {loss: {use: tr_grpo, with: {tau: 0.1111, clip: [0.2, 0.2]}}}}
"""

from __future__ import annotations

import math
from typing import Annotated, Any

from pydantic import Field, model_validator

from gfcr.spec.problems import fixable
from gfcr.stages.components.loss.base import LossConfig, LossTerms


class TRGRPO:
    """PPO-clip with each token's term weighted by a clipped sigmoid of its probability."""

    needs_logprobs = True

    class Config(LossConfig):
        tau: Annotated[float, Field(gt=0.0, description=(
            "temperature of sigmoid(p / tau); required (the transcribed 9 makes every weight 1)"))]
        alpha: Annotated[float, Field(gt=0.0, description="scale of the shaped weight (transcribed: 2)")] = 2.0
        mu: float = Field(0.25, description="offset subtracted from the sigmoid (transcribed: 0.25)")
        bounds: tuple[float, float] = Field((1.0, 1.4), description="(L, U): the weight's clip (transcribed: 1, 1.4)")
        clip: tuple[Annotated[float, Field(ge=0.0)], Annotated[float, Field(ge=0.0)]] = Field(
            (0.2, 0.2), description="(eps_low, eps_high) of the token-ratio clip (the transcription's 0.2, 0.2)")

        @model_validator(mode="after")
        def _weights_vary(self) -> "TRGRPO.Config":
            low, high = self.bounds
            if not low <= high:
                raise fixable(f"`bounds` must be (L, U) with L <= U, got ({low}, {high})", "swap the two bounds")
            at_zero = self.alpha * (0.5 - self.mu)  # p = 0: sigmoid(0) = 1/2
            at_one = self.alpha * (1 / (1 + math.exp(-1 / self.tau)) - self.mu)  # p = 1
            if at_one <= low or at_zero >= high:
                raise fixable(
                    f"with tau={self.tau}, alpha={self.alpha}, mu={self.mu} the shaped weight runs from "
                    f"{at_zero:.3f} (p = 0) to {at_one:.3f} (p = 1), all outside bounds ({low}, {high}), so every "
                    "token weighs the same and this is plain GRPO",
                    "lower tau (e.g. 0.1111, i.e. sigmoid(9 p)) or change alpha, mu or the bounds")
            return self

    def __init__(self, config: Config):
        self.config = config

    def weights(self, logprobs: Any) -> Any:
        """``[B, R]`` detached token weights ``clip(alpha (sigmoid(p / tau) - mu), L, U)``."""
        import torch

        c = self.config
        p = torch.exp(logprobs.detach())
        return torch.clamp(c.alpha * (torch.sigmoid(p / c.tau) - c.mu), min=c.bounds[0], max=c.bounds[1])

    def terms(self, log_ratio: Any, advantages: Any, weight: Any, *, logprobs: Any = None) -> LossTerms:
        import torch

        if logprobs is None:
            raise ValueError("loss `tr_grpo` needs the current policy's token log-probabilities "
                             "(`logprobs=`); update.grpo passes them because the class sets `needs_logprobs`")
        eps_low, eps_high = self.config.clip
        ratio = torch.exp(log_ratio)
        surrogate = torch.min(ratio * advantages, torch.clamp(ratio, 1 - eps_low, 1 + eps_high) * advantages)
        per_token = -self.weights(logprobs) * surrogate
        detached = ratio.detach()
        return LossTerms(per_token, detached, (detached < 1 - eps_low) | (detached > 1 + eps_high))
