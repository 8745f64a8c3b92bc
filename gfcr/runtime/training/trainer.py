"""The runtime's trainer: runs an update stage's step and moves what the step changed
(DESIGN.md section 12, "Who owns what": stages decide, the runtime moves things).

An update stage that ``Trains`` (``gfcr.registry.lifecycle``) computes the batch (``prepare``),
each shard's gradients and optimizer step (``train_shard``) and the report (``finish``). The
trainer calls them, and then, when the step was not skipped:

1. bumps the policy version (the policy's; a pipeline without a policy, such as the fake one,
   counts versions in the trainer, from 0 each time the trainer is built);
2. (``RankTrainer``) loads rank 0's trained weights into the driver's policy, which scores,
   checkpoints and feeds the engine;
3. hands the new version to the weight mover (``gfcr.runtime.weights``), which brings the
   engine(s) up to date; the report's ``sync_s`` and ``sync_bytes`` are the mover's time and
   bytes.

``LocalTrainer`` steps in this process (the whole batch is one shard); ``RankTrainer`` steps on
a ``TrainerGroup`` of trainer ranks (``gfcr.runtime.ray.trainer_ranks``), the batch split into
contiguous shards balanced by the sizes ``prepare`` gave. The runner calls ``update`` for the
update node of the plan (still one node, one Prefect task, one line of lineage and timings) and
routes the update stage's state through ``state_dict`` / ``load_state_dict`` here, since under
trainer ranks the optimizer lives in the ranks.
"""

from __future__ import annotations

import time
from dataclasses import replace
from typing import Any, Protocol, Sequence, TypeVar

from gfcr.records import UpdateReport
from gfcr.stages.resources import Policy, policy_weights
from gfcr.stages.training import Ranks, TrainBatch

T = TypeVar("T")


class WeightMover(Protocol):
    """Carries a new policy version to the engine(s) (``gfcr.runtime.weights``)."""

    def move(self, version: int) -> int:
        """Bring the engine(s) up to ``version``; the bytes copied (0 where the engine shares the model)."""
        ...


class TrainerGroup(Protocol):
    """The update's trainer ranks, driven from the driver (``gfcr.runtime.ray.trainer_ranks``).

    ``step(shards, *args)`` calls ``train_shard(shards[r], *args, ranks)`` on the stage built in
    rank ``r`` and returns the answers in rank order; ``weights()`` is rank 0's policy
    ``state_dict`` (on the CPU); ``load_weights`` puts the driver's into every rank;
    ``state_dict`` / ``load_state_dict`` are rank 0's stage state / every rank's."""

    world_size: int
    version: int  # the policy version the ranks hold

    def step(self, shards: list[list[Any]], *args: Any) -> list[Any]: ...

    def weights(self) -> dict[str, Any]: ...

    def load_weights(self, weights: dict[str, Any], version: int) -> None: ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


class _StayPut:
    """No engine to bring up to date: nothing moves."""

    def move(self, version: int) -> int:
        return 0


def split_balanced(items: Sequence[T], sizes: Sequence[int], k: int) -> list[list[T]]:
    """``k`` contiguous, in-order shards of ``items`` balanced by ``sizes``: item ``i`` goes to the
    shard holding the middle of its size (some shards may be empty)."""
    total = sum(sizes)
    shards: list[list[T]] = [[] for _ in range(k)]
    before = 0
    for item, n in zip(items, sizes, strict=True):
        shards[min(k - 1, (k * (2 * before + n)) // (2 * total)) if total else 0].append(item)
        before += n
    return shards


class LocalTrainer:
    """Runs a ``Trains`` update in this process and moves the version it makes."""

    def __init__(self, policy: Policy | None = None, mover: WeightMover | None = None):
        self.policy = policy
        self.mover: WeightMover = mover if mover is not None else _StayPut()
        self._version = 0  # without a policy: the versions this trainer made

    @property
    def version(self) -> int:
        return self.policy.version if self.policy is not None else self._version

    def update(self, stage: Any, *inputs: Any, **named: Any) -> UpdateReport:
        """One step of ``stage``: prepare, train, finish; then, unless skipped, the new version,
        the trained weights in the driver, and the mover's sync."""
        version = self.version
        batch: TrainBatch = stage.prepare(*inputs, **named)
        outcomes = [] if batch.skip_reason is not None else self._train(stage, batch, version)
        report: UpdateReport = stage.finish(batch, outcomes)
        if report.skipped:
            return replace(report, policy_version=version)
        self._advance(version + 1)
        if self.policy is None:  # no weights, nothing to move (the fake pipeline)
            return replace(report, policy_version=version + 1)
        start = time.perf_counter()
        moved = self.mover.move(version + 1)
        return replace(report, policy_version=version + 1, sync_s=time.perf_counter() - start, sync_bytes=moved)

    def _train(self, stage: Any, batch: TrainBatch, version: int) -> list[Any]:
        return [stage.train_shard(batch.items, batch.plan, version, Ranks())]

    def _advance(self, version: int) -> None:
        if self.policy is not None:
            self.policy.version = version
        else:
            self._version = version

    def resume_at(self, version: int) -> None:
        """Go on from ``version`` (the checkpoint's runner position): without a policy, the
        trainer's count; with one, the checkpoint has loaded the policy's own."""
        if self.policy is None:
            self._version = version

    def state_dict(self, stage: Any) -> dict[str, Any]:
        """The update stage's state (its optimizer, learned aggregation weights)."""
        return stage.state_dict()

    def load_state_dict(self, stage: Any, state: dict[str, Any]) -> None:
        stage.load_state_dict(state)


class RankTrainer(LocalTrainer):
    """Runs a ``Trains`` update on trainer ranks: the driver's stage prepares and finishes, each
    rank trains its shard; the driver's policy then takes rank 0's weights."""

    def __init__(self, policy: Policy, group: TrainerGroup, mover: WeightMover | None = None):
        super().__init__(policy, mover)
        self.group = group

    def _train(self, stage: Any, batch: TrainBatch, version: int) -> list[Any]:
        assert self.policy is not None
        if self.group.version != version:  # the ranks catch up with the driver's weights (after a resume)
            self.group.load_weights(policy_weights(self.policy), version)
        shards = split_balanced(batch.items, batch.sizes, self.group.world_size)
        return self.group.step(shards, batch.plan, version)

    def _advance(self, version: int) -> None:
        """The new version, with rank 0's weights (through Ray's object store) in the driver's
        policy, which scores, checkpoints and feeds the engine replicas."""
        assert self.policy is not None
        self.policy.version = version
        self.policy.model.load_state_dict(self.group.weights())
        self.group.version = version

    def state_dict(self, stage: Any) -> dict[str, Any]:
        """Rank 0's stage state: the optimizer (and learned aggregation weights) live in the ranks."""
        return self.group.state_dict()

    def load_state_dict(self, stage: Any, state: dict[str, Any]) -> None:
        stage.load_state_dict(state)  # the driver's stage holds no optimizer: it takes what it keeps
        self.group.load_state_dict(state)
