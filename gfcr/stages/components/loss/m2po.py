"""loss ``m2po``: M2PO, Second-Moment Trust Policy Optimization (Zheng et al., 2025, "Prosperity
before Collapse: How Far Can Off-Policy RL Reach with Stale Data on LLMs?", arXiv 2510.01161), as
the authors' code computes it (Infini-AI-Lab/M2PO, ``compute_m2po_policy_loss``).

Stale rollouts move the ratio ``r_t = pi_theta(y_t) / pi_prox(y_t)`` far from 1; PPO's fixed
clip then throws away most of their tokens. M2PO bounds the second moment of the log-ratio
instead, and only over the tokens that could do harm, with ``Delta_t = -log r_t``:

- harmful tokens: those of a response whose advantage is positive with ``r_t > 1``, or
  negative with ``r_t < 1`` (the sign is the advantage on the response's first position);
- ``M2 = mean Delta_t^2`` over the ``n`` harmful tokens of the micro-batch. If
  ``M2 <= m2_budget`` nothing is clipped (bounds ``[0, 1e5]``);
- otherwise one ``tau`` per micro-batch: with the harmful ``Delta^2`` sorted ascending
  (``v_0 <= ... <= v_{n-1}``) and their prefix sums ``S_k``, ``k`` is the first index with
  ``v_k (n - k - 1) + S_k >= m2_budget n`` (capping every ``Delta^2`` at ``v_k`` would spend the
  budget), and ``tau^2 = v_{k-1}``, the breakpoint below (``tau = 0`` when ``k = 0``);
- every token then gets PPO's clipped surrogate with the ratio clamped to
  ``[e^-tau, e^tau]``: ``l_t = -min(r_t A_t, clip(r_t, e^-tau, e^tau) A_t)``. ``miniclip``
  floors the two half-widths (``1 - e^-tau``, ``e^tau - 1``) from below.

Defaults from the authors' scripts (``train-scripts/m2po-qwen-math-7b-s256.sh``):
``m2_budget = 0.04``; ``miniclip`` off (the scripts pass none; the function's own defaults,
0.3 and 0.5, are ``miniclip: [0.3, 0.5]``); ``loss_agg_mode`` token-mean, gfcr's default
aggregation. The authors train on batches 256 updates stale (Qwen2.5-Math-7B, lr 1e-6, 8
rollouts per prompt, no KL).

Which M2PO: the official code above, not AReaL's port (``_apply_m2po_masking``), which masks
the largest ``Delta^2`` of all tokens (not the harmful ones) against the proximal policy until
the mean of the rest is under the threshold, and then runs decoupled PPO: a different rule.

Fidelity: checked against Infini-AI-Lab/M2PO@af54a3e: 41/42 cases, 1 documented deviation
(``tests/fidelity/m2po.json``;
``compute_m2po_policy_loss``, ``kpo_clip_harmful_tokens``, ``_solve_tau_from_sorted_delta2``: the
loss and its gradient, the bounds and M2 before and after, budgets 0.04, 0.01 and 0.2, with
and without ``miniclip``, one-sign batches, zero-advantage and fully masked rows,
``token_mean`` and ``seq_mean_token_mean``).

Deviations:
- ``tau`` is solved per call, over the micro-batch the update hands the loss, as the reference
  solves it per micro-batch of its actor (``ppo_micro_batch_size_per_gpu``): like there, it
  depends on the micro-batch size;
- ``pi_prox`` is the policy the correction names (the behaviour policy under ``none``, the
  reference's ``old_log_prob`` computed at rollout time); the reference has no proximal policy;
- ``clipped`` (the ``clip_fraction`` metric) marks the tokens whose ratio is outside
  ``[e^-tau, e^tau]``, as ``ppo_clip`` does; the reference's ``pg_clipfrac`` counts only those
  where the clipped term is the larger loss. The reference's ``m2po/*`` metrics are not logged;
- the reference prints its bounds on every call, and its solver returns a bare number where
  the budget is 0 (which ``m2_budget > 0`` rules out); at ``k = 0`` it reports ``M2`` itself as
  ``M2_after`` (kept: ``bounds`` returns the same);
- the reference's ``agg_loss`` (the verl of its fork) gives NaN under ``seq-mean-token-mean``
  for a micro-batch with a fully masked response (0 / 0); ``seq_mean_token_mean`` leaves that
  response out (1 reference case; the M2PO terms agree).

Example (two harmful tokens with ``Delta^2`` 0.01 and 1.0, budget 0.04: ``k = 1``, so
``tau = 0.1``; the stale token's ratio ``e^1`` is clipped to ``e^0.1``):

>>> import torch
>>> loss = M2PO(M2PO.Config())
>>> b = loss.bounds(torch.tensor([[0.1, 1.0]]), torch.ones(1, 2), torch.ones(1, 2))
>>> round(b.m2, 3), round(b.low, 4), round(b.high, 4)
(0.505, 0.9048, 1.1052)

YAML:

.. code-block:: yaml

    update: {use: update.grpo, from: reward, with: {loss: {use: m2po, with: {m2_budget: 0.04}}}}
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Annotated, Any

from pydantic import Field

from gfcr.stages.components.loss.base import LossConfig, LossTerms

NO_CLIP = (0.0, 100000.0)  # the reference's ratio bounds when the budget holds (clip_low 0, clip_high 1e5)
TINY = 1e-12  # the reference's tolerance in every comparison


@dataclass(frozen=True)
class M2Bounds:
    """One micro-batch's ratio bounds and the harmful tokens' second moment before and after."""

    low: float
    high: float
    m2: float
    m2_after: float


class M2PO:
    """PPO's clipped surrogate with one clip range per micro-batch, from a second-moment budget."""

    class Config(LossConfig):
        m2_budget: Annotated[float, Field(gt=0.0)] = Field(
            0.04, description="the bound on the harmful tokens' mean squared log-ratio (the authors' 0.04)")
        miniclip: tuple[Annotated[float, Field(ge=0.0)] | None, Annotated[float, Field(ge=0.0)] | None] = Field(
            (None, None), description="floors of the half-widths (1 - e^-tau, e^tau - 1); null: none (the "
                                      "authors' scripts); the reference function's defaults are [0.3, 0.5]")

    def __init__(self, config: Config):
        self.config = config

    def terms(self, log_ratio: Any, advantages: Any, weight: Any) -> LossTerms:
        import torch

        b = self.bounds(log_ratio, advantages, weight)
        ratio = torch.exp(log_ratio)
        per_token = -torch.min(ratio * advantages, torch.clamp(ratio, b.low, b.high) * advantages)
        detached = ratio.detach()
        return LossTerms(per_token, detached, (detached < b.low) | (detached > b.high))

    def bounds(self, log_ratio: Any, advantages: Any, weight: Any) -> M2Bounds:
        """The micro-batch's ratio bounds ``[1 - eps_low, 1 + eps_high]`` under the budget."""
        d2 = harmful_delta_sq(log_ratio.detach(), advantages, weight)  # [n]
        n = d2.numel()
        if n == 0:
            return M2Bounds(*NO_CLIP, 0.0, 0.0)
        m2 = float(d2.sum().item() / n)
        if m2 <= self.config.m2_budget + TINY:
            return M2Bounds(*NO_CLIP, m2, m2)
        tau, m2_after = solve_tau(d2, self.config.m2_budget * n)
        eps_low, eps_high = 1 - _exp32(-tau), _exp32(tau) - 1  # as the reference maps tau, in float32
        floor_low, floor_high = self.config.miniclip
        eps_low = eps_low if floor_low is None else max(eps_low, floor_low)
        eps_high = eps_high if floor_high is None else max(eps_high, floor_high)
        return M2Bounds(1 - eps_low, 1 + eps_high, m2, m2_after)


