"""The off-policy correction contract: how the update takes each token's ratio and weight when
the tokens were sampled by an older policy than the one being trained.

A correction is a class registered in ``gfcr.registry.catalog.CORRECTIONS`` (entry-point group
``gfcr.corrections``) with a frozen ``Config`` and ``__init__(config)``, chosen in the update's
``correction: {use: <alias>, with: {...}}`` (``none`` by default). Two optional roles
(``gfcr.registry.components``):

- ``correct(logp, behaviour, stale) -> TokenCorrection`` (``CorrectsTokens``), with ``[B, R]``
  tensors of one micro-batch: ``logp`` the current log-probs (with gradient), ``behaviour`` the
  log-probs ``mu`` each token's segment recorded, ``stale`` whether the token is stale
  (``staleness = current_version - segment.policy_version > 0``). With it, the update takes
  every token's ratio against ``TokenCorrection.proximal``, multiplies the token's loss by
  ``weight``, writes ``pi_old`` to ``Rollout.old_logprobs`` and adds to its metrics
  ``off_policy_token_fraction`` (tokens with staleness > 0, before any staleness limit),
  ``is_weight_mean``, ``is_weight_max`` (of ``pi_old / mu`` before any cap, over the corrected
  tokens) and ``is_clipped_fraction`` (the share of them the cap truncated). Without it
  (``none``), the ratio is taken against ``mu`` and nothing is added.
- ``keeps(rollout, version) -> [T] weights | None`` (``LimitsStaleness``): tokens more than
  ``max_staleness`` versions old are masked out of the loss and its denominator (a bool
  mask); ``freshness`` gives float weights in [0, 1] instead, which multiply the tokens' loss
  weights and the denominator alike.

``pi_old`` is the policy at update start. The update takes one optimizer step per batch, so
the weights do not change while gradients accumulate over micro-batches: ``pi_old`` is the
detached log-prob of the gradient pass itself, and no second forward pass is spent on it.

A correction that reweights the per-token ratio (``tis``, ``decoupled_clip``,
``recompute_old``) needs a loss that has one: a loss that declares ``token_corrections = False``
(GSPO, TIC-GRPO) refuses it in ``gfcr validate``. An upstream stage that replays old rollouts
says which correction it needs (``update_needs``: ``replay.rollout_replay`` needs
``decoupled_clip``), and ``gfcr validate`` checks that too.

This module imports no torch at import time: ``gfcr validate`` builds every spec.

Example (a token sampled two versions ago, whose probability rose from 0.2 to 0.5):

>>> import math, torch
>>> logp = torch.tensor([[math.log(0.5)]], requires_grad=True)
>>> behaviour, stale = torch.tensor([[math.log(0.2)]]), torch.tensor([[True]])
>>> correction = proximal_correction(logp, behaviour, stale, cap=2.0)
>>> ratio = torch.exp(logp - correction.proximal)  # against pi_old: 1 at the update's start
>>> round(float(correction.weight), 4), round(float(correction.raw_weight), 4), float(ratio.detach())
(2.0, 2.5, 1.0)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Any, ClassVar, Protocol

import numpy as np
from pydantic import BaseModel, Field

from gfcr.records import Rollout
from gfcr.registry import PipelineProblem
from gfcr.stages.components.base import ComponentConfig, ComponentSpec, PairingContext

CorrectionConfig = ComponentConfig

# the ``max_staleness`` key every correction but ``none`` has (``staleness`` requires it)
MaxStaleness = Annotated[Annotated[int, Field(ge=0)] | None, Field(
    description="mask tokens more than K policy versions old out of the loss and its denominator; null: no limit")]


class Correction(Protocol):
    config: BaseModel


class CorrectionSpec(ComponentSpec):
    """``correction: {use: <alias>, with: {<its Config>}}``."""

    kind: ClassVar[str] = "off-policy correction"
    key: ClassVar[str] = "correction"
    registry_name: ClassVar[str] = "CORRECTIONS"

    use: str = Field("none", description="off-policy correction alias (`gfcr stages --components` lists them)")


@dataclass
class TokenCorrection:
    """Per-token tensors ``[B, R]`` of one micro-batch."""

    proximal: Any  # log-prob of the policy the ratio is taken against (mu, or pi_old where decoupled)
    weight: Any  # the detached IS weight applied to the loss (1 where not decoupled)
    raw_weight: Any  # pi_old / mu before any cap
    decoupled: Any  # bool: the token's ratio is against pi_old
    capped: Any  # bool: the cap truncated the token's weight


def proximal_correction(logp: Any, behaviour: Any, decoupled: Any, cap: float | None = None,
                        weighted: bool = True) -> TokenCorrection:
    """The ``decoupled`` tokens (``[B, R]`` bool) take their ratio against ``pi_old`` and, when
    ``weighted``, the weight ``pi_old / mu`` (truncated at ``cap``); the others keep the ratio
    against ``mu`` and the weight 1."""
    import torch

    old = logp.detach()  # pi_old: the policy at update start (see the module docstring)
    raw = torch.exp(old - behaviour)
    truncated = raw.clamp(max=cap) if cap is not None else raw
    ones = torch.ones_like(raw)
    weight = torch.where(decoupled, truncated, ones) if weighted else ones
    capped = raw > cap if cap is not None else torch.zeros_like(decoupled)
    return TokenCorrection(torch.where(decoupled, old, behaviour), weight, raw, decoupled, capped)


def kept_tokens(max_staleness: int | None, rollout: Rollout, version: int) -> np.ndarray | None:
    """``[T]`` bool: the tokens at most ``max_staleness`` versions old; None without a limit."""
    return None if max_staleness is None else rollout.staleness(version) <= max_staleness


def per_token_ratio_problems(alias: str, ctx: PairingContext) -> list[PipelineProblem]:
    """Correction ``alias`` reweights each token's ratio: the loss must have one."""
    if ctx.token_corrections:
        return []
    return [PipelineProblem(("correction", "use"), f"loss `{ctx.loss}` has no per-token ratio for correction "
                                                   f"`{alias}` to correct",
                            "set `correction: {use: none}` (--set update.with.correction.use=none), or use loss "
                            "`ppo_clip`")]


