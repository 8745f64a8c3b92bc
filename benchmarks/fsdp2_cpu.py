"""FSDP2 on the CPU (issue 43, Must show 3, as a probe): does torch's ``fully_shard`` run on gloo here,
and do its gradients equal one process's? SmolLM2-135M-Instruct, float32, one fixed batch.

Three ways to take one AdamW step on the same batch (``--rows`` rows of ``--tokens`` seeded random
token ids; loss: the summed next-token NLL divided by the *whole batch's* token count, so per-rank
losses add up to the one-process loss, as gfcr's trainer ranks divide each shard):

- ``single``: one process, the whole batch;
- ``replicated``: ``--ranks`` processes over gloo, each a full copy of the model and AdamW, its rows
  of the batch, then ``all_reduce`` SUM of every gradient (what ``gfcr.runtime.ray.trainer_ranks``
  does);
- ``fsdp2``: the same ranks, the model sharded with ``fully_shard`` (each decoder layer, then the
  root; a 1-D CPU device mesh), gradients reduce-scattered with divide factor 1 (a SUM, not FSDP's
  default mean over ranks), AdamW over the local shards.

It reports the largest gradient and parameter-after-one-step differences of each against
``single`` (sharded tensors gathered with ``full_tensor``), and per rank: the bytes of parameters,
gradients and AdamW state the rank holds, its RSS after the step (gradients and AdamW state still
held) and its peak RSS, which the full model loaded in every rank before ``fully_shard`` sets (a
meta-device init with a sharded load would avoid it; not done here). This is not gfcr's trainer ranks: the
ranks here are ``torch.multiprocessing`` processes, not Ray actors, and the loss is plain NLL, not
``update.grpo``'s; docs/scale-out.md says what wiring FSDP2 into them would take.

Run (a few CPU-minutes; under the heavy lock on a shared machine):
    PYTHONPATH=. HF_HUB_OFFLINE=1 python benchmarks/fsdp2_cpu.py
Smoke (tiny-arith-h64):
    PYTHONPATH=. HF_HUB_OFFLINE=1 python benchmarks/fsdp2_cpu.py --model tiny-arith-h64 --rows 4 --tokens 16
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import socket
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

REPO = Path(__file__).resolve().parents[1]
LR = 1e-4


def load(model: str) -> Any:
    from gfcr.engines import load_policy
    from gfcr.spec import PolicySpec

    policy = load_policy(PolicySpec(model=model))
    policy.model.train()
    return policy.model


def batch(vocab: int, rows: int, tokens: int, seed: int) -> torch.Tensor:
    return torch.randint(0, vocab, (rows, tokens), generator=torch.Generator().manual_seed(seed))  # [R, T]


def shard_loss(model: Any, ids: torch.Tensor, whole_count: int) -> torch.Tensor:
    """Summed next-token NLL of ``ids`` divided by the whole batch's predicted-token count."""
    logits = model(input_ids=ids).logits[:, :-1].float()  # [r, T-1, V]
    nll = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1),
                                            reduction="sum")
    return nll / whole_count


def full(t: Any) -> torch.Tensor:
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().clone()


def held_bytes(model: Any, optimizer: torch.optim.Optimizer) -> dict[str, int]:
    """The bytes of parameters, gradients and AdamW state this rank holds (its local shards)."""
    local = (lambda t: t.to_local() if hasattr(t, "to_local") else t)
    params = {id(p): p for p in model.parameters()}.values()  # tied weights once
    state = [v for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v)]
    return {"params": sum(local(p).numel() * local(p).element_size() for p in params),
            "grads": sum(local(p.grad).numel() * local(p.grad).element_size() for p in params if p.grad is not None),
            "adamw": sum(local(v).numel() * local(v).element_size() for v in state)}


def step(model: Any, ids: torch.Tensor, whole_count: int, out: Path | None,
         reduce: Any = None) -> dict[str, Any]:
    """One AdamW step; what the rank holds is measured before anything is gathered for the comparison
    (AdamW reads the gradients and leaves them as they were)."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    shard_loss(model, ids, whole_count).backward()
    if reduce is not None:
        reduce(model)
    optimizer.step()
    gc.collect()
    measured = {"held_bytes": held_bytes(model, optimizer),
                "peak_rss_mb": rss_mb("VmHWM"), "rss_after_step_mb": rss_mb("VmRSS")}
    names = dict(model.named_parameters())
    grads = {n: full(p.grad) for n, p in names.items() if p.grad is not None}  # collectives: on every rank
    params = {n: full(p) for n, p in names.items()}
    if out is not None:
        torch.save({"grads": grads, "params": params}, out)
    return measured


def rss_mb(key: str) -> float:
    """This process's resident set now (``VmRSS``) or at its peak (``VmHWM``), in MiB. Not
    ``getrusage``'s ``ru_maxrss``: a spawned rank inherits its parent's across fork and exec."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(f"{key}:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def all_reduce_sum(model: Any) -> None:
    for p in model.parameters():
        if p.grad is not None:
            dist.all_reduce(p.grad, op=dist.ReduceOp.SUM)


