"""The aggregation contract: per-token losses of the batch in, one scalar out.

An aggregation is a class registered in ``gfcr.registry.catalog.AGGREGATIONS`` (entry-point
group ``gfcr.aggregations``) with a frozen ``Config``, ``__init__(config)`` and two methods:

- ``plan(rows) -> plan``: called once per step with every response of the batch (a ``Row``
  each, including those whose advantage is zero and never reach the forward pass), returns
  the batch-wide denominators;
- ``reduce(per_token, weight, rows, plan) -> loss``: called once per micro-batch with its
  ``[B, R]`` per-token losses and token weights and its ``B`` rows; the update backwards each
  micro-batch's loss, so the step's loss is the sum over micro-batches, and ``reduce`` must
  divide by ``plan``'s batch-wide totals, never by the micro-batch's own.

Optional, for aggregations with learnable weights (DARO, lambda-GRPO):
``parameters(device) -> list[dict]``, optimizer param groups (``{"params": [...]}``, optionally
with ``"lr"``) added to the update's AdamW, which uses the policy's learning rate where a group
sets none, ``batch_term(plan) -> loss | None``
(added once per step, e.g. a regulariser), ``metrics() -> dict[str, float]``, and
``state_dict()`` / ``load_state_dict(state)`` so that a resumed run goes on with the learned
weights. These extension points are declared in ``gfcr.registry.components`` (``LearnsParameters``,
``AddsBatchTerm``, ``ReportsStepMetrics``, ``Stateful``); a near miss of their names is refused
when the aggregation is registered.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, Literal, Protocol, Sequence

import numpy as np
from pydantic import BaseModel, Field

from gfcr.stages.components.base import ComponentConfig, ComponentSpec

AggregationConfig = ComponentConfig


@dataclass(frozen=True)
class Row:
    """One response of the batch as an aggregation sees it."""

    group_id: str
    group_size: int  # responses of its group in the batch
    group_rewards: np.ndarray  # [G] float64, its group's rewards (difficulty = their mean)
    length: int  # response tokens
    token_weight: float  # the sum of its token weights (its length when nothing is masked)
    counted_tokens: int  # tokens with a non-zero weight

    @property
    def counts(self) -> bool:
        """Some token of it counts (an empty response counts, as GRPO's mean over responses does)."""
        return self.length == 0 or self.counted_tokens > 0


class Aggregation(Protocol):
    config: BaseModel

    def plan(self, rows: Sequence[Row]) -> Any: ...

    def reduce(self, per_token: Any, weight: Any, rows: Sequence[Row], plan: Any) -> Any: ...


class AggregationSpec(ComponentSpec):
    """``aggregation: {use: <alias>, with: {<its Config>}}``."""

    kind: ClassVar[str] = "aggregation"
    key: ClassVar[str] = "aggregation"
    registry_name: ClassVar[str] = "AGGREGATIONS"

    use: str = Field("token_mean", description="aggregation alias (`gfcr stages --components` lists them)")


def counted_lengths(weight: Any) -> Any:
    """``[B]``: the number of tokens with a non-zero weight in each response."""
    return (weight > 0).to(weight.dtype).sum(1)


# which responses a mean over responses divides by: gfcr's default, verl's agg_loss on one
# batch, and verl's engine workers (global_batch_size: every response of the mini-batch)
ResponsesCounted = Literal["counted", "with_tokens", "all"]
RESPONSES_HELP = ("the responses N counts: `counted` (those with a counted token, and empty ones), `with_tokens` "
                  "(verl's agg_loss on one batch), `all` (verl's engine workers: every response of the batch)")


def responses_counted(rows: Sequence[Row], which: ResponsesCounted) -> int:
    """``N``: the batch's responses a mean over responses divides by, as ``which`` says."""
    if which == "all":
        return len(rows)
    if which == "with_tokens":
        return sum(1 for r in rows if r.counted_tokens > 0)
    return sum(1 for r in rows if r.counts)
