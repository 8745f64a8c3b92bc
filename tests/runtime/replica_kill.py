"""TEST-ONLY fault injection for engine replicas on Ray (``tests/runtime/test_ray_faults.py``,
``benchmarks/replica_restart.py``): SIGKILL a replica's process by its pid while a generate call
runs on it."""

from __future__ import annotations

import os
import signal
import time

import ray


class KillsInFlight:
    """TEST-ONLY: stands in for replica ``index``'s actor handle in ``group``; its ``at_call``-th
    ``generate`` SIGKILLs the replica's process (found by its pid, from the actor) while the call
    runs on it, then puts the real handle back. Other calls and methods pass through."""

    def __init__(self, group, index: int, at_call: int, delay_s: float = 0.3):
        self.group, self.index, self.handle = group, index, group.replicas[index]
        self.at_call, self.delay_s = at_call, delay_s
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
        pid = ray.get(self.handle.process.remote())[1]
        ref = self.handle.generate.remote(*args)
        time.sleep(self.delay_s)  # under way: 64 rows of up to 8 tokens take the replica longer
        self.killed_in_flight = not ray.wait([ref], timeout=0)[0]
        os.kill(pid, signal.SIGKILL)
        self.group.replicas[self.index] = self.handle
        return ref
