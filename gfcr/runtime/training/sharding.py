"""FSDP2 on the trainer ranks: ``resources: {replicas: N, sharding: fsdp2}`` on the update (issue 43).

Each trainer rank (``gfcr.runtime.ray.trainer_ranks``) loads the whole policy, then ``shard_policy``
shards it with torch's ``fully_shard`` over a 1-D device mesh of the N ranks (each transformer block,
then the root, which holds the embeddings, the final norm and a tied head), before the update stage
builds its AdamW, which then holds each rank's shards: a rank keeps 1/N of the parameters, gradients
and AdamW's moments. Each forward pass all-gathers a block's parameters and each backward pass
reduce-scatters its gradients.

The gradient of the whole batch is the SUM of the ranks' gradients (each shard's loss is already
divided by the whole batch's totals, as under replicated ranks), not FSDP's default mean: every
sharded module gets ``set_gradient_divide_factor(1.0)``. Gloo has no ``PREMUL_SUM``, the op FSDP2
reduces with once a divide factor is set (``RuntimeError: Cannot use ReduceOp.PREMUL_SUM with
Gloo``), so every module also gets ``set_force_sum_reduction_for_comms(True)`` (a plain SUM; set on
the root alone, the blocks would still average: benchmarks/fsdp2_cpu.py found their gradients at
half). On NCCL the same settings give the same SUM.

What leaves a rank whole, gathered (collectives: every rank calls them, in the same order):

- ``full_weights``: the policy's ``state_dict`` with full tensors, on the CPU, on rank 0 (the
  others get an empty dict): for the driver's copy and the engines' weight group;
- ``full_state``: any tree (the update stage's ``state_dict``) with each DTensor replaced by its
  full tensor: the checkpoint holds AdamW's state as one process's optimizer would, so a
  checkpoint moves between sharded ranks, replicated ranks and one process;
- ``load_full_weights`` / ``shard_optimizer_state``: the way back, each rank keeping its shards.

Not done: a meta-device init with a sharded load (each rank loads the whole policy before sharding
it, so a rank's peak memory is one full copy); ``torch.distributed.checkpoint``'s sharded files
(the checkpoint gathers onto rank 0's CPU memory); sharding the frozen reference of a KL term
(each rank holds it whole); mixed precision (float32 throughout, as the replicated ranks).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch


def shard_policy(model: Any, world_size: int) -> None:
    """Shard ``model`` in place over the process group's ``world_size`` ranks: each block (the
    classes ``model._no_split_modules`` names, as accelerate does), then the root; gradients summed."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FSDPModule, fully_shard

    device = next(model.parameters()).device.type
    mesh = init_device_mesh(device, (world_size,))
    blocks = set(model._no_split_modules or ())  # a transformers model declares its blocks (None: none)
    for module in list(model.modules()):
        if module is not model and type(module).__name__ in blocks:
            fully_shard(module, mesh=mesh)
    fully_shard(model, mesh=mesh)
    for module in model.modules():
        if isinstance(module, FSDPModule):  # each sharded module reduces its own parameters' gradients
            module.set_gradient_divide_factor(1.0)  # a SUM over the ranks: the shards' losses are pre-divided
            module.set_force_sum_reduction_for_comms(True)  # gloo has no PREMUL_SUM, the divide factor's op


def is_sharded(t: Any) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(t, DTensor)


def full_weights(model: Any, rank: int) -> dict[str, torch.Tensor]:
    """The whole ``state_dict`` on the CPU on rank 0 (gathered one tensor at a time); ``{}`` on the others."""
    out = {}
    for name, t in model.state_dict().items():
        whole = t.full_tensor() if is_sharded(t) else t
        if rank == 0:
            out[name] = whole.detach().cpu().clone()
        del whole
    return out


def load_full_weights(model: Any, state: dict[str, torch.Tensor]) -> None:
    """Copy a whole ``state_dict`` into a sharded model: each rank keeps its own shard of each tensor."""
    from torch.distributed.tensor import distribute_tensor

    with torch.no_grad():
        for name, t in model.state_dict().items():
            value = state[name].to(t.device, t.dtype)
            if is_sharded(t):
                t.to_local().copy_(distribute_tensor(value, t.device_mesh, t.placements, src_data_rank=None).to_local())
            else:
                t.copy_(value)


def full_state(tree: Any) -> Any:
    """``tree`` (dicts, lists, tuples of tensors and plain values) with every DTensor gathered whole, on the CPU."""
    if is_sharded(tree):
        return tree.full_tensor().cpu()
    if isinstance(tree, dict):
        return {k: full_state(v) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(full_state(v) for v in tree)
    return tree


def shard_optimizer_state(optimizer: torch.optim.Optimizer) -> None:
    """After ``load_state_dict`` of whole tensors (a checkpoint): each sharded parameter's state tensors
    of its whole shape become DTensors laid out like it (each rank keeps its shard)."""
    from torch.distributed.tensor import distribute_tensor

    for p, state in optimizer.state.items():
        if not is_sharded(p):
            continue
        for key, value in state.items():
            if torch.is_tensor(value) and not is_sharded(value) and tuple(value.shape) == tuple(p.shape):
                state[key] = distribute_tensor(value.to(p.device), p.device_mesh, p.placements, src_data_rank=None)


def held_bytes(model: Any, optimizer: torch.optim.Optimizer | None) -> dict[str, int]:
    """The bytes of parameters, gradients and optimizer state this rank holds (its shards, under FSDP2)."""
    def nbytes(t: torch.Tensor) -> int:
        local = t.to_local() if is_sharded(t) else t
        return local.numel() * local.element_size()

    params = list({id(p): p for p in model.parameters()}.values())  # tied weights once
    state = [v for s in (optimizer.state.values() if optimizer is not None else ()) for v in s.values()
             if torch.is_tensor(v)]
    return {"params": sum(nbytes(p) for p in params),
            "grads": sum(nbytes(p.grad) for p in params if p.grad is not None),
            "optimizer": sum(nbytes(v) for v in state)}


def rss_mb(key: str = "VmRSS") -> float:
    """This process's resident set now (``VmRSS``) or at its peak (``VmHWM``), in MiB (Linux)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(f"{key}:"):
            return int(line.split()[1]) / 1024
    return float("nan")
