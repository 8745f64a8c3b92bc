"""Does the policy learn? Run a pipeline (default: the seeded quickstart, tiny-arith GRPO) and
print its greedy eval accuracy against steps, rollouts and tokens, with the gain over step 0.

    .venv/bin/python benchmarks/learning_curve.py [--pipeline pipelines/quickstart.yaml] [--steps 200]
        [--seed 0] [--set KEY=VALUE]...

Writes ``benchmarks/results/learning_<pipeline>_seed<seed>.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--pipeline", default=str(REPO / "pipelines" / "quickstart.yaml"))
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--set", dest="overrides", action="append", default=[])
    args = parser.parse_args()
    run_dir = Path(tempfile.mkdtemp(prefix="gfcr-learning-")) / "run"
    cmd = [str(REPO / ".venv" / "bin" / "gfcr"), "run", args.pipeline, "--steps", str(args.steps),
           "--run-dir", str(run_dir), "--set", f"run.seed={args.seed}"]
    for override in args.overrides:
        cmd += ["--set", override]
    subprocess.run(cmd, check=True, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    summary = json.loads((run_dir / "summary.json").read_text())
    curve, rollouts, tokens = [], 0, 0
    for r in records:
        if "eval_accuracy" in r:
            curve.append({"step": r["step"], "rollouts": rollouts, "tokens": tokens, "eval_accuracy": r["eval_accuracy"]})
        rollouts += r["rollouts_generated"]
        tokens += r["tokens_generated"]
    curve.append({"step": len(records), "rollouts": rollouts, "tokens": tokens,
                  "eval_accuracy": summary["eval_accuracy_after"]})
    before = curve[0]["eval_accuracy"]
    print("| step | rollouts | tokens | eval accuracy | gain (points) |")
    print("|---|---|---|---|---|")
    for point in curve:
        print(f"| {point['step']} | {point['rollouts']} | {point['tokens']} | {point['eval_accuracy']:.1%} | "
              f"{100 * (point['eval_accuracy'] - before):+.1f} |")
    name = Path(args.pipeline).stem
    out = REPO / "benchmarks" / "results" / f"learning_{name}_seed{args.seed}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"command": cmd, "curve": curve, "summary": summary}, indent=2) + "\n")


if __name__ == "__main__":
    main()
