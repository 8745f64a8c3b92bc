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
    from gfcr.runtime.session import Run

    class Stall:
        def after_step(self, record):
            if record["step"] == int(sys.argv[4]):  # its checkpoint written, the next step not yet run
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
