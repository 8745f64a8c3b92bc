"""A full disk under a run (issue 31, item 4): the write that fails leaves the previous
consistent state (metrics whole lines, the older checkpoints, no half-written file), the run
stops with exit 1 saying what failed and how much space it needed, and `gfcr resume` (once there
is space) ends with the metrics of an uninterrupted run.

How the fault is injected, in a `gfcr run` subprocess of the fake-engine example:
- ENOSPC: ``os.fsync`` fails with ENOSPC ("No space left on device") for the files of one write
  site (the metrics file, a lineage file, a file of a checkpoint being built, a stage's own state
  among them). fsync is where a full disk is reported for data already buffered (delayed
  allocation), so the real error path of each write site runs; a tiny filesystem cannot be
  mounted unprivileged here.
- EFBIG, raised by the kernel: the run's file size limit (RLIMIT_FSIZE, as ``ulimit -f``) set
  below the size of a lineage file, so a real write of pyarrow's fails part way.
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.conftest import REPO

FAKE = REPO / "pipelines" / "examples" / "fake_dapo.yaml"
RUN = ["run", str(FAKE), "--run-dir", "run", "--executor", "local", "--set", "run.steps=4",
       "--set", "run.checkpoint_every=2"]

# gfcr, with os.fsync failing (ENOSPC) for the files whose path matches argv[1], from its argv[2]-th such call
WRAPPER = textwrap.dedent("""\
    import errno, fnmatch, os, sys
    pattern, nth = sys.argv[1], int(sys.argv[2])
    real_fsync, seen = os.fsync, [0]

    def fsync(fd):
        path = os.readlink(f"/proc/self/fd/{fd}")
        if fnmatch.fnmatch(path, pattern):
            seen[0] += 1
            if seen[0] >= nth:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real_fsync(fd)

    os.fsync = fsync
    from gfcr.cli.main import app
    sys.argv = ["gfcr", *sys.argv[3:]]
    app()
    """)


def _env() -> dict:
    return {**os.environ, "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1"}


def _gfcr(cwd: Path, args: list[str], wrapper: list[str] | None = None, **kwargs) -> subprocess.CompletedProcess:
    head = [sys.executable, "-c", WRAPPER, *wrapper] if wrapper else [sys.executable, "-m", "gfcr.cli.main"]
    return subprocess.run(head + args, cwd=cwd, env=_env(), capture_output=True, text=True, timeout=300, **kwargs)


def _metrics(run_dir: Path) -> list[dict]:
    return [{k: v for k, v in json.loads(line).items() if k != "time"}
            for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> list[dict]:
    """The same run, uninterrupted and in-process (a second: no model)."""
    from gfcr.graph import load_pipeline
    from gfcr.runtime.loop.session import Run

    run_dir = tmp_path_factory.mktemp("reference") / "run"
    Run.start(load_pipeline(FAKE, ["executor.kind=local", "run.steps=4", "run.checkpoint_every=2"]), run_dir).train()
    return _metrics(run_dir)


def _resume(run_dir: Path) -> None:
    from gfcr.runtime.loop.session import Run

    Run.resume(run_dir).train()


SLOW = pytest.mark.slow  # each case is a `gfcr run` subprocess (about 10 s on a quiet machine); one stays in the default run


@pytest.mark.parametrize("site, pattern, nth, says, steps_recorded, checkpoints", [
    pytest.param("metrics", "*/run/metrics.jsonl", 4, "writing the metrics of step 3 failed", 3, ["step-000002"],
                 marks=SLOW),
    pytest.param("lineage", "*/run/lineage/.step-000003.parquet.*", 1, "writing the lineage of step 3 failed", 4,
                 ["step-000002"], marks=SLOW),
    ("checkpoint", "*/run/checkpoints/.step-000004.*.tmp/stages/pick/state.json", 1,
     "writing the checkpoint of step 4 failed", 4, ["step-000002"]),
])
def test_enospc_at_a_write_site_stops_the_run_with_exit_1_and_the_state_before_it(
        reference, tmp_path, site, pattern, nth, says, steps_recorded, checkpoints):
    done = _gfcr(tmp_path, RUN, wrapper=[pattern, str(nth)])
    assert done.returncode == 1, done.stdout + done.stderr
    assert says in done.stderr and "No space left on device" in done.stderr and "it needed about" in done.stderr
    assert "free there" in done.stderr and f"gfcr resume {Path('run')}" in done.stderr
    assert "Traceback" not in done.stderr
    run_dir = tmp_path / "run"
    assert _metrics(run_dir) == reference[:steps_recorded]  # whole lines only: none cut mid-way
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == checkpoints  # no partial copy left
    assert not [p for p in (run_dir / "lineage").iterdir() if p.name.startswith(".")]
    _resume(run_dir)  # once there is space: as if uninterrupted
    assert _metrics(run_dir) == reference


@SLOW
def test_a_file_size_limit_hit_by_the_kernel_stops_the_run_the_same_way(reference, tmp_path):
    """RLIMIT_FSIZE of 8 KB: a step's lineage file (about 10 KB) fails in pyarrow's write with
    EFBIG; the metrics, spec and run files stay under it."""
    limit = 8 * 1024

    def limited() -> None:
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    done = _gfcr(tmp_path, RUN, preexec_fn=limited)
    assert done.returncode == 1, done.stdout + done.stderr
    assert "writing the lineage of step 0 failed: File too large" in done.stderr, done.stderr
    run_dir = tmp_path / "run"
    assert _metrics(run_dir) == reference[:1] and not list((run_dir / "lineage").iterdir())
    _resume(run_dir)  # once there is space: as if uninterrupted
    assert _metrics(run_dir) == reference
