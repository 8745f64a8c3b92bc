"""Kill a real run mid-way, as a SIGKILL would: shared by the resume tests of stateful stages."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

_KILLER = textwrap.dedent("""\
    import sys, time
    from gfcr.graph import load_pipeline
    from gfcr.runtime.loop.session import Run

    class Stall:
        def step_recorded(self, event):
            if event.record["step"] == int(sys.argv[4]):  # its checkpoint written, the next step not yet run
                open(sys.argv[3], "w").close()
                time.sleep(120)

    Run.start(load_pipeline(sys.argv[1]), sys.argv[2], hooks=(Stall(),)).train()
    """)


def sigkill_after_step(spec: Path, run_dir: Path, step: int, work: Path, timeout: float = 300) -> None:
    """Start ``spec`` in a subprocess writing ``run_dir``, and SIGKILL it (and its children:
    an embedding thread, an embedded Prefect server) once step ``step`` has been recorded."""
    script, marker = work / "killer.py", work / "stalled"
    script.write_text(_KILLER)
    proc = subprocess.Popen([sys.executable, str(script), str(spec), str(run_dir), str(marker), str(step)],
                            env={**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(REPO)},
                            start_new_session=True)
    deadline = time.monotonic() + timeout
    while not marker.exists():
        assert proc.poll() is None, f"the run ended before step {step}"
        assert time.monotonic() < deadline, f"step {step} not reached in {timeout} s"
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


# --- processes a test started, found by a mark in their environment ---------------------------

MARK_VAR = "GFCR_TEST_PROCESS_MARK"  # every process a marked test starts, and their children, inherit it


def marked_processes(mark: str) -> list[int]:
    """The live processes (zombies excluded) whose environment holds ``MARK_VAR=mark``: those a test
    started with that mark and everything they started (Prefect's server, its guard, Ray)."""
    needle = f"{MARK_VAR}={mark}".encode()
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            if needle not in (entry / "environ").read_bytes().split(b"\0"):
                continue
            if (entry / "stat").read_text().rsplit(")", 1)[1].split()[0] == "Z":
                continue
        except OSError:  # gone meanwhile, or not ours to read
            continue
        found.append(int(entry.name))
    return sorted(found)


def describe(pids: list[int]) -> list[str]:
    """``pid: command line`` of each process, for an assertion message."""
    lines = []
    for pid in pids:
        try:
            cmd = (Path("/proc") / str(pid) / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            cmd = "(gone)"
        lines.append(f"{pid}: {cmd[:200]}")
    return lines


def left_running(mark: str, within: float) -> list[int]:
    """The marked processes still running after waiting up to ``within`` seconds for them to end."""
    deadline = time.monotonic() + within
    while (pids := marked_processes(mark)) and time.monotonic() < deadline:
        time.sleep(0.1)
    return pids


def kill_marked(mark: str) -> None:
    """SIGKILL whatever still carries ``mark`` (a test's cleanup after a failed assertion)."""
    for pid in marked_processes(mark):
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass
