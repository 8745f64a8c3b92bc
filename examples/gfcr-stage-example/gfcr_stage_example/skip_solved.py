"""control.skip_solved: pick ``batch_size`` prompts a step in a seeded epoch order, skipping the
prompts whose latest ``solved_streak`` groups were all correct.

The pool is walked in a fresh seeded permutation per epoch; a candidate is kept (one rollout
marked: put ``control.fixed_n`` downstream to set the group size) unless it is solved, and
skipped ones stay in the Allocation with ``n_rollouts=0``. Each entry's ``ControlReason`` is
``unsolved`` or ``solved`` with the prompt's ``solved_streak``. After each step, ``observe``
records what every group of the step says of its prompt (rollouts no verifier judged left out).
The step's ``controller_state`` reports ``epoch``, ``candidates``, ``kept`` and ``solved``.

Deviations: not a published method. It is the skipping of GRESO (Zheng et al., 2025, arXiv
2506.02177; ``control.greso``) without its probabilities: a solved prompt is always skipped
(GRESO skips it with probability ``1 - p_easy ** streak``, tunes ``p_easy`` and keeps a 1%
floor), so it is never rolled out again; prompts that were all wrong are kept. A batch never
spans two epochs: when the epoch runs out mid-batch the step gets fewer prompts.

Fidelity: gfcr's own: the example stage of ``docs/writing-a-stage.md``; no method to check against.

Example:

>>> from gfcr.records import Prompt, PromptPool, Rollout, RolloutGroup, Segment, StepReport
>>> def group(pid, correct):
...     rollouts = [Rollout(f"{pid}/{i}", pid, pid, [1], [Segment(0, 1, 0, [0.0])], correct=c)
...                 for i, c in enumerate(correct)]
...     return RolloutGroup(pid, pid, 0, len(rollouts), rollouts)
>>> pool = PromptPool([Prompt(f"p:{i}", text=str(i)) for i in range(3)])
>>> stage = SkipSolved(SkipSolved.Config(batch_size=2, solved_streak=1, seed=0))
>>> first = stage.run(pool)
>>> solved = tuple(group(e.prompt_id, [True, True]) for e in first)
>>> stage.observe(StepReport("run", 0, 1, solved, None, {}, {}))
>>> second = stage.run(pool)  # epoch 1: only the third prompt is left unsolved
>>> sorted(e.why.code for e in second), second.controller_state["kept"]
(['solved', 'solved', 'unsolved'], 1)

YAML:

.. code-block:: yaml

    pick:   {use: control.skip_solved, with: {batch_size: 16, solved_streak: 2}}
    budget: {use: control.fixed_n, from: pick, with: {n: 8}}
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import Field

from gfcr.records import Allocation, AllocationEntry, ControlReason, Prompt, PromptPool, PromptStats, StepContext, \
    StepReport
from gfcr.registry import MarksCorrect, PipelineProblem, Seed, StageConfig
from gfcr.stages.common.epochs import epoch_order, start_batch
from gfcr.stages.common.prompt_stats import observe_group, stats_from_state, stats_to_state
from gfcr.stages.common.run_context import RunContext


class SkipSolved:
    """Seeded epoch-order selection that skips the prompts solved ``solved_streak`` times in a row."""

    class Config(StageConfig):
        batch_size: Annotated[int, Field(ge=1, description="prompts kept per step")]  # a PicksBatch
        solved_streak: Annotated[int, Field(ge=1, description=(
            "skip a prompt once this many of its latest groups in a row were all correct"))] = 2
        seed: Seed | None = Field(None, description="permutation seed; default: the run's seed")

    @staticmethod
    def check_pipeline(config: "SkipSolved.Config", view: Any) -> list[PipelineProblem]:
        """Solved means all correct: some stage of the pipeline must mark rollouts correct."""
        if view.having(MarksCorrect):
            return []
        return [PipelineProblem((), "no stage of this pipeline marks rollouts correct, so no prompt is ever "
                                    "seen solved and nothing is skipped",
                                "add a verifier after the rollout stage: `reward: {use: filter.verify, from: rollout}`")]

    def __init__(self, config: Config):
        self.config = config
        self.epoch, self.cursor = 0, 0
        self.stats: dict[str, PromptStats] = {}
        self.run_ctx = RunContext(config.seed)

    def before_step(self, ctx: StepContext) -> None:
        self.run_ctx.before_step(ctx)

    def run(self, pool: PromptPool) -> Allocation:
        size = self.config.batch_size
        self.epoch, self.cursor = start_batch(self.epoch, self.cursor, size, len(pool))
        order = epoch_order(self.run_ctx.seed, self.epoch, len(pool))
        entries: list[AllocationEntry] = []
        kept = 0
        while kept < size and self.cursor < len(pool):
            entries.append(self._decide(pool[int(order[self.cursor])]))
            self.cursor += 1
            kept += entries[-1].n_rollouts
        state = {"epoch": self.epoch, "candidates": len(entries), "kept": kept,
                 "solved": sum(s.easy_streak >= self.config.solved_streak for s in self.stats.values())}
        return Allocation(step=self.run_ctx.step, entries=tuple(entries), controller_state=state)

    def _decide(self, prompt: Prompt) -> AllocationEntry:
        stats = self.stats.get(prompt.prompt_id)
        streak = stats.easy_streak if stats is not None else 0
        solved = streak >= self.config.solved_streak
        code, n = ("solved", 0) if solved else ("unsolved", 1)
        return AllocationEntry(prompt, n, reason=f"skip_solved: {'skip' if solved else 'keep'} (solved streak {streak})",
                               why=ControlReason(code, "solved_streak", streak, {"epoch": self.epoch}))

    def observe(self, report: StepReport) -> None:
        for group in report.groups:
            obs = observe_group(group, self.run_ctx.policy_version) if group.step == report.step else None
            if obs is not None:
                self.stats.setdefault(group.prompt_id, PromptStats(group.prompt_id, history_size=4)).record(obs)

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "cursor": self.cursor,
                "prompts": {pid: stats_to_state(s) for pid, s in self.stats.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.epoch, self.cursor = int(state["epoch"]), int(state["cursor"])
        self.stats = {pid: stats_from_state(s) for pid, s in state["prompts"].items()}
