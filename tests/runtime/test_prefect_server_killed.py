"""The embedded Prefect server SIGKILLed under a run (issue 31, item 3): the run's supervisor
starts it again on the same port and database, the run finishes with the metrics of an
uninterrupted run, the flow run is COMPLETED, and nothing is left running afterwards.
Processes are found by a mark in their environment (tests/killing.py)."""

from __future__ import annotations

import json
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

pytestmark = pytest.mark.skipif(not guards_available(), reason="the supervisor comes with the guard: Linux pidfds")

DRIVER = textwrap.dedent("""\
    import sys, time
    from pathlib import Path
    from gfcr.graph import load_pipeline
    from gfcr.runtime import server_guard
    from gfcr.runtime.loop.session import Run

    work = Path(sys.argv[3])

    class Pause:  # the test kills the server while the run waits here
        def step_recorded(self, event):
            if event.record["step"] == 3:
                (work / "at-3").write_text("")
                while not (work / "go-3").exists():
                    time.sleep(0.05)

    Run.start(load_pipeline(sys.argv[1]), sys.argv[2], hooks=(Pause(),)).train()
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterName

    with get_client(sync_client=True) as client:
        runs = client.read_flow_runs(flow_run_filter=FlowRunFilter(name=FlowRunFilterName(any_=[Path(sys.argv[2]).name])))
    print("FLOW", [r.state.type.value for r in runs], "RESTARTED", server_guard.restarts, flush=True)
    """)


def _servers(mark: str) -> list[int]:
    return [pid for pid, line in zip(marked_processes(mark), describe(marked_processes(mark)))
            if "prefect.server" in line]


def _without_time(path):
    return [{k: v for k, v in json.loads(line).items() if k != "time"} for line in path.read_text().splitlines()]


@pytest.mark.slow  # a Prefect run with two server starts: about a minute, more on a busy machine
def test_a_sigkilled_embedded_prefect_server_is_started_again_and_the_run_finishes_exactly(write_spec, tmp_path):
    spec = write_spec(BASE.replace("run: {steps: 2}", "run: {steps: 8, checkpoint_every: 2}"))
    work, mark = tmp_path / "work", f"prefect-killed-{uuid.uuid4().hex}"
    work.mkdir()
    (work / "driver.py").write_text(DRIVER)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(REPO), MARK_VAR: mark}
    proc = subprocess.Popen([sys.executable, str(work / "driver.py"), str(spec), str(tmp_path / "run"), str(work)],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 400
        while not (work / "at-3").exists():
            assert proc.poll() is None, proc.communicate()[0]
            assert time.monotonic() < deadline, "step 3 not reached"
            time.sleep(0.05)
        servers = _servers(mark)
        assert len(servers) == 1, describe(marked_processes(mark))
        os.kill(servers[0], signal.SIGKILL)  # the server only, by its pid; the run lives on
        (work / "go-3").write_text("")
        started = time.monotonic()
        output = proc.communicate(timeout=500)[0]
        print(f"the run ended {time.monotonic() - started:.1f} s after the server was killed")
        assert proc.returncode == 0, output
        flow = next(line for line in output.splitlines() if line.startswith("FLOW"))
        assert "FLOW ['COMPLETED'] RESTARTED [" in flow, output
        assert str(servers[0]) not in flow.split("RESTARTED")[1]  # a new server, not the killed one
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        remaining = left_running(mark, within=15)
        kill_marked(mark)
    assert remaining == [], describe(remaining)  # the restarted server and its guard ended with the run

    from gfcr.graph import load_pipeline
    from gfcr.runtime.loop.session import Run

    Run.start(load_pipeline(spec, ["executor.kind=local"]), tmp_path / "uninterrupted").train()
    assert _without_time(tmp_path / "run" / "metrics.jsonl") == _without_time(tmp_path / "uninterrupted" / "metrics.jsonl")