@dataclass
class CorrectionStats:
    """Running sums of the IS diagnostics over the counted tokens of a batch."""

    decoupled: float = 0.0
    weight_sum: float = 0.0
    weight_max: float = 0.0
    capped: float = 0.0

    def add(self, correction: TokenCorrection, counted: Any) -> None:
        chosen = correction.decoupled & (counted > 0)
        raw = correction.raw_weight[chosen]
        self.decoupled += float(chosen.sum())
        self.weight_sum += float(raw.sum())
        self.weight_max = max(self.weight_max, float(raw.max())) if raw.numel() else self.weight_max
        self.capped += float(correction.capped[chosen].sum())

    def merged(self, other: "CorrectionStats") -> "CorrectionStats":
        """The sums over two parts of a batch (two trainer ranks' shards)."""
        return CorrectionStats(self.decoupled + other.decoupled, self.weight_sum + other.weight_sum,
                               max(self.weight_max, other.weight_max), self.capped + other.capped)

    def metrics(self) -> dict[str, float]:
        """``is_weight_mean`` and ``is_weight_max`` of ``pi_old / mu`` before the cap, and
        ``is_clipped_fraction`` (truncated by the cap), over the decoupled tokens; 1, 1 and 0
        when no token was decoupled."""
        if not self.decoupled:
            return {"is_weight_mean": 1.0, "is_weight_max": 1.0, "is_clipped_fraction": 0.0}
        return {"is_weight_mean": self.weight_sum / self.decoupled, "is_weight_max": self.weight_max,
                "is_clipped_fraction": self.capped / self.decoupled}
