"""The local runner: plan order, loop blocks with an until stage and a feedback edge,
observe after every step, and StageError. Uses TEST STAGES defined here, registered in a
private registry, that log every call."""

from __future__ import annotations

from typing import ClassVar

import pytest

from gfcr.errors import StageError
from gfcr.graph import compile_pipeline
from gfcr.records import (
    Allocation, AllocationEntry, PromptPool, RolloutGroups, StepContext, StepReport, UpdateReport,
)
from gfcr.registry import StageConfig, make_stage_registry
from gfcr.runtime import LocalRunner
from gfcr.spec import load_spec_text
from gfcr.stages.testing import scored_group

LOG: list[tuple] = []
REGISTRY = make_stage_registry(entry_points=False)


class _Logged:
    """TEST STAGE mixin: logs before_step, observe and done with the step and round."""

    testing: ClassVar[bool] = True

    class Config(StageConfig):
        tag: str
        rounds_needed: int = 2
        fail_at_step: int | None = None

    def __init__(self, config):
        self.config = config

    def log(self, method, *extra):
        LOG.append((self.config.tag, method, self.ctx.step, self.ctx.round, *extra))

    def before_step(self, ctx: StepContext) -> None:
        self.ctx = self.step_ctx = ctx
        self.log("before_step")

    def observe(self, report: StepReport) -> None:
        self.ctx = self.step_ctx
        self.log("observe", report.policy_version)


@REGISTRY.register("control.test_pick")
class Pick(_Logged):
    """TEST STAGE: picks the first two prompts."""

    def run(self, pool: PromptPool) -> Allocation:
        self.log("run")
        return Allocation(self.ctx.step, tuple(AllocationEntry(p, 2) for p in pool[:2]))


@REGISTRY.register("generate.test_gen")
class Gen(_Logged):
    """TEST STAGE: one group per prompt; logs how many groups the previous round fed back."""

    def run(self, allocation: Allocation, ctx: StepContext, previous: RolloutGroups | None = None) -> RolloutGroups:
        self.ctx = ctx  # this call's context: the loop round is on it
        if self.config.fail_at_step == self.ctx.step:
            raise RuntimeError("engine fell over")
        self.log("run", len(previous) if previous is not None else None)
        return RolloutGroups([scored_group(e.prompt_id, [0, 1], self.ctx.step) for e in allocation])


@REGISTRY.register("filter.test_gate")
class Gate(_Logged):
    """TEST STAGE: done after `rounds_needed` rounds."""

    def before_step(self, ctx: StepContext) -> None:
        super().before_step(ctx)
        self.rounds = 0

    def run(self, groups: RolloutGroups, ctx: StepContext) -> RolloutGroups:
        self.ctx = ctx
        self.rounds += 1
        self.log("run")
        return groups

    def done(self) -> bool:
        self.log("done", self.rounds >= self.config.rounds_needed)
        return self.rounds >= self.config.rounds_needed


@REGISTRY.register("update.test_update")
class Update(_Logged):
    """TEST STAGE: counts what reaches it."""

    version = 0

    def run(self, groups: RolloutGroups) -> UpdateReport:
        self.version += 1
        self.log("run", len(groups))
        return UpdateReport(self.version, rollouts_in_update=sum(1 for _ in groups.rollouts()))


SPEC = """\
name: order
data: {source: arithmetic, with: {n: 10}}
stages:
  pick: {use: control.test_pick, with: {tag: pick}}
  gen:  {use: generate.test_gen, from: {allocation: pick, previous: gate}, with: {tag: gen}}
  gate: {use: filter.test_gate, from: gen, with: {tag: gate, rounds_needed: 2}}
loops:
  again: {stages: [gen, gate], until: gate, max_rounds: 5}
update: {use: update.test_update, from: again, with: {tag: update}}
"""


def runner(overrides=()):
    LOG.clear()
    return LocalRunner(compile_pipeline(load_spec_text(SPEC, "order.yaml", overrides), REGISTRY))


def test_feedback_edge_and_plan():
    pipeline = runner().pipeline
    assert pipeline.describe_plan() == "pick -> [again x<=5: gen -> gate] -> update"
    (previous,) = [b for b in pipeline.nodes["gen"].bindings if b.param == "previous"]
    assert previous.feedback and previous.source == "gate"


