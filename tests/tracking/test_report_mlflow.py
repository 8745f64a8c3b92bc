"""`gfcr report --experiment`: runs read back from a real MLflow store (SQLite in a temporary
folder) give the same series, variants and table as their run directories."""

from __future__ import annotations

import json
import time
from dataclasses import replace
from pathlib import Path

import pytest
from mlflow.entities import Metric, Param
from typer.testing import CliRunner

from gfcr.cli.main import app
from gfcr.errors import GfcrError
from gfcr.graph import load_pipeline
from gfcr.runtime.loop.session import Run
from gfcr.spec.models import MlflowSpec
from gfcr.tracking.mlflow_store import connect, experiment_id
from gfcr.tracking.mlflow_tracker import MlflowTracker
from gfcr.tracking.mlflow_values import metric_values, spec_params
from gfcr.tracking.report import markdown_table, report_rows, series_from_mlflow, series_from_run_dirs
from tests.conftest import BASE
from tests.tracking.test_report import toy_runs, write_run

cli = CliRunner()


def log_like_the_tracker(client, experiment: str, path: Path, parent: str | None) -> str:
    """Log a run directory as ``MlflowTracker`` does (its module docstring): the resolved spec as
    params, each metrics line's numeric leaves at its step, the final evaluation at step = steps."""
    pipeline = load_pipeline(path / "spec.yaml")
    tags = {"gfcr.run_dir": str(path), "gfcr.seed": str(pipeline.spec.run.seed)}
    if parent:
        tags["mlflow.parentRunId"] = parent
    run_id = client.create_run(experiment, run_name=path.name, tags=tags).info.run_id
    params = spec_params(pipeline)
    client.log_batch(run_id, params=[Param(k, v) for k, v in params.items()])
    now = int(time.time() * 1000)
    records = [json.loads(line) for line in (path / "metrics.jsonl").read_text().splitlines()]
    metrics = [Metric(k, v, now, r["step"]) for r in records for k, v in metric_values(r).items()]
    summary = json.loads((path / "summary.json").read_text())
    metrics.append(Metric("eval_accuracy", summary["eval_accuracy_after"], now, summary["steps"]))
    client.log_batch(run_id, metrics=metrics)
    client.set_terminated(run_id)
    return run_id


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    """The toy runs as children of one ablation parent, plus one loose run, in experiment `toy`."""
    base = tmp_path_factory.mktemp("store")
    uri = f"sqlite:///{base / 'mlflow.db'}"
    client = connect(uri)
    exp = experiment_id(client, uri, "toy")
    parent = client.create_run(exp, run_name="ablation").info.run_id
    dirs = toy_runs(base / "runs")
    children = [log_like_the_tracker(client, exp, path, parent) for path in dirs]
    loose = write_run(base / "loose", seed=7, n=2, tokens=[5, 5], evals={0: 0.5}, final=0.5)
    log_like_the_tracker(client, exp, loose, None)
    return {"uri": uri, "client": client, "parent": parent, "children": children, "dirs": dirs, "base": base}


def test_an_ablation_parent_s_children_give_the_run_directories_table(store, tmp_path):
    from_mlflow = series_from_mlflow("toy", parent_run_id=store["parent"], tracking_uri=store["uri"])
    from_dirs = series_from_run_dirs(store["dirs"])
    assert [s.source for s in from_mlflow] == store["children"]
    for a, b in zip(from_mlflow, from_dirs):
        assert (a.steps, a.evals, a.seed, a.run_dir) == (b.steps, b.evals, b.seed, b.run_dir)
        assert dict(a.params) == dict(b.params)
    rows = report_rows(from_mlflow, target=0.3)[1]
    assert rows == report_rows(from_dirs, target=0.3)[1]
    assert "| stages.budget.with.n=4 | 0, 1 | 0.350 (0.300-0.400) | 24 | 105 | 6.5 |" in markdown_table(rows, 0.3)


def test_without_parent_every_run_but_the_parent_is_reported(store):
    runs = series_from_mlflow("toy", tracking_uri=store["uri"])
    assert [r.name for r in runs] == ["a0", "a1", "b0", "loose"]  # oldest first; the parent has no steps


def test_the_last_value_logged_at_a_step_wins(store):
    """A resumed run logs the steps after its checkpoint again; the report reads the newer values."""
    client, child = store["client"], store["children"][2]
    client.log_metric(child, "tokens_generated", 1000.0, timestamp=int(time.time() * 1000) + 10_000, step=1)
    try:
        run = series_from_mlflow("toy", parent_run_id=store["parent"], tracking_uri=store["uri"])[2]
        assert [s.tokens_generated for s in run.steps] == [10, 1000, 10, 10]
    finally:  # the other tests see the store as it was
        client.log_metric(child, "tokens_generated", 10.0, timestamp=int(time.time() * 1000) + 20_000, step=1)


def test_a_variant_tag_labels_the_variant(store):
    runs = series_from_mlflow("toy", parent_run_id=store["parent"], tracking_uri=store["uri"])
    tagged = [replace(r, variant="baseline") if r.name.startswith("a") else r for r in runs]
    assert [row.variant for row in report_rows(tagged, 0.3)[1]] == ["baseline", "stages.budget.with.n=8"]


def test_an_unknown_experiment_suggests_the_near_name(store):
    with pytest.raises(GfcrError, match=r"(?s)no MLflow experiment `toyy` .*did you mean `toy`\?"):
        series_from_mlflow("toyy", tracking_uri=store["uri"])


def test_cli_report_from_an_experiment(store, tmp_path):
    result = cli.invoke(app, ["report", "--experiment", "toy", "--parent", store["parent"], "--tracking-uri",
                              store["uri"], "--target", "0.3"])
    assert result.exit_code == 0, result.output
    assert f"wrote {store['base'] / 'runs' / 'report' / 'index.html'}" in result.output  # beside gfcr.run_dir
    assert "| stages.budget.with.n=8 | 0 | 0.250 | not reached (0/1 seeds) |" in result.output


def test_a_parent_without_children_gives_no_runs_and_the_cli_says_so(store):
    lonely = store["client"].create_run(store["client"].get_experiment_by_name("toy").experiment_id).info.run_id
    assert series_from_mlflow("toy", parent_run_id=lonely, tracking_uri=store["uri"]) == []
    result = cli.invoke(app, ["report", "--experiment", "toy", "--parent", lonely, "--tracking-uri", store["uri"]])
    assert result.exit_code == 2 and f"has no child runs of {lonely} with step metrics" in result.output


def test_a_run_tracked_by_mlflow_tracker_reads_back_equal_to_its_directory(store, write_spec, tmp_path):
    """The real tracker on a fake-pipeline run (no model): what the report reads from MLflow is
    what the run directory holds."""
    uri = store["uri"]
    tracker = MlflowTracker(MlflowSpec(uri=uri, experiment="fake"), flush_seconds=0.0)
    pipeline = load_pipeline(write_spec(BASE), ["run.steps=3", "executor.kind=local"])
    Run.start(pipeline, tmp_path / "run", hooks=(tracker,)).train()
    [from_mlflow] = series_from_mlflow("fake", tracking_uri=uri)
    [from_dir] = series_from_run_dirs([tmp_path / "run"])
    assert [s.step for s in from_mlflow.steps] == [0, 1, 2] and from_mlflow.steps == from_dir.steps
    assert dict(from_mlflow.params) == dict(from_dir.params) and from_mlflow.seed == from_dir.seed == 0
