"""Partial rollouts (issue 11, Must show 2): APRIL and CoPRIS against synchronous sampling, SmolLM2 on GSM8K.

Three columns, one after another in one process, on the same prompt stream and the same update
batch of ``N`` groups of ``n`` rows, each over ``--steps`` steps:

- ``sync``: ``generate.sample`` on ``N`` prompts, every row to its end (the step waits for the
  longest row);
- ``april``: ``generate.partial`` on ``N' = 2N`` prompts, every row in flight at once,
  ``control.stop_at_target`` at ``N`` complete groups, the unfinished groups resumed first next step;
- ``copris``: the same with at most ``N * n`` rows in flight (``max_in_flight``, refilled at once:
  the concurrency of ``sync``).

The workload: temperature 0.7 and a 384-token cap, where SmolLM2's GSM8K answers have a long
tail (a probe of 16 rows: 49 to 384 tokens, median about 150; at temperature 1.0 and 192 or
256 tokens nearly every group holds a row that runs to the cap, so all groups end together
and there is no tail to cut, as the generation benchmark of contract v2 found).

Only generation is timed. Between steps the policy version is bumped as an update would
bump it, but the weights do not change (so lengths stay those of the initial policy and the
columns see the same length distribution); the off-policy token fraction is the share of the
update batch's tokens sampled at an earlier version, as the update would report it.

Per column: wall per step, generated tokens/s, the update batch's rows and tokens, and the
off-policy token fraction, over all steps and over the steps after the first (the buffer's
steady state). Results go to ``benchmarks/results/partial_rollouts.json``.

    PYTHONPATH=. HF_HUB_OFFLINE=1 python benchmarks/partial_rollouts.py
    PYTHONPATH=. HF_HUB_OFFLINE=1 python benchmarks/partial_rollouts.py --model tiny-arith --steps 3  # smoke
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from gfcr.engines import TransformersEngine, load_policy
from gfcr.records import Allocation, AllocationEntry, Prompt, RolloutGroups, StepContext
from gfcr.spec import PolicySpec
from gfcr.stages.control.stop_at_target import StopAtTarget
from gfcr.stages.generate.partial import Partial
from gfcr.stages.generate.sample import Sample
from gfcr.stages.resources import Resources

REPO = Path(__file__).resolve().parents[1]
GSM8K = [REPO.parent / "shared" / "data" / "gsm8k" / "train.jsonl", Path("/work/shared/data/gsm8k/train.jsonl")]


def load_prompts(count: int, model: str) -> list[Prompt]:
    if model == "tiny-arith":  # the smoke run: tiny-arith reads plain text
        return [Prompt(f"arith:{i}", text=f"What is {i % 90 + 10} + {i % 7 + 3}? Answer:") for i in range(count)]
    path = next((p for p in GSM8K if p.exists()), None)
    if path is None:
        raise SystemExit(f"GSM8K train.jsonl not found at {[str(p) for p in GSM8K]}")
    with path.open() as f:
        questions = [json.loads(line)["question"] for _, line in zip(range(count), f)]
    return [Prompt(f"gsm8k:train:{i}", messages=[{"role": "user", "content": q}]) for i, q in enumerate(questions)]


def run_column(name: str, stage: Any, policy: Any, prompts: list[Prompt], per_step: int, n: int,
               steps: int) -> dict[str, Any]:
    stream, records = iter(prompts), []
    for step in range(steps):
        entries = tuple(AllocationEntry(next(stream), n) for _ in range(per_step))
        start = time.perf_counter()
        with torch.no_grad():
            groups: RolloutGroups = stage.run(Allocation(step, entries), StepContext("bench", step, 0, policy.version))
        wall = time.perf_counter() - start
        kept = [g for g in groups.groups if g.verdict.included]
        batch = [r for g in kept for r in g.rollouts]
        tokens_in_batch = sum(len(r) for r in batch)
        stale = sum(int((r.policy_versions() < policy.version).sum()) for r in batch)
        generated = sum(r.generated_length for g in groups.groups for r in g.rollouts)
        records.append(dict(step=step, wall_s=round(wall, 3), tokens_generated=generated,
                            groups_complete=len(kept), rows_in_batch=len(batch), tokens_in_batch=tokens_in_batch,
                            off_policy_tokens=stale, buffered=len(getattr(stage, "buffer", ()))))
        print(f"{name} step {step}: {wall:.1f}s, {generated} tokens, {len(kept)} groups, "
              f"{stale}/{tokens_in_batch} off-policy", file=sys.stderr, flush=True)
        policy.version += 1  # as an update would; the weights stay (see the module docstring)
    return dict(steps=records, all=summary(records), after_first=summary(records[1:]))


def summary(records: list[dict[str, Any]]) -> dict[str, float]:
    if not records:
        return {}
    wall = sum(r["wall_s"] for r in records)
    tokens = sum(r["tokens_generated"] for r in records)
    batch = sum(r["tokens_in_batch"] for r in records)
    return dict(wall_per_step_s=round(wall / len(records), 3), tokens_per_s=round(tokens / wall, 2),
                groups_per_step=round(float(np.mean([r["groups_complete"] for r in records])), 2),
                batch_tokens_per_s=round(batch / wall, 2),
                off_policy_token_fraction=round(sum(r["off_policy_tokens"] for r in records) / max(batch, 1), 4))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--groups", type=int, default=4, help="N: groups in the update batch")
    ap.add_argument("--samples", type=int, default=4, help="n: rows per group")
    ap.add_argument("--max-new-tokens", type=int, default=384)
    ap.add_argument("--temperature", type=float, default=0.7)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--columns", default="sync,april,copris")
    ap.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "partial_rollouts.json")
    args = ap.parse_args()

    policy = load_policy(PolicySpec(model=args.model))
    policy.model.eval()
    engine = TransformersEngine(policy)
    prompts = load_prompts(2 * args.groups * args.steps + 2 * args.groups, args.model)
    sampling = dict(temperature=args.temperature, max_new_tokens=args.max_new_tokens)
    N, n = args.groups, args.samples
    results: dict[str, Any] = dict(model=args.model, groups=N, samples=n, max_new_tokens=args.max_new_tokens,
                                   temperature=args.temperature,
                                   steps=args.steps, threads=torch.get_num_threads(),
                                   machine=platform.processor() or platform.machine(),
                                   date=time.strftime("%Y-%m-%d"))
    for name in args.columns.split(","):
        policy.version = 0
        if name == "sync":
            stage, per_step = Sample(Sample.Config(**sampling)), N
        else:
            cap = N * n if name == "copris" else None
            stage, per_step = Partial(Partial.Config(**sampling, max_in_flight=cap)), 2 * N
        stage.setup(Resources(policy, engine))
        if name != "sync":
            stage.attach_in_flight([StopAtTarget(StopAtTarget.Config(groups=N))])
        results[name] = run_column(name, stage, policy, prompts, per_step, n, args.steps)
    results["ratios"] = {  # wall per step of sync over the column's: above 1, the column is faster
        f"{a}_speedup_{part}": round(results["sync"][part]["wall_per_step_s"] / results[a][part]["wall_per_step_s"], 3)
        for a in ("april", "copris") if a in results and "sync" in results for part in ("all", "after_first")}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2) + "\n")
    print(json.dumps({k: v for k, v in results.items() if k not in ("sync", "april", "copris")}, indent=2))
    for name in ("sync", "april", "copris"):
        if name in results:
            print(name, json.dumps(results[name]["all"]), json.dumps(results[name]["after_first"]))


if __name__ == "__main__":
    main()