def test_call_order_through_a_loop_block_and_observe():
    reports = runner().run(steps=2)
    step0 = [entry for entry in LOG if entry[2] == 0]
    assert step0 == [
        ("pick", "before_step", 0, None), ("gen", "before_step", 0, None),
        ("gate", "before_step", 0, None), ("update", "before_step", 0, None),
        ("pick", "run", 0, None),
        ("gen", "run", 0, 0, 0), ("gate", "run", 0, 0), ("gate", "done", 0, 0, False),
        ("gen", "run", 0, 1, 2), ("gate", "run", 0, 1), ("gate", "done", 0, 1, True),
        ("update", "run", 0, None, 2),
        ("pick", "observe", 0, None, 1), ("gen", "observe", 0, None, 1),
        ("gate", "observe", 0, None, 1), ("update", "observe", 0, None, 1),
    ]
    assert [entry for entry in LOG if entry[2] == 1][0] == ("pick", "before_step", 1, None)
    assert [r.policy_version for r in reports] == [1, 2]
    assert reports[0].loop_rounds == {"again": 2}
    assert set(reports[0].stage_seconds) == {"pick", "gen", "gate", "update"}


def test_loop_stops_at_max_rounds_when_never_done():
    r = runner(["stages.gate.with.rounds_needed=99", "loops.again.max_rounds=3"])
    report = r.run_step()
    assert report.loop_rounds == {"again": 3}
    assert [e[3] for e in LOG if e[:2] == ("gate", "done")] == [0, 1, 2]


def test_stage_exception_becomes_stage_error():
    r = runner(["stages.gen.with.fail_at_step=1"])
    r.run_step()
    with pytest.raises(StageError) as info:
        r.run_step()
    err = info.value
    assert (err.stage_id, err.step, err.round, err.run_id) == ("gen", 1, 0, "order")
    assert isinstance(err.cause, RuntimeError)
    assert "stage `gen` failed at step 1, loop round 0 of run order: RuntimeError: engine fell over" in str(err)


def test_step_report_counts_groups_and_verdicts():
    from tests.conftest import DAPO

    report = LocalRunner(compile_pipeline(load_spec_text(DAPO))).run_step()
    kept = [g for g in report.groups if g.verdict.included]
    assert report.groups_kept == len(kept) == report.update.rollouts_in_update // 4 > 0
    assert report.rollouts_generated == 4 * len(report.groups)
    dropped_by = {g.verdict.dropped_by for g in report.groups if not g.verdict.included}
    assert dropped_by and dropped_by <= {"keep", "enough"}  # stamped by the runtime: stage ids
    assert {g.group_id: g.verdict.dropped_by for g in report.groups if not g.verdict.included} == report.dropped_by
    assert all(g.stats.reward_std > 0 for g in kept)


def test_state_dict_round_trip():
    from tests.conftest import DAPO

    pipeline = compile_pipeline(load_spec_text(DAPO))
    first = LocalRunner(pipeline)
    first.run(steps=2)
    second = LocalRunner(pipeline)
    second.load_state_dict(first.state_dict())
    assert second.step == 2 and second.stages["pick"].state_dict() == first.stages["pick"].state_dict()
    a, b = first.run_step(), second.run_step()
    assert [g.group_id for g in a.groups] == [g.group_id for g in b.groups]


def test_hooks_see_every_step_and_stage():
    from tests.conftest import DAPO

    class Recorder:
        def __init__(self):
            self.events = []

        def before_step(self, event):
            self.events.append(("before_step", event.ctx.step))

        def after_stage(self, event):
            self.events.append((event.stage_id, event.ctx.round))

        def after_step(self, event):
            self.events.append(("after_step", event.report.step))

    hook = Recorder()
    LocalRunner(compile_pipeline(load_spec_text(DAPO)), hooks=(hook,)).run(steps=1)
    assert hook.events[0] == ("before_step", 0) and hook.events[-1] == ("after_step", 0)
    assert hook.events[1:6] == [("pick", 0), ("budget", 0), ("rollout", 0), ("keep", 0), ("enough", 0)]
    assert hook.events[-2] == ("update", None)


def test_pinned_numbers_of_a_seeded_fake_dapo_run():
    """The fake engine and every built-in stage are deterministic: pin a run's numbers so an
    unintended change of order, seeding or ids shows up."""
    from tests.conftest import REPO
    from gfcr.graph import load_pipeline

    reports = LocalRunner(load_pipeline(REPO / "pipelines/examples/fake_dapo.yaml")).run()
    assert [r.zero_variance_groups for r in reports] == [4, 3, 4, 5, 2]
    assert [r.groups_kept for r in reports] == [8] * 5
    assert [r.loop_rounds["collect"] for r in reports] == [2] * 5
    assert [r.update.rollouts_in_update for r in reports] == [64] * 5
    assert reports[0].groups[0].group_id == "arithmetic:train-0:105@s0"


