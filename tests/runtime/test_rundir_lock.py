"""One process at a time in a run directory (issue 31, item 1): a second `gfcr run` or
`gfcr resume` on a run directory in use is refused at once (exit 2, naming the holder), and a
lock left by a SIGKILLed holder is taken over. The holder is a real other process holding the
real lock (``lock_run_dir``); the refused commands are the real CLI in subprocesses."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest

from gfcr.runtime.store.rundir import new_run_dir
from gfcr.runtime.store.rundir_lock import LOCK_NAME, RunDirLocked, lock_run_dir, release_run_dir
from tests.conftest import REPO

GFCR = [sys.executable, "-m", "gfcr.cli.main"]
FAKE = REPO / "pipelines" / "examples" / "fake_dapo.yaml"
HOLDER = "import sys, time; from gfcr.runtime.store.rundir_lock import lock_run_dir; lock_run_dir(sys.argv[1]); " \
         "print('locked', flush=True); time.sleep(600)"


def _env() -> dict:
    return {**os.environ, "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1"}


@pytest.fixture
def finished_run(tmp_path):
    """A finished fake-engine run directory (in-process, about a second: no model), resumable to more steps."""
    from gfcr.graph import load_pipeline
    from gfcr.runtime.loop.session import Run

    run_dir = tmp_path / "run"
    Run.start(load_pipeline(FAKE, ["run.steps=2", "executor.kind=local"]), run_dir).train()
    return run_dir


def _hold(run_dir) -> subprocess.Popen:
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(run_dir)], env=_env(), stdout=subprocess.PIPE,
                              text=True)
    assert holder.stdout.readline().strip() == "locked"
    return holder


def test_a_run_directory_in_use_is_refused_at_once_and_a_killed_holders_lock_is_taken_over(finished_run, tmp_path):
    from gfcr.runtime.loop.session import Run

    holder = _hold(finished_run)
    try:
        for args in (["resume", str(finished_run), "--steps", "3"],
                     ["run", str(FAKE), "--run-dir", str(finished_run), "--executor", "local"]):
            done = subprocess.run(GFCR + args, env=_env(), cwd=tmp_path, capture_output=True, text=True, timeout=120)
            assert done.returncode == 2, done.stdout + done.stderr
            assert f"is in use by process {holder.pid}" in done.stderr and f"kill {holder.pid}" in done.stderr
            assert "Traceback" not in done.stderr
        assert len((finished_run / "metrics.jsonl").read_text().splitlines()) == 2  # nothing was touched
        with pytest.raises(RunDirLocked, match=f"process {holder.pid}"):
            Run.resume(finished_run, steps=3)
    finally:
        os.kill(holder.pid, signal.SIGKILL)  # as a crash or an OOM kill would end it: no clean-up ran
        holder.wait()
    assert json.loads((finished_run / LOCK_NAME).read_text())["pid"] == holder.pid  # its note is still there
    Run.resume(finished_run, steps=3).train()  # the kernel dropped its lock: taken over at once
    assert len((finished_run / "metrics.jsonl").read_text().splitlines()) == 3
    assert json.loads((finished_run / LOCK_NAME).read_text())["pid"] == os.getpid()


def test_the_lock_is_reentrant_in_a_process_and_names_its_holder_to_others(tmp_path):
    lock = lock_run_dir(tmp_path / "run")
    try:
        assert lock_run_dir(tmp_path / "run") is lock
        probe = subprocess.run([sys.executable, "-c", "import sys; from gfcr.runtime.store.rundir_lock import lock_run_dir; "
                                "lock_run_dir(sys.argv[1])", str(tmp_path / "run")], env=_env(),
                               capture_output=True, text=True, timeout=60)
        assert probe.returncode == 1 and RunDirLocked.__name__ in probe.stderr
        assert f"in use by process {os.getpid()}" in probe.stderr
    finally:
        release_run_dir(tmp_path / "run")
    assert lock_run_dir(tmp_path / "run") is not lock  # released: taken afresh
    release_run_dir(tmp_path / "run")


def test_runs_started_in_the_same_second_get_their_own_directories(tmp_path):
    made = [new_run_dir("quickstart", tmp_path) for _ in range(4)]
    assert len(set(made)) == 4 and all(p.is_dir() for p in made)
