"""Connecting to Ray (a Ray this process already runs, ``executor.address``, or a local cluster
gfcr starts quietly and shuts down when the last run of this process using it ends), and the
capacity checks made before anything is placed, so that nothing waits on Ray forever."""

from __future__ import annotations

import logging
import math
import os
import threading
from typing import Any, Callable

import ray

from gfcr.errors import GfcrError
from gfcr.spec import Resources as Placement

# Set before a local cluster starts, so its processes inherit them: no usage-stats notice, and
# no FutureWarning about accelerator variables from each worker.
QUIET_ENV = {"RAY_USAGE_STATS_ENABLED": "0", "RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO": "0"}


def cluster_cpus(placement: Placement, trainers: Placement | None = None) -> int:
    """CPUs of a local cluster: this machine's, and at least the replicas' and trainer ranks' plus
    one for tasks."""
    ranks = trainers.replicas * trainers.cpus if trainers is not None else 0.0
    return max(os.cpu_count() or 1, math.ceil(placement.replicas * placement.cpus + ranks) + 1)


_CONNECTION = threading.Lock()
_users = 0  # runs of this process using a cluster that gfcr started (parallel ablation cells share it)


def connect(address: str | None, placement: Placement, trainers: Placement | None = None) -> Callable[[], None]:
    """Connect to Ray, or start a local cluster; returns the release to call when the run ends.

    A cluster gfcr started is shut down when the last run of this process using it releases
    it; a Ray someone else started in this process is left running."""
    global _users
    with _CONNECTION:
        if ray.is_initialized() and _users == 0:
            return lambda: None
        if not ray.is_initialized():
            _start(address, placement, trainers)
        _users += 1
    return _release


def _start(address: str | None, placement: Placement, trainers: Placement | None) -> None:
    for key, value in QUIET_ENV.items():
        os.environ.setdefault(key, value)
    quiet: dict[str, Any] = dict(log_to_driver=False, logging_level=logging.ERROR, namespace="gfcr")
    if address is not None:
        ray.init(address=address, **quiet)
    else:
        # "local": a new cluster even where `ray start` left one on this machine (ray.init would join it)
        ray.init(address="local", num_cpus=cluster_cpus(placement, trainers), include_dashboard=False, **quiet)


def _release() -> None:
    global _users
    with _CONNECTION:
        _users -= 1
        if _users == 0:
            ray.shutdown()


def check_capacity(placement: Placement, engine: bool, trainers: Placement | None = None) -> None:
    """Fail now, with the fix, where Ray would otherwise leave an actor or task pending forever:
    the engine replicas, the trainer ranks and one verification task must fit in what the
    cluster has free."""
    free = ray.available_resources()
    if trainers is not None:
        cpus, gpus = trainers.replicas * trainers.cpus, trainers.replicas * trainers.gpus
        if free.get("CPU", 0.0) < cpus or free.get("GPU", 0.0) < gpus:
            raise GfcrError(f"the Ray cluster has {free.get('CPU', 0.0):g} CPUs and {free.get('GPU', 0.0):g} GPUs "
                            f"free; the {trainers.replicas} trainer ranks need {cpus:g} CPUs and {gpus} GPUs\n"
                            "    fix: lower `resources` on the update, add nodes to the cluster, or stop what "
                            "holds its resources (`ray status` lists them)")
        free = {**free, "CPU": free.get("CPU", 0.0) - cpus, "GPU": free.get("GPU", 0.0) - gpus}
    cpus = (placement.replicas * placement.cpus if engine else 0.0) + 1.0
    gpus = placement.replicas * placement.gpus if engine else 0
    if free.get("CPU", 0.0) < cpus:
        raise GfcrError(f"the Ray cluster has {free.get('CPU', 0.0):g} CPUs free; the engine replicas need "
                        f"{cpus - 1:g} and verification 1 more\n    fix: lower `resources.replicas` or "
                        "`resources.cpus` on the generate stage, add nodes to the cluster, or stop what holds "
                        "its CPUs (`ray status` lists them)")
    if free.get("GPU", 0.0) < gpus:
        raise GfcrError(f"the Ray cluster has {free.get('GPU', 0.0):g} GPUs free; the engine replicas need {gpus}\n"
                        "    fix: lower `resources.gpus` or `resources.replicas` on the generate stage, or "
                        "connect to a cluster with free GPUs (`executor.address`)")


def task_slots(placement: Placement, engine: bool, trainers: Placement | None = None) -> int:
    """How many verification tasks can run at once beside the engine replicas and trainer ranks
    (counted before they start)."""
    reserved = placement.replicas * placement.cpus if engine else 0.0
    reserved += trainers.replicas * trainers.cpus if trainers is not None else 0.0
    return max(1, int(ray.available_resources().get("CPU", 1.0) - reserved))
