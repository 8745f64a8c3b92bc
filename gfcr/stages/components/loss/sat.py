"""loss ``sat``: SAT, a staleness-adaptive trust region (Tencent Hy, "Staleness-Adaptive Trust
Region", arXiv 2607.18722), on PPO's token-level clipped surrogate, from the abstract.

Stale tokens are the ones whose ratio moves furthest; SAT narrows the trust region only where
the mismatch is large, and only on the side that can do harm. Per micro-batch, with
``d_t = sg(log_ratio_t)`` (the detached sampled log-ratio ``log pi_theta(y_t) - log mu(y_t)``,
the staleness proxy) and ``m_t = |d_t|``:

- the tail: ``q`` is the ``quantile`` of ``m`` over the counted tokens (``weight > 0``); a
  token with ``m_t > q`` is flagged;
- the kernel: a flagged token keeps ``k_t = exp(-((m_t - q) / h)^2 / 2)`` of the interval's
  half-width on its advantage's side (``k_t = 1`` on unflagged tokens), with ``h``, the
  ``bandwidth``, by default the half-width of that side itself (``eps_high`` or ``eps_low``);
- the contraction: only the endpoint the advantage pushes the ratio towards moves,
  ``[1 - eps_low, 1 + k_t eps_high]`` for ``A_t > 0`` and ``[1 - k_t eps_low, 1 + eps_high]``
  for ``A_t < 0`` (``A_t = 0``: PPO's interval); then PPO's
  ``l_t = -min(r_t A_t, clip(r_t, low_t, high_t) A_t)``.

Since ``0 < k_t <= 1`` the interval stays inside PPO's; with no staleness (``d = 0``) nothing
is flagged and the loss is PPO's; and, within a batch, the contraction grows with ``m_t``
(``tests/stages/update/test_sat.py`` checks the three).

Fidelity: from the abstract: no public code (searched for the paper's title, "SAT-GSPO" and
"Staleness-Adaptive Trust Region"; one review notes the paper ships no artifact). What the
abstract states: the detached sampled log-ratio as the staleness proxy; batch-quantile/kernel
scaling that flags the high-mismatch tail; contracting only the sign-selected endpoint of the
PPO interval on those tokens; provably inside the PPO interval; reported on GSPO with routing
replay (``sat_gspo``), Qwen3-30B-A3B, lags 1 and 8.

Deviations (each a choice the abstract leaves open):
- the proxy's magnitude ``|d_t|`` flags a token, whichever way its ratio moved (a ratio that
  moved against the advantage is not clipped by the moved endpoint anyway);
- ``quantile: 0.9`` (the top 10% of the micro-batch's tokens by ``|d|``), computed over the
  micro-batch the update hands the loss (like M2PO's ``tau``, it depends on the micro-batch size);
- the kernel is a Gaussian of the excess over the quantile, in log-ratio units, with the
  endpoint's own half-width as the bandwidth: fresh tokens whose ``|d|`` is rounding noise
  contract by nothing measurable, and a token ``eps`` past the quantile keeps 61% of its side;
- ``clip: [0.2, 0.2]`` (``ppo_clip``'s default; the paper's values are not in the abstract);
- ``d_t`` is the log-ratio the loss gets: against ``mu`` under the corrections ``none``,
  ``staleness`` and ``freshness``, the three SAT pairs with (a decoupled correction's ratio is against ``pi_old``,
  where the proxy would be 0: refused by ``gfcr validate``);
- ``clipped`` (``clip_fraction``) marks the tokens outside their own (contracted) interval.

Example (two stale tokens and eight fresh ones, all with positive advantages: the 0.9
quantile of ``|d|`` is ``q = 0.32``, so the token at ``d = 0.5`` is in the tail and keeps
``exp(-((0.5 - 0.32) / 0.2)^2 / 2) = 0.667`` of ``eps_high``; the others keep PPO's interval):

>>> import torch
>>> loss = SAT(SAT.Config())
>>> d = torch.tensor([[0.5, 0.3] + [0.0] * 8])
>>> low, high = loss.interval(d, torch.ones(1, 10), torch.ones(1, 10))
>>> [round(float(v), 4) for v in high[0, :3]], [round(float(v), 4) for v in low[0, :3]]
([1.1334, 1.2, 1.2], [0.8, 0.8, 0.8])

YAML:

.. code-block:: yaml

    update: {use: update.grpo, from: keep, with: {loss: {use: sat, with: {clip: [0.2, 0.2], quantile: 0.9}}, correction: {use: staleness, with: {max_staleness: 4}}}}
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import Field

from gfcr.stages.components.base import Requirement
from gfcr.stages.components.loss.base import LossConfig, LossTerms

# the proxy is the log-ratio against the behaviour policy: a correction that takes it against pi_old zeroes it
PROXY_CORRECTIONS = Requirement("correction", ("none", "staleness", "freshness"),
                                "SAT's staleness proxy is the log-ratio against the behaviour policy")
Quantile = Annotated[float, Field(ge=0.0, lt=1.0, description="the batch quantile of |log-ratio| above which a "
                                                               "token is in the high-mismatch tail (0.9: the top 10%)")]
Bandwidth = Annotated[float, Field(gt=0.0)] | None


class SAT:
    """PPO's clipped surrogate whose advantage-side endpoint contracts on the high-mismatch tail."""

    requires = (PROXY_CORRECTIONS,)

    class Config(LossConfig):
        clip: tuple[Annotated[float, Field(ge=0.0)], Annotated[float, Field(ge=0.0)]] = Field(
            (0.2, 0.2), description="(eps_low, eps_high) of PPO's interval, which SAT contracts and never widens")
        quantile: Quantile = 0.9
        bandwidth: Bandwidth = Field(None, description="the Gaussian kernel's width in log-ratio units; null: the "
                                                       "half-width of the contracted side (eps_high or eps_low)")

    def __init__(self, config: Config):
        self.config = config

    def terms(self, log_ratio: Any, advantages: Any, weight: Any) -> LossTerms:
        import torch

        low, high = self.interval(log_ratio.detach(), advantages, weight)
        ratio = torch.exp(log_ratio)
        per_token = -torch.min(ratio * advantages, torch.clamp(ratio, low, high) * advantages)
        detached = ratio.detach()
        return LossTerms(per_token, detached, (detached < low) | (detached > high))

    def interval(self, proxy: Any, advantages: Any, weight: Any) -> tuple[Any, Any]:
        """``([B, R], [B, R])``: each token's ``(low, high)`` ratio bounds from the detached
        log-ratio ``proxy``."""
        c = self.config
        return contracted_interval(proxy.abs(), advantages, weight > 0, c.clip, c.quantile, c.bandwidth)


