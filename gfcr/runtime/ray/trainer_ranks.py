"""The update as trainer ranks: N Ray actors over ``torch.distributed`` (issue 32, Build item 1).

With ``executor: {kind: ray}`` and ``resources: {replicas: N}`` on the update, the update stage
(``update.grpo``) runs its optimizer step in N ``TrainerRank`` actors, each holding ``cpus``
CPUs and ``gpus`` GPUs, its own copy of the policy (loaded from the same ``policy`` spec, on
``policy.device``) and its own instance of the stage, built from the same Config and set up over
that copy (its AdamW, its frozen reference for a KL term, its learned aggregation weights).

The driver keeps the step loop, every stage's state and its own copy of the policy (for scoring,
checkpoints and the engine replicas). Each step it splits the update's batch (the rollouts with
their advantages and per-token weights, as the stage builds them) into N contiguous shards
balanced by response tokens and calls ``train_shard`` on every rank with the whole batch's
aggregation ``plan``. Each rank backwards its shard, divided by the *whole batch's* totals, so
the per-shard gradients add up to the single-process gradient: they are summed over the ranks
(``all_reduce`` SUM, not mean), and the aggregation's once-a-step term is added on rank 0 only.
Every rank then clips and steps alike, so the replicas stay equal. The driver takes rank 0's
weights afterwards (``gfcr.runtime.training.RankTrainer``, through Ray's object store), and
rank 0 is the source of the engine replicas' weight group (``open_weight_source``, ``send_weights``;
``gfcr.runtime.ray.executor.CollectiveSync``): the engines get the new weights from the trainer.

Why explicit ``all_reduce`` and a replicated optimizer rather than DDP by default: the exact
gradient needs a SUM of gradients that are already divided by batch-wide totals, and a
parameter that no rank touched must keep no gradient (AdamW then skips it, as in one process);
DDP averages over the ranks and reduces in buckets during each micro-batch's backward. One
``all_reduce`` per gradient tensor after the micro-batches is simple and exact.

Sharded ranks (``resources: {replicas: N, sharding: fsdp2}`` on the update; issue 43): each rank
shards its policy with FSDP2's ``fully_shard`` once the ranks have joined, before the stage builds
its AdamW, which then holds 1/N of the parameters and AdamW's moments
(``gfcr.runtime.training.sharding``: the gradients reduce-scattered as a SUM, on gloo too). The stage
gets ``Ranks(sharded=True)``: it sums only what the model does not (the loss, a learned aggregation's
parameters), and the ranks agree on the number of micro-batches first, the less busy ones taking
empty passes, since every forward and backward pass is a collective. What leaves a rank whole is
gathered by every rank together (``weights``, ``state_dict``: the group calls each rank): the driver's
copy gets rank 0's gathered weights; rank 0 keeps them for the engines' weight group (``send_weights``);
the checkpoint holds AdamW's state whole, as one process's, so it resumes on sharded ranks,
replicated ranks or in one process (``load_state_dict`` shards it again).

Backend: gloo on the CPU; NCCL where the policy is on ``cuda`` (the ranks then hold GPUs).
NCCL was not tested here (no machine with 2 GPUs was lent; ``scripts/gpu_check.sh`` Part 3 runs both
ways where one is).

A rank that dies (its process killed, its node lost) fails the step: the run stops with
``TrainerRankLost``, and its directory resumes from the last checkpoint.
"""

from __future__ import annotations

import socket
from datetime import timedelta
from typing import Any, Callable, Literal

import ray

from gfcr.errors import GfcrError, WorkerLost
from gfcr.runtime.ray.placement import Reservation, placement_bundles, reserve
from gfcr.runtime.training.sharding import (full_state, full_weights, held_bytes, load_full_weights, rss_mb,
                                            shard_optimizer_state, shard_policy)
from gfcr.runtime.weights.collective import WeightSender, check_layout, layout_of
from gfcr.spec import PolicySpec
from gfcr.spec import Resources as Placement
from gfcr.stages.resources import Lent, policy_weights
from gfcr.stages.training import Ranks

Sharding = Literal["replicated", "fsdp2"]  # ``resources.sharding`` on the update
READY_TIMEOUT_S = 600.0  # loading the policy in a rank; a pending actor means the cluster is too small
JOIN_TIMEOUT = timedelta(minutes=5)  # torch.distributed rendezvous and each collective


