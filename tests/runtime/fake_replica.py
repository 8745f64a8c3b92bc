"""FAKE ENGINE REPLICA, for the runtime logic of ``gfcr.runtime.ray.restarts`` only
(``tests/runtime/test_ray_faults.py``): ``EngineReplica``'s actor interface without a model, in a
module that imports little, so that Ray starts and restarts it in about a second."""

from __future__ import annotations

import os
import time
from pathlib import Path

import ray

from gfcr.runtime.ray.restarts import require_current, restarted_by_ray


class FakeReplica:
    """``generate`` answers ``(replica, request, version)`` per request after ``seconds``, touching
    ``started/<replica>-<pid>`` first so that a test can kill it while the call runs; like the real
    replica it refuses to generate before the driver has loaded its weights after a restart."""

    def __init__(self, name: str, started: str, seconds: float):
        self.name, self.started, self.seconds = name, Path(started), seconds
        self.version, self.restarted = 0, restarted_by_ray()

    def process(self) -> tuple[str, int]:
        return ray.get_runtime_context().get_worker_id(), os.getpid()

    def generate(self, requests: list, max_in_flight: int | None, version: int) -> list[tuple]:
        require_current(self.restarted, self.version, version, self.name)
        (self.started / f"{self.name}-{os.getpid()}").touch()
        time.sleep(self.seconds)
        return [(self.name, request, self.version) for request in requests]

    def load_weights(self, weights: dict, version: int) -> int:
        assert set(weights) == {"weight", "bias"}  # the driver's state_dict
        self.version, self.restarted = version, False
        return version
