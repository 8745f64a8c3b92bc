"""A normal `gfcr run`, with its defaults (the Prefect runner, MLflow tracking), prints no
traceback, no warning and no log noise from the libraries under it (issue 4, item 6)."""

from __future__ import annotations

import os
import re
import subprocess
import sys

from tests.conftest import REPO

NOISE = re.compile(r"traceback|warning|error|exception|deprecat|telemetry|\| (INFO|DEBUG)\s+\|", re.IGNORECASE)


def test_a_normal_run_prints_no_traceback_warning_or_log_lines(tmp_path):
    env = {**os.environ, "PREFECT_HOME": str(tmp_path / "prefect"), "COLUMNS": "120",
           "MLFLOW_TRACKING_URI": f"sqlite:///{tmp_path / 'mlflow.db'}"}
    cmd = [sys.executable, "-m", "gfcr.cli.main", "run", str(REPO / "pipelines" / "quickstart.yaml"), "--steps", "2",
           "--run-dir", str(tmp_path / "run"), "--set", "eval.every=2", "--set", "eval.with.n=16"]
    done = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    output = done.stdout + done.stderr
    assert done.returncode == 0, output
    assert "eval accuracy after" in done.stdout  # it did run, and said so
    noisy = [line for line in output.splitlines() if NOISE.search(line)]
    assert noisy == [], "\n".join(noisy)
