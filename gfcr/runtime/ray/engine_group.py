"""The engine replicas (``EngineReplica``, the body of a Ray actor each) and the Engine protocol
over them (``RayEngineGroup``): requests split across the replicas by rows and gathered in
order, weights synced by ``executor.weight_sync`` (``collective``, falling back to the object
store), replicas that died restarted and caught up (``gfcr.runtime.ray.restarts``)."""

from __future__ import annotations

import logging
import os
import time
from dataclasses import replace
from typing import Any, Callable, Literal, Sequence

import ray

from gfcr.errors import GfcrError
from gfcr.runtime.ray.collective import SYNC_TIMEOUT_S, CollectiveSync, SyncRecord, WeightSync
from gfcr.runtime.ray.placement import Reservation, placement_bundles, reserve
from gfcr.runtime.ray.restarts import (
    READY_TIMEOUT_S, STARTED_DIR_VARIABLE, ReplicaRestarts, require_current, restarted_by_ray,
)
from gfcr.runtime.weights.collective import WeightReceiver, WeightSyncError, check_layout, layout_of
from gfcr.spec import PolicySpec
from gfcr.spec import Resources as Placement
from gfcr.stages.resources import (
    Completion, GenerationRequest, InFlightController, Policy, Scored, ScoreRequest, policy_weights,
)

MAX_GROUP_FAILURES = 2  # collective syncs failed in a row before the run keeps to the object store
log = logging.getLogger(__name__)


def replica_name(index: int) -> str:
    return f"ray-{index}"


