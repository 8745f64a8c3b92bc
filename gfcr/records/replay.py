"""The records of the Replay ports (DESIGN.md sections 1 and 9), declared before the Replay
stages that will use them, so that their wiring is type-checked from the start.

- provide: a Replay stage offers earlier material to a Generate stage as ``Provided``
  (partials to continue, drafts to verify, rollouts to replay), read by the generate stage's
  optional input ``provided: Provided | None = None``; or it returns ``RolloutGroups``
  directly (replayed groups that join the step's groups).
- ingest: a Replay stage reads ``StepOutputs``, a runtime input: every group the step has
  produced before the stage runs, kept or dropped, with the stage that created, dropped or
  changed it. The compiler runs such a stage as late as its readers allow.
- mix: a Replay stage returns ``RolloutGroups`` that feed the update batch (fresh and
  replayed groups mixed).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterator, Literal

from gfcr.records.group import RolloutGroup
from gfcr.records.rollout import Rollout

ProvidedKind = Literal["partial", "draft", "replayed"]


@dataclass(frozen=True, slots=True)
class ProvidedRollout:
    """One rollout offered to generation: a ``partial`` to continue from its last token, a
    ``draft`` whose tokens the policy verifies (SPEC-RL), or a ``replayed`` rollout reused as is."""

    kind: ProvidedKind
    rollout: Rollout

    @property
    def prompt_id(self) -> str:
        return self.rollout.prompt_id


@dataclass(frozen=True, slots=True)
class Provided:
    """The provide port: what a Replay stage offers a Generate stage this step."""

    step: int
    items: tuple[ProvidedRollout, ...] = ()

    def __iter__(self) -> Iterator[ProvidedRollout]:
        return iter(self.items)

    def __len__(self) -> int:
        return len(self.items)

    def for_prompt(self, prompt_id: str, kind: ProvidedKind | None = None) -> tuple[ProvidedRollout, ...]:
        return tuple(p for p in self.items if p.prompt_id == prompt_id and (kind is None or p.kind == kind))


@dataclass(frozen=True, slots=True)
class StepOutputs:
    """The ingest port (a runtime input): the groups this step produced before the reading stage
    ran, in order, kept or dropped, and which stage created, dropped or changed each one."""

    step: int
    groups: tuple[RolloutGroup, ...] = ()
    created_by: dict[str, str] = field(default_factory=dict)
    dropped_by: dict[str, str] = field(default_factory=dict)
    changed_by: dict[str, tuple[str, ...]] = field(default_factory=dict)

    def __iter__(self) -> Iterator[RolloutGroup]:
        return iter(self.groups)

    def __len__(self) -> int:
        return len(self.groups)

    def kept(self) -> tuple[RolloutGroup, ...]:
        return tuple(g for g in self.groups if g.verdict.included)
