"""The MLflow tracker against a real SQLite MLflow store (the session's temporary one, see
tests/conftest.py), read back through MLflow's own API.

The fast tests run the fake pipeline of tests/conftest.py (test stages ``generate.fake`` and
``update.fake``, no model): the tracker's logic does not depend on the model. The CLI test
runs ``pipelines/quickstart.yaml`` with tiny-arith, made small with ``--set``.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import mlflow
import pytest
from mlflow import MlflowClient
from typer.testing import CliRunner

from gfcr.cli.main import app
from gfcr.graph import load_pipeline
from gfcr.runtime.store.rundir import RunDir
from gfcr.runtime.loop.session import Run
from gfcr.spec.models import MlflowSpec
from gfcr.tracking.mlflow_inputs import git_commit
from gfcr.tracking.mlflow_store import create_parent_run, finish_run
from gfcr.tracking.mlflow_tracker import MlflowTracker, start_tracking
from tests.conftest import BASE, REPO

cli = CliRunner()
FAKE = ["executor.kind=local", "run.steps=6", "run.checkpoint_every=2"]
NOISE = re.compile(r"warning|traceback|INFO|DEBUG", re.IGNORECASE)


def _fake(write_spec, experiment: str, *overrides: str):
    """The fake pipeline, tracked in ``experiment``."""
    return load_pipeline(write_spec(BASE), [*FAKE, f"tracking.mlflow.experiment={experiment}", *overrides])


def _run_id(run_dir: Path) -> str:
    return json.loads((run_dir / "tracking.json").read_text())["mlflow_run_id"]


def _history(client: MlflowClient, run_id: str, key: str) -> list[tuple[int, float]]:
    metrics = sorted(client.get_metric_history(run_id, key), key=lambda m: (m.timestamp, m.step))
    return [(m.step, m.value) for m in metrics]


def _last_per_step(history: list[tuple[int, float]]) -> dict[int, float]:
    return dict(history)  # later entries win: how readers must read a resumed run


class _Kill:
    """A run hook that stops the run after step ``at`` (after its metrics line is written),
    like a SIGKILL: nothing after it runs."""

    def __init__(self, at: int):
        self.at = at

    def step_recorded(self, event) -> None:
        if event.record["step"] == self.at:
            raise KeyboardInterrupt


def test_a_tracked_run_has_params_metrics_artifacts_inputs_and_tags(write_spec, tmp_path, mlflow_store):
    pipeline = _fake(write_spec, "fake-basics")
    run = Run.start(pipeline, tmp_path / "run")
    trackers = start_tracking(run)
    run.hooks = trackers
    run.train()
    client = MlflowClient(mlflow_store)
    got = client.get_run(_run_id(tmp_path / "run"))
    assert got.info.status == "FINISHED" and got.info.run_name == "run"
    assert got.data.params["stages.pick.with.batch_size"] == "4" and got.data.params["run.steps"] == "6"
    assert got.data.tags["gfcr.pipeline"] == "golden" and got.data.tags["gfcr.stage.rollout"] == "generate.fake"
    assert got.data.tags["gfcr.run_dir"] == str((tmp_path / "run").resolve()) and got.data.tags["gfcr.seed"] == "0"
    assert got.data.tags.get("mlflow.source.git.commit") == git_commit(Path.cwd())
    records = RunDir(tmp_path / "run").read_metrics()
    assert _history(client, got.info.run_id, "groups_kept") == [(r["step"], r["groups_kept"]) for r in records]
    assert [s for s, _ in _history(client, got.info.run_id, "time.step_s")] == list(range(6))
    assert got.data.metrics["total.rollouts_generated"] == sum(r["rollouts_generated"] for r in records)
    names = {a.path for a in client.list_artifacts(got.info.run_id)}
    assert {"spec.yaml", "summary.json", "metrics.jsonl", "lineage"} <= names and names & {"graph.svg", "graph.dot"}
    assert len(client.list_artifacts(got.info.run_id, "lineage")) == 12  # rollouts and control decisions
    [data] = got.inputs.dataset_inputs
    assert data.dataset.name == "arithmetic/train" and data.dataset.digest
    assert [(t.key, t.value) for t in data.tags] == [("mlflow.data.context", "training")]
    assert json.loads(data.dataset.profile)["num_rows"] == 50
    assert got.info.artifact_uri.startswith(Path(mlflow_store[len("sqlite:///"):]).parent.as_uri())


@pytest.mark.parametrize("flushed", [False, True], ids=["killed-before-a-flush", "killed-after-flushing"])
def test_resume_continues_the_same_mlflow_run(write_spec, tmp_path, mlflow_store, flushed):
    """Killed after step 4 (checkpoint at 4 steps), resumed: one MLflow run with every step; the
    re-run step 4 appears twice when it had been flushed, and its last value is the one that counts."""
    pipeline = _fake(write_spec, f"fake-resume-{flushed}")
    run = Run.start(pipeline, tmp_path / "run")
    tracker = MlflowTracker(pipeline.spec.tracking.mlflow, flush_seconds=0.0 if flushed else 1e9)
    run.hooks = (tracker, _Kill(at=4))
    with pytest.raises(KeyboardInterrupt):
        run.train()
    if flushed:
        tracker.close()  # what `gfcr run` does on its way out
    client = MlflowClient(mlflow_store)
    run_id = _run_id(tmp_path / "run")
    assert client.get_run(run_id).info.status == ("FAILED" if flushed else "RUNNING")

    resumed = Run.resume(tmp_path / "run")
    resumed.hooks = start_tracking(resumed)
    resumed.train()
    got = client.get_run(run_id)
    assert got.info.status == "FINISHED" and got.data.tags["gfcr.resumes"] == "1"
    assert len(client.search_runs([got.info.experiment_id])) == 1
    history = _history(client, run_id, "rollouts_generated")
    assert [s for s, _ in history] == ([0, 1, 2, 3, 4, 4, 5] if flushed else [0, 1, 2, 3, 4, 5])
    records = RunDir(tmp_path / "run").read_metrics()
    assert _last_per_step(_history(client, run_id, "reward_mean")) == {r["step"]: r["reward_mean"] for r in records}


def test_a_changed_param_on_resume_becomes_a_tag(write_spec, tmp_path, mlflow_store):
    pipeline = _fake(write_spec, "fake-longer", "run.steps=2")
    run = Run.start(pipeline, tmp_path / "run")
    run.hooks = start_tracking(run)
    run.train()
    resumed = Run.resume(tmp_path / "run", steps=3)
    resumed.hooks = start_tracking(resumed)
    resumed.train()
    got = MlflowClient(mlflow_store).get_run(_run_id(tmp_path / "run"))
    assert got.data.params["run.steps"] == "2" and got.data.tags["gfcr.resumed.run.steps"] == "2 -> 3"


def test_an_ablation_cell_is_a_child_of_its_parent_run(write_spec, tmp_path, mlflow_store):
    settings = MlflowSpec(experiment="fake-ablation")
    parent, uri = create_parent_run(settings, "fake-ablation", "grid", tags={"gfcr.ablation": "yes"})
    pipeline = load_pipeline(write_spec(BASE), ["executor.kind=local", "run.steps=1"])
    tracker = MlflowTracker(settings, parent_run_id=parent, tags={"gfcr.variant": "n=4"})
    Run.start(pipeline, tmp_path / "cell", hooks=(tracker,)).train()
    finish_run(uri, parent)
    child = mlflow.search_runs(search_all_experiments=True, output_format="list",
                               filter_string=f"tags.`mlflow.parentRunId` = '{parent}'")
    assert [r.info.run_id for r in child] == [tracker.run_id]
    assert child[0].data.tags["gfcr.variant"] == "n=4"
    assert child[0].info.experiment_id == MlflowClient(uri).get_run(parent).info.experiment_id


def test_tracking_off_writes_nothing(write_spec, tmp_path):
    pipeline = load_pipeline(write_spec(BASE), ["executor.kind=local", "run.steps=1"])
    assert pipeline.spec.tracking.mlflow is None
    run = Run.start(pipeline, tmp_path / "run")
    assert start_tracking(run) == ()
    assert not (tmp_path / "run" / "tracking.json").exists()


def test_gfcr_run_quickstart_is_found_by_mlflow_search_and_resume_continues_it(tmp_path, mlflow_store, capfd):
    """Issue 5 item 1: `gfcr run pipelines/quickstart.yaml` (made small), then MLflow's own
    search API finds the run with its params, per-step metrics, lineage artifact and datasets;
    `gfcr resume` continues the same MLflow run. Neither prints warnings or MLflow log lines."""
    run_dir = tmp_path / "quick"
    small = [arg for kv in ("executor.kind=local", "stages.pick.with.batch_size=4", "stages.budget.with.n=4",
                            "eval.with.n=8", "eval.every=2") for arg in ("--set", kv)]
    result = cli.invoke(app, ["run", str(REPO / "pipelines/quickstart.yaml"), "--steps", "2", "--run-dir", str(run_dir),
                              *small])
    assert result.exit_code == 0, result.output
    printed = result.output
    runs = mlflow.search_runs(experiment_names=["quickstart"], output_format="list",
                              filter_string=f"tags.`gfcr.run_dir` = '{run_dir.resolve()}'")
    assert len(runs) == 1
    found, client = runs[0], MlflowClient(mlflow_store)
    assert f"MLflow run {found.info.run_id}" in result.output
    assert found.data.params["update.with.lr"] == "0.0003" and found.data.params["policy.model"] == "tiny-arith"
    assert found.data.tags["gfcr.stage.update"] == "update.grpo"
    for key in ("reward_mean", "update.grad_norm", "time.step_s", "tokens_generated"):
        assert [m.step for m in client.get_metric_history(found.info.run_id, key)] == [0, 1], key
    assert [a.path for a in client.list_artifacts(found.info.run_id, "lineage")] == \
        [f"lineage/{kind}-00000{i}.parquet" for kind in ("control", "step") for i in (0, 1)]
    assert {[t.value for t in d.tags][0] for d in found.inputs.dataset_inputs} == {"training", "eval"}

    result = cli.invoke(app, ["resume", str(run_dir), "--steps", "3"])
    assert result.exit_code == 0, result.output
    printed += result.output
    again = client.get_run(found.info.run_id)
    assert again.info.status == "FINISHED"
    assert [m.step for m in client.get_metric_history(found.info.run_id, "reward_mean")] == [0, 1, 2]
    # the final evaluation (step 2) of the first session, then step 2's own evaluation after resuming
    assert sorted(m.step for m in client.get_metric_history(found.info.run_id, "eval_accuracy")) == [0, 2, 2, 3]
    captured = capfd.readouterr()
    assert not NOISE.search(printed + captured.out + captured.err), printed + captured.err


def test_a_store_that_cannot_be_opened_stops_gfcr_run_before_the_run_directory_is_written(write_spec, tmp_path):
    spec = write_spec(BASE)
    result = cli.invoke(app, ["run", str(spec), "--run-dir", str(tmp_path / "run"),
                              "--set", "tracking.mlflow.uri=nosuchstore://x", "--set", "executor.kind=local"])
    assert result.exit_code == 2 and "cannot open the MLflow store nosuchstore://x" in result.output
    assert "fix: set `tracking.mlflow.uri`" in result.output and not (tmp_path / "run").exists()
