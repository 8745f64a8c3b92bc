"""The in-process runner: run a compiled plan step after step.

Before the first step, ``setup(resources)`` on every stage that has it (the policy and
engine the runtime lends). Per step: ``before_step(ctx)`` on every stage that has it; the plan's items in order (a
loop block repeats its body until its until stage is done or ``max_rounds`` have run);
then ``observe(report)`` on every stage that has it. An exception raised inside a stage
becomes a ``StageError`` naming the stage, step, round and run.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol

from gfcr.errors import StageError
from gfcr.graph import CompiledPipeline, LoopBlock, Node
from gfcr.records import (
    Allocation, PromptPool, RolloutGroup, RolloutGroups, StepContext, StepReport, UpdateReport,
)
from gfcr.spec import UPDATE_ID
from gfcr.stages.resources import Resources

# what a feedback input reads in round 0, before its until stage has produced anything
_EMPTY: dict[type, Callable[[int], Any]] = {
    RolloutGroups: lambda step: RolloutGroups(),
    Allocation: lambda step: Allocation(step),
}


class RunnerHooks(Protocol):
    """Optional callbacks for progress bars and tracking; implement any subset."""

    def before_step(self, ctx: StepContext) -> None: ...
    def after_stage(self, stage_id: str, ctx: StepContext, output: Any, seconds: float) -> None: ...
    def after_step(self, report: StepReport) -> None: ...


def build_stages(pipeline: CompiledPipeline) -> dict[str, Any]:
    """Instantiate every stage from its class and validated config, in plan order."""
    return {sid: node.info.cls(node.config) for sid, node in pipeline.nodes.items()}


@dataclass
class _StepState:
    ctx: StepContext
    outputs: dict[str, Any] = field(default_factory=dict)
    groups: dict[str, RolloutGroup] = field(default_factory=dict)
    seconds: dict[str, float] = field(default_factory=dict)
    rounds: dict[str, int] = field(default_factory=dict)
    created_by: dict[str, str] = field(default_factory=dict)  # group id -> first stage that output it
    dropped_by: dict[str, str] = field(default_factory=dict)  # group id -> stage id that dropped it


class LocalRunner:
    """Runs a compiled pipeline in this process.

    ``pool`` defaults to the pipeline's data source; ``stages`` to fresh instances, set up
    with ``resources``.
    """

    def __init__(self, pipeline: CompiledPipeline, *, pool: PromptPool | None = None,
                 stages: dict[str, Any] | None = None, run_id: str | None = None,
                 hooks: tuple[Any, ...] = (), resources: Resources | None = None):
        self.pipeline = pipeline
        self.pool = pool if pool is not None else pipeline.data.load()
        self.run_id = run_id or pipeline.spec.name
        self.hooks = hooks
        self.step = 0
        self.policy_version = 0
        self.resources = resources or Resources()
        self.stages = stages if stages is not None else build_stages(pipeline)
        setup_ctx = StepContext(self.run_id, 0, pipeline.spec.run.seed, 0)
        for sid, stage in self.stages.items():
            self._call(sid, setup_ctx, getattr(stage, "setup", None), self.resources)

    def _hook(self, name: str, *args: Any) -> None:
        for hook in self.hooks:
            method = getattr(hook, name, None)
            if method is not None:
                method(*args)

    def run(self, steps: int | None = None) -> list[StepReport]:
        """Run ``steps`` steps (default: the spec's ``run.steps``) and return their reports."""
        total = steps if steps is not None else self.pipeline.spec.run.steps
        return [self.run_step() for _ in range(total)]

    def run_step(self) -> StepReport:
        ctx = StepContext(self.run_id, self.step, self.pipeline.spec.run.seed, self.policy_version)
        state = _StepState(ctx)
        self._hook("before_step", ctx)
        for sid, stage in self.stages.items():
            self._call(sid, ctx, getattr(stage, "before_step", None), ctx)
        for item in self.pipeline.plan:
            if isinstance(item, LoopBlock):
                self._run_loop(item, state)
            else:
                self._run_stage(self.pipeline.nodes[item], state)
        report = self._report(state)
        for sid, stage in self.stages.items():
            self._call(sid, ctx, getattr(stage, "observe", None), report)
        self._hook("after_step", report)
        self.policy_version = report.policy_version
        self.step += 1
        return report

    def _run_loop(self, loop: LoopBlock, state: _StepState) -> None:
        until = self.stages[loop.until]
        for round in range(loop.max_rounds):
            state.ctx.round = round
            state.rounds[loop.name] = round + 1
            for sid in loop.body:
                self._run_stage(self.pipeline.nodes[sid], state)
            if self._call(loop.until, state.ctx, until.done):
                break
        state.ctx.round = None

    def _run_stage(self, node: Node, state: _StepState) -> None:
        kwargs = {p.name: self.pool for p in node.runtime_inputs}
        for b in node.bindings:
            if b.source in state.outputs:
                kwargs[b.param] = state.outputs[b.source]
            else:  # a feedback input in round 0
                kwargs[b.param] = _EMPTY[b.type](state.ctx.step)
        included_before = {gid for gid, g in state.groups.items() if g.verdict.included}
        start = time.perf_counter()
        output = self._execute(node.id, state.ctx, self.stages[node.id].run, kwargs)
        seconds = time.perf_counter() - start
        for gid in included_before:
            if not state.groups[gid].verdict.included:
                state.dropped_by.setdefault(gid, node.id)
        state.seconds[node.id] = state.seconds.get(node.id, 0.0) + seconds
        state.outputs[node.id] = output
        if isinstance(output, RolloutGroups):
            for g in output:
                state.groups.setdefault(g.group_id, g)
                state.created_by.setdefault(g.group_id, node.id)
                if not g.verdict.included:  # dropped by the stage that produced it
                    state.dropped_by.setdefault(g.group_id, node.id)
        self._hook("after_stage", node.id, state.ctx, output, seconds)

    def call_as(self, name: str, fn: Callable[[], Any]) -> Any:
        """Run ``fn``, a runtime job that is not a stage (evaluation); the Prefect runner makes it a task."""
        return fn()

    def _execute(self, sid: str, ctx: StepContext, run: Callable, kwargs: dict[str, Any]) -> Any:
        """One stage execution (its ``run``). The Prefect runner overrides this to make it a task."""
        return self._call(sid, ctx, run, **kwargs)

    def _call(self, sid: str, ctx: StepContext, method: Callable | None, *args: Any, **kwargs: Any) -> Any:
        if method is None:
            return None
        try:
            return method(*args, **kwargs)
        except StageError:
            raise
        except Exception as exc:
            raise StageError(sid, ctx.step, ctx.run_id, exc, ctx.round) from exc

    def _report(self, state: _StepState) -> StepReport:
        update = state.outputs.get(UPDATE_ID)
        version = update.policy_version if isinstance(update, UpdateReport) else self.policy_version
        update_node = self.pipeline.nodes[UPDATE_ID]
        fed = [state.outputs.get(b.source) for b in update_node.bindings]
        in_update = {g.group_id for out in fed if isinstance(out, RolloutGroups) for g in out if g.verdict.included}
        controls = {sid: dict(out.controller_state) for sid, out in state.outputs.items()
                    if isinstance(out, Allocation) and out.controller_state}
        return StepReport(
            run_id=self.run_id, step=state.ctx.step, policy_version=version,
            groups=tuple(state.groups.values()), update=update, stage_seconds=dict(state.seconds),
            loop_rounds=dict(state.rounds), created_by=dict(state.created_by), dropped_by=dict(state.dropped_by),
            update_group_ids=frozenset(in_update), controller_state=controls,
        )

    def state_dict(self) -> dict[str, Any]:
        """The runner's position and every stateful stage's state (checkpoints build on this)."""
        return {
            "step": self.step,
            "policy_version": self.policy_version,
            "stages": {sid: s.state_dict() for sid, s in self.stages.items() if hasattr(s, "state_dict")},
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step, self.policy_version = int(state["step"]), int(state["policy_version"])
        for sid, stage_state in state["stages"].items():
            self.stages[sid].load_state_dict(stage_state)
