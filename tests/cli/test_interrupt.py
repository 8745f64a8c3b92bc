"""Ctrl-C on `gfcr run`: the run stops with exit code 130 and says where it stopped (the steps
recorded, the checkpoint a resume starts from) and the `gfcr resume` command, without a
traceback; the resume then finishes the run; nothing the run started is left running.

The signal goes to the whole process group, as a terminal's Ctrl-C does (the embedded Prefect
server's guard ignores it and goes with its parent). Real runs of the quickstart (tiny-arith),
one on the local executor (25 s) and one on the default, Prefect (70-100 s on 2 cores, marked
``slow``). Under Prefect the signal may land inside a task run, whose engine can turn it into an
error of its own; that still reads as the interruption (exit 130 and the same message).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from tests.conftest import REPO
from tests.killing import MARK_VAR, describe, kill_marked, left_running

SETTINGS = ["run.steps=40", "run.checkpoint_every=2", "stages.pick.with.batch_size=4", "data.with.n=200",
            "eval=null", "tracking.mlflow=null"]


def _gfcr(args: list[str], env: dict[str, str]) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "gfcr.cli.main", *args], cwd=REPO, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)


def _lines(path: Path) -> int:
    return len(path.read_text().splitlines()) if path.is_file() else 0


# the Prefect variant (the default executor) is `slow`: 70-100 s, an embedded server's start-up
@pytest.mark.parametrize("executor", ["local", pytest.param("prefect", marks=pytest.mark.slow)])
def test_ctrl_c_says_where_the_run_stopped_and_how_to_resume_it(executor, tmp_path):
    mark = uuid.uuid4().hex
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(REPO), MARK_VAR: mark,
           "PREFECT_HOME": str(tmp_path / "prefect")}
    run_dir = tmp_path / "run"
    sets = [arg for s in SETTINGS for arg in ("--set", s)]
    proc = _gfcr(["run", str(REPO / "pipelines" / "quickstart.yaml"), *sets, "--executor", executor,
                  "--run-dir", str(run_dir)], env)
    try:
        deadline = time.monotonic() + 300
        while _lines(run_dir / "metrics.jsonl") < 3:  # past its first checkpoint (step 2)
            assert proc.poll() is None, proc.communicate()
            assert time.monotonic() < deadline, "step 3 not reached in 300 s"
            time.sleep(0.05)
        os.killpg(proc.pid, signal.SIGINT)
        stdout, stderr = proc.communicate(timeout=120)
        assert proc.returncode == 130, (stdout, stderr)
        assert "Traceback" not in stderr, stderr
        said = " ".join(stderr.split())  # rich may wrap the message
        recorded = _lines(run_dir / "metrics.jsonl")
        assert f"interrupted: stopped after {recorded} of 40 steps" in said, stderr
        checkpoint = max(int(p.name.removeprefix("step-")) for p in (run_dir / "checkpoints").glob("step-*"))
        assert f"continues from its checkpoint of step {checkpoint}" in said, stderr
        assert f"gfcr resume {run_dir}" in said, stderr
        assert left_running(mark, within=30) == [], describe(left_running(mark, within=0))

        resumed = _gfcr(["resume", str(run_dir), "--steps", str(recorded + 2)], env)
        stdout, stderr = resumed.communicate(timeout=300)
        assert resumed.returncode == 0, (stdout, stderr)
        steps = [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
        assert steps == list(range(recorded + 2))  # from the checkpoint on, each step once
    finally:
        kill_marked(mark)
