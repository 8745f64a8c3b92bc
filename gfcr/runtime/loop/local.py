"""The in-process runner: run a compiled plan step after step.

The runner is typed against the lifecycle roles of ``gfcr.registry.lifecycle``. After
building the stages it attaches every generate stage's in-flight controllers
(``attach_in_flight``), then calls ``setup(lent)`` on every ``SetsUp`` stage (the policy
and engine the runtime lends). Per step: ``before_step(ctx)`` on every ``BeforeStep`` stage;
the plan's items in order (a generate stage with ``lifecycle: {stream_groups: true}`` and the
per-group stages after it together, ``gfcr.runtime.loop.streaming``; a loop block repeats its
body, each round with a fresh ``StepContext`` carrying the round, until its until stage is
``done()``, ``max_rounds`` have run, or the loop's optional ``max_seconds`` of wall-clock time have passed; hooks hear of
each round that did not end the loop, ``loop_round``, and of a loop stopped at a limit before
its until stage was done, ``loop_stopped``); then ``step_metrics()`` on every ``ReportsMetrics`` stage (the report's
``metrics``, by stage id) and ``observe(report)`` on every ``Observes`` stage. Runtime inputs of ``run``
(``PromptPool``, ``StepContext``, ``StepOutputs``) are filled by type.

The runner, not the stages, records who did what to a group: the stage that first output
it (``created_by``), the stage that dropped it (stamped on its verdict as ``dropped_by``) and
the stages that changed its rewards, advantages, loss masks, sample weights or verdict
(``changed_by``, found by comparing a cheap fingerprint of every group before and after each
stage), and the stage that appended a rollout to a group another stage created (``added_by``: a
Replay stage's replayed rollouts), and, per prompt, what each Control stage decided
(``control_decisions``: the entries of its Allocation that it set, its reason and ``why``, not
those it passed on unchanged from an upstream Allocation). An exception raised inside a stage
becomes a ``StageError`` naming the stage, step, round and run.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from functools import partial
from typing import Any, Callable, Hashable, Protocol

import numpy as np

from gfcr.errors import StageError
from gfcr.graph import CompiledPipeline, LoopBlock, Node
from gfcr.graph.streaming import group_chains
from gfcr.records import (
    Allocation, ControlDecision, PromptPool, Provided, RolloutGroup, RolloutGroups, StepContext, StepOutputs,
    StepReport, UpdateReport,
)
from gfcr.registry.lifecycle import (
    BeforeStep, EndsLoop, HostsInFlight, Observes, ReportsMetrics, SetsUp, Stateful, Trains,
)
from gfcr.registry.contract import Port
from gfcr.runtime.loop.events import HookChannel, RunEvent
from gfcr.runtime.loop.streaming import run_streamed
from gfcr.runtime.services import RuntimeServices
from gfcr.spec import UPDATE_ID

# what a feedback input reads in round 0, before its until stage has produced anything
_EMPTY: dict[type, Callable[[int], Any]] = {
    RolloutGroups: lambda step: RolloutGroups(),
    Allocation: lambda step: Allocation(step),
    Provided: lambda step: Provided(step),
}


class RunnerHooks(Protocol):
    """Optional callbacks for progress bars and tracking, each given the ``RunEvent``
    (``gfcr.runtime.loop.events``); implement any subset."""

    def before_step(self, event: RunEvent) -> None: ...  # ctx
    def after_stage(self, event: RunEvent) -> None: ...  # stage_id, ctx, output, seconds
    def after_step(self, event: RunEvent) -> None: ...  # report
    def loop_round(self, event: RunEvent) -> None: ...  # loop, rounds: a round ended, not done
    def loop_stopped(self, event: RunEvent) -> None: ...  # loop, rounds, limit: at a limit


def build_stages(pipeline: CompiledPipeline) -> dict[str, Any]:
    """Instantiate every stage (in-flight controllers too) from its class and validated config,
    in plan order."""
    return {sid: node.info.cls(node.config) for sid, node in pipeline.nodes.items()}


def fingerprint(group: RolloutGroup) -> Hashable:
    """What a stage may change about a group, cheaply comparable: verdict, sample weights,
    rewards, advantages and loss masks (arrays by a hash of their bytes)."""
    return (group.verdict.included, group.verdict.reason, group.sample_weight,
            tuple((r.reward, r.sample_weight, _value(r.advantage), _value(r.loss_mask)) for r in group.rollouts))


def _value(x: float | np.ndarray | None) -> Hashable:
    return (x.shape, hash(x.tobytes())) if isinstance(x, np.ndarray) else x


def decided(sid: str, round: int | None, inputs: Any, output: Allocation) -> list[ControlDecision]:
    """The entries of ``output`` that stage ``sid`` decided: those whose pick or skip, reason or
    ``why`` differ from the same prompt's entry in an Allocation it was given (or that it was
    not given)."""
    given = {e.prompt_id: (e.decision, e.reason, e.why) for a in inputs if isinstance(a, Allocation) for e in a}
    return [ControlDecision(sid, e, round) for e in output if given.get(e.prompt_id) != (e.decision, e.reason, e.why)]


@dataclass
class _StepState:
    ctx: StepContext
    outputs: dict[str, Any] = field(default_factory=dict)
    groups: dict[str, RolloutGroup] = field(default_factory=dict)
    seconds: dict[str, float] = field(default_factory=dict)
    rounds: dict[str, int] = field(default_factory=dict)
    created_by: dict[str, str] = field(default_factory=dict)  # group id -> first stage that output it
    dropped_by: dict[str, str] = field(default_factory=dict)  # group id -> stage id that dropped it
    changed_by: dict[str, list[str]] = field(default_factory=dict)  # group id -> stages that changed it
    added_by: dict[str, str] = field(default_factory=dict)  # rollout id -> stage that added it to an existing group
    rollout_ids: set[str] = field(default_factory=set)  # every rollout id the step's groups have held
    decisions: list[ControlDecision] = field(default_factory=list)  # per prompt, what a Control stage decided

    def outputs_so_far(self) -> StepOutputs:
        return StepOutputs(self.ctx.step, tuple(self.groups.values()), dict(self.created_by), dict(self.dropped_by),
                           {g: tuple(s) for g, s in self.changed_by.items()})


@dataclass(frozen=True)
class _Taken:
    """A step's reads that may happen once: the stages' metrics and the runtime's counters."""

    metrics: dict[str, dict[str, Any]]
    rollouts_charged: int
    tokens_charged: int
    tokens_scored: int


