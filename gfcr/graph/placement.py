"""What ``gfcr validate`` refuses about placing a pipeline's engine on Ray (``executor: {kind:
ray}``, docs/ray.md), so that a run never starts only to fail at its first generation, or
samples on a device other than the one its spec asks for:

- in-flight controllers (``in_flight: [...]`` on a generate stage): a controller steers the
  rows of one engine in the driver's process, and on Ray the engine is a group of replica
  actors, each sampling a part of the call (several replicas, or one in another process);
- GPUs reserved for replicas that would not use them: ``resources.gpus`` on a generate stage
  with the policy on the CPU (``policy.device`` unset or ``cpu`` with the transformers engine,
  ``cpu`` with vLLM's CPU build) would hold the GPUs while the replicas sample on the CPU;
- the policy on ``cuda`` with no GPU reserved: Ray gives the replica actors no GPU
  (``CUDA_VISIBLE_DEVICES`` empty), so they could not load it;
- vLLM's tensor parallelism wider than the GPUs a replica holds;
- a ``node_resource`` that names one of Ray's built-in quantities (``CPU``, ``GPU``,
  ``memory``, ...) rather than a custom resource that marks nodes;
- ``executor.weight_sync`` with another executor than Ray (it has no replicas to sync);
- ``lifecycle.in_flight: true`` (a newer version published between the decode steps of a running
  call, docs/async.md): each replica syncs one version before a step's generation, and no replica
  takes a version mid-call yet;
- trainer ranks (``resources: {replicas: N}`` on the update, N > 1) without the Ray executor,
  for an update that cannot run split (no ``train_shard``), or with GPUs that disagree with
  ``policy.device`` (``trainer_problems``);
- ``sharding: fsdp2`` anywhere but on the update's trainer ranks (a stage's replicas each hold
  the whole policy; without the Ray executor the update steps in the driver), on an update that
  cannot train sharded (``TrainsSharded``) or whose Config asks for what sharded ranks cannot do
  (its ``sharding_problems``), and with ``policy.lora``.

A cluster without the GPUs reserved, without nodes that declare the ``node_resource``, or too
small for the ``strategy``, and a driver without CUDA for a ``cuda`` policy, are found when the
run starts (``gfcr.runtime.ray.placement.reserve``, ``load_policy``), before any step, each
with its fix.
"""

from __future__ import annotations

from typing import Any, Iterator

from gfcr.errors import GfcrError
from gfcr.registry import Trains, TrainsSharded, has_role
from gfcr.spec import PipelineSpec
from gfcr.spec import Resources as Placement

RAY_QUANTITIES = ("CPU", "GPU", "memory", "object_store_memory")  # every node has them: they mark none
NOT_ON_RAY = ("run this pipeline with `executor: {kind: prefect}` (or `local`), or remove `in_flight`: "
              "in-flight control across Ray engine replicas is not supported yet")


def declared_placements(spec: PipelineSpec) -> dict[str, Placement]:
    """The ``resources`` the generate stages (aliases ``generate.*``) declare, by stage id."""
    return {sid: s.resources for sid, s in spec.all_stages().items()
            if s.use.startswith("generate.") and s.resources != Placement()}


def engine_placement(spec: PipelineSpec) -> Placement:
    """The engine group's resources: those the generate stages declare (the default if none do)."""
    declared = declared_placements(spec)
    if len({r.model_dump_json() for r in declared.values()}) > 1:
        listed = ", ".join(f"`{sid}`: {r.model_dump()}" for sid, r in declared.items())
        raise GfcrError(f"the generate stages declare different resources ({listed}), but they share one engine "
                        "group\n    fix: give every generate stage the same `resources`, or declare them on one")
    return next(iter(declared.values()), Placement())


def trainer_placement(spec: PipelineSpec) -> Placement | None:
    """The update's trainer ranks (``resources`` on the update, Ray executor), or None: the update
    steps in the driver."""
    if spec.executor.kind != "ray" or spec.policy is None or spec.update.resources == Placement():
        return None
    return spec.update.resources