def contracted_interval(mismatch: Any, advantages: Any, counted: Any, clip: tuple[float, float], quantile: float,
                        bandwidth: float | None) -> tuple[Any, Any]:
    """PPO's ``[1 - eps_low, 1 + eps_high]`` with the advantage-side endpoint contracted on
    the entries of ``mismatch`` above its ``quantile`` over the ``counted`` ones."""
    import torch

    eps_low, eps_high = clip
    pos, neg = advantages > 0, advantages < 0
    side = torch.where(pos, torch.full_like(mismatch, eps_high), torch.full_like(mismatch, eps_low))
    width = torch.where(side > 0, side, torch.ones_like(side)) if bandwidth is None else bandwidth  # eps 0: no side
    keep = kernel(mismatch, tail_start(mismatch, counted, quantile), width)
    high = torch.where(pos, 1 + keep * eps_high, torch.full_like(mismatch, 1 + eps_high))
    low = torch.where(neg, 1 - keep * eps_low, torch.full_like(mismatch, 1 - eps_low))
    return low, high


def tail_start(mismatch: Any, counted: Any, quantile: float) -> Any:
    """The ``quantile`` of ``mismatch`` over the ``counted`` entries (0-d; inf when none count)."""
    import torch

    values = mismatch[counted]
    if values.numel() == 0:
        return torch.tensor(float("inf"), dtype=mismatch.dtype, device=mismatch.device)
    return torch.quantile(values.double(), quantile).to(mismatch.dtype)


def kernel(mismatch: Any, start: Any, bandwidth: Any) -> Any:
    """The share of the half-width a token keeps: 1 up to ``start``, then a Gaussian of the excess."""
    import torch

    excess = torch.clamp(mismatch - start, min=0.0) / bandwidth
    return torch.exp(-0.5 * excess * excess)
