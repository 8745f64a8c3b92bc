"""TEST-ONLY fault injection for engine replicas on Ray (``tests/runtime/test_ray_faults.py``,
``benchmarks/replica_restart.py``): SIGKILL a replica's process, by its pid, while a generate call
runs on it.

``started_dir`` sets the replicas' test-only hook (``GFCR_TEST_REPLICA_STARTED_DIR``: each
generate call leaves a file ``<replica>-<pid>`` as it starts); it must be set before the Ray
cluster starts, so that the replica processes inherit it."""

from __future__ import annotations

import os
import signal
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import ray

from gfcr.runtime.ray.restarts import STARTED_DIR_VARIABLE


class Tokens:
    """A runner hook: the token ids of every rollout the generate stage output, by rollout id."""

    def __init__(self):
        self.by_id: dict[str, tuple] = {}

    def after_stage(self, event) -> None:
        if event.stage_id == "rollout":
            self.by_id.update({r.rollout_id: tuple(r.response_token_ids) for r in event.output.rollouts()})


@contextmanager
def started_dir(path: Path) -> Iterator[Path]:
    """Set the replicas' hook to ``path`` for a cluster started inside the block."""
    previous = os.environ.get(STARTED_DIR_VARIABLE)
    os.environ[STARTED_DIR_VARIABLE] = str(path)
    try:
        yield path
    finally:
        if previous is None:
            del os.environ[STARTED_DIR_VARIABLE]
        else:
            os.environ[STARTED_DIR_VARIABLE] = previous


class KillsInFlight:
    """Stands in for replica ``index``'s actor handle in ``group``; its ``at_call``-th ``generate``
    SIGKILLs the replica's process as soon as the call has started on it (its file in ``started``
    appears), then puts the real handle back. Other calls and methods pass through."""

    def __init__(self, group, index: int, at_call: int, started: Path):
        self.group, self.index, self.handle = group, index, group.replicas[index]
        self.at_call, self.started = at_call, Path(started)
        self.calls, self.killed_in_flight = 0, None
        group.replicas[index] = self

    def __getattr__(self, name: str):
        return getattr(self.handle, name)

    @property
    def generate(self) -> "KillsInFlight":
        return self

    def remote(self, *args):
        self.calls += 1
        if self.calls != self.at_call:
            return self.handle.generate.remote(*args)
        name, pid = f"ray-{self.index}", ray.get(self.handle.process.remote())[1]
        mark = self.started / f"{name}-{pid}"
        mark.unlink(missing_ok=True)
        ref = self.handle.generate.remote(*args)
        deadline = time.monotonic() + 120
        while not mark.exists() and time.monotonic() < deadline:
            time.sleep(0.005)
        self.killed_in_flight = mark.exists() and not ray.wait([ref], timeout=0)[0]
        os.kill(pid, signal.SIGKILL)
        self.group.replicas[self.index] = self.handle
        return ref