def split_requests(requests: Sequence[GenerationRequest], k: int) -> list[range]:
    """K contiguous, in-order index ranges of ``requests``, balanced by rows (``sum(n)``); a
    request's ``n`` samples stay together. Request ``i`` goes to the part holding the middle
    of its rows, so equal requests split evenly; some ranges may be empty."""
    total = sum(r.n for r in requests)
    parts, start, before = [], 0, 0
    owner = [0] * len(requests)
    for i, r in enumerate(requests):
        owner[i] = min(k - 1, (k * (2 * before + r.n)) // (2 * total)) if total else 0
        before += r.n
    for part in range(k):
        end = start
        while end < len(requests) and owner[end] == part:
            end += 1
        parts.append(range(start, end))
        start = end
    return parts


class EngineReplica:
    """One engine replica (the body of a Ray actor): its own copy of the policy, loaded from the
    same ``PolicySpec`` as the driver's and on the same device (``policy.device``: the GPU Ray
    gave the actor, or the CPU), sampled by the engine ``policy.engine`` names: a
    ``TransformersEngine`` over that copy, or a ``VLLMEngine`` that loads it into vLLM."""

    def __init__(self, policy: PolicySpec, index: int, threads: int, seed: int = 0):
        import torch

        from gfcr.engines import load_policy

        torch.set_num_threads(threads)
        self.policy = load_policy(policy)
        self.receiver: Any = None  # a WeightReceiver, once the engine group has formed a weight group
        self.engine = replica_engine(self.policy, policy, replica_name(index), seed)
        # the Ray node this actor runs on (None for the body of a replica run in-process, without Ray)
        self.node = ray.get_runtime_context().get_node_id() if ray.is_initialized() else None
        # Ray restarted this replica after its process died: its weights are the initial ones, and
        # it generates nothing until the driver has loaded its own (gfcr.runtime.ray.restarts)
        self.restarted = restarted_by_ray()
        # TEST-ONLY hook (tests/runtime/replica_kill.py): a folder where each generate call leaves
        # a file as it starts, so that a test kills the replica while the call runs
        self._started_dir = os.environ.get(STARTED_DIR_VARIABLE)

    def ready(self) -> str:
        return self.engine.replica

    def node_id(self) -> str | None:
        return self.node

    def process(self) -> tuple[str, int]:
        """The Ray worker id and the pid of the process this replica runs in (a restart changes both)."""
        return ray.get_runtime_context().get_worker_id(), os.getpid()

    def generate(self, requests: Sequence[GenerationRequest], max_in_flight: int | None = None,
                 version: int | None = None) -> list[list[Completion]]:
        """The engine's completions, each naming this replica's node (the lineage's ``ray_node``);
        refused (``ReplicaBehind``) unless this replica holds weights ``version`` loaded by the driver."""
        require_current(self.restarted, self.policy.version, version, self.engine.replica)
        if self._started_dir:
            open(os.path.join(self._started_dir, f"{self.engine.replica}-{os.getpid()}"), "w").close()
        answers = self.engine.generate(requests, max_in_flight=max_in_flight)
        return [[replace(c, ray_node=self.node) for c in completions] for completions in answers]

    def score(self, requests: Sequence[ScoreRequest]) -> list[Scored]:
        return self.engine.score(requests)

    def load_weights(self, weights: dict[str, Any], version: int) -> int:
        """Load the driver's weights (from the object store) into this replica's policy, then into
        its engine (vLLM copies them in; the transformers engine samples from the policy itself)."""
        self.policy.model.load_state_dict(weights)
        return self._loaded(version)

    def join_weight_group(self, host: str, port: int, world_size: int, rank: int, layout: Any,
                          backend: str, timeout_s: float) -> int:
        """Join the weight group whose source listens on ``host:port`` as ``rank`` (blocks until
        the group has formed); a group this replica was in before is left."""
        self.receiver = None
        check_layout(layout, layout_of(self.policy.model.state_dict()))
        self.receiver = WeightReceiver(host, port, world_size, rank, layout, backend, timeout_s)  # type: ignore[arg-type]
        return rank

    def receive_weights(self, version: int) -> int:
        """Take one broadcast of the weight group into this replica's policy, then its engine; a
        failed broadcast leaves the group (the engine group forms a new one)."""
        if self.receiver is None:
            raise WeightSyncError(f"{self.engine.replica} is in no weight group\n    fix: the engine group forms "
                                  "one at its next sync")
        try:
            self.receiver.receive_into(self.policy.model.state_dict())
        except BaseException:
            self.receiver = None
            raise
        return self._loaded(version)

    def leave_weight_group(self) -> None:
        self.receiver = None  # the group's sockets close with it: the source's next broadcast fails at once

    def weights(self) -> dict[str, Any]:
        """This replica's policy weights, on the CPU (for checks)."""
        return policy_weights(self.policy)

    def _loaded(self, version: int) -> int:
        self.policy.version = version
        self.engine.sync_weights(version)
        self.restarted = False
        return version


def replica_engine(policy: Any, spec: PolicySpec, name: str, seed: int) -> Any:
    """The engine of one replica over its own ``policy`` (an ``HFPolicy``)."""
    if spec.engine == "vllm":
        from gfcr.engines import VLLMEngine

        return VLLMEngine(policy, spec.vllm_settings(), seed=seed, replica=name)
    from gfcr.engines import TransformersEngine

    return TransformersEngine(policy, replica=name, score_path=spec.score_path)


class RayEngineGroup:
    """The Engine protocol over K ``EngineReplica`` actors, driven from the driver process.

    ``policy`` is the driver's policy being trained (under a stale lifecycle, the driver's
    generation copy, which the schedule loads with the version each step samples:
    ``gfcr.runtime.ray.executor.ray_services``); the replicas start from the same source
    weights (version 0). Before generating, a group whose replicas lag the policy's version
    (a resumed run loads a checkpoint into the driver only) syncs them first. ``nodes`` holds
    the Ray node id of each replica, as the replica reports it.

    ``weight_sync`` is how the weights travel: ``collective`` (a weight group, ``CollectiveSync``)
    or ``object_store``. A collective sync that fails (a replica left or died, a broadcast timed
    out) is done again through the object store, with a warning, and the next sync forms a new
    group; after ``MAX_GROUP_FAILURES`` failures in a row the rest of the run uses the object store.

    A replica whose process dies is restarted by Ray, up to ``max_restarts`` times in the run; the
    group loads the current weights into it and makes its call again (``gfcr.runtime.ray.restarts``).
    """

    def __init__(self, policy: Policy, replicas: list[Any], score_path: Literal["forward", "decode"] = "forward",
                 weight_sync: WeightSync = "collective", sync_timeout_s: float = SYNC_TIMEOUT_S,
                 reservation: Reservation | None = None, max_restarts: int = 0):
        self.policy, self.replicas, self.score_path = policy, replicas, score_path
        self.weight_sync: WeightSync = weight_sync
        self.collective = CollectiveSync(sync_timeout_s)
        self.syncs: list[SyncRecord] = []
        self.reservation = reservation  # the placement group the replicas run in, released at close
        self.nodes: list[str] = []
        self._failures = 0  # collective syncs failed in a row
        self._version = 0
        self.source: Any = None  # trainer rank 0's actor, once the update runs on ranks
        self.source_version: Callable[[], int] = lambda: -1  # the weights version the source holds
        workers = [worker for worker, _pid in ray.get([r.process.remote() for r in replicas])]
        self.faults = ReplicaRestarts([replica_name(i) for i in range(len(replicas))], workers, max_restarts)

    @classmethod
    def start(cls, policy: Policy, spec: PolicySpec, placement: Placement, seed: int = 0,
              weight_sync: WeightSync = "collective", max_restarts: int = 0) -> "RayEngineGroup":
        """K replicas, each in its bundle of a placement group reserved first (fails at once, with
        the fix, when the cluster cannot hold them where ``placement`` asks)."""
        reservation = reserve(placement_bundles(placement), placement.strategy, what="the engine replicas",
                              lower="`resources.replicas`, `resources.cpus` or `resources.gpus` on the generate stage")
        # max_task_retries stays 0: Ray would re-run a call on the restarted replica's initial
        # weights; the group re-runs it once the driver's weights are loaded
        actor, threads = ray.remote(EngineReplica), max(1, int(placement.cpus))
        replicas = [actor.options(num_cpus=placement.cpus, num_gpus=placement.gpus, scheduling_strategy=where,
                                  max_restarts=max_restarts).remote(spec, i, threads, seed)
                    for i, where in enumerate(reservation.strategies)]
        try:
            ray.get([r.ready.remote() for r in replicas], timeout=READY_TIMEOUT_S)
            group = cls(policy, replicas, spec.score_path, weight_sync, reservation=reservation,
                        max_restarts=max_restarts)
            group.nodes = ray.get([r.node_id.remote() for r in replicas])
        except BaseException as exc:  # a replica failed to load, or never started: stop them all
            for replica in replicas:
                ray.kill(replica)
            reservation.release()
            if not isinstance(exc, ray.exceptions.GetTimeoutError):
                raise
            raise GfcrError(f"the {placement.replicas} engine replicas did not load the policy within "
                            f"{READY_TIMEOUT_S:g}s, in their reserved {placement.cpus:g} CPUs and {placement.gpus} "
                            "GPUs each\n    fix: read the replicas' logs (`/tmp/ray/session_latest/logs` on their nodes), "
                            "or give them more with `resources` on the generate stage") from None
        return group

    @property
    def policy_version(self) -> int:
        return self._version

    def generate(self, requests: Sequence[GenerationRequest], controller: InFlightController | None = None,
                 max_in_flight: int | None = None) -> list[list[Completion]]:
        """Requests split across replicas by rows; each row is seeded by itself (``row_seed``), so
        the samples do not depend on the replica count. ``max_in_flight`` applies per replica."""
        if controller is not None:
            raise GfcrError("in-flight control (an `in_flight` controller on a generate stage) is not supported "
                            "across Ray engine replicas yet: a controller must see every row of the call\n"
                            "    fix: run this pipeline with the local executor, or remove the in-flight "
                            "controller")
        self._require_open()
        if self._version != self.policy.version:
            self.sync_weights(self.policy.version)
        parts = split_requests(requests, len(self.replicas))
        calls = {i: _generate_call([requests[j] for j in part], max_in_flight, self._version)
                 for i, part in enumerate(parts) if len(part)}
        answers = self.faults.call(self.replicas, calls, self._catch_up)  # a replica that dies is run again
        return [completions for i in sorted(answers) for completions in answers[i]]

    def score(self, requests: Sequence[ScoreRequest]) -> list[Scored]:
        """Scored in the driver's policy (the one being trained), in one process."""
        from gfcr.engines.hf import TransformersEngine

        return TransformersEngine(self.policy, score_path=self.score_path).score(requests)  # type: ignore[arg-type]

    def sync_weights(self, policy_version: int) -> int:
        """Push the driver's weights to every replica (into its policy, then its engine), by the
        group's ``weight_sync`` path; returns the bytes sent, the weights' times the replicas."""
        self._require_open()
        start = time.perf_counter()
        state = {k: v.detach() for k, v in self.policy.model.state_dict().items()}
        path: WeightSync = "object_store"
        # trainer rank 0 broadcasts when it holds this version (not before a resumed run's first update)
        source = self.source if self.source is not None and self.source_version() == policy_version else None
        if self.weight_sync == "collective" and self._collective(state, policy_version, source):
            path = "collective"
        else:  # a replica that died is restarted, caught up and loaded again (self.faults)
            weights = ray.put(policy_weights(self.policy))
            self.faults.call(self.replicas, {i: _load_call(weights, policy_version) for i in range(len(self.replicas))},
                             self._catch_up)
        self._version = policy_version
        sent = len(self.replicas) * sum(v.numel() * v.element_size() for v in state.values())
        self.syncs.append(SyncRecord(policy_version, path, time.perf_counter() - start, sent,
                                     "trainer rank 0" if path == "collective" and source is not None else "driver"))
        return sent

    def take_weights_from(self, source: Any, version: Callable[[], int]) -> None:
        """Make ``source`` (trainer rank 0's actor: ``open_weight_source``, ``join_weight_source``,
        ``send_weights``, ``close_weight_source``) the weight group's source whenever it holds the
        version being synced (``version()``); the driver stays the source otherwise and on the
        object-store path."""
        self.source, self.source_version = source, version

    def _collective(self, state: dict[str, Any], version: int, source: Any = None) -> bool:
        """Sync through the weight group; False (with a warning) when it failed."""
        try:
            self.collective.send(self.replicas, state, version, source)
        except (WeightSyncError, ray.exceptions.RayError) as exc:
            self._failures += 1
            gave_up = self._failures >= MAX_GROUP_FAILURES
            if gave_up:
                self.weight_sync = "object_store"
            log.warning("the weight sync to version %d through the collective group failed (%s); sent through "
                        "Ray's object store instead, %s", version, str(exc).splitlines()[0],
                        "and for the rest of the run" if gave_up else "and a new group forms at the next sync")
            return False
        self._failures = 0
        return True

    def _catch_up(self, index: int) -> None:
        """Load the driver's current weights (at its policy version) into replica ``index``, which
        Ray restarted with the initial ones."""
        ray.get(self.replicas[index].load_weights.remote(ray.put(policy_weights(self.policy)), self.policy.version))

    def step_metrics(self) -> dict[str, int]:
        """The step's ``ray`` metrics: replicas restarted since the last call."""
        return {"replica_restarts": self.faults.take()}

    def close(self) -> None:
        self.collective.close()
        for replica in self.replicas:
            ray.kill(replica)
        self.replicas = []
        if self.reservation is not None:
            self.reservation.release()
            self.reservation = None

    def _require_open(self) -> None:
        if not self.replicas:
            raise GfcrError("the Ray engine group is closed (its run has ended)\n"
                            "    fix: start a new run, or `gfcr resume` this one")


def _generate_call(requests: list[GenerationRequest], max_in_flight: int | None, version: int) -> Callable[[Any], Any]:
    return lambda replica: replica.generate.remote(requests, max_in_flight, version)


def _load_call(weights: Any, version: int) -> Callable[[Any], Any]:
    return lambda replica: replica.load_weights.remote(weights, version)
