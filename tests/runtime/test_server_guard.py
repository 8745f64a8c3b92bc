"""A SIGKILLed run leaves nothing running: its embedded Prefect server dies with it
(gfcr.runtime.loop.server_guard). Processes are found by a mark in their environment that only
these tests set (tests/killing.py), so nothing unrelated is ever looked at or signalled."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
import uuid

import pytest

from gfcr.runtime.loop.server_guard import guards_available
from tests.conftest import BASE, REPO
from tests.killing import MARK_VAR, describe, kill_marked, left_running, marked_processes

pytestmark = pytest.mark.skipif(not guards_available(), reason="guards need Linux pidfds")

# a parent that starts a long-lived "server" (any process will do) and guards it
PARENT = textwrap.dedent("""\
    import subprocess, sys, time
    from gfcr.runtime.loop.server_guard import start_guard
    server = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    start_guard(server.pid)
    print(server.pid, flush=True)
    if sys.argv[1] == "stop":  # the server ends on its own: the guard must end too
        server.kill(); server.wait()
    time.sleep(600)
    """)


def _env(mark: str) -> dict[str, str]:
    return {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(REPO), MARK_VAR: mark}


def test_the_guarded_process_dies_when_its_parent_is_sigkilled():
    mark = f"guard-{uuid.uuid4().hex}"
    parent = subprocess.Popen([sys.executable, "-c", PARENT, "kill"], env=_env(mark), stdout=subprocess.PIPE,
                              text=True)
    try:
        server = int(parent.stdout.readline())
        assert server in marked_processes(mark)
        parent.send_signal(signal.SIGKILL)  # the parent only: the server is re-parented, as after a real kill
        parent.wait()
        remaining = left_running(mark, within=10)
        assert remaining == [], describe(remaining)
    finally:
        kill_marked(mark)


def test_the_guard_ends_when_the_server_ends_and_the_parent_lives_on():
    mark = f"guard-{uuid.uuid4().hex}"
    parent = subprocess.Popen([sys.executable, "-c", PARENT, "stop"], env=_env(mark), stdout=subprocess.PIPE,
                              text=True)
    try:
        parent.stdout.readline()
        remaining = left_running(mark, within=10)
        assert remaining == [parent.pid], describe(remaining)  # the guard is gone; the parent is untouched
    finally:
        parent.kill()
        parent.wait()
        kill_marked(mark)


RUN = textwrap.dedent("""\
    import sys, time
    from gfcr.graph import load_pipeline
    from gfcr.runtime.loop.session import Run

    class Stall:
        def step_recorded(self, event):
            if event.record["step"] == 1:
                open(sys.argv[3], "w").close()
                time.sleep(600)

    Run.start(load_pipeline(sys.argv[1]), sys.argv[2], hooks=(Stall(),)).train()
    """)


def test_a_sigkilled_prefect_run_leaves_no_server_running(write_spec, tmp_path):
    spec = write_spec(BASE.replace("run: {steps: 2}", "run: {steps: 50}"))  # executor: prefect, the default
    mark, stalled = f"prefect-{uuid.uuid4().hex}", tmp_path / "stalled"
    proc = subprocess.Popen([sys.executable, "-c", RUN, str(spec), str(tmp_path / "run"), str(stalled)],
                            env=_env(mark))
    try:
        deadline = time.monotonic() + 300
        while not stalled.exists():
            assert proc.poll() is None, "the run ended before step 1"
            assert time.monotonic() < deadline, "step 1 not reached"
            time.sleep(0.05)
        servers = [line for line in describe(marked_processes(mark)) if "prefect.server" in line]
        assert servers, "the run started no embedded Prefect server: nothing was tested"
        proc.send_signal(signal.SIGKILL)  # the run's process only, as the kernel's OOM killer would
        proc.wait()
        started = time.monotonic()
        remaining = left_running(mark, within=15)
        assert remaining == [], describe(remaining)
        print(f"server gone {time.monotonic() - started:.1f} s after the kill")
    finally:
        kill_marked(mark)
