"""Engine replicas that die mid-step: restarted by Ray, given the current weights, their calls made again.

An engine replica (``gfcr.runtime.ray.executor.EngineReplica``) is a Ray actor created with
``max_restarts`` = ``executor.max_replica_restarts`` (2 by default). When its process dies (SIGKILL,
the kernel's OOM killer, a crash in a kernel), Ray starts a new process for it from the actor's
constructor, which loads the *initial* weights. Ray could also re-run the call that was in flight
(``max_task_retries``), but it would run on those initial weights; so the engine group re-runs it
itself, in three moves (``ReplicaRestarts.call``):

1. the call in flight fails with ``RayActorError`` (``ActorUnavailableError``: the actor is
   restarting); a replica that died between calls answers its next call from the new process, which
   refuses to generate before the driver has loaded its weights into it (``ReplicaBehind``);
2. the group waits for the replica to answer again, tells a restart by the new Ray worker id (each
   one counted: ``restarts``, and the step's ``ray.replica_restarts`` metric), and loads the
   driver's current weights into it (``catch_up``: the driver's ``state_dict`` at its policy
   version, through the object store, as ``sync_weights`` does);
3. it makes the same call again on the same replica: the same requests, each row seeded by itself
   (``row_seed``), so the replica samples the tokens it would have sampled, and the lineage (rollout
   ids, replicas) equals an undisturbed run's.

When Ray has used up the replica's restarts (``ActorDiedError``), or a restarted replica does not
answer within ``READY_TIMEOUT_S``, the call raises ``ReplicaLostError``: the CLI stops the run
(exit 1) and prints the ``gfcr resume`` that continues it from its newest checkpoint.

Checked against Ray 2.60 on a local cluster (``tests/runtime/test_ray_faults.py``): a call in
flight on a SIGKILLed actor fails with ``ActorUnavailableError``; a call made while it restarts
waits for it, or fails with ``ActorUnavailableError`` (``The actor is restarting``); once the
restarts are spent, every call fails with ``ActorDiedError``.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Callable

import ray

from gfcr.errors import ReplicaLostError

log = logging.getLogger(__name__)
READY_TIMEOUT_S = 600.0  # loading a model in a (re)started replica; a pending actor means the cluster is too small
POLL_S = 0.5  # between calls to a replica that Ray is restarting
STARTED_DIR_VARIABLE = "GFCR_TEST_REPLICA_STARTED_DIR"  # TEST-ONLY: see EngineReplica.generate


class ReplicaBehind(Exception):
    """Raised in a replica asked to generate before it holds the group's weights: Ray restarted it
    (its constructor loaded the initial weights), or its version is not the one the group expects.
    The group catches it (Ray raises it as a ``RayTaskError`` that is also a ``ReplicaBehind``)."""


def restarted_by_ray() -> bool:
    """Whether this process is a Ray actor that Ray restarted (False outside an actor: a replica
    built in-process, as a test does)."""
    if not ray.is_initialized():
        return False
    context = ray.get_runtime_context()
    return context.get_actor_id() is not None and context.was_current_actor_reconstructed


def require_current(restarted: bool, have: int, want: int | None, replica: str) -> None:
    """Refuse to generate on weights other than the group's (``ReplicaBehind``): called in the replica."""
    if restarted or (want is not None and have != want):
        why = "was restarted and holds its initial weights" if restarted else f"holds weights version {have}"
        raise ReplicaBehind(f"engine replica {replica} {why}; the group is at version {want}")


class ReplicaRestarts:
    """The restarts of K engine replicas in one run. ``workers[i]`` is the Ray worker id replica
    ``i`` last answered from (a new one means Ray restarted it); ``limit`` is the actors'
    ``max_restarts``, which Ray enforces."""

    def __init__(self, names: list[str], workers: list[str], limit: int):
        self.names, self.workers, self.limit = names, list(workers), limit
        self.restarts = [0] * len(names)  # per replica, in this run
        self.seconds: list[float] = []  # each restart's wait: from the failed call to the weights loaded
        self._untaken = 0  # since the last ``take``

    def call(self, replicas: list[Any], calls: dict[int, Callable[[Any], Any]],
             catch_up: Callable[[int], None]) -> dict[int, Any]:
        """``calls[i](replicas[i])`` (an ``ObjectRef``) for each ``i``, run at once; their results by
        ``i``. A replica that died under its call, or was restarted before it, is waited for, caught
        up (``catch_up(i)``: the current weights loaded into it) and called again."""
        done, pending = {}, dict(calls)
        while pending:
            refs = {i: call(replicas[i]) for i, call in pending.items()}
            for i, ref in refs.items():
                try:
                    done[i] = ray.get(ref)
                    del pending[i]
                except (ray.exceptions.RayActorError, ReplicaBehind) as exc:
                    self._revive(i, replicas[i], catch_up, exc)
        return done

    def take(self) -> int:
        """The restarts since the last call (the session records them once a step)."""
        taken, self._untaken = self._untaken, 0
        return taken

    def _revive(self, i: int, replica: Any, catch_up: Callable[[int], None], cause: BaseException) -> None:
        """Wait until replica ``i`` answers again (counting a restart if it answers from a new
        worker), then load the current weights into it; a death meanwhile starts over."""
        start, first_cause, restarted = time.monotonic(), cause, 0
        while True:
            worker = self._wait_alive(i, replica)
            if worker != self.workers[i]:
                self.workers[i] = worker
                self.restarts[i] += 1
                restarted += 1
            try:
                catch_up(i)
                break
            except ray.exceptions.RayActorError as exc:  # died again while loading the weights
                cause = exc
        if restarted:
            self._untaken += restarted
            self.seconds.append(time.monotonic() - start)
            log.warning("engine replica %s died (%s); Ray restarted it (%d of %d restarts in this run) and it has "
                        "the current weights again after %.1f s; its requests run again", self.names[i],
                        _first_line(first_cause), self.restarts[i], self.limit, self.seconds[-1])

    def _wait_alive(self, i: int, replica: Any) -> str:
        """The worker id replica ``i`` answers from once Ray has restarted it (at once if it lives)."""
        deadline = time.monotonic() + READY_TIMEOUT_S
        while True:
            try:
                worker, _pid = ray.get(replica.process.remote(), timeout=max(1.0, deadline - time.monotonic()))
                return worker
            except ray.exceptions.ActorDiedError as exc:  # Ray has spent the restarts: the actor is gone
                raise self._lost(i, exc) from exc
            except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError) as exc:  # restarting
                if time.monotonic() >= deadline:
                    raise self._lost(i, exc, f"did not answer within {READY_TIMEOUT_S:g}s of dying") from exc
                time.sleep(POLL_S)

    def _lost(self, i: int, cause: BaseException, how: str = "") -> ReplicaLostError:
        how = how or (f"died after {self.restarts[i]} restart(s) in this run, and "
                      f"`executor.max_replica_restarts` allows {self.limit}")
        return ReplicaLostError(
            f"engine replica {self.names[i]} is lost: it {how} (Ray: {_first_line(cause)})",
            "see why it died in Ray's worker logs (/tmp/ray/session_latest/logs/worker-*.err on its node; "
            "running out of memory is the usual cause: `dmesg`), then continue the run from its newest "
            "checkpoint with `gfcr resume RUN_DIR`; `executor.max_replica_restarts` in the spec allows "
            "more restarts")


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0] if text else ''}"