@dataclass
class Produced:
    """A step of the pipelined schedule whose stages have run, waiting for its update; ``report``
    is what its stages observed (no update yet)."""

    state: _StepState
    taken: _Taken
    report: StepReport
    waited_s: float = 0.0  # how long its producer waited (for a checkpoint, for weights) before it ran
    moved_s: float = 0.0  # how long its producer spent moving the weights into an engine with its own copy (vLLM)


class LocalRunner:
    """Runs a compiled pipeline in this process.

    ``pool`` defaults to the pipeline's data source; ``stages`` to fresh instances, set up
    with what ``services`` lends them (``services.lent``). The update node runs through the
    trainer ``services`` gives for it (``gfcr.runtime.training``) when the update ``Trains``.
    """

    def __init__(self, pipeline: CompiledPipeline, *, pool: PromptPool | None = None,
                 stages: dict[str, Any] | None = None, run_id: str | None = None,
                 hooks: tuple[Any, ...] | HookChannel = (), services: RuntimeServices | None = None,
                 schedule: Any = None):
        self.pipeline = pipeline
        self.schedule = schedule  # a PipelinedSchedule (gfcr.runtime.loop.lifecycle), or None: the synchronous lifecycle
        self.pool = pool if pool is not None else pipeline.data.load()
        self.run_id = run_id or pipeline.spec.name
        self.channel = hooks if isinstance(hooks, HookChannel) else HookChannel(hooks)
        self.step = 0
        self.policy_version = 0
        self.services = services or RuntimeServices()
        self.lent = self.services.lent
        self.stages = stages if stages is not None else build_stages(pipeline)
        # generate stage -> the per-group stages run on each of its groups as it hands them over
        self.chains = group_chains(pipeline.plan, pipeline.nodes) if pipeline.spec.lifecycle.stream_groups else {}
        self.services.lend_stores(self.stages)  # a Replay stage may read another's store (replay.rlep)
        setup_ctx = StepContext(self.run_id, 0, pipeline.spec.run.seed, 0)
        for sid, node in pipeline.nodes.items():
            host = self.stages[sid]
            if node.in_flight and isinstance(host, HostsInFlight):  # the compiler checked the role
                self._call(sid, setup_ctx, host.attach_in_flight, [self.stages[c] for c in node.in_flight])
        for sid, stage in self.stages.items():
            if isinstance(stage, SetsUp):
                self._call(sid, setup_ctx, stage.setup, self.lent)
        update = self.stages.get(UPDATE_ID)
        self.trainer = self._call(UPDATE_ID, setup_ctx, self.services.trainer_for, update)

    @property
    def hooks(self) -> tuple[Any, ...]:
        """The hooks of the runner's channel (shared with the run around it)."""
        return self.channel.hooks

    @hooks.setter
    def hooks(self, hooks: tuple[Any, ...]) -> None:
        self.channel.hooks = tuple(hooks)

    def run(self, steps: int | None = None) -> list[StepReport]:
        """Run ``steps`` steps (default: the spec's ``run.steps``) and return their reports."""
        total = steps if steps is not None else self.pipeline.spec.run.steps
        return [self.run_step() for _ in range(total)]

    def run_step(self) -> StepReport:
        """One step: the plan's items in order, then ``observe`` (synchronous lifecycle). Under a
        pipelined schedule, the step's two halves in turn (``produce_step``, ``train_step``)."""
        if self.schedule is not None:  # the sequential twin of the pipelined schedule
            self.schedule.record_start(self.step, self.policy_version)  # a run's or a resume's start; else recorded
            return self.train_step(self.produce_step(self.step))
        state = self._begin(self.step, self.policy_version)
        self._run_items(self.pipeline.plan, state)
        report = self._report(state, self._take(state))
        self._observe(report)
        return self._end(report)

    def produce_step(self, step: int) -> Produced:
        """The pipelined schedule's first half of ``step``: its stages but the update, on the
        weights of ``lag`` steps before, then ``observe`` of the report without its update
        (``gfcr.runtime.loop.lifecycle``). May run ahead of ``train_step``, in another thread."""
        state = self._begin(step, self.schedule.generation_for(step))
        *produce, update = self.pipeline.plan  # the update is the sink: last in every plan
        assert update == UPDATE_ID, self.pipeline.plan
        self._run_items(produce, state)
        taken = self._take(state)
        report = self._report(state, taken)  # update None, the generation's version
        self._observe(report)
        return Produced(state, taken, report, moved_s=self.schedule.moved_s)

    def train_step(self, produced: Produced) -> StepReport:
        """The second half: the update on the step's batch, the step's report, and the record of
        the trained weights at the start of the next step."""
        assert produced.state.ctx.step == self.step, (produced.state.ctx.step, self.step)
        self._run_items([UPDATE_ID], produced.state)
        report = self._end(self._report(produced.state, produced.taken))
        self.schedule.record_start(self.step, self.policy_version)
        return report

    def _begin(self, step: int, version: int) -> _StepState:
        ctx = StepContext(self.run_id, step, self.pipeline.spec.run.seed, version)
        self.channel.emit("before_step", ctx.step, ctx=ctx)
        for sid, stage in self.stages.items():
            if isinstance(stage, BeforeStep):
                self._call(sid, ctx, stage.before_step, ctx)
        return _StepState(ctx)

    def _end(self, report: StepReport) -> StepReport:
        self.channel.emit("after_step", report.step, report=report)
        self.policy_version = report.policy_version
        self.step += 1
        return report

    def _run_items(self, items: Any, state: _StepState) -> None:
        streamed: set[str] = set()  # the chain stages a streamed generate stage has run already
        for item in items:
            if isinstance(item, LoopBlock):
                self._run_loop(item, state)
            elif self.chains.get(item):  # `lifecycle: {stream_groups: true}`
                nodes = self.pipeline.nodes
                run_streamed(self, nodes[item], [nodes[sid] for sid in self.chains[item]], state)
                streamed.update(self.chains[item])
            elif item not in streamed:
                self._run_stage(self.pipeline.nodes[item], state)

    def _observe(self, report: StepReport) -> None:
        ctx = StepContext(self.run_id, report.step, self.pipeline.spec.run.seed, report.policy_version)
        for sid, stage in self.stages.items():
            if isinstance(stage, Observes):
                self._call(sid, ctx, stage.observe, report)

    def _run_loop(self, loop: LoopBlock, state: _StepState) -> None:
        until = self.stages[loop.until]
        assert isinstance(until, EndsLoop)  # the compiler checked the role
        step_ctx = state.ctx
        start = time.monotonic()
        for round in range(loop.max_rounds):
            state.ctx = replace(step_ctx, round=round)
            state.rounds[loop.name] = round + 1
            for sid in loop.body:
                self._run_stage(self.pipeline.nodes[sid], state)
            if self._call(loop.until, state.ctx, until.done):
                break
            self.channel.emit("loop_round", step_ctx.step, loop=loop, rounds=round + 1)
            if loop.max_seconds is not None and time.monotonic() - start >= loop.max_seconds:
                self.channel.emit("loop_stopped", step_ctx.step, loop=loop, rounds=round + 1,
                                  limit=f"max_seconds={loop.max_seconds:g}")
                break
        else:
            self.channel.emit("loop_stopped", step_ctx.step, loop=loop, rounds=loop.max_rounds,
                              limit=f"max_rounds={loop.max_rounds}")
        state.ctx = step_ctx

    def _runtime_input(self, port: Port, state: _StepState) -> Any:
        if port.type is StepContext:
            return state.ctx
        if port.type is StepOutputs:
            return state.outputs_so_far()
        return self.pool

    def _inputs(self, node: Node, state: _StepState) -> dict[str, Any]:
        """The keyword arguments of ``node``'s ``run``: runtime inputs, and its bound outputs."""
        kwargs = {p.name: self._runtime_input(p, state) for p in node.runtime_inputs}
        for b in node.bindings:
            if b.source in state.outputs:
                kwargs[b.param] = state.outputs[b.source]
            else:  # a feedback input in round 0
                kwargs[b.param] = _EMPTY[b.type](state.ctx.step)
        return kwargs

    def _run_stage(self, node: Node, state: _StepState) -> None:
        kwargs = self._inputs(node, state)
        before = self._fingerprints(state)
        start = time.perf_counter()
        output = self._execute(node.id, state.ctx, self._runs(node.id), kwargs)
        seconds = time.perf_counter() - start
        self._stamp(node.id, state, before, output)
        if isinstance(output, Allocation):
            state.decisions.extend(decided(node.id, state.ctx.round, kwargs.values(), output))
        self._ran(node.id, state, output, seconds)

    @staticmethod
    def _fingerprints(state: _StepState) -> dict[str, Hashable]:
        return {gid: fingerprint(g) for gid, g in state.groups.items()}

    def _ran(self, sid: str, state: _StepState, output: Any, seconds: float) -> None:
        """Record stage ``sid``'s output and time (its stamps are recorded), and tell the hooks."""
        state.seconds[sid] = state.seconds.get(sid, 0.0) + seconds
        state.outputs[sid] = output
        self.channel.emit("after_stage", state.ctx.step, stage_id=sid, ctx=state.ctx, output=output, seconds=seconds)

    def _runs(self, sid: str) -> Callable[..., Any]:
        """What executes stage ``sid``: its ``run``, or, for an update that ``Trains``, the trainer
        (which calls its ``prepare``, ``train_shard`` and ``finish`` and moves the version)."""
        stage = self.stages[sid]
        if sid == UPDATE_ID and isinstance(stage, Trains):
            return partial(self.trainer.update, stage)
        return stage.run

    def _stamp(self, sid: str, state: _StepState, before: dict[str, Hashable], output: Any) -> None:
        """Record what stage ``sid`` created, dropped and changed (groups it output or mutated)."""
        touched = {gid: [g] for gid, g in state.groups.items()}
        for g in output if isinstance(output, RolloutGroups) else ():
            if g.group_id not in state.groups:
                state.groups[g.group_id] = g
                state.created_by[g.group_id] = sid
                state.rollout_ids.update(r.rollout_id for r in g.generated)
                if not g.verdict.included:  # dropped by the stage that produced it
                    self._dropped(sid, state, g)
                for removal in g.removed:  # taken out by the stage that produced it (a failed trajectory)
                    removal.removed_by = removal.removed_by or sid
            elif g is not state.groups[g.group_id]:
                touched[g.group_id].append(g)  # a copy of a group seen before
        for gid, copies in touched.items():
            if gid in before and any(fingerprint(g) != before[gid] for g in copies):
                state.changed_by.setdefault(gid, []).append(sid)
                self._added(sid, state, copies)
                for g in copies:
                    if not g.verdict.included and gid not in state.dropped_by:
                        self._dropped(sid, state, g)
                    for removal in g.removed:  # rollouts this stage took out of the group
                        removal.removed_by = removal.removed_by or sid

    @staticmethod
    def _added(sid: str, state: _StepState, copies: list[RolloutGroup]) -> None:
        """Rollouts stage ``sid`` appended to a group another stage created (replayed ones)."""
        for r in (r for g in copies for r in g.generated):
            if r.rollout_id not in state.rollout_ids:
                state.rollout_ids.add(r.rollout_id)
                state.added_by[r.rollout_id] = sid

    @staticmethod
    def _dropped(sid: str, state: _StepState, group: RolloutGroup) -> None:
        group.verdict = replace(group.verdict, dropped_by=sid)
        state.dropped_by[group.group_id] = sid

    def call_as(self, name: str, fn: Callable[[], Any]) -> Any:
        """Run ``fn``, a runtime job that is not a stage (evaluation); the Prefect runner makes it a task."""
        return fn()

    def _execute(self, sid: str, ctx: StepContext, run: Callable, kwargs: dict[str, Any]) -> Any:
        """One stage execution (its ``run``). The Prefect runner overrides this to make it a task."""
        return self._call(sid, ctx, run, **kwargs)

    def _call(self, sid: str, ctx: StepContext, method: Callable | None, /, *args: Any, **kwargs: Any) -> Any:
        if method is None:
            return None
        try:
            return method(*args, **kwargs)
        except StageError:
            raise
        except Exception as exc:
            raise StageError(sid, ctx.step, ctx.run_id, exc, ctx.round) from exc

    def _take(self, state: _StepState) -> _Taken:
        """What is read once a step: the stages' ``step_metrics()`` and the runtime's counters."""
        metrics = {sid: dict(self._call(sid, state.ctx, stage.step_metrics)) for sid, stage in self.stages.items()
                   if isinstance(stage, ReportsMetrics)}
        rollouts_charged, tokens_charged = self.lent.take_generation_charge()
        return _Taken(metrics, rollouts_charged, tokens_charged, self.lent.take_tokens_scored())

    def _report(self, state: _StepState, taken: _Taken) -> StepReport:
        update = state.outputs.get(UPDATE_ID)
        version = update.policy_version if isinstance(update, UpdateReport) else state.ctx.policy_version
        update_node = self.pipeline.nodes[UPDATE_ID]
        fed = [state.outputs.get(b.source) for b in update_node.bindings]
        in_update = {g.group_id for out in fed if isinstance(out, RolloutGroups) for g in out if g.verdict.included}
        controls = {sid: dict(out.controller_state) for sid, out in state.outputs.items()
                    if isinstance(out, Allocation) and out.controller_state}
        return StepReport(
            run_id=self.run_id, step=state.ctx.step, policy_version=version, metrics=dict(taken.metrics),
            groups=tuple(state.groups.values()), update=update, stage_seconds=dict(state.seconds),
            loop_rounds=dict(state.rounds), created_by=dict(state.created_by), dropped_by=dict(state.dropped_by),
            changed_by={gid: tuple(s) for gid, s in state.changed_by.items()},
            update_group_ids=frozenset(in_update), controller_state=controls,
            tokens_scored=taken.tokens_scored, added_by=dict(state.added_by),
            rollouts_charged=taken.rollouts_charged, tokens_charged=taken.tokens_charged,
            control_decisions=tuple(state.decisions),
        )

    def state_dict(self) -> dict[str, Any]:
        """The runner's position and every stateful stage's state (checkpoints build on this)."""
        return {
            "step": self.step,
            "policy_version": self.policy_version,
            "stages": {sid: self._stage_state(sid, s) for sid, s in self.stages.items() if isinstance(s, Stateful)},
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step, self.policy_version = int(state["step"]), int(state["policy_version"])
        self.trainer.resume_at(self.policy_version)
        for sid, stage_state in state["stages"].items():
            stage = self.stages[sid]
            if not isinstance(stage, Stateful):
                raise StageError(sid, self.step, self.run_id,
                                 TypeError(f"the checkpoint holds state for `{sid}`, which is not stateful"))
            if sid == UPDATE_ID:  # under trainer ranks, the optimizer lives in the ranks
                self.trainer.load_state_dict(stage, stage_state)
            else:
                stage.load_state_dict(stage_state)

    def _stage_state(self, sid: str, stage: Stateful) -> dict[str, Any]:
        return self.trainer.state_dict(stage) if sid == UPDATE_ID else stage.state_dict()