class TrainerRankLost(WorkerLost):
    """A trainer rank died during the run (its process killed, its node lost)."""


def all_reduce_sum(tensors: list[Any]) -> None:
    """Replace each tensor by its sum over the process group, in place."""
    import torch.distributed as dist

    for t in tensors:
        dist.all_reduce(t, op=dist.ReduceOp.SUM)


def all_reduce_max(n: int) -> int:
    """The largest ``n`` over the process group."""
    import torch
    import torch.distributed as dist

    t = torch.tensor([n], dtype=torch.int64, device="cuda" if dist.get_backend() == "nccl" else "cpu")
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return int(t.item())


def optimizer_gradients(optimizer: Any) -> dict[str, Any]:
    """Every gradient the optimizer would step, on the CPU, by ``"<param group>.<index>"`` (the
    policy's parameters, then a learned aggregation's); sharded ones gathered whole (a collective)."""
    return {f"{g}.{i}": full_state(p.grad.detach()).cpu().clone() for g, group in enumerate(optimizer.param_groups)
            for i, p in enumerate(group["params"]) if p.grad is not None}


class TrainerRank:
    """One trainer rank (the body of a Ray actor): a copy of the policy and of the update stage."""

    def __init__(self, policy: PolicySpec, stage_class: type, config: Any, rank: int, world_size: int,
                 threads: int, sharding: Sharding = "replicated"):
        import torch

        from gfcr.engines import load_policy

        torch.set_num_threads(threads)
        self.rank, self.world_size, self.sharded = rank, world_size, sharding == "fsdp2"
        self.backend = "nccl" if policy.where() == "cuda" else "gloo"
        self.policy = load_policy(policy)
        self.stage = stage_class(config)  # set up once the ranks have joined (sharded first, under FSDP2)
        self.sender: WeightSender | None = None  # rank 0: the source of the engines' weight group
        self.gathered: dict[str, Any] | None = None  # FSDP2, rank 0: the whole weights of ``weights()``

    # --- rank 0 as the source of the weight group (gfcr.runtime.ray.executor.CollectiveSync) ----

    def open_weight_source(self, world_size: int, layout: Any, backend: str, timeout_s: float) -> tuple[str, int]:
        """Open a weight group's rendezvous on this rank's node; returns its host and port."""
        self.close_weight_source()
        check_layout(layout, layout_of(self.policy.model.state_dict()))  # a DTensor's shape is the whole's
        self.sender = WeightSender(ray.util.get_node_ip_address(), world_size, layout, backend, timeout_s)  # type: ignore[arg-type]
        return self.sender.host, self.sender.port

    def join_weight_source(self) -> None:
        assert self.sender is not None
        self.sender.join()

    def send_weights(self) -> int:
        """Broadcast this rank's weights to the engine replicas; returns the bytes each got. Under
        FSDP2, the whole weights the last ``weights()`` gathered (the group's version's)."""
        assert self.sender is not None
        if not self.sharded:
            return self.sender.send(self.policy.model.state_dict())
        if self.gathered is None:  # the caller falls back to the object store
            raise GfcrError("sharded trainer rank 0 holds no gathered weights to send yet")
        return self.sender.send(self.gathered)

    def close_weight_source(self) -> None:
        if self.sender is not None:
            self.sender.close()
        self.sender = None

    def endpoint(self) -> str:
        """A ``tcp://`` address on this rank's node for the others to meet at (rank 0's)."""
        with socket.socket() as s:
            s.bind(("", 0))
            port = s.getsockname()[1]
        return f"tcp://{ray.util.get_node_ip_address()}:{port}"

    def join(self, endpoint: str) -> int:
        import torch.distributed as dist

        dist.init_process_group(self.backend, init_method=endpoint, rank=self.rank, world_size=self.world_size,
                                timeout=JOIN_TIMEOUT)
        if self.sharded:  # before the stage builds its AdamW, which must hold the shards
            shard_policy(self.policy.model, self.world_size)
        self.stage.setup(Lent(self.policy))
        return self.rank

    def ranks(self, reduce: Callable[[list[Any]], None] = all_reduce_sum) -> Ranks:
        return Ranks(self.rank, self.world_size, reduce, self.sharded, all_reduce_max)

    def step(self, shard: list[Any], plan: Any, version: int) -> Any:
        self.policy.version = version  # staleness is counted from the driver's version
        return self.stage.train_shard(shard, plan, version, self.ranks())

    def gradients(self, shard: list[Any], plan: Any, version: int,
                  reduce: Callable[[list[Any]], None] = all_reduce_sum) -> dict[str, Any]:
        """The policy's gradients summed over the ranks for one step, without stepping (the
        gradient-equality check; ``reduce`` replaces the sum, to show that a wrong one is caught;
        under FSDP2 it sums only what the model does not: a learned aggregation's)."""
        self.policy.version = version
        self.stage.shard_gradients(shard, plan, version, self.ranks(reduce))
        grads = optimizer_gradients(self.stage.optimizer)
        self.stage.optimizer.zero_grad(set_to_none=True)
        return grads

    def weights(self) -> dict[str, Any] | None:
        """The policy's weights on the CPU. Under FSDP2 a collective (every rank calls it): rank 0
        gets them whole, and keeps them for ``send_weights``; the others None."""
        if not self.sharded:
            return policy_weights(self.policy)
        self.gathered = None
        gathered = full_weights(self.policy.model, self.rank)
        self.gathered = gathered if self.rank == 0 else None
        return self.gathered

    def load_weights(self, weights: dict[str, Any], version: int) -> None:
        if self.sharded:
            load_full_weights(self.policy.model, weights)
            self.gathered = weights if self.rank == 0 else None
        else:
            self.policy.model.load_state_dict(weights)
        self.policy.version = version

    def state_dict(self) -> dict[str, Any] | None:
        """The stage's state; under FSDP2 gathered whole (a collective), as one process's, on rank 0."""
        if not self.sharded:
            return self.stage.state_dict()
        state = full_state(self.stage.state_dict())
        return state if self.rank == 0 else None

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.stage.load_state_dict(state)
        if self.sharded and self.stage.optimizer is not None:  # whole tensors in: each rank keeps its shards
            shard_optimizer_state(self.stage.optimizer)

    def held(self) -> dict[str, Any]:
        """What this rank holds: bytes of parameters, gradients and optimizer state (its shards under
        FSDP2), its resident set now and at its peak (MiB)."""
        return {"bytes": held_bytes(self.policy.model, self.stage.optimizer), "rss_mb": rss_mb("VmRSS"),
                "peak_rss_mb": rss_mb("VmHWM")}

    def node_id(self) -> str:
        """The Ray node this rank runs on."""
        return ray.get_runtime_context().get_node_id()

    def pid(self) -> int:
        import os

        return os.getpid()