def trainer_problems(spec: PipelineSpec, update_class: type, config: Any = None) -> Iterator[tuple[tuple, str, str]]:
    """``(key path, message, fix)`` for trainer ranks the update's ``resources`` ask for and cannot get
    (``config``: the update's parsed Config, None where it did not parse)."""
    ranks = spec.update.resources
    if ranks.sharding != "replicated":
        yield from _sharding_problems(spec, update_class, config)
    if ranks.replicas > 1 and spec.executor.kind != "ray":
        yield (("update", "resources", "replicas"),
               f"the update asks for {ranks.replicas} trainer ranks, which run as Ray actors, but the executor is "
               f"`{spec.executor.kind}`",
               "set `executor: {kind: ray}` (--set executor.kind=ray), or `replicas: 1` on the update")
    if spec.executor.kind == "ray" and ranks != Placement() and not has_role(update_class, Trains):
        yield (("update", "resources"),
               f"the update `{spec.update.use}` cannot run split across trainer ranks (it does not play the "
               "`Trains` role: `prepare`, `train_shard`, `finish`)",
               "remove `resources` from the update; it then steps in the driver")
    placed = trainer_placement(spec)
    if placed is None or spec.policy is None:
        return
    yield from _node_resource_problems(placed, ("update", "resources", "node_resource"), "trainers")
    device = spec.policy.where()
    if placed.gpus and device == "cpu":
        yield (("update", "resources", "gpus"),
               f"the update reserves {placed.gpus} GPU(s) per trainer rank, but the policy is on the CPU "
               f"(`policy.device` {spec.policy.device or 'unset'}), so the ranks would hold them and train on the CPU",
               "set `policy.device: cuda`, or remove `gpus` from the update's `resources`")
    if not placed.gpus and device == "cuda":
        yield (("update", "resources", "gpus"),
               "the policy is on `cuda`, but the update reserves no GPU for its trainer ranks, and Ray gives an "
               "actor only the GPUs it reserves",
               "set `resources: {gpus: 1}` on the update, or `policy.device: cpu`")


def _sharding_problems(spec: PipelineSpec, update_class: type, config: Any) -> Iterator[tuple[tuple, str, str]]:
    """``sharding: fsdp2`` on the update: the Ray executor, an update that trains sharded, no LoRA."""
    path, use = ("update", "resources", "sharding"), spec.update.use
    if spec.executor.kind != "ray":
        yield (path, f"`sharding: fsdp2` shards the policy over the update's trainer ranks, which run as Ray actors, "
                     f"but the executor is `{spec.executor.kind}` (the update steps in the driver, unsharded)",
               "set `executor: {kind: ray}` (--set executor.kind=ray), or remove `sharding`")
        return
    if not has_role(update_class, TrainsSharded):
        yield (path, f"the update `{use}` cannot train with its policy sharded (it does not play the "
                     "`TrainsSharded` role)", "remove `sharding` (the ranks then replicate the policy)")
        return
    if spec.policy is not None and spec.policy.lora is not None:
        yield (path, "`sharding: fsdp2` with `policy.lora`: sharded ranks train and gather full weights, not an "
                     "adapter, so far (an adapter is small: replicated ranks hold it)",
               "remove `sharding` (or set `sharding: replicated`), or remove `policy.lora`")
    if config is not None:
        for problem in update_class.sharding_problems(config):
            yield ("update", "with", *problem.key), problem.message, problem.fix


