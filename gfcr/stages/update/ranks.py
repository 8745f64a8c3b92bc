"""What ``update.grpo`` needs to run its step split across trainer ranks: the shards of a batch,
the sums each rank's backward passes add up to (merged in the driver into the step's
diagnostics), a rank's answer, and where rank 0's weights arrive in the driver.

The ranks themselves are Ray actors (``gfcr.runtime.trainer_ranks``); nothing here imports Ray
or ``torch.distributed``: a rank sums tensors through ``gfcr.stages.resources.Ranks``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence, TypeVar

from gfcr.stages.components.correction import CorrectionStats
from gfcr.stages.resources import Policy, TrainerGroup

T = TypeVar("T")


@dataclass
class ShardSums:
    """What the backward passes of one shard add up to, for the step's diagnostics."""

    loss: float = 0.0  # the shard's part of the loss (with the batch term on rank 0)
    clipped: float = 0.0  # counted tokens whose ratio was clipped
    ratio: float = 0.0  # the ratios of the counted tokens, summed
    kl: float = 0.0  # the weighted k3 KL, summed
    counted: int = 0  # tokens with a non-zero weight
    correction: CorrectionStats = field(default_factory=CorrectionStats)

    @staticmethod
    def merged(shards: list["ShardSums"]) -> "ShardSums":
        """The sums over every rank (one shard: itself, so one process is unchanged)."""
        if len(shards) == 1:
            return shards[0]
        total = ShardSums()
        for s in shards:
            total.loss += s.loss
            total.clipped += s.clipped
            total.ratio += s.ratio
            total.kl += s.kl
            total.counted += s.counted
            total.correction = total.correction.merged(s.correction)
        return total


@dataclass
class ShardOutcome:
    """One rank's answer for a step; ``loss``, ``grad_norm`` and ``skip_reason`` are the same on every rank."""

    sums: ShardSums
    loss: float  # the whole batch's loss, summed over the ranks
    grad_norm: float | None  # None when a non-finite loss skipped the step before clipping
    skip_reason: str | None
    old_logprobs: list[Any] | None  # [T] float32 per shard item, under an off-policy correction
    extra: dict[str, float]  # the aggregation's metrics, before the step


def split_items(items: Sequence[T], k: int) -> list[list[T]]:
    """``k`` contiguous, in-order shards of ``items`` balanced by response tokens: item ``i`` goes
    to the shard holding the middle of its tokens (some shards may be empty)."""
    total = sum(len(i.rollout) for i in items)
    shards: list[list[T]] = [[] for _ in range(k)]
    before = 0
    for item in items:
        n = len(item.rollout)
        shards[min(k - 1, (k * (2 * before + n)) // (2 * total)) if total else 0].append(item)
        before += n
    return shards


def receive_weights(policy: Policy, trainers: TrainerGroup) -> None:
    """Where the trained weights arrive in the driver after a distributed step: rank 0's
    ``state_dict``, through Ray's object store, loaded into the driver's copy of the policy
    (which scores, checkpoints and feeds the engine replicas)."""
    policy.model.load_state_dict(trainers.weights())
