"""What a step did: the context stages see during it, the update's report and the step report
every stage observes after it."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from gfcr.records.allocation import AllocationEntry
from gfcr.records.group import RolloutGroup


@dataclass(frozen=True, slots=True)
class StepContext:
    """Where a stage call stands: handed to ``before_step`` and, as a runtime input, to a ``run``
    parameter annotated ``StepContext``. Frozen: each loop round gets a fresh context
    (``dataclasses.replace(ctx, round=r)``), so a stage reads the round from the context it is
    given, never from one it kept."""

    run_id: str
    step: int
    seed: int
    policy_version: int
    round: int | None = None  # None outside loop blocks


@dataclass(frozen=True, slots=True)
class UpdateReport:
    """The output of the Update stage: what went into the update and what came out."""

    policy_version: int  # after this update
    rollouts_in_update: int = 0
    tokens_in_update: int = 0
    skipped: bool = False
    skip_reason: str | None = None
    loss: float | None = None
    metrics: dict[str, float] = field(default_factory=dict)
    sync_s: float = 0.0  # wall seconds the engine's weight sync took after the optimizer step (clock: in ``time``)
    sync_bytes: int = 0  # bytes of weights that sync copied into the engine(s); 0 when it shares the model


@dataclass(frozen=True, slots=True)
class ControlDecision:
    """One prompt's entry as the Control stage ``stage_id`` set it (its pick or skip, reason and
    ``why``), in loop round ``round``. Stamped by the runtime, never by the stage: a stage that
    passes an entry through unchanged (``control.fixed_n`` sizing a group) decided nothing about
    it."""

    stage_id: str
    entry: AllocationEntry
    round: int | None = None


@dataclass(frozen=True, slots=True)
class StepReport:
    """Everything a step did. Fed to every stage's ``observe`` and to tracking.

    ``groups`` holds every group produced in the step, kept or dropped, each with its
    verdict; ``stage_seconds`` sums a stage's time over loop rounds.
    """

    run_id: str
    step: int
    policy_version: int  # after the step's update
    groups: tuple[RolloutGroup, ...]
    update: UpdateReport | None
    stage_seconds: dict[str, float]
    loop_rounds: dict[str, int]
    metrics: dict[str, Any] = field(default_factory=dict)  # stage id -> its step_metrics() (ReportsMetrics)
    created_by: dict[str, str] = field(default_factory=dict)  # group id -> stage that first output it
    dropped_by: dict[str, str] = field(default_factory=dict)  # group id -> id of the stage that dropped it
    changed_by: dict[str, tuple[str, ...]] = field(default_factory=dict)  # group id -> stages that changed it
    update_group_ids: frozenset[str] = frozenset()  # groups handed to the update stage
    controller_state: dict[str, dict[str, Any]] = field(default_factory=dict)  # control stage id -> its state
    tokens_scored: int = 0  # response tokens stages scored without generating them (pilots, draft checks)
    added_by: dict[str, str] = field(default_factory=dict)  # rollout id -> stage that added it to a group it did not create
    # samples a stage generated outside the plan's generate stages (sGPO's profiling pass):
    # no groups, but counted in ``rollouts_generated`` and ``tokens_generated``
    rollouts_charged: int = 0
    tokens_charged: int = 0
    control_decisions: tuple[ControlDecision, ...] = ()  # per prompt, what each Control stage decided and why

    def created_by_rollout(self, group_id: str, rollout_id: str) -> str | None:
        """The stage that created a rollout: the one that added it to an existing group (a Replay
        stage appending replayed rollouts), else the stage that created its group."""
        return self.added_by.get(rollout_id, self.created_by.get(group_id))

    @property
    def trained_version(self) -> int:
        """The policy version the step's update trained against (the one before its bump; the
        step's version when the update was skipped or there was none): what staleness counts from."""
        stepped = self.update is not None and not self.update.skipped
        return self.policy_version - (1 if stepped else 0)

    @property
    def prompts_sampled(self) -> int:
        """Distinct prompts that got rollouts this step (over all loop rounds)."""
        return len({g.prompt_id for g in self.groups})

    @property
    def rollouts_generated(self) -> int:
        """Rollouts sampled this step, plus those a stage generated and charged itself (a
        profiling pass); rollouts reused from earlier steps (``Rollout.reused``: replayed
        groups, cached correct responses) are not generated again, so not counted."""
        sampled = sum(1 for g in self.groups for r in g.generated if not (r.reused or r.sampled_nothing))
        return sampled + self.rollouts_charged

    @property
    def tokens_generated(self) -> int:
        """Response tokens sampled this step (reused rollouts left out, as in ``rollouts_generated``;
        a tree branch's copied prefix left out, ``Rollout.generated_length``), plus those a stage
        generated and charged itself."""
        return sum(r.generated_length for g in self.groups for r in g.generated if not r.reused) + self.tokens_charged

    @property
    def rollouts_replayed(self) -> int:
        """Rollouts of earlier steps reused in this step's groups (``Rollout.reused``)."""
        return sum(1 for g in self.groups for r in g.generated if r.reused)

    @property
    def groups_kept(self) -> int:
        return sum(g.verdict.included for g in self.groups)

    @property
    def tokens_with_signal(self) -> int:
        """Response tokens of the groups that reached the update with unequal rewards: the
        generated tokens a group-relative advantage can give a gradient (reused rollouts left
        out: they were generated, and counted, at an earlier step)."""
        return sum(r.generated_length for g in self.groups if g.group_id in self.update_group_ids
                   and g.stats.n_scored > 1 and g.stats.reward_std > 0.0 for r in g.rollouts if not r.reused)

    @property
    def zero_variance_groups(self) -> int:
        """Groups of two or more scored rollouts with equal rewards; a group holding an unfinished
        rollout (carried to ``generate.partial``'s buffer) is judged when it is complete."""
        return sum(1 for g in self.groups if g.stats.n_scored > 1 and g.stats.reward_std == 0.0
                   and not any(r.unfinished for r in g.rollouts))
