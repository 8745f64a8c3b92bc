"""The Prefect runner: a flow run per run and a task run per stage execution, read back through
Prefect's own client; retries of a failing stage; a permanent failure, then resume.

These run against Prefect's embedded server (PREFECT_HOME is a temporary folder, see
conftest.py). The retry tests use a TEST STAGE defined here, in a private registry.
"""

from __future__ import annotations

import json
import time
from collections import Counter
from typing import ClassVar

import pytest
from typer.testing import CliRunner

from gfcr.cli.main import app
from gfcr.errors import StageError
from gfcr.graph import load_pipeline
from gfcr.records import RolloutGroups, StepContext
from gfcr.registry import StageConfig, make_stage_registry
from gfcr.runtime.loop.session import Run
from tests.conftest import BASE, REPO

REGISTRY = make_stage_registry(entry_points=False)
CALLS: Counter = Counter()


@REGISTRY.register("filter.test_flaky")
class Flaky:
    """TEST STAGE: passes groups through, but its first ``failures`` calls at ``step`` raise."""

    testing: ClassVar[bool] = True

    class Config(StageConfig):
        step: int = 1
        failures: int = 1
        key: str = "flaky"

    def __init__(self, config):
        self.config = config

    def before_step(self, ctx: StepContext) -> None:
        self.ctx = ctx

    def run(self, groups: RolloutGroups) -> RolloutGroups:
        if self.ctx.step == self.config.step and CALLS[self.config.key] < self.config.failures:
            CALLS[self.config.key] += 1
            raise ConnectionError("verifier service went away")
        return groups


FLAKY = BASE.replace(
    "  keep:    {use: filter.nonzero_variance, from: rollout}",
    "  flaky:   {use: filter.test_flaky, from: rollout, with: {key: KEY, failures: FAILURES}, retries: 2}\n"
    "  keep:    {use: filter.nonzero_variance, from: flaky}",
).replace("run: {steps: 2}", "run: {steps: 3, checkpoint_every: 1}")


assert "test_flaky" in FLAKY and "checkpoint_every" in FLAKY


def _flaky(write_spec, key: str, failures: int, name: str):
    return write_spec(FLAKY.replace("KEY", key).replace("FAILURES", str(failures)), name)


def _metrics(run_dir) -> list[dict]:
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in line.items() if k != "time"} for line in lines]


def _task_runs(flow_run_name: str, expected: int):
    """The flow, flow run and task runs of a run, read with Prefect's client. Task run states reach
    the server's database through its event pipeline, a moment after the flow returns: wait for
    ``expected`` finished task runs (bounded)."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterName, TaskRunFilter, TaskRunFilterFlowRunId

    with get_client(sync_client=True) as client:
        (flow_run,) = client.read_flow_runs(flow_run_filter=FlowRunFilter(name=FlowRunFilterName(any_=[flow_run_name])))
        deadline = time.monotonic() + 60
        while True:
            tasks = client.read_task_runs(task_run_filter=TaskRunFilter(
                flow_run_id=TaskRunFilterFlowRunId(any_=[flow_run.id])), limit=200)
            finished = [t for t in tasks if t.state is not None and t.state.is_final()]
            if len(finished) >= expected or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        return client.read_flow(flow_run.flow_id), client.read_flow_run(flow_run.id), tasks


def test_quickstart_is_a_flow_run_with_a_task_run_per_stage_execution(tmp_path):
    run_dir = tmp_path / "quick"
    result = CliRunner().invoke(app, ["run", str(REPO / "pipelines" / "quickstart.yaml"), "--steps", "2",
                                      "--run-dir", str(run_dir), "--set", "eval.every=2", "--set", "eval.with.n=16"])
    assert result.exit_code == 0, result.output
    flow, flow_run, tasks = _task_runs(run_dir.name, expected=12)
    assert flow.name == "quickstart" and flow_run.state.is_completed()
    stage_ids = {"pick", "budget", "rollout", "reward", "update"}
    assert set(load_pipeline(REPO / "pipelines" / "quickstart.yaml").nodes) == stage_ids
    per_task = Counter(t.task_key.rsplit("-", 1)[0] for t in tasks)
    assert per_task == {**{sid: 2 for sid in stage_ids}, "eval": 2}  # before step 0, after step 2
    assert all(t.state.is_completed() for t in tasks)
    assert {t.name for t in tasks if t.task_key.startswith("rollout-")} == {"rollout step 0", "rollout step 1"}


def test_a_stage_that_fails_once_is_retried_and_the_run_is_unchanged(write_spec, tmp_path):
    steady = Run.start(load_pipeline(_flaky(write_spec, "steady", 0, "steady.yaml"), stages=REGISTRY),
                       tmp_path / "steady")
    steady.train()
    flaky = Run.start(load_pipeline(_flaky(write_spec, "once", 1, "once.yaml"), stages=REGISTRY), tmp_path / "once")
    flaky.train()
    assert CALLS["once"] == 1  # it did fail, at step 1
    assert _metrics(tmp_path / "once") == _metrics(tmp_path / "steady")
    _, _, tasks = _task_runs("once", expected=18)
    runs = [t for t in tasks if t.name == "flaky step 1"]
    assert len(runs) == 1, sorted((t.name, t.run_count) for t in tasks)
    assert runs[0].run_count == 2 and runs[0].state.is_completed()


def test_a_permanent_failure_stops_the_run_naming_the_stage_and_resume_finishes_it(write_spec, tmp_path):
    spec = _flaky(write_spec, "down", 5, "down.yaml")  # more failures than 1 + 2 retries
    run = Run.start(load_pipeline(spec, stages=REGISTRY), tmp_path / "down")
    with pytest.raises(StageError) as info:
        run.train()
    assert info.value.stage_id == "flaky" and info.value.step == 1
    assert isinstance(info.value.cause, ConnectionError) and CALLS["down"] == 3
    assert [m["step"] for m in _metrics(tmp_path / "down")] == [0]
    _, flow_run, _ = _task_runs("down", expected=10)
    assert flow_run.state.is_failed()

    Run.resume(tmp_path / "down", stages=REGISTRY).train()  # its 4th call succeeds
    assert [m["step"] for m in _metrics(tmp_path / "down")] == [0, 1, 2]


def test_retries_default_by_family(write_spec):
    from gfcr.runtime.loop.prefect_runner import stage_retries

    pipeline = load_pipeline(_flaky(write_spec, "k", 0, "d.yaml"), ["stages.rollout.retries=0"], stages=REGISTRY)
    retries = {sid: stage_retries(pipeline, sid) for sid in pipeline.nodes}
    assert retries == {"pick": 0, "budget": 0, "rollout": 0, "flaky": 2, "keep": 2, "update": 0}


def test_an_in_flight_controller_is_no_task(write_spec):
    from gfcr.runtime.loop.prefect_runner import PrefectRunner

    text = BASE.replace("  rollout: {use: generate.fake, from: budget}",
                        "  stop:    {use: control.fake_stop, with: {groups: 2}}\n"
                        "  rollout: {use: generate.fake, from: budget, in_flight: [stop]}")
    runner = PrefectRunner(load_pipeline(write_spec(text)))
    assert "stop" not in runner._tasks and "rollout" in runner._tasks
    assert runner.stages["rollout"].controllers == (runner.stages["stop"],)
