"""control.pilot_commit: Pilot-Commit, cheap pilot rollouts pick the prompts worth a full group.

Pilot-Commit (Kim et al., 2026, "Spend Your Rollouts Where It Counts: Rollout Allocation for
Group-Based RL Post-Training", arXiv 2605.26606; reference ``databricks/pilot-commit``,
``recipe/pc/pc_ray_trainer.py``, ``recipe/pc/utils.py::select_prompts``,
``recipe/pc/replay_buffer.py``). Per step:

- **pilot**: every candidate prompt (the upstream selection: ``control.uniform`` with a batch of
  ``3 B``) gets ``n_pilot`` rollouts (``stage_index`` 0, reason ``pilot``);
- **commit**: up to ``B`` prompts drawn uniformly, without replacement, from the buffer get
  ``n_commit`` fresh rollouts (``stage_index`` 1, reason ``commit``) *in the same allocation*, so
  one generation call serves both; each commit entry carries its stored pilot rollouts in
  ``AllocationEntry.joins`` (down-sampled to ``n_pilot_effective`` by binary max-variance), and
  ``replay.pilot_join`` after the verifier appends them to the commit group and drops the pilot
  groups: the update group of a committed prompt is pilot ∪ commit, ``n_pilot_effective +
  n_commit`` rollouts under one baseline;
- **verdicts**, after the step (``observe``), from each pilot group's ``p = correct / n``:
  ``keep`` if ``thr_lo <= p <= 1 - thr_up`` (defaults ``[0.125, 0.75]``): the prompt enters the
  buffer with its pilot rollouts; ``too_correct`` if ``p > 1 - thr_up`` (skipped this epoch);
  ``too_incorrect`` if ``p < thr_lo`` (deferred to a later epoch); and, on top of these,
  ``evicted`` if ``p >= exclude_threshold_upper`` (1.0: every pilot correct): never a candidate
  again;
- **flush**: after the verdicts, a buffered prompt with ``step - added_step > max_off_steps``
  leaves the buffer (the reference's order: draw, add, flush; so a pilot is committed at most
  ``max_off_steps + 1`` steps after it was rolled out).

Binary max-variance down-sampling of a pilot group to ``m`` responses (the reference's
``_maxvar_downsample_binary``): take ``floor(m / 2)`` correct and ``m - floor(m / 2)`` wrong ones;
when one kind is short, take all of it and fill up with the other; within a kind, uniformly at
random.

Budget accounting per step (``metrics.jsonl`` under ``control.<id>``): ``pilot_prompts``,
``pilot_rollouts`` (generated this step), ``commit_prompts``, ``commit_rollouts`` (generated this
step), ``pilot_rollouts_joined`` (reused pilots going into this step's update, generated at an
earlier step and counted there), ``commit_staleness_mean`` (steps between a commit and its
pilots), ``buffer_prompts`` (after the draw), ``skipped_buffered`` / ``skipped_evicted`` /
``skipped_piloted`` (candidates not piloted: buffered or being committed, evicted, piloted in an
earlier loop round), and the verdicts of the latest judging: ``judged``, ``keep``,
``too_correct``, ``too_incorrect``, ``evicted``, ``flushed``, ``evicted_total``. The runtime calls
``step_metrics`` before ``observe``, so the verdict counts on the line of step ``t`` are those of
step ``t - 1``'s pilots (judged at the end of step ``t - 1``).

Off-policy pilots: a committed prompt's pilots were sampled by a policy up to ``max_off_steps +
1`` versions old. The reference recomputes ``old_log_probs`` for the whole batch under the
current policy and takes the plain PPO ratio against them, with no importance weight: stale
pilots are treated as on-policy. ``update.grpo`` takes its ratio against the stored behaviour
log-probs ``mu``, which would clip a stale pilot's tokens to no gradient once the policy moved
more than ``eps``; so ``replay.pilot_join`` requires the update's correction ``decoupled_clip`` (ratio
against ``pi_old`` clipped around 1, as the reference, and the loss weighted by ``pi_old / mu``,
which the reference does not apply). The buffer and the evicted prompts are the stage's
checkpoint state (the pilots in ``files/entries.parquet``).

Fidelity: checked against databricks/pilot-commit@6def20e: 75/75 cases (``tests/fidelity/pilot_commit.json``:
the verdicts and the max-variance down-sampling; the buffer's draw and flush are not compared).

Deviations:
- one round per step: the reference keeps drawing candidate batches (up to
  ``max_num_gen_batches`` rounds) until ``B`` prompts are committed; here a step commits
  ``min(B, buffered)`` prompts, so the first step trains on nothing (its update is skipped) and
  a step with a thin buffer trains on fewer than ``B`` prompts. Inside a loop block the rounds of
  a step share the ``B`` commits and the counts, but a round's pilots are judged only after the
  step (``observe``), so later rounds cannot commit them as the reference's rounds do.
- verdicts read ``Rollout.correct`` (the reference's ``acc``); a group with no rollout left
  (a filter removed them all) gets no verdict.
- eviction skips the prompt whenever it is a candidate again (it is not removed from the pool,
  so that batch has fewer pilots); the reference removes it from the dataset at the next epoch.
- a candidate that is in the buffer, or evicted, gets no pilot (``n_rollouts`` 0, reason
  ``buffered`` / ``evicted``): a prompt is never both pilot and commit in one step. The reference
  never meets the case: it empties the buffer at each epoch's end, which this stage does not (it
  does not see epochs; the flush bounds the age).
- the commit draw and the down-sampling are seeded by ``(seed, step)``; the reference's are
  unseeded. Down-sampled pilots keep their group order.
- the reference's defaults ``(n_pilot, n_commit) = (16, 48)``, ``B = 128``, thresholds from
  its training scripts (``thr_lo = 0.125``, ``thr_up = 0.25``, ``exclude_threshold_upper = 1.0``;
  ``pc_trainer.yaml`` has 0.25, 0.25 and null).

Example (two candidates piloted, nothing buffered yet; after the step, `a` is kept, `b` evicted):

>>> from gfcr.records import Allocation, AllocationEntry, Prompt, PromptPool, StepContext, StepReport
>>> from gfcr.stages.testing import scored_group
>>> pool = PromptPool([Prompt("a", text="a"), Prompt("b", text="b")])
>>> stage = PilotCommit(PilotCommit.Config(batch_size=1, n_pilot=4, n_commit=4))
>>> stage.before_step(StepContext("r", 0, 0, 0))
>>> first = stage.run(Allocation(0, tuple(AllocationEntry(p, 1) for p in pool)), pool, StepContext("r", 0, 0, 0))
>>> [(e.prompt_id, e.n_rollouts, e.reason) for e in first]
[('a', 4, 'pilot'), ('b', 4, 'pilot')]
>>> pilots = (scored_group("a", [1, 0, 0, 1]), scored_group("b", [1, 1, 1, 1]))  # p = 0.5 and 1.0
>>> stage.observe(StepReport("r", 0, 1, pilots, None, {}, {}))
>>> stage.buffered_prompts(), sorted(stage.evicted)
(['a'], ['b'])
>>> stage.before_step(StepContext("r", 1, 0, 1))
>>> second = stage.run(Allocation(1, tuple(AllocationEntry(p, 1) for p in pool)), pool, StepContext("r", 1, 0, 1))
>>> [(e.prompt_id, e.n_rollouts, e.reason, len(e.joins)) for e in second]
[('a', 0, 'buffered', 0), ('b', 0, 'evicted', 0), ('a', 4, 'commit', 4)]

YAML:

.. code-block:: yaml

    pick:   {use: control.uniform, with: {batch_size: 24}}                    # 3 B candidates
    plan:   {use: control.pilot_commit, from: pick, with: {batch_size: 8, n_pilot: 4, n_commit: 4}}
    rollout: {use: generate.sample, from: plan}
    reward: {use: filter.verify, from: rollout}
    join:   {use: replay.pilot_join, from: {groups: reward, allocation: plan}}
    update: {use: update.grpo, from: join, with: {correction: {use: decoupled_clip}}}
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from enum import StrEnum
from pathlib import Path
from typing import Annotated, Any, ClassVar

import numpy as np
from pydantic import Field, model_validator

from gfcr.records import (
    Allocation, AllocationEntry, Origin, Prompt, PromptPool, RolloutGroup, StepContext, StepReport,
)
from gfcr.registry import PipelineProblem, StageConfig
from gfcr.stages.common.reuse import keep, load_entries, reuse, save_entries
from gfcr.stages.common.stored import StoredRollout

ENTRIES = "entries.parquet"
_SALT = 0x50494C54  # "PILT": this stage's draws differ from other seeded draws of the step
JOIN_STAGE = "replay.pilot_join"
ALLOCATION_COUNTS = ("pilot_prompts", "pilot_rollouts", "commit_prompts", "commit_rollouts", "pilot_rollouts_joined",
                     "commit_staleness_mean", "buffer_prompts", "skipped_buffered", "skipped_evicted", "skipped_piloted")
VERDICT_COUNTS = ("judged", "keep", "too_correct", "too_incorrect", "evicted", "flushed")


class Verdict(StrEnum):
    KEEP = "keep"
    TOO_CORRECT = "too_correct"
    TOO_INCORRECT = "too_incorrect"


def verdict(p: float, thr_lo: float, thr_up: float) -> Verdict:
    """The reference's ``select_prompts``: keep ``thr_lo <= p <= 1 - thr_up``."""
    if p > 1.0 - thr_up:
        return Verdict.TOO_CORRECT
    if p < thr_lo:
        return Verdict.TOO_INCORRECT
    return Verdict.KEEP


