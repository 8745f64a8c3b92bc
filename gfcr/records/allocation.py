"""Allocations: the output of every Control stage.

An allocation says, per prompt, how many rollouts to generate (0 = skip, as GRESO, HIVE or
Pilot-Commit decide), with what priority and why, plus the step's ``Budget``. An entry may carry
rollouts of an earlier step that are to join its new ones in one group (``joins``).

Why comes twice: ``reason``, a sentence for people, and ``why``, an optional
``ControlReason`` for machines: a snake_case ``code``, the decisive number (``name`` and
``value``) and the other numbers the stage decided on (``quantities``). Whether the prompt
was picked or skipped is the entry's own ``n_rollouts`` (0 = skipped). The runtime writes both
into the control lineage (``gfcr.runtime.store.lineage``) under the id of the stage that set them.

>>> why = ControlReason("easy_streak", "p_skip", 0.75, {"streak": 2, "draw": 0.31})
>>> entry = AllocationEntry(Prompt("p:0", text="0"), 0, why=why)
>>> entry.decision, str(why)
('skipped', 'easy_streak, p_skip=0.75 (streak=2, draw=0.31)')
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field, replace
from typing import Any, Iterator, Mapping

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


_CODE = re.compile(r"[a-z][a-z0-9_]*")


@dataclass(frozen=True, slots=True)
class ControlReason:
    """Why a Control stage picked or skipped one prompt, machine-readable.

    ``code`` is a snake_case reason (``no_streak``, ``easy_streak``, ``closest_to_target``,
    ``farther_from_target``, ``trivial``); ``name`` / ``value`` the number that decided
    (``p_skip``, ``draw``, ``gain``, ``p0``), both set or both None; ``quantities`` the other
    numbers the decision used (streak, posterior, cutoff). Every number is finite.
    """

    code: str
    name: str | None = None
    value: float | None = None
    quantities: Mapping[str, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not _CODE.fullmatch(self.code):
            raise ValueError(f"ControlReason code must be snake_case (e.g. `easy_streak`), got {self.code!r}")
        if (self.name is None) != (self.value is None):
            raise ValueError(f"ControlReason `{self.code}`: give the decisive number both a name and a value "
                             f"(got name={self.name!r}, value={self.value!r})")
        numbers = {**({self.name: self.value} if self.name is not None else {}), **self.quantities}
        for key, number in numbers.items():
            if not _CODE.fullmatch(str(key)) or not math.isfinite(float(number)):
                raise ValueError(f"ControlReason `{self.code}`: {key!r}={number!r} must be a snake_case name "
                                 "and a finite number")
        object.__setattr__(self, "quantities", {k: float(v) for k, v in self.quantities.items()})
        if self.value is not None:
            object.__setattr__(self, "value", float(self.value))

    def __str__(self) -> str:
        text = self.code + (f", {self.name}={self.value:.4g}" if self.name is not None else "")
        extra = ", ".join(f"{k}={v:.4g}" for k, v in self.quantities.items())
        return text + (f" ({extra})" if extra else "")


@dataclass(frozen=True, slots=True)
class AllocationEntry:
    """The decision for one prompt."""

    prompt: Prompt
    n_rollouts: int
    priority: float = 0.0
    reason: str = ""  # for people; ``why`` for machines
    sample_weight: float = 1.0
    context_override: tuple[int, ...] | None = None  # XRPO in-context seeding
    resume_from: str | None = None  # rollout id of a partial to continue
    draft_from: str | None = None  # rollout id of a SPEC-RL draft
    stage_index: int = 0  # multi-stage methods: pilot 0, commit 1; DARS second pass
    why: ControlReason | None = None  # the Control stage's reason, written to the control lineage
    # rollouts of an earlier step that join this prompt's new ones in one group (Pilot-Commit: the
    # pilots under a commit); a Replay stage downstream of generation appends them (``replay.pilot_join``)
    joins: tuple[Rollout, ...] = ()

    def __post_init__(self) -> None:
        if self.n_rollouts < 0:
            raise ValueError(f"prompt {self.prompt.prompt_id}: n_rollouts must be >= 0, got {self.n_rollouts}")

    @property
    def prompt_id(self) -> str:
        return self.prompt.prompt_id

    @property
    def decision(self) -> str:
        """``picked`` (at least one rollout) or ``skipped``."""
        return "picked" if self.n_rollouts > 0 else "skipped"


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
        """This allocation with other entries, as a downstream stage hands it on: the upstream
        stage's ``controller_state`` stays with that stage's output (the runner logs each
        Allocation's state under the stage that made it), so it is not copied."""
        return replace(self, entries=tuple(entries), controller_state={})
