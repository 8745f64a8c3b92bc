"""The learning-rate rule contract: how the update scales its optimizer's learning rate for one
step from what the step's batch looks like, and puts it back after the step.

A rule is a class registered in ``gfcr.registry.catalog.LR_RULES`` (entry-point group
``gfcr.lr_rules``) with a frozen ``Config`` and ``__init__(config)``, chosen in the update's
``lr_rule: {use: <alias>, with: {...}}`` (``constant`` by default), with two methods:

- ``sums(log_seq_weights) -> [k]``: with ``log_seq_weights`` the ``[B]`` tensor of one
  micro-batch's per-trajectory log importance weights ``sum_t (log pi_old(y_t) - log mu(y_t))``
  over the counted tokens (``pi_old`` the policy at update start, ``mu`` the behaviour
  log-probs), a ``[k]`` float64 tensor of sums (``k = 0`` for a rule that reads nothing). The
  update adds them over micro-batches and, under trainer ranks, over every rank, so a rule sees
  the whole batch (VCPO all-gathers its weights across data-parallel ranks);
- ``factor(totals) -> (factor, metrics)``: from those totals (a list of ``k`` floats), the
  factor every param group's learning rate is multiplied by for this step, and the numbers the
  update adds to its metrics. The update restores the learning rates after the step.

This module imports no torch at import time: ``gfcr validate`` builds every spec.
"""

from __future__ import annotations

from typing import Any, ClassVar, Protocol

from pydantic import BaseModel, Field

from gfcr.stages.components.base import ComponentConfig, ComponentSpec

LrRuleConfig = ComponentConfig


class LrRule(Protocol):
    config: BaseModel

    def sums(self, log_seq_weights: Any) -> Any: ...

    def factor(self, totals: list[float]) -> tuple[float, dict[str, float]]: ...


class LrRuleSpec(ComponentSpec):
    """``lr_rule: {use: <alias>, with: {<its Config>}}``."""

    kind: ClassVar[str] = "learning-rate rule"
    key: ClassVar[str] = "lr_rule"
    registry_name: ClassVar[str] = "LR_RULES"

    use: str = Field("constant", description="learning-rate rule alias (`gfcr stages --components` lists them)")


def sequence_log_weights(logp: Any, behaviour: Any, weight: Any) -> Any:
    """``[B]``: each row's ``sum_t (log pi_old - log mu)`` over its counted tokens (``weight > 0``);
    ``logp`` ``[B, R]`` is detached here (``pi_old``: the policy at update start)."""
    import torch

    counted = (weight > 0).to(logp.dtype)
    return torch.where(counted > 0, logp.detach() - behaviour, torch.zeros_like(logp)).sum(1)
