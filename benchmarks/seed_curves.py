"""Learning curves over seeds: each pipeline's greedy eval accuracy at chosen steps, for
several seeds, with the mean and the seed spread (min, max) per step.

    .venv/bin/python benchmarks/seed_curves.py [--pipelines quickstart greso_arith dapo_arith]
        [--seeds 0 1 2] [--steps 40] [--every 20] [--label NAME]

Runs on the local runner without tracking (the numbers are the same under Prefect) and
writes ``benchmarks/results/seed_curves_<label>.json``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path

from gfcr.graph import load_pipeline
from gfcr.runtime.loop.session import Run

REPO = Path(__file__).resolve().parents[1]


def curve(pipeline: str, seed: int, steps: int, every: int) -> dict[int, float]:
    """Eval accuracy by step of one seeded run."""
    overrides = [f"run.steps={steps}", f"run.seed={seed}", f"eval.every={every}", "executor.kind=local",
                 "tracking.mlflow=null"]
    compiled = load_pipeline(REPO / "pipelines" / f"{pipeline}.yaml", overrides)
    run_dir = Path(tempfile.mkdtemp(prefix="gfcr-curve-")) / "run"
    summary = Run.start(compiled, run_dir).train()
    points = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        if "eval_accuracy" in record:
            points[record["step"]] = record["eval_accuracy"]
    points[steps] = summary["eval_accuracy_after"]
    return points


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--pipelines", nargs="+", default=["quickstart", "greso_arith", "dapo_arith"])
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--every", type=int, default=20)
    parser.add_argument("--label", default="current")
    args = parser.parse_args()
    results: dict[str, dict] = {}
    for name in args.pipelines:
        runs = {seed: curve(name, seed, args.steps, args.every) for seed in args.seeds}
        steps = sorted(next(iter(runs.values())))
        table = {}
        for step in steps:
            values = [runs[s][step] for s in args.seeds]
            table[step] = {"mean": statistics.mean(values), "min": min(values), "max": max(values), "seeds": values}
            print(f"{name:12s} step {step:3d}: mean {table[step]['mean']:.3f}  "
                  f"[{table[step]['min']:.3f}, {table[step]['max']:.3f}]  {values}", flush=True)
        results[name] = table
    out = REPO / "benchmarks" / "results" / f"seed_curves_{args.label}.json"
    out.write_text(json.dumps({"args": vars(args), "results": results}, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
