"""Allocations: the output of every Control stage.

An allocation says, per prompt, how many rollouts to generate (0 = skip, as GRESO, HIVE or
Pilot-Commit decide), with what priority and why, plus the step's ``Budget``. An entry may carry
rollouts of an earlier step that are to join its new ones in one group (``joins``).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Iterator

from gfcr.records.prompt import Prompt
from gfcr.records.rollout import Rollout


@dataclass(frozen=True, slots=True)
class Budget:
    """Limits for one step. ``None`` means unbounded. Tokens generated and tokens scored
    (pilots, drafts, profiling) are counted separately by the runtime."""

    max_rollouts: int | None = None
    max_tokens: int | None = None
    target_complete_groups: int | None = None  # APRIL N, CoPRIS B
    over_provision: int = 0  # APRIL N' - N
    max_concurrency: int | None = None  # CoPRIS C
    max_gen_rounds: int | None = None  # DAPO max_num_gen_batches


@dataclass(frozen=True, slots=True)
class AllocationEntry:
    """The decision for one prompt."""

    prompt: Prompt
    n_rollouts: int
    priority: float = 0.0
    reason: str = ""
    sample_weight: float = 1.0
    context_override: tuple[int, ...] | None = None  # XRPO in-context seeding
    resume_from: str | None = None  # rollout id of a partial to continue
    draft_from: str | None = None  # rollout id of a SPEC-RL draft
    stage_index: int = 0  # multi-stage methods: pilot 0, commit 1; DARS second pass
    # rollouts of an earlier step that join this prompt's new ones in one group (Pilot-Commit: the
    # pilots under a commit); a Replay stage downstream of generation appends them (``replay.pilot_join``)
    joins: tuple[Rollout, ...] = ()

    def __post_init__(self) -> None:
        if self.n_rollouts < 0:
            raise ValueError(f"prompt {self.prompt.prompt_id}: n_rollouts must be >= 0, got {self.n_rollouts}")

    @property
    def prompt_id(self) -> str:
        return self.prompt.prompt_id


@dataclass(frozen=True, slots=True)
class Allocation:
    """Per-prompt decisions for one step, in dispatch order."""

    step: int
    entries: tuple[AllocationEntry, ...] = ()
    budget: Budget = field(default_factory=Budget)
    controller_state: dict[str, Any] = field(default_factory=dict)  # e.g. GRESO p_easy/p_hard, for logs

    def __iter__(self) -> Iterator[AllocationEntry]:
        return iter(self.entries)

    def __len__(self) -> int:
        return len(self.entries)

    def active(self) -> tuple[AllocationEntry, ...]:
        """Entries that get at least one rollout."""
        return tuple(e for e in self.entries if e.n_rollouts > 0)

    @property
    def total_rollouts(self) -> int:
        return sum(e.n_rollouts for e in self.entries)

    def with_entries(self, entries: tuple[AllocationEntry, ...] | list[AllocationEntry]) -> "Allocation":
        return replace(self, entries=tuple(entries))