# --- contract v2: frozen context, runtime stamps, in-flight controllers, Replay ports ---------

def test_step_context_is_frozen():
    import dataclasses

    ctx = StepContext("r", 0, 0, 0)
    with pytest.raises(dataclasses.FrozenInstanceError):
        ctx.round = 1  # type: ignore[misc]


def test_runtime_stamps_changed_by_and_dropped_by():
    from tests.conftest import DAPO

    report = LocalRunner(compile_pipeline(load_spec_text(DAPO))).run_step()
    dropped = {g.group_id for g in report.groups if not g.verdict.included}
    assert dropped and all(report.changed_by[gid][-1] == report.dropped_by[gid] for gid in dropped)
    assert all(report.created_by[g.group_id] == "rollout" for g in report.groups)
    kept = [g.group_id for g in report.groups if g.verdict.included]
    assert all(gid not in report.changed_by for gid in kept)  # nothing changed the kept groups


STOP = """\
name: stop
data: {source: arithmetic, with: {n: 50}}
stages:
  pick:    {use: control.uniform, with: {batch_size: 6}}
  budget:  {use: control.fixed_n, from: pick, with: {n: 4}}
  stop:    {use: control.fake_stop, with: {groups: 2, every: 1}}
  rollout: {use: generate.fake, from: budget, in_flight: [stop], with: {length: 16}}
update: {use: update.fake, from: rollout}
run: {steps: 2}
"""


def test_in_flight_controller_steers_the_fake_decode_loop():
    r = LocalRunner(compile_pipeline(load_spec_text(STOP)))
    assert r.stages["rollout"].controllers == (r.stages["stop"],)  # attached once, before setup
    reports = r.run()
    for report in reports:
        statuses = [str(x.status) for g in report.groups for x in g.rollouts]
        assert sum(g.complete for g in report.groups) >= 2  # stopped once two groups were complete
        assert "aborted_partial" in statuses  # the rest was cut short, kept as partials
        assert all(len(x) <= 16 for g in report.groups for x in g.rollouts)
    stop = r.stages["stop"]
    assert stop.total_calls > 0 and "stop" in r.state_dict()["stages"]  # before_step, observe, state


def test_in_flight_controller_is_no_task_and_no_plan_item():
    r = LocalRunner(compile_pipeline(load_spec_text(STOP)))
    report = r.run_step()
    assert "stop" not in report.stage_seconds and "stop" not in r.pipeline.plan


REPLAY = """\
name: replay
data: {source: arithmetic, with: {n: 50}}
stages:
  pick:    {use: control.uniform, with: {batch_size: 4}}
  budget:  {use: control.fixed_n, from: pick, with: {n: 4}}
  offer:   {use: replay.fake_provide, from: budget, with: {tokens: 3}}
  past:    {use: replay.fake_ingest, with: {max_groups: 2}}
  rollout: {use: generate.fake, from: {allocation: budget, provided: offer}}
  keep:    {use: filter.nonzero_variance, from: rollout}
  mix:     {use: replay.fake_mix, from: {fresh: keep, replayed: past}, with: {max_replayed: 2}}
update: {use: update.fake, from: mix}
run: {steps: 3}
"""


def test_replay_ports_wire_and_run():
    pipeline = compile_pipeline(load_spec_text(REPLAY))
    # the ingest stage runs as late as its reader allows: after the step's groups are made
    assert pipeline.plan == ("pick", "budget", "offer", "rollout", "keep", "past", "mix", "update")
    reports = LocalRunner(pipeline).run()
    first = reports[0]
    resumed = [x for g in first.groups for x in g.rollouts if str(x.origin) == "resumed"]
    assert len(resumed) == len(first.groups) and all(x.response_token_ids[:3] == [1, 1, 1] for x in resumed)
    later = reports[1]
    resumed = [x for g in later.groups for x in g.rollouts if str(x.origin) == "resumed"]
    assert [s.policy_version for s in resumed[0].segments] == [0, 1]  # the partial's, then the new tokens
    replayed = [g for g in later.groups if later.created_by[g.group_id] == "past"]
    assert replayed and all(str(x.origin) == "replayed" and x.replayed_from for g in replayed for x in g.rollouts)
    assert {g.group_id for g in replayed} <= later.update_group_ids
