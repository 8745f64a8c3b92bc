"""Groups of rollouts of one prompt, and ``RolloutGroups``, the port type that carries them.

A Filter stage leaves a whole group out with ``drop(reason)`` (its ``Verdict``), or takes one
rollout out of its group with ``remove(rollout_id, reason)``: the rollout leaves the group's
baseline, stats and update, and is kept in ``removed`` (a ``Removal``), so that lineage and the
step's counts of generated rollouts still see it (``generated``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterator

import numpy as np

from gfcr.records.ids import check_id
from gfcr.records.rollout import Rollout, RolloutStatus

FINISHED = (RolloutStatus.COMPLETED, RolloutStatus.TRUNCATED)


@dataclass(frozen=True, slots=True)
class GroupStats:
    """Summary of a group's rewards; derived from the rollouts, never stored separately."""

    n: int
    n_scored: int
    n_correct: int
    reward_mean: float
    reward_std: float  # population std (ddof=0), as GRPO uses
    reward_median: float
    mean_length: float
    truncated_fraction: float

    @classmethod
    def of(cls, rollouts: list[Rollout]) -> "GroupStats":
        rewards = np.array([r.reward for r in rollouts if r.reward is not None], dtype=np.float64)
        lengths = np.array([len(r) for r in rollouts], dtype=np.float64)
        nan = float("nan")
        return cls(
            n=len(rollouts),
            n_scored=len(rewards),
            n_correct=sum(1 for r in rollouts if r.correct),
            reward_mean=float(rewards.mean()) if len(rewards) else nan,
            reward_std=float(rewards.std()) if len(rewards) else nan,
            reward_median=float(np.median(rewards)) if len(rewards) else nan,
            mean_length=float(lengths.mean()) if len(lengths) else 0.0,
            truncated_fraction=(
                sum(r.status == RolloutStatus.TRUNCATED for r in rollouts) / len(rollouts) if rollouts else 0.0
            ),
        )


@dataclass(slots=True)
class TreeIndex:
    """Tree topology of a group (TreeRL, BranchGRPO): node -> children, node -> leaf rollouts,
    and optionally node -> the span ``(start, end)`` of response positions its segment covers
    (the same in every leaf below it; ``generate.tree`` writes them, a hand-built tree may leave
    them out and consumers then read the spans from the leaves' tokens)."""

    children: dict[str, list[str]] = field(default_factory=dict)
    leaves: dict[str, list[str]] = field(default_factory=dict)
    spans: dict[str, tuple[int, int]] = field(default_factory=dict)


@dataclass(slots=True)
class Verdict:
    """What the filters decided about a group. A dropped group records why; the runtime stamps
    ``dropped_by`` with the id of the stage that dropped it."""

    included: bool = True
    dropped_by: str | None = None
    reason: str | None = None


@dataclass(slots=True)
class Removal:
    """A rollout a filter took out of its group, and why. The runtime stamps ``removed_by`` with
    the id of the stage that removed it, as it stamps ``Verdict.dropped_by``."""

    rollout: Rollout
    reason: str
    removed_by: str | None = None


@dataclass(slots=True)
class RolloutGroup:
    """The rollouts of one prompt in one sampling event (a step, or a loop round of a step)."""

    group_id: str
    prompt_id: str
    step: int
    target_size: int
    rollouts: list[Rollout] = field(default_factory=list)
    tree: TreeIndex | None = None
    verdict: Verdict = field(default_factory=Verdict)
    sample_weight: float = 1.0  # propagated from the Allocation (Prompt-GDRO)
    removed: list[Removal] = field(default_factory=list)  # rollouts filters took out, for lineage

    def __post_init__(self) -> None:
        check_id(self.group_id, "RolloutGroup.group_id")
        check_id(self.prompt_id, "RolloutGroup.prompt_id")
        for r in self.rollouts:
            if r.prompt_id != self.prompt_id:
                raise ValueError(f"rollout {r.rollout_id} is for prompt {r.prompt_id}, not {self.prompt_id}")

    @property
    def stats(self) -> GroupStats:
        return GroupStats.of(self.rollouts)

    @property
    def generated(self) -> list[Rollout]:
        """Every rollout generated for the group: those in it, then those filters removed."""
        return self.rollouts + [m.rollout for m in self.removed]

    @property
    def complete(self) -> bool:
        """All target rollouts finished (the unit of completion of APRIL and CoPRIS)."""
        return sum(r.status in FINISHED for r in self.generated) >= self.target_size

    @property
    def rewards(self) -> np.ndarray:  # [n] float64; NaN where unscored
        return np.array([np.nan if r.reward is None else r.reward for r in self.rollouts], dtype=np.float64)

    def drop(self, reason: str) -> None:
        """Leave the group out of the update, saying why (the runtime records which stage did).
        A group already dropped keeps its first verdict: the stage that dropped it first is the one
        the lineage names, with that stage's reason."""
        if self.verdict.included:
            self.verdict = Verdict(included=False, reason=reason)

    def remove(self, rollout_id: str, reason: str) -> None:
        """Take one rollout out of the group, saying why: it no longer counts in the group's
        rewards, stats or update, and stays in ``removed`` for lineage."""
        index = next((i for i, r in enumerate(self.rollouts) if r.rollout_id == rollout_id), None)
        if index is None:
            raise ValueError(f"group {self.group_id} has no rollout {rollout_id} to remove")
        self.removed.append(Removal(self.rollouts.pop(index), reason))


@dataclass(slots=True)
class RolloutGroups:
    """The port type between Generate, Filter, Replay and Update stages: a batch of groups."""

    groups: list[RolloutGroup] = field(default_factory=list)

    def __iter__(self) -> Iterator[RolloutGroup]:
        return iter(self.groups)

    def __len__(self) -> int:
        return len(self.groups)

    def rollouts(self) -> Iterator[Rollout]:
        for g in self.groups:
            yield from g.rollouts

    def included(self) -> "RolloutGroups":
        return RolloutGroups([g for g in self.groups if g.verdict.included])