class RayTrainerGroup:
    """The ``TrainerGroup`` protocol over N ``TrainerRank`` actors, driven from the driver."""

    def __init__(self, ranks: list[Any], reservation: Reservation | None = None, sharding: Sharding = "replicated"):
        self.ranks = ranks
        self.sharding = sharding
        self.world_size = len(ranks)
        self.version = 0  # the ranks start from the source weights
        self.reservation = reservation
        self.nodes: list[str] = []  # each rank's Ray node id

    @classmethod
    def start(cls, policy: PolicySpec, placement: Placement, stage_class: type, config: Any) -> "RayTrainerGroup":
        """Start the ranks, each in its bundle of a placement group reserved first (on the nodes
        ``placement`` asks for: ``strategy``, ``node_resource``; fails at once, with the fix, when
        the cluster cannot hold them), wait until each has loaded the policy, and join them into one
        process group."""
        reservation = reserve(placement_bundles(placement), placement.strategy, what="the trainer ranks",
                              lower="`resources.replicas`, `resources.cpus` or `resources.gpus` on the update")
        actor = ray.remote(TrainerRank)
        threads = max(1, int(placement.cpus))
        n = placement.replicas
        group = cls([actor.options(num_cpus=placement.cpus, num_gpus=placement.gpus, scheduling_strategy=where)
                     .remote(policy, stage_class, config, r, n, threads, placement.sharding)
                     for r, where in enumerate(reservation.strategies)], reservation, placement.sharding)
        try:
            group.nodes = ray.get([r.node_id.remote() for r in group.ranks], timeout=READY_TIMEOUT_S)
            endpoint = ray.get(group.ranks[0].endpoint.remote(), timeout=READY_TIMEOUT_S)
            ray.get([r.join.remote(endpoint) for r in group.ranks], timeout=READY_TIMEOUT_S)
        except BaseException as exc:  # a rank failed to load or join, or never started: stop them all
            group.close()
            if not isinstance(exc, ray.exceptions.GetTimeoutError):
                raise
            raise GfcrError(f"the {n} trainer ranks did not start within {READY_TIMEOUT_S:g}s (each needs "
                            f"{placement.cpus:g} CPUs, {placement.gpus} GPUs)\n    fix: check that the cluster has "
                            "free resources (`ray status`), or lower `resources` on the update") from None
        return group

    def step(self, shards: list[list[Any]], *args: Any) -> list[Any]:
        return self._get([rank.step.remote(shard, *args) for rank, shard in zip(self.ranks, shards)])

    def weights(self) -> dict[str, Any]:
        """Rank 0's weights; sharded ranks gather them together (each rank takes part)."""
        if self.sharding == "replicated":
            return self._get(self.ranks[0].weights.remote())
        return self._get([rank.weights.remote() for rank in self.ranks])[0]

    def load_weights(self, weights: dict[str, Any], version: int) -> None:
        ref = ray.put(weights)
        self._get([rank.load_weights.remote(ref, version) for rank in self.ranks])
        self.version = version

    def state_dict(self) -> dict[str, Any]:
        """Rank 0's stage state; sharded ranks gather AdamW's state whole together (each rank takes part)."""
        if self.sharding == "replicated":
            return self._get(self.ranks[0].state_dict.remote())
        return self._get([rank.state_dict.remote() for rank in self.ranks])[0]

    def load_state_dict(self, state: dict[str, Any]) -> None:
        ref = ray.put(state)
        self._get([rank.load_state_dict.remote(ref) for rank in self.ranks])

    def close(self) -> None:
        for rank in self.ranks:
            ray.kill(rank)
        self.ranks = []
        if self.reservation is not None:
            self.reservation.release()
            self.reservation = None

    def _get(self, refs: Any) -> Any:
        """The answers, or ``TrainerRankLost`` as soon as one rank has died: the survivors would
        wait in a collective for it (until ``JOIN_TIMEOUT``), so they are stopped too."""
        if not self.ranks:
            raise GfcrError("the trainer ranks are closed (their run has ended)\n"
                            "    fix: start a new run, or `gfcr resume` this one")
        pending = list(refs) if isinstance(refs, list) else [refs]
        try:
            while pending:  # the first failure, not the first rank's: rank 0 may be blocked on a dead rank 1
                done, pending = ray.wait(pending, num_returns=1)
                ray.get(done)
            return ray.get(refs)
        except ray.exceptions.RayActorError as exc:
            raise self._rank_lost(f" ({type(exc).__name__})") from None
        except ray.exceptions.RayTaskError:
            if self._lost():  # a survivor's collective failed because a peer died
                raise self._rank_lost("") from None
            raise

    def _rank_lost(self, how: str) -> TrainerRankLost:
        """Stop every rank and say how to go on."""
        self.close()
        return TrainerRankLost(f"a trainer rank died during the update{how}; the step did not complete and the "
                               "run stops\n    fix: resume the run from its last checkpoint (`gfcr resume "
                               "RUN_DIR`); if a rank keeps dying, check its node's memory (`ray status`, the "
                               "worker logs under /tmp/ray/session_latest/logs)")

    def _lost(self) -> bool:
        for rank in self.ranks:
            try:
                ray.get(rank.pid.remote(), timeout=30)
            except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
                return True
        return False


def trainer_starter(policy: PolicySpec, placement: Placement, closers: list[Callable[[], None]],
                    started: Callable[[RayTrainerGroup], None] = lambda group: None) -> Any:
    """``RuntimeServices.start_trainers`` for this run: starts the group, has the run's end close it
    (``closers``), and hands it to ``started`` (the Ray executor makes rank 0 its engines' weight source)."""
    def start(stage_class: type, config: Any) -> RayTrainerGroup:
        group = RayTrainerGroup.start(policy, placement, stage_class, config)
        closers.append(group.close)
        started(group)
        return group
    return start
