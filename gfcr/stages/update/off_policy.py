"""Off-policy corrections of the clipped surrogate, per token, each switched by its own field
of the update's Config:

- ``tis_cap: C``: truncated importance sampling (Yao et al., 2025, "Your efficient RL
  framework secretly brings you off-policy RL training"; verl's ``tis_imp_ratio_cap``). Every
  token's PPO ratio is taken against ``pi_old``, the policy at update start, and its loss is
  multiplied by the detached weight ``min(pi_old(y_t) / mu(y_t), C)``, with ``mu`` the
  behaviour log-prob its segment recorded.
- ``decoupled_clip: true``: AReaL's decoupled PPO (Fu et al., 2025, arXiv 2505.24298) for
  stale tokens only (``staleness = current_version - segment.policy_version > 0``): the ratio
  is clipped around the proximal policy ``pi_old`` and the loss is multiplied by the
  detached behaviour weight ``pi_old / mu`` (uncapped); fresh tokens keep the ratio against
  ``mu``. With ``tis_cap`` every token is already decoupled, so the two are not combined.
- ``recompute_old: true``: every token's ratio is taken against ``pi_old`` with no weight, so
  a stale token is treated as if the current policy had sampled it. This is the standard PPO
  ratio against recomputed ``old_log_probs`` that APRIL (slime), SPEC-RL and RLEP's reference
  code use (seed_methods 6.4: "a known bias; make it configurable"). The diagnostics still
  report ``pi_old / mu``, which is the weight these methods leave out.
- ``max_staleness: K``: tokens whose staleness exceeds ``K`` are masked out of the loss and
  of its denominator (verl's ``staleness_threshold``, AReaL's ``max_head_offpolicyness``, but
  per token: a resumed rollout keeps its fresh segments).

``pi_old`` is the policy at update start. The update takes one optimizer step per batch, so
the weights do not change while gradients accumulate over micro-batches: ``pi_old`` is the
detached log-prob of the gradient pass itself, and no second forward pass is spent on it.
Nothing here runs unless an option is on, so the default update is bit-for-bit today's.

Example (a token sampled two versions ago, whose probability rose from 0.2 to 0.5):

>>> import math, torch
>>> logp = torch.tensor([[math.log(0.5)]], requires_grad=True)
>>> behaviour, stale = torch.tensor([[math.log(0.2)]]), torch.tensor([[True]])
>>> correction = token_correction(logp, behaviour, stale, tis_cap=2.0, decoupled_clip=False)
>>> ratio = torch.exp(logp - correction.proximal)  # against pi_old: 1 at the update's start
>>> round(float(correction.weight), 4), round(float(correction.raw_weight), 4), float(ratio.detach())
(2.0, 2.5, 1.0)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass
class TokenCorrection:
    """Per-token tensors ``[B, R]`` of one micro-batch."""

    proximal: Any  # log-prob of the policy the ratio is taken against (mu, or pi_old where decoupled)
    weight: Any  # the detached IS weight applied to the loss (1 where not decoupled)
    raw_weight: Any  # pi_old / mu before the cap
    decoupled: Any  # bool: the token's ratio is against pi_old


def token_correction(logp: Any, behaviour: Any, stale: Any, tis_cap: float | None,
                     decoupled_clip: bool, recompute_old: bool = False) -> TokenCorrection:
    """The ratio and IS weight of every token; ``stale`` is ``[B, R]`` bool (staleness > 0)."""
    import torch

    old = logp.detach()  # pi_old: the policy at update start (see the module docstring)
    every = tis_cap is not None or recompute_old
    decoupled = torch.ones_like(stale) if every else (stale if decoupled_clip else torch.zeros_like(stale))
    proximal = torch.where(decoupled, old, behaviour)
    raw = torch.exp(old - behaviour)
    capped = raw.clamp(max=tis_cap) if tis_cap is not None else raw
    weight = torch.ones_like(raw) if recompute_old else torch.where(decoupled, capped, torch.ones_like(raw))
    return TokenCorrection(proximal, weight, raw, decoupled)


@dataclass
class CorrectionStats:
    """Running sums of the IS diagnostics over the counted tokens of a batch."""

    decoupled: float = 0.0
    weight_sum: float = 0.0
    weight_max: float = 0.0
    capped: float = 0.0

    def add(self, correction: TokenCorrection, counted: Any, tis_cap: float | None) -> None:
        chosen = correction.decoupled & (counted > 0)
        raw = correction.raw_weight[chosen]
        self.decoupled += float(chosen.sum())
        self.weight_sum += float(raw.sum())
        self.weight_max = max(self.weight_max, float(raw.max())) if raw.numel() else self.weight_max
        self.capped += float((raw > tis_cap).sum()) if tis_cap is not None else 0.0

    def metrics(self) -> dict[str, float]:
        """``is_weight_mean`` and ``is_weight_max`` of ``pi_old / mu`` before the cap, and
        ``is_clipped_fraction`` (capped by ``tis_cap``), over the decoupled tokens; 1, 1 and 0
        when no token was decoupled."""
        if not self.decoupled:
            return {"is_weight_mean": 1.0, "is_weight_max": 1.0, "is_clipped_fraction": 0.0}
        return {"is_weight_mean": self.weight_sum / self.decoupled, "is_weight_max": self.weight_max,
                "is_clipped_fraction": self.capped / self.decoupled}