def placement_problems(spec: PipelineSpec) -> Iterator[tuple[tuple, str, str]]:
    """``(key path, message, fix)`` for each thing Ray placement cannot honour in ``spec``."""
    for sid, stage in spec.stages.items():  # the update's own is ``trainer_problems``'
        if stage.resources.sharding != "replicated":
            yield (("stages", sid, "resources", "sharding"),
                   f"`sharding: {stage.resources.sharding}` shards the update's trainer ranks; `{sid}` is a stage "
                   "whose replicas each hold the whole policy", f"remove `sharding` from `{sid}`'s resources, and "
                   "set it on the update's (`update: {resources: {replicas: 2, sharding: fsdp2}}`)")
    if spec.executor.weight_sync is not None and spec.executor.kind != "ray":
        yield (("executor", "weight_sync"),
               f"`executor.weight_sync` chooses how weights reach Ray engine replicas, but the executor is "
               f"`{spec.executor.kind}`, whose engine shares the trained policy's process",
               "set `executor.kind: ray`, or remove `weight_sync`")
    if spec.executor.kind == "ray" and spec.lifecycle.in_flight:
        yield (("lifecycle", "in_flight"),
               "`lifecycle.in_flight: true` publishes new versions between the decode steps of a running generate "
               "call, but with `executor: {kind: ray}` each engine replica is synced to one version before a "
               "step's generation and takes no version mid-call yet (docs/async.md, \"On Ray\")",
               "remove `in_flight` (each step then samples with the newest version the bound allows), or run it "
               "on vLLM with `executor: {kind: prefect}` (or `local`)")
    if spec.executor.kind != "ray" or spec.policy is None:
        return
    generate = {sid: s for sid, s in spec.all_stages().items() if s.use.startswith("generate.")}
    if not generate:
        return
    try:
        placement = engine_placement(spec)
    except GfcrError as exc:
        message, _, fix = str(exc).partition("\n    fix: ")
        yield ("stages", list(declared_placements(spec))[-1], "resources"), message, fix
        return
    for sid, stage in generate.items():
        if stage.in_flight:
            yield (("stages", sid, "in_flight"),
                   f"`{sid}` hands in-flight controllers ({', '.join(stage.in_flight)}) to the engine, but with "
                   f"`executor: {{kind: ray}}` the engine is {placement.replicas} replica actor(s), each sampling "
                   "a part of the call in its own process, and a controller must see every row of the call as "
                   "it is generated", NOT_ON_RAY)
    owner = next(iter(declared_placements(spec)), next(iter(generate)))
    yield from _device_problems(spec, placement, ("stages", owner, "resources", "gpus"))
    yield from _node_resource_problems(placement, ("stages", owner, "resources", "node_resource"), "engines")


def _node_resource_problems(placement: Placement, path: tuple, example: str) -> Iterator[tuple[tuple, str, str]]:
    """A ``node_resource`` that selects no nodes: one of Ray's built-in quantities."""
    if placement.node_resource in RAY_QUANTITIES:
        yield (path,
               f"`node_resource: {placement.node_resource}` names a quantity every Ray node has, so it selects no "
               f"nodes; `node_resource` is a custom resource that the chosen nodes declare",
               f"start those nodes with `ray start --resources '{{\"{example}\": 1}}'` and set `node_resource: "
               f"{example}`, or remove `node_resource` (`cpus` and `gpus` reserve CPUs and GPUs)")


def _device_problems(spec: PipelineSpec, placement: Placement, path: tuple) -> Iterator[tuple[tuple, str, str]]:
    """The replicas' GPUs against the device the policy asks for."""
    assert spec.policy is not None
    policy, gpus, sid = spec.policy, placement.gpus, path[1]
    device = policy.where()
    if gpus and device == "cpu":
        yield (path, f"`{sid}` reserves {gpus} GPU(s) per engine replica, but the policy is on the CPU "
                     f"(`policy.device` {policy.device or 'unset'}, engine `{policy.engine}`), so the replicas "
                     "would hold the GPUs and sample on the CPU",
               "set `policy.device: cuda` (with `engine: vllm`, vLLM's CUDA build) to sample on the GPUs, "
               "or remove `gpus`")
    if not gpus and device == "cuda":
        yield (path, f"the policy is on `cuda`, but `{sid}` reserves no GPU for the engine replicas, and Ray "
                     "gives an actor only the GPUs it reserves",
               f"set `resources: {{gpus: 1}}` (or more) on `{sid}`, or `policy.device: cpu`")
    tp = policy.vllm_settings().tensor_parallel_size if policy.engine == "vllm" else 1
    if gpus and gpus < tp:
        yield (path, f"`{sid}` reserves {gpus} GPU(s) per replica, and `policy.vllm.tensor_parallel_size: "
                     f"{tp}` shards each vLLM engine over {tp}",
               f"set `resources.gpus: {tp}` on `{sid}`, or lower `tensor_parallel_size`")