def rank_main(rank: int, world: int, port: int, mode: str, args: argparse.Namespace, folder: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        model = load(args.model)
        ids = batch(model.config.vocab_size, args.rows, args.tokens, args.seed)
        rows = ids.shape[0] // world
        mine, whole = ids[rank * rows:(rank + 1) * rows], ids.shape[0] * (ids.shape[1] - 1)
        reduce = all_reduce_sum
        if mode == "fsdp2":
            from torch.distributed.device_mesh import init_device_mesh
            from torch.distributed.fsdp import FSDPModule, fully_shard

            mesh = init_device_mesh("cpu", (world,))
            for layer in model.model.layers:
                fully_shard(layer, mesh=mesh)
            fully_shard(model, mesh=mesh)
            for module in model.modules():  # each fully_shard'ed module reduces its own parameters
                if isinstance(module, FSDPModule):
                    module.set_gradient_divide_factor(1.0)  # a SUM over the ranks: the shards are pre-divided
                    module.set_force_sum_reduction_for_comms(True)  # gloo has no PREMUL_SUM, the factor's op
            reduce = None
        result = step(model, mine, whole, Path(folder) / f"{mode}.pt" if rank == 0 else None, reduce)
        Path(folder, f"{mode}-rank{rank}.json").write_text(json.dumps(result))
    finally:
        dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def gaps(reference: dict[str, dict[str, torch.Tensor]], other: dict[str, dict[str, torch.Tensor]]) -> dict[str, float]:
    out = {}
    for kind in ("grads", "params"):
        assert reference[kind].keys() == other[kind].keys(), (kind, set(reference[kind]) ^ set(other[kind]))
        out[f"max_{kind[:-1]}_diff"] = max(float((reference[kind][n] - other[kind][n]).abs().max())
                                          for n in reference[kind])
    out["max_grad_abs"] = max(float(g.abs().max()) for g in reference["grads"].values())
    worst = max(reference["grads"], key=lambda n: float((reference["grads"][n] - other["grads"][n]).abs().max()))
    ref, got = reference["grads"][worst], other["grads"][worst]
    out["worst_grad"] = {"name": worst, "ratio_of_norms": float(got.norm() / ref.norm())}
    return out


def compare(model: str, ranks: int = 2, rows: int = 4, tokens: int = 64, seed: int = 0) -> dict[str, Any]:
    """One AdamW step three ways (``single``, ``replicated``, ``fsdp2``): each way's per-rank bytes and
    peak RSS, and the largest gradient and parameter gaps of the ranked ways against ``single``."""
    args = argparse.Namespace(model=model, rows=rows, tokens=tokens, seed=seed)
    result: dict[str, Any] = {"model": model, "ranks": ranks, "rows": rows, "tokens": tokens,
                              "torch": torch.__version__, "load_before": os.getloadavg()}
    with tempfile.TemporaryDirectory(prefix="gfcr-fsdp2-") as folder:
        start = time.perf_counter()
        policy = load(model)
        ids = batch(policy.config.vocab_size, rows, tokens, seed)
        result["single"] = step(policy, ids, ids.shape[0] * (ids.shape[1] - 1), Path(folder) / "single.pt")
        del policy
        for mode in ("replicated", "fsdp2"):
            mp.spawn(rank_main, args=(ranks, free_port(), mode, args, folder), nprocs=ranks)
            result[mode] = {"ranks": [json.loads(Path(folder, f"{mode}-rank{r}.json").read_text())
                                      for r in range(ranks)]}
        single = torch.load(Path(folder) / "single.pt")
        for mode in ("replicated", "fsdp2"):
            result[mode] |= gaps(single, torch.load(Path(folder) / f"{mode}.pt"))
        result["seconds"] = time.perf_counter() - start
    result["load_after"] = os.getloadavg()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--rows", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "fsdp2_cpu.json")
    args = parser.parse_args()
    result = compare(args.model, args.ranks, args.rows, args.tokens, args.seed)
    result["python"], result["argv"] = platform.python_version(), sys.argv
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({k: v for k, v in result.items() if k in ("replicated", "fsdp2", "single")}, indent=1))


if __name__ == "__main__":
    main()
