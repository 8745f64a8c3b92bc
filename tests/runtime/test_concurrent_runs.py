"""Several runs at once on one machine (issue 31, item 1; must-show 2): 4 `gfcr run`s of
quickstart, started together in one working directory, on the Prefect runner (each with its
embedded server, all on one Prefect database under PREFECT_HOME) and tracked to the default
MLflow store (``sqlite:///mlflow.db`` there). All finish; each has its own run directory with
every step's metrics; MLflow has 4 FINISHED runs with every step's metrics; Prefect's database
has 4 COMPLETED flow runs of the flow ``quickstart``, one per run directory.

Slow: 4 real policies and 4 Prefect servers on the machine at once. The same 4 commands and
checks, run by hand on 2 cores shared with other jobs (load average 24 to 39), took 1612 s; on a
quiet machine expect a few minutes."""

from __future__ import annotations

import json
import os
import sqlite3
import subprocess
import sys

import pytest

from tests.conftest import REPO

STEPS = 3
SETTINGS = [f"run.steps={STEPS}", "stages.pick.with.batch_size=4", "eval.every=2", "eval.with.n=16"]


@pytest.mark.slow
def test_four_runs_started_together_share_the_mlflow_store_and_the_prefect_database(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1", "PREFECT_HOME": str(tmp_path / "prefect")}
    env.pop("MLFLOW_TRACKING_URI", None)  # the default store: mlflow.db in the working directory
    env.pop("PREFECT_API_URL", None)  # each run's embedded server
    sets = [a for s in SETTINGS for a in ("--set", s)]
    runs = [subprocess.Popen([sys.executable, "-m", "gfcr.cli.main", "run", str(REPO / "pipelines" / "quickstart.yaml"),
                              *sets], cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            for _ in range(4)]
    outputs = [run.communicate(timeout=1800)[0] for run in runs]
    assert [run.returncode for run in runs] == [0] * 4, "\n\n".join(o[-2000:] for o in outputs)

    run_dirs = sorted((tmp_path / "runs").iterdir())
    assert len(run_dirs) == 4
    for run_dir in run_dirs:
        steps = [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
        assert steps == list(range(STEPS)) and (run_dir / "summary.json").is_file()

    from mlflow import MlflowClient

    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    tracked = client.search_runs([client.get_experiment_by_name("quickstart").experiment_id])
    assert sorted(r.data.tags["gfcr.run_dir"] for r in tracked) == [str(d.resolve()) for d in run_dirs]
    assert all(r.info.status == "FINISHED" for r in tracked)
    for r in tracked:
        history = client.get_metric_history(r.info.run_id, "rollouts_generated")
        assert sorted({m.step for m in history}) == list(range(STEPS))

    with sqlite3.connect(tmp_path / "prefect" / "prefect.db") as db:
        flow_runs = db.execute("SELECT flow_run.name, flow_run.state_type FROM flow_run JOIN flow "
                               "ON flow.id = flow_run.flow_id WHERE flow.name = 'quickstart'").fetchall()
    assert sorted(flow_runs) == [(d.name, "COMPLETED") for d in run_dirs]
