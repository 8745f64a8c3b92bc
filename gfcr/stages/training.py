"""What an update stage and the runtime's trainer exchange (the ``Trains`` role of
``gfcr.registry.lifecycle``; DESIGN.md section 12, "Who owns what").

The stage decides; the runtime moves things. An update stage that ``Trains`` computes its batch
(``prepare``: the items, the plan every shard trains against, the step's metrics so far, or why
the step is skipped), the gradients of a shard and its optimizer step (``train_shard``, on
``Ranks`` that sum tensors across trainer ranks), and the report from the shards' answers
(``finish``). The trainer (``gfcr.runtime.training``: in this process, or over trainer ranks)
calls the three, splits the batch into shards, bumps the policy version, brings the trained
weights to the driver and hands the new version to a weight mover. The stage never touches the
policy's version, another process or the engine's weights.

``step_here`` is the three calls in this process, for the trainer that runs there and for a
stage's own ``run`` (a step without the runtime, as tests and examples take it): its report's
``policy_version`` is the version the batch was trained *from*; the runtime's trainer writes the
version after.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

from gfcr.records import UpdateReport


def _one_rank(tensors: list[Any]) -> None:
    """The sum over one rank: the tensors as they are."""


def _itself(n: int) -> int:
    """The largest over one rank: ``n``."""
    return n


@dataclass(frozen=True)
class Ranks:
    """Where one shard of a distributed update runs: rank ``rank`` of ``world_size`` trainer ranks,
    and ``all_reduce_sum``, which replaces each tensor of a list by its sum over the ranks, in
    place. In one process (the default) it is rank 0 of 1 and the sum does nothing.

    ``sharded``: the policy's parameters are sharded over the ranks (FSDP2, ``resources: {sharding:
    fsdp2}``; ``gfcr.runtime.training.sharding``): each backward pass reduces the policy's gradients
    itself (a SUM over the ranks), so the stage sums only what is not the policy's (the loss, a
    learned aggregation's parameters); and each forward and backward pass is a collective, so every
    rank must run as many as the busiest: ``most(n)`` is the largest ``n`` over the ranks."""

    rank: int = 0
    world_size: int = 1
    all_reduce_sum: Callable[[list[Any]], None] = _one_rank
    sharded: bool = False
    most: Callable[[int], int] = _itself


@dataclass
class TrainBatch:
    """An update's batch as ``prepare`` hands it to the trainer.

    ``items`` are what ``train_shard`` trains on (they must pickle: trainer ranks get them), each
    ``sizes[i]`` units of work (response tokens), by which the trainer balances its shards; ``plan``
    is what every shard is trained against (the aggregation's batch-wide totals); ``metrics`` the
    step's numbers so far; ``skip_reason`` says why the step does not train (None: it does);
    ``version`` is the policy version the batch was prepared at."""

    items: list[Any]
    sizes: list[int]
    plan: Any = None
    metrics: dict[str, float] = field(default_factory=dict)
    skip_reason: str | None = None
    version: int = 0
    saved: dict[str, Any] | None = None  # what the stage saves of the batch when asked (``update.grpo``'s save_batches)


def step_here(stage: Any, version: int, *inputs: Any, **named: Any) -> UpdateReport:
    """One step of ``stage`` (a ``Trains`` update) in this process: ``prepare``, the whole batch as
    one shard at ``version``, ``finish``. Nothing moves the policy's version or the engine's
    weights here (the runtime's trainer does, around this call)."""
    batch = stage.prepare(*inputs, **named)
    outcomes = [] if batch.skip_reason is not None else [stage.train_shard(batch.items, batch.plan, version, Ranks())]
    return stage.finish(batch, outcomes)
