"""loss ``sat_gspo``: SAT-GSPO, the staleness-adaptive trust region (arXiv 2607.18722) on GSPO's
sequence-level clipped surrogate (loss ``gspo``, arXiv 2507.18071), from the abstract.

GSPO clips one ratio per response, ``s_i = exp(mean_t log_ratio_it)``; SAT-GSPO narrows that
clip where the response is stale. The staleness proxy is the detached log sequence ratio
``d_i = sg(log s_i)``; with ``m_i = |d_i|`` and ``q`` the ``quantile`` of ``m`` over the
micro-batch's responses that have a counted token, a response with ``m_i > q`` keeps
``k_i = exp(-((m_i - q) / h)^2 / 2)`` of the half-width on its advantage's side (``h``, the
``bandwidth``, by default that half-width), and only that endpoint moves:
``[1 - eps_low, 1 + k_i eps_high]`` for ``A_i > 0``, ``[1 - k_i eps_low, 1 + eps_high]`` for
``A_i < 0``. Then GSPO's ``l_i = -min(s_i A_i, clip(s_i, low_i, high_i) A_i)`` on every token
of the response, averaged over responses by ``seq_mean_token_mean`` (which it requires, as
``gspo`` does). It is ``sat``'s rule (``gfcr.stages.components.loss.sat``) with a response
in place of a token; inside GSPO's interval, and GSPO's loss when nothing is stale.

Fidelity: from the abstract: no public code (the paper reports SAT on GSPO with routing replay,
Qwen3-30B-A3B, lags 1 and 8; no artifact was found).

Deviations (choices the abstract leaves open, beyond ``sat``'s):
- the proxy is the response's log sequence ratio (GSPO's own ratio), one per response, and the
  quantile runs over the micro-batch's responses, not its tokens;
- ``clip: [3.0e-4, 4.0e-4]``, GSPO's (the abstract gives SAT-GSPO's values nowhere), so the
  default bandwidth is as small: a response whose ``|log s_i|`` is 4e-4 past the quantile keeps
  61% of its side. Routing replay (R3) is a mixture-of-experts matter with no counterpart here;
- GSPO defines no per-token ratio: the corrections ``tis``, ``decoupled_clip`` and
  ``recompute_old`` are refused (``token_corrections = False``), and the proxy is against
  ``mu`` (``none``, ``staleness`` or ``freshness``);
- per-token advantages enter each token's term with the sequence ratio, and the side is chosen
  per token, as ``gspo`` takes them (every built-in estimator gives one advantage per response).

Example (four responses with positive advantages, quantile 0.5, so ``q = 5e-5``: the stalest,
``log s = 0.002``, has its upper endpoint pulled in from ``1 + 4e-4`` to 1; the one at 1e-4
barely moves):

>>> import torch
>>> loss = SATGSPO(SATGSPO.Config(quantile=0.5))
>>> lr = torch.tensor([[0.002, 0.002], [0.0, 0.0], [1e-4, 1e-4], [0.0, 0.0]])
>>> low, high = loss.interval(lr, torch.ones(4, 2), torch.ones(4, 2))
>>> [round(float(v), 6) for v in high[:, 0]]
[1.0, 1.0004, 1.000397, 1.0004]

YAML:

.. code-block:: yaml

    update: {use: update.grpo, from: keep, with: {loss: {use: sat_gspo, with: {clip: [3.0e-4, 4.0e-4], quantile: 0.9}}, aggregation: {use: seq_mean_token_mean}, correction: {use: staleness, with: {max_staleness: 8}}}}
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import Field

from gfcr.stages.components.base import Requirement
from gfcr.stages.components.loss.base import LossConfig, LossTerms, sequence_mean
from gfcr.stages.components.loss.gspo import sequence_ratio
from gfcr.stages.components.loss.sat import PROXY_CORRECTIONS, Bandwidth, Quantile, contracted_interval


class SATGSPO:
    """GSPO's sequence-ratio clip whose advantage-side endpoint contracts on the stalest responses."""

    requires = (Requirement("aggregation", ("seq_mean_token_mean",), "GSPO's objective is a mean over responses"),
                PROXY_CORRECTIONS)
    token_corrections = False

    class Config(LossConfig):
        clip: tuple[Annotated[float, Field(ge=0.0)], Annotated[float, Field(ge=0.0)]] = Field(
            (3e-4, 4e-4), description="(eps_low, eps_high) of GSPO's sequence-ratio clip (the GSPO paper's), which "
                                      "SAT contracts and never widens")
        quantile: Quantile = 0.9
        bandwidth: Bandwidth = Field(None, description="the Gaussian kernel's width in log sequence-ratio units; "
                                                       "null: the half-width of the contracted side")
        log_ratio_cap: Annotated[float, Field(gt=0.0)] | None = Field(
            None, description="cap on the log sequence ratio (no gradient past it), as gspo's; verl's is 10.0")

    def __init__(self, config: Config):
        self.config = config

    def terms(self, log_ratio: Any, advantages: Any, weight: Any) -> LossTerms:
        import torch

        ratio = sequence_ratio(log_ratio, weight, self.config.log_ratio_cap)  # [B, R], s_i on each token
        low, high = self.interval(log_ratio.detach(), advantages, weight)
        per_token = -torch.min(ratio * advantages, torch.clamp(ratio, low, high) * advantages)
        detached = ratio.detach()
        return LossTerms(per_token, detached, (detached < low) | (detached > high))

    def interval(self, log_ratio: Any, advantages: Any, weight: Any) -> tuple[Any, Any]:
        """``([B, R], [B, R])``: each token's bounds on its response's sequence ratio, from the
        detached log sequence ratios (the quantile over the responses with a counted token)."""
        c = self.config
        counted = weight > 0
        log_s = sequence_mean(log_ratio, counted.to(log_ratio.dtype))  # [B, 1]
        mismatch = log_s.abs().expand_as(log_ratio)  # [B, R]
        first = counted & (counted.cumsum(1) == 1)  # [B, R]: one entry per response that counts
        return contracted_interval(mismatch, advantages, first, c.clip, c.quantile, c.bandwidth)
