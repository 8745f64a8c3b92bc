"""Step truncation (issue 11, ``control.truncate_steps``): what Step-GRPO's Dynamic Truncated Rollout,
with DEER's confidence test, does to SmolLM2's GSM8K rollouts, against plain ``generate.sample``.

Columns, one after another in one process for each seed, on the same prompts and the same
per-row random streams (so a row is the same sample in every column up to its first exit):

- ``sample``: ``generate.sample``, every row to its end;
- ``truncate@T``: the same with ``control.truncate_steps`` (threshold ``T``) in flight: at each step
  marker a greedy trial answer after DEER's inducer, and an exit when its mean token probability
  is above ``T``.

No update: this measures the rollouts only (the effect Step-GRPO trains for, fewer tokens at the
same accuracy, needs a training run on a reasoning model, far beyond two CPU cores). Per column
and seed: response tokens (sampled and appended), the trial answers' own tokens and prefill,
wall, the exits, and the correct fraction under the ``gsm8k`` verifier (the pipeline's reward).
The table gives the mean over seeds and a 95% t-interval of the per-seed values.

    PYTHONPATH=. HF_HUB_OFFLINE=1 python benchmarks/truncate_steps.py
    PYTHONPATH=. HF_HUB_OFFLINE=1 python benchmarks/truncate_steps.py --prompts 2 --samples 2 --seeds 0  # smoke
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
from scipy import stats

from gfcr.engines import TransformersEngine, load_policy
from gfcr.records import Allocation, AllocationEntry, StepContext
from gfcr.spec import PolicySpec
from gfcr.stages.control.truncate_steps import TruncateSteps
from gfcr.stages.data.gsm8k import Gsm8kSource
from gfcr.stages.generate.sample import Sample
from gfcr.stages.resources import Lent
from gfcr.stages.verifiers.scoring import score_texts

REPO = Path(__file__).resolve().parents[1]
GSM8K = [REPO.parent / "shared" / "data" / "gsm8k" / "train.jsonl", Path("/work/shared/data/gsm8k/train.jsonl")]


def run_column(column: str, policy: Any, engine: Any, pool: list, args: argparse.Namespace, seed: int) -> dict:
    resources = Lent(policy, engine)
    stage = Sample(Sample.Config(temperature=args.temperature, max_new_tokens=args.max_new_tokens))
    stage.setup(resources)
    controller = None
    if column != "sample":
        controller = TruncateSteps(TruncateSteps.Config(threshold=float(column.split("@")[1]), markers=args.markers,
                                                        confidence=args.confidence, repeats=args.repeats))
        controller.setup(resources)
        controller.before_step(None)
        stage.attach_in_flight([controller])
    allocation = Allocation(0, tuple(AllocationEntry(p, args.samples) for p in pool))
    start = time.perf_counter()
    with torch.no_grad():
        groups = stage.run(allocation, StepContext("bench", 0, seed, policy.version))
    wall = time.perf_counter() - start
    rollouts = [r for g in groups.groups for r in g.rollouts]
    spec = {p.prompt_id: p.verifier for p in pool}
    scores = score_texts([(r.text or "", spec[r.prompt_id]) for r in rollouts])
    correct = [bool(s.correct) for _, s in scores]
    exited = [r.finish_reason == "exited" for r in rollouts]
    tokens = sum(len(r) for r in rollouts)
    forced = sum(r.forced_tokens for r in rollouts)
    metrics = controller.step_metrics() if controller else {}
    probe = int(metrics.get("probe_tokens", 0))
    row = dict(column=column, seed=seed, rows=len(rollouts), wall_s=round(wall, 2), response_tokens=tokens,
               sampled_tokens=tokens - forced, forced_tokens=forced, probe_tokens=probe,
               probe_prefill_tokens=resources.tokens_scored - forced,  # less the appended tokens, scored once each
               tokens_charged=resources.tokens_charged, checks=int(metrics.get("checks", 0)),
               exits=int(sum(exited)), exit_fraction=round(float(np.mean(exited)), 4),
               correct_fraction=round(float(np.mean(correct)), 4),
               correct_of_exited=round(float(np.mean([c for c, e in zip(correct, exited) if e])), 4) if any(exited) else None,
               mean_length=round(tokens / len(rollouts), 1), confidence_mean=metrics.get("confidence_mean"),
               finish=_count([r.finish_reason for r in rollouts]),
               confidences=[round(c, 4) for c in controller.confidences] if controller else [])
    print(json.dumps({k: v for k, v in row.items() if k != "confidences"}), file=sys.stderr, flush=True)
    return row


def _count(items: list[str]) -> dict[str, int]:
    out: dict[str, int] = {}
    for x in items:
        out[x] = out.get(x, 0) + 1
    return out


def interval(values: list[float]) -> tuple[float, float]:
    """Mean and the half-width of a 95% t-interval over seeds (0 for one seed)."""
    v = np.asarray(values, np.float64)
    if len(v) < 2:
        return float(v.mean()), 0.0
    return float(v.mean()), float(stats.t.ppf(0.975, len(v) - 1) * v.std(ddof=1) / np.sqrt(len(v)))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--prompts", type=int, default=12)
    ap.add_argument("--samples", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--temperature", type=float, default=0.7)
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--columns", default="sample,truncate@0.95,truncate@0.6")
    ap.add_argument("--markers", type=json.loads, default=["\n"],
                    help='JSON list of step markers (default ["\\n"]: SmolLM2 writes a step a line)')
    ap.add_argument("--confidence", choices=["geometric", "mean"], default="geometric",
                    help="the trial answer's confidence (the figures of 2026-12-02 were measured with mean)")
    ap.add_argument("--repeats", type=lambda v: None if v == "none" else int(v), default=3,
                    help="repetition exit after this many repeated step chunks, or none (2026-12-02: none)")
    ap.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "truncate_steps.json")
    args = ap.parse_args()

    path = next((p for p in GSM8K if p.exists()), None)
    if path is None:
        raise SystemExit(f"GSM8K train.jsonl not found at {[str(p) for p in GSM8K]}")
    pool = list(Gsm8kSource(Gsm8kSource.Config(path=str(path), split="train", limit=args.prompts)).load())
    policy = load_policy(PolicySpec(model=args.model))
    policy.model.eval()
    engine = TransformersEngine(policy)
    results: dict[str, Any] = dict(model=args.model, prompts=args.prompts, samples=args.samples, markers=args.markers,
                                   max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                                   threads=torch.get_num_threads(), machine=platform.processor() or platform.machine(),
                                   date=time.strftime("%Y-%m-%d"), runs=[])
    columns = args.columns.split(",")
    for seed in [int(s) for s in args.seeds.split(",")]:
        for column in columns:
            results["runs"].append(run_column(column, policy, engine, pool, args, seed))
    table = {}
    for column in columns:
        runs = [r for r in results["runs"] if r["column"] == column]
        table[column] = {k: interval([float(r[k]) for r in runs]) for k in (
            "wall_s", "response_tokens", "sampled_tokens", "forced_tokens", "probe_tokens", "probe_prefill_tokens",
            "exit_fraction", "correct_fraction", "mean_length")}
    base = [r for r in results["runs"] if r["column"] == columns[0]]
    for column in columns[1:]:
        runs = [r for r in results["runs"] if r["column"] == column]
        table[column]["token_ratio"] = interval([r["response_tokens"] / b["response_tokens"] for r, b in zip(runs, base)])
        table[column]["wall_ratio"] = interval([r["wall_s"] / b["wall_s"] for r, b in zip(runs, base)])
        table[column]["correct_diff"] = interval([r["correct_fraction"] - b["correct_fraction"] for r, b in zip(runs, base)])
    for column in columns[1:]:  # every trial answer's confidence, over the seeds
        values = np.array([c for r in results["runs"] if r["column"] == column for c in r["confidences"]])
        if len(values):
            table[column]["confidence_quantiles"] = {q: float(np.quantile(values, q)) for q in (0.5, 0.9, 0.99, 1.0)}
    results["table"] = table
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2) + "\n")
    for column, row in table.items():
        print(column, json.dumps({k: v if isinstance(v, dict) else [round(v[0], 4), round(v[1], 4)] for k, v in row.items()}))


if __name__ == "__main__":
    main()
