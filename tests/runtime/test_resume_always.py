"""Runs that can always be continued: a run stopped before its first checkpoint resumes from
step 0 (after a SIGKILL, too) to the metrics of an uninterrupted run; `gfcr run --run-dir` and
`gfcr resume` never send the user to each other; a resume that fails changes nothing in the
run directory. The fake pipeline of conftest.py, in-process: this is runtime logic."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from typer.testing import CliRunner

from gfcr.cli.main import app
from gfcr.graph import load_pipeline
from gfcr.runtime.loop.session import Run
from tests.conftest import BASE, REPO
from tests.killing import sigkill_after_step

cli = CliRunner()
SPEC = BASE.replace("run: {steps: 2}", "run: {steps: 5, checkpoint_every: 3}\nexecutor: {kind: local}")


class Stop(Exception):
    pass


class StopAfter:
    """A run hook that stops the run (as an error would) once step ``step`` is recorded."""

    def __init__(self, step: int):
        self.step = step

    def step_recorded(self, event):
        if event.record["step"] == self.step:
            raise Stop


def _metrics(run_dir: Path) -> list[dict]:
    return [{k: v for k, v in json.loads(line).items() if k != "time"}
            for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _files(run_dir: Path) -> dict[str, bytes]:
    """The run directory's files, but its lock's (who last held it: not run state)."""
    return {str(p.relative_to(run_dir)): p.read_bytes() for p in sorted(run_dir.rglob("*"))
            if p.is_file() and p.name != ".lock"}


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> list[dict]:
    root = tmp_path_factory.mktemp("full")
    (root / "spec.yaml").write_text(SPEC)
    Run.start(load_pipeline(root / "spec.yaml"), root / "run").train()
    return _metrics(root / "run")


def test_a_run_sigkilled_before_its_first_checkpoint_resumes_from_step_0(write_spec, tmp_path, uninterrupted):
    run_dir = tmp_path / "killed"
    sigkill_after_step(write_spec(SPEC), run_dir, 1, tmp_path)  # checkpoints come at steps 3 and 5
    assert not (run_dir / "checkpoints").exists() and len(_metrics(run_dir)) == 2
    run = Run.resume(run_dir)
    assert run.restarted and run.runner.step == 0
    assert run.train()["steps"] == 5
    assert _metrics(run_dir) == uninterrupted


def test_gfcr_resume_says_it_starts_again_from_step_0(write_spec, tmp_path, uninterrupted):
    run_dir = tmp_path / "stopped"
    with pytest.raises(Stop):
        Run.start(load_pipeline(write_spec(SPEC)), run_dir, hooks=(StopAfter(1),)).train()
    result = cli.invoke(app, ["resume", str(run_dir)])
    assert result.exit_code == 0, result.output
    assert "no checkpoint yet (stopped before its first one): running it again from step 0" in result.output
    assert _metrics(run_dir) == uninterrupted


def test_a_run_stopped_before_step_0_resumes_and_run_dir_points_at_resume(write_spec, tmp_path, uninterrupted):
    spec, run_dir = write_spec(SPEC), tmp_path / "new"
    Run.start(load_pipeline(spec), run_dir)  # spec.yaml and run.json written, then stopped
    again = cli.invoke(app, ["run", str(spec), "--run-dir", str(run_dir)])
    assert again.exit_code == 2 and f"continue that run with `gfcr resume {run_dir}`" in again.output
    result = cli.invoke(app, ["resume", str(run_dir)])  # ... which works
    assert result.exit_code == 0, result.output
    assert _metrics(run_dir) == uninterrupted


def test_run_dir_of_another_kind_is_not_sent_to_resume(write_spec, tmp_path):
    folder = tmp_path / "photos"
    folder.mkdir()
    (folder / "cat.jpg").write_bytes(b"\xff\xd8")
    result = cli.invoke(app, ["run", str(write_spec(SPEC)), "--run-dir", str(folder)])
    assert result.exit_code == 2
    assert "is not empty (and not a gfcr run directory)" in result.output and "gfcr resume" not in result.output


def test_a_resume_that_fails_changes_nothing_in_the_run_directory(write_spec, tmp_path):
    run_dir = tmp_path / "run"
    Run.start(load_pipeline(write_spec(SPEC), ["run.steps=3"]), run_dir).train()
    state = run_dir / "checkpoints" / "step-000003" / "stages" / "pick" / "state.json"
    data = bytearray(state.read_bytes())
    data[len(data) // 2] ^= 0xFF  # the manifest's sha256 no longer matches: found while loading
    state.write_bytes(bytes(data))
    before = _files(run_dir)
    result = cli.invoke(app, ["resume", str(run_dir), "--steps", "99", "--executor", "local"])
    assert result.exit_code == 2 and "is corrupt" in result.output, result.output
    assert _files(run_dir) == before  # spec.yaml still says 3 steps; metrics.jsonl untouched


def test_damaged_checkpoints_alone_are_refused_not_restarted(write_spec, tmp_path):
    run_dir = tmp_path / "run"
    Run.start(load_pipeline(write_spec(SPEC), ["run.steps=3"]), run_dir).train()
    (run_dir / "checkpoints" / "step-000003" / "manifest.json").write_text("{")
    before = _files(run_dir)
    result = cli.invoke(app, ["resume", str(run_dir)])
    assert result.exit_code == 2 and "has no complete checkpoint to resume from" in result.output, result.output
    assert _files(run_dir) == before


# killed at the one moment a run has an MLflow run that its directory does not name yet
KILLED_BEFORE_TRACKING_FILE = textwrap.dedent("""\
    import os, signal, sys
    import gfcr.tracking.mlflow_tracker as tracker
    from gfcr.graph import load_pipeline
    from gfcr.runtime.loop.session import Run

    def killed(path, text):
        os.kill(os.getpid(), signal.SIGKILL)

    tracker.write_text = killed
    tracker.start_tracking(Run.start(load_pipeline(sys.argv[1]), sys.argv[2]))
    """)


def test_a_run_killed_before_naming_its_mlflow_run_keeps_one_mlflow_run(write_spec, tmp_path, uninterrupted):
    from mlflow import MlflowClient

    spec = write_spec(SPEC.replace("tracking: {mlflow: null}", "tracking: {mlflow: {experiment: orphans}}"))
    run_dir = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-c", KILLED_BEFORE_TRACKING_FILE, str(spec), str(run_dir)],
                          env={**os.environ, "PYTHONPATH": str(REPO)}, timeout=300)
    assert proc.returncode == -signal.SIGKILL and not (run_dir / "tracking.json").exists()
    client = MlflowClient(os.environ["MLFLOW_TRACKING_URI"])
    experiment = client.get_experiment_by_name("orphans").experiment_id
    query = f"tags.`gfcr.run_dir` = '{run_dir.resolve()}'"
    assert [r.info.status for r in client.search_runs([experiment], query)] == ["RUNNING"]  # the orphan
    result = cli.invoke(app, ["resume", str(run_dir)])
    assert result.exit_code == 0, result.output
    runs = client.search_runs([experiment], query)
    assert [r.info.status for r in runs] == ["FINISHED"]  # the same MLflow run, continued
    assert json.loads((run_dir / "tracking.json").read_text())["mlflow_run_id"] == runs[0].info.run_id
    assert runs[0].data.params and runs[0].inputs.dataset_inputs
    assert _metrics(run_dir) == uninterrupted
