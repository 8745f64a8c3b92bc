"""The loss contract: per-token log-ratios and advantages in, a per-token loss out.

A loss is a class registered in ``gfcr.registry.catalog.LOSSES`` (entry-point group
``gfcr.losses``) with a frozen ``Config`` (``extra="forbid"``), ``__init__(config)`` and

    terms(log_ratio, advantages, weight) -> LossTerms

where every tensor is ``[B, R]`` over one micro-batch (``B`` responses, ``R`` response
positions): ``log_ratio = log pi_theta(y_t) - log pi_prox(y_t)`` carries the gradient
(``pi_prox`` is the behaviour policy, or ``pi_old`` under an off-policy correction),
``advantages`` is the advantage of every token, and ``weight`` is the token weight the
aggregation will use (0 on padding and masked tokens; a sequence-level loss averages over
it). The update multiplies the returned ``per_token`` by any importance weight, then hands it
to the aggregation; the loss never divides by a batch size.

A loss module imports torch inside its functions only, so that ``gfcr validate`` can import
it. Class attributes a loss may set:

- ``requires``: ``Requirement``s on the other components (GSPO is defined with a
  sequence-mean aggregation);
- ``token_corrections: bool`` (default True): whether the loss has a per-token ratio that an
  off-policy correction may reweight (``correction: tis``, ``decoupled_clip``,
  ``recompute_old``); a loss that sets False makes them a validate error.
- ``needs_logprobs: bool`` (default False): the loss also takes ``logprobs=``, the ``[B, R]``
  detached log-probabilities of the current policy (TR-GRPO weights tokens by them).

These extension points are declared in ``gfcr.registry.components``; a near miss of their
names is refused when the loss is registered.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, Protocol

from pydantic import BaseModel, Field

from gfcr.stages.components.base import ComponentConfig, ComponentSpec

LossConfig = ComponentConfig


@dataclass
class LossTerms:
    """``[B, R]`` tensors of one micro-batch."""

    per_token: Any  # the loss of every token, with gradient (before the aggregation's weights)
    ratio: Any  # detached: the ratio the loss used (a sequence ratio is repeated over its tokens)
    clipped: Any  # bool: the token's ratio (or IS weight) was outside the clip range


class Loss(Protocol):
    config: BaseModel

    def terms(self, log_ratio: Any, advantages: Any, weight: Any) -> LossTerms: ...


class LossSpec(ComponentSpec):
    """``loss: {use: <loss alias>, with: {<its Config>}}``."""

    kind: ClassVar[str] = "loss"
    key: ClassVar[str] = "loss"
    registry_name: ClassVar[str] = "LOSSES"

    use: str = Field("ppo_clip", description="loss alias (`gfcr stages --components` lists them)")


def sequence_mean(values: Any, weight: Any) -> Any:
    """``[B, 1]``: the ``weight``-weighted mean of ``values`` over each response (0 for a
    response with no weight)."""
    total = (values * weight).sum(1, keepdim=True)
    return total / weight.sum(1, keepdim=True).clamp(min=1e-12)
