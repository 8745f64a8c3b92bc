"""gfcr's trainer ranks, replicated against sharded (issue 43, Must show 3): what each rank holds, and the
weights after one ``update.grpo`` step against one process's. SmolLM2-135M-Instruct, float32, 2 ranks.

One batch of rollouts (``--prompts`` arithmetic prompts x ``--samples`` samples of ``--tokens`` tokens,
sampled by the policy on the transformers engine, rewarded by hand so that every group has signal, their
behaviour log-probs moved off the policy's so that the ratios leave 1), one AdamW step (lr 1e-4, the
gradient clipped at norm 1) three ways:

- ``single``: ``update.grpo`` in this process, the whole batch;
- ``replicated``: ``RayTrainerGroup`` with ``resources: {replicas: 2}`` (each rank a full copy, the
  gradients summed by ``all_reduce``);
- ``fsdp2``: the same with ``sharding: fsdp2`` (each rank half the policy and AdamW, FSDP2 over gloo).

Per rank: the bytes of parameters and AdamW state it holds after the step (the step has cleared the
gradients, which at their peak take as many bytes as the parameters, sharded alike), its resident set
and its peak; and the largest difference of the weights rank 0 gathers after the step from the
one-process step's. Unlike ``benchmarks/fsdp2_cpu.py`` (plain processes, a plain NLL), this
runs the trainer ranks of a gfcr run (Ray actors, ``update.grpo``'s loss and micro-batches).

Run (a few CPU-minutes and about 8 GB; under the heavy lock on a shared machine):
    PYTHONPATH=. HF_HUB_OFFLINE=1 OMP_NUM_THREADS=1 python benchmarks/fsdp2_ranks.py
Smoke (tiny-arith):
    PYTHONPATH=. HF_HUB_OFFLINE=1 python benchmarks/fsdp2_ranks.py --model tiny-arith --out /tmp/fsdp2_ranks.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

REPO = Path(__file__).resolve().parents[1]
LR = 1e-4


def rollouts(model: str, prompts: int, samples: int, tokens: int) -> tuple[Any, Any, Any]:
    """The policy, the scored groups and their pool."""
    from gfcr.engines import TransformersEngine, load_policy
    from gfcr.records import Allocation, AllocationEntry, Prompt, PromptPool
    from gfcr.spec import PolicySpec
    from gfcr.stages.generate.sample import Sample
    from gfcr.stages.resources import Lent

    policy = load_policy(PolicySpec(model=model))
    pool = [Prompt(f"a:{i}", text=f"What is {10 + i} + {20 + 3 * i}? Answer:") for i in range(prompts)]
    sample = Sample(Sample.Config(max_new_tokens=tokens, seed=0))
    sample.setup(Lent(policy, TransformersEngine(policy)))
    groups = sample.run(Allocation(0, tuple(AllocationEntry(p, samples) for p in pool)))
    noise = np.random.default_rng(0)
    for g in groups:
        for i, rollout in enumerate(g.rollouts):
            rollout.reward = float(i % 2)  # every group has a correct and a wrong answer: signal everywhere
            for segment in rollout.segments:
                segment.behavior_logprobs += noise.normal(0.0, 0.3, segment.behavior_logprobs.shape).astype(np.float32)
    return policy, groups, PromptPool(pool)


def one_process(policy: Any, groups: Any, pool: Any, config: Any) -> tuple[list[Any], Any, dict[str, Any], float]:
    """The forward items, the plan, the weights after one step in this process, and its seconds."""
    from gfcr.stages.resources import Lent
    from gfcr.stages.training import Ranks
    from gfcr.stages.update.grpo import GRPOUpdate

    stage = GRPOUpdate(config)
    stage.setup(Lent(policy))
    items, _, _ = stage._batch(groups, pool)
    plan = stage.aggregation.plan([i.row() for i in items])
    forward = [i for i in items if len(i.rollout) and i.has_signal()]
    start = time.perf_counter()
    stage.train_shard(forward, plan, 0, Ranks())
    seconds = time.perf_counter() - start
    weights = {k: v.detach().clone() for k, v in policy.model.state_dict().items()}
    return forward, plan, weights, seconds


def on_ranks(model: str, sharding: str, forward: list[Any], plan: Any, config: Any,
             single: dict[str, Any]) -> dict[str, Any]:
    """One step on 2 ranks; what each holds after it, the seconds, the gap to one process's weights."""
    import ray

    from gfcr.runtime.ray.trainer_ranks import RayTrainerGroup
    from gfcr.runtime.training import split_balanced
    from gfcr.spec import PolicySpec
    from gfcr.spec import Resources as Placement
    from gfcr.stages.update.grpo import GRPOUpdate

    start = time.perf_counter()
    group = RayTrainerGroup.start(PolicySpec(model=model), Placement(replicas=2, sharding=sharding), GRPOUpdate, config)
    started = time.perf_counter() - start
    try:
        shards = split_balanced(forward, [len(i.rollout) for i in forward], 2)
        start = time.perf_counter()
        group.step(shards, plan, 0)
        step_s = time.perf_counter() - start
        held = ray.get([r.held.remote() for r in group.ranks])  # AdamW's state made; gradients cleared by the step
        start = time.perf_counter()
        weights = group.weights()
        gather_s = time.perf_counter() - start
    finally:
        group.close()
    diff = max(float((weights[n] - single[n]).abs().max()) for n in single)
    return {"ranks": held, "start_s": started, "step_s": step_s, "gather_s": gather_s, "max_param_diff": diff}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--samples", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=16)
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "fsdp2_ranks.json")
    args = parser.parse_args()
    from gfcr.runtime.ray.executor import connect
    from gfcr.spec import Resources as Placement
    from gfcr.stages.update.grpo import GRPOUpdate

    result: dict[str, Any] = {"model": args.model, "ranks": 2, "load_before": os.getloadavg()}
    config = GRPOUpdate.Config(lr=LR, micro_batch_size=4)
    policy, groups, pool = rollouts(args.model, args.prompts, args.samples, args.tokens)
    forward, plan, single, seconds = one_process(policy, groups, pool, config)
    result["rollouts"], result["response_tokens"] = len(forward), sum(len(i.rollout) for i in forward)
    result["single"] = {"step_s": seconds}
    del policy
    release = connect(None, Placement(replicas=1), Placement(replicas=2))
    try:
        for sharding in ("replicated", "fsdp2"):
            result[sharding] = on_ranks(args.model, sharding, forward, plan, config, single)
            print(sharding, json.dumps(result[sharding]), flush=True)
    finally:
        release()
    result["load_after"] = os.getloadavg()
    result["python"], result["argv"] = platform.python_version(), sys.argv
    args.out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