def harmful_delta_sq(log_ratio: Any, advantages: Any, weight: Any) -> Any:
    """``[n]``: ``Delta^2`` of the counted tokens whose ratio moves against their response's
    advantage sign (positive with ``r > 1``, negative with ``r < 1``)."""
    ratio = log_ratio.exp()
    sign = advantages[:, :1]  # [B, 1]: the reference reads the response's advantage at position 0
    counted = weight > 0
    pos = counted & (sign > TINY) & (ratio > 1.0 + TINY)
    neg = counted & (sign < -TINY) & (ratio < 1.0 - TINY)
    return log_ratio[pos | neg].pow(2)


def solve_tau(d2: Any, target: float) -> tuple[float, float]:
    """``(tau, M2 after capping)``: the breakpoint ``sqrt(v_{k-1})`` below the level at which
    capping every ``Delta^2`` spends ``target`` (the reference's ``_solve_tau_from_sorted_delta2``)."""
    import torch

    v, _ = torch.sort(d2)  # ascending
    csum = torch.cumsum(v, dim=0).double()  # float32 prefix sums, as the reference's
    v = v.double()
    n = v.numel()
    rest = torch.arange(n - 1, -1, -1, dtype=torch.float64)  # n - k - 1
    k = int(torch.nonzero((v - TINY) * rest + csum >= target - TINY)[0])  # k = n - 1 always qualifies
    if k == 0:
        return 0.0, float(csum[-1]) / n
    return float(v[k - 1] - TINY) ** 0.5, (float(v[k - 1]) * (n - k) + float(csum[k - 1])) / n


def _exp32(x: float) -> float:
    import torch

    return float(torch.exp(torch.tensor(x)).item()) if math.isfinite(x) else math.exp(x)