def maxvar_indices(correct: list[bool], m: int, rng: np.random.Generator) -> list[int]:
    """``m`` indices maximising the variance of binary outcomes (half correct, half wrong when
    possible), in ascending order."""
    ones = [i for i, c in enumerate(correct) if c]
    zeros = [i for i, c in enumerate(correct) if not c]
    need_ones = m // 2
    if len(ones) < need_ones:
        need_ones = len(ones)
    elif len(zeros) < m - need_ones:
        need_ones = m - len(zeros)
    chosen = rng.choice(ones, size=need_ones, replace=False).tolist() if need_ones else []
    chosen += rng.choice(zeros, size=m - need_ones, replace=False).tolist() if m - need_ones else []
    return sorted(int(i) for i in chosen)


@dataclass
class Buffered:
    """A kept prompt: the step its pilots were rolled out and the pilots."""

    prompt_id: str
    step: int
    pilots: list[StoredRollout]


class PilotCommit:
    """Pilot-Commit: pilot rollouts judge candidates; kept prompts are committed later with their pilots."""

    class Config(StageConfig):
        sizes_each_group: ClassVar[bool] = True  # a capability: it sizes each prompt's group itself
        batch_size: Annotated[int, Field(ge=1, description=(
            "B: prompts committed per step (the update batch); the candidate batch upstream is 3 B"))] = 128
        n_pilot: Annotated[int, Field(ge=1, description="pilot rollouts per candidate prompt")] = 16
        n_commit: Annotated[int, Field(ge=1, description="fresh rollouts per committed prompt")] = 48
        n_pilot_effective: Annotated[int | None, Field(ge=1, description=(
            "pilots a committed prompt keeps in its update group, chosen by binary max-variance; "
            "null keeps all n_pilot"))] = None
        thr_lo: Annotated[float, Field(ge=0.0, le=1.0, description=(
            "keep if thr_lo <= p <= 1 - thr_up; below: too_incorrect (deferred)"))] = 0.125
        thr_up: Annotated[float, Field(ge=0.0, le=1.0, description=(
            "keep if p <= 1 - thr_up; above: too_correct (skipped)"))] = 0.25
        exclude_threshold_upper: Annotated[float | None, Field(ge=0.0, le=1.0, description=(
            "evict a prompt for good when p >= this; null never evicts"))] = 1.0
        max_off_steps: Annotated[int, Field(ge=0, description=(
            "flush a buffered prompt once step - added_step > max_off_steps"))] = 4
        seed: int | None = Field(None, description="seed of the commit draw and down-sampling; default: the run's")

        @model_validator(mode="after")
        def _consistent(self) -> "PilotCommit.Config":
            if self.n_pilot_effective is not None and self.n_pilot_effective > self.n_pilot:
                raise ValueError(f"`n_pilot_effective: {self.n_pilot_effective}` keeps more pilots than are rolled "
                                 f"out (`n_pilot: {self.n_pilot}`): set it to at most n_pilot, or null")
            if self.thr_lo > 1.0 - self.thr_up:
                raise ValueError(f"no p can be kept: `thr_lo: {self.thr_lo}` > 1 - `thr_up` = {1.0 - self.thr_up}; "
                                 "lower thr_lo or thr_up")
            return self

    @staticmethod
    def check_pipeline(config: "PilotCommit.Config", view: Any) -> list[PipelineProblem]:
        """Without ``replay.pilot_join`` the pilot groups would be trained on at once and commits without pilots."""
        if JOIN_STAGE in view.aliases.values():
            return []
        return [PipelineProblem(
            (), f"no `{JOIN_STAGE}` stage: the pilot groups would reach the update on their own step "
                "and the committed groups would lack their pilots",
            "add `join: {use: replay.pilot_join, from: {groups: <verifier>, allocation: <this stage>}}` "
            "and take the update `from: join`")]

    def __init__(self, config: Config):
        self.config = config
        self.buffer: dict[str, Buffered] = {}  # prompt id -> kept prompt; insertion order
        self.evicted: set[str] = set()
        self.next_entry_id = 0
        self._pilots: set[str] = set()  # prompts piloted this step, judged in observe
        self._ages: list[int] = []  # steps between this step's commits and their pilots
        self._last: dict[str, float] = dict.fromkeys(ALLOCATION_COUNTS, 0)
        self._verdicts: dict[str, int] = dict.fromkeys(VERDICT_COUNTS, 0)
        self._loaded: dict[str, Any] | None = None

    def before_step(self, ctx: StepContext) -> None:
        self._pilots, self._ages, self._last = set(), [], dict.fromkeys(ALLOCATION_COUNTS, 0)

    def run(self, candidates: Allocation, pool: PromptPool, ctx: StepContext) -> Allocation:
        rng = np.random.default_rng([self._seed(ctx), ctx.step, ctx.round or 0, _SALT])
        committed = self._draw(self.config.batch_size - self._last["commit_prompts"], rng)
        held = set(self.buffer) | {b.prompt_id for b in committed}
        pilots, skipped = [], []
        for e in candidates.active():
            why = ("evicted" if e.prompt_id in self.evicted else "buffered" if e.prompt_id in held
                   else "piloted" if e.prompt_id in self._pilots else None)  # piloted: in an earlier loop round
            if why:
                skipped.append(replace(e, n_rollouts=0, reason=why))
            else:
                pilots.append(replace(e, n_rollouts=self.config.n_pilot, reason="pilot", stage_index=0))
        commits = [self._commit(b, pool.get(b.prompt_id), rng) for b in committed]
        self._pilots |= {e.prompt_id for e in pilots}
        self._ages += [ctx.step - b.step for b in committed]
        self._count(pilots, skipped, commits)
        return replace(candidates, step=ctx.step, entries=tuple(pilots + skipped + commits))

    def _seed(self, ctx: StepContext) -> int:
        return ctx.seed if self.config.seed is None else self.config.seed

    def _draw(self, want: int, rng: np.random.Generator) -> list[Buffered]:
        """Up to ``want`` buffered prompts, uniformly without replacement, popped in buffer order."""
        keys = list(self.buffer)
        if len(keys) > want:
            keys = [keys[i] for i in sorted(rng.choice(len(keys), max(want, 0), replace=False).tolist())]
        return [self.buffer.pop(k) for k in keys]

    def _commit(self, buffered: Buffered, prompt: Prompt, rng: np.random.Generator) -> AllocationEntry:
        pilots = buffered.pilots
        m = self.config.n_pilot_effective
        if m is not None and m < len(pilots):
            pilots = [pilots[i] for i in maxvar_indices([p.correct is True for p in pilots], m, rng)]
        joins = tuple(reuse(p, p.rollout_id, p.group_id, Origin.REPLAYED) for p in pilots)
        return AllocationEntry(prompt, self.config.n_commit, reason="commit", stage_index=1, joins=joins)

    def _count(self, pilots: list[AllocationEntry], skipped: list[AllocationEntry],
               commits: list[AllocationEntry]) -> None:
        """Add one call's allocation to the step's counts (summed over loop rounds)."""
        last = self._last
        last["pilot_prompts"] += len(pilots)
        last["pilot_rollouts"] += sum(e.n_rollouts for e in pilots)
        last["commit_prompts"] += len(commits)
        last["commit_rollouts"] += sum(e.n_rollouts for e in commits)
        last["pilot_rollouts_joined"] += sum(len(e.joins) for e in commits)
        last["skipped_buffered"] += sum(e.reason == "buffered" for e in skipped)
        last["skipped_evicted"] += sum(e.reason == "evicted" for e in skipped)
        last["skipped_piloted"] += sum(e.reason == "piloted" for e in skipped)
        last["buffer_prompts"] = len(self.buffer)
        last["commit_staleness_mean"] = float(np.mean(self._ages)) if self._ages else 0.0

    def observe(self, report: StepReport) -> None:
        """Judge this step's pilot groups, buffer the kept ones with their pilots, then flush."""
        counts = dict.fromkeys(VERDICT_COUNTS, 0)
        for group in report.groups:
            if group.prompt_id in self._pilots and group.rollouts:
                self._judge(group, report.step, counts)
        self._pilots = set()
        stale = [k for k, b in self.buffer.items() if report.step - b.step > self.config.max_off_steps]
        for k in stale:
            del self.buffer[k]
        counts["flushed"] = len(stale)
        self._verdicts = counts

    def _judge(self, group: RolloutGroup, step: int, counts: dict[str, int]) -> None:
        cfg = self.config
        p = sum(r.correct is True for r in group.rollouts) / len(group.rollouts)
        v = verdict(p, cfg.thr_lo, cfg.thr_up)
        counts["judged"] += 1
        counts[v.value] += 1
        if v is Verdict.KEEP:
            pilots = []
            for r in group.rollouts:
                pilots.append(keep(r, self.next_entry_id, step))
                self.next_entry_id += 1
            self.buffer[group.prompt_id] = Buffered(group.prompt_id, step, pilots)
        if cfg.exclude_threshold_upper is not None and p >= cfg.exclude_threshold_upper:
            counts["evicted"] += 1
            self.evicted.add(group.prompt_id)

    def buffered_prompts(self) -> list[str]:
        """The buffer's prompts, in insertion order."""
        return list(self.buffer)

    def step_metrics(self) -> dict[str, float]:
        """This step's allocation, and the verdicts of the latest judging (the previous step's pilots)."""
        return {**self._last, **self._verdicts, "evicted_total": len(self.evicted)}

    # --- checkpoint ---------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        buffer = [[k, b.step, [e.entry_id for e in b.pilots]] for k, b in self.buffer.items()]
        return {"next_entry_id": self.next_entry_id, "buffer": buffer, "evicted": sorted(self.evicted),
                "verdicts": dict(self._verdicts)}  # the latest judging, reported on the next step's line

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._loaded = state  # the pilots arrive with the files (load_files)

    def save_files(self, directory: Path) -> None:
        save_entries([e for b in self.buffer.values() for e in b.pilots], directory / ENTRIES)

    def load_files(self, directory: Path) -> None:
        state, self._loaded = self._loaded, None
        assert state is not None, "load_state_dict comes before load_files"
        entries = {e.entry_id: e for e in load_entries(directory / ENTRIES)}
        self.buffer = {k: Buffered(k, int(step), [entries[int(i)] for i in ids])
                       for k, step, ids in state["buffer"]}
        self.evicted = set(state["evicted"])
        self._verdicts = {k: int(state["verdicts"][k]) for k in VERDICT_COUNTS}
        self.next_entry_id = int(state["next_entry_id"])
