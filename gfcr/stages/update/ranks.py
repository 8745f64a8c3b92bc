"""What ``update.grpo``'s step hands back from each shard: the sums each rank's backward passes
add up to (merged in the driver into the step's diagnostics) and a rank's answer.

The runtime's trainer splits the batch and runs the ranks (``gfcr.runtime.training``); nothing
here imports Ray or ``torch.distributed``: a rank sums tensors through
``gfcr.stages.training.Ranks``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from gfcr.stages.components.correction import CorrectionStats


@dataclass
class ShardSums:
    """What the backward passes of one shard add up to, for the step's diagnostics."""

    loss: float = 0.0  # the shard's part of the loss (with the batch term on rank 0)
    clipped: float = 0.0  # counted tokens whose ratio was clipped
    ratio: float = 0.0  # the ratios of the counted tokens, summed
    kl: float = 0.0  # the weighted k3 KL, summed
    counted: int = 0  # tokens with a non-zero weight
    correction: CorrectionStats = field(default_factory=CorrectionStats)
    lr_sums: list[float] = field(default_factory=list)  # the learning-rate rule's sums (this shard's)

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
            total.lr_sums = s.lr_sums if not total.lr_sums else [a + b for a, b in zip(total.lr_sums, s.lr_sums)]
        return total


@dataclass
class ShardOutcome:
    """One rank's answer for a step; ``loss``, ``grad_norm`` and ``skip_reason`` are the same on every rank."""

    sums: ShardSums
    loss: float  # the whole batch's loss, summed over the ranks
    grad_norm: float | None  # None when a non-finite loss skipped the step before clipping
    skip_reason: str | None
    old_logprobs: list[Any] | None  # [T] float32 per shard item, under an off-policy correction
    extra: dict[str, float]  # the aggregation's and the learning-rate rule's metrics, before the step
    advantages: list[float] | None = None  # per shard item, where the estimator weighs by gradients
    batch_trace: list[dict[str, Any]] | None = None  # the micro-batches' records, under ``save_batches``
