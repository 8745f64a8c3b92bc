"""Run a pipeline from Python with ``gfcr.run``, as ``gfcr run`` runs it from the shell.

The pipeline is the quickstart (GRPO on tiny-arith), read from its YAML and made small with
the same ``KEY=VALUE`` overrides as ``--set``; the run gets a run directory, is tracked to
MLflow and, when it is done, ``gfcr.resume`` carries it two steps further from its
checkpoint. Run it from the repository root (about a minute on 2 CPU cores):

    python examples/run_from_python.py [OUT_DIR]

OUT_DIR (default ``runs/python-api``) holds the run directory and the MLflow store.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import gfcr


def main(out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    overrides = ["run.steps=4", "run.checkpoint_every=2", "stages.pick.with.batch_size=8", "eval.every=4",
                 "eval.with.n=50", "executor.kind=local", f"tracking.mlflow.uri=sqlite:///{out / 'mlflow.db'}"]
    summary = gfcr.run("pipelines/quickstart.yaml", overrides=overrides, run_dir=out / "quickstart")
    print(f"ran {summary['steps']} steps: eval accuracy {summary['eval_accuracy_before']} -> "
          f"{summary['eval_accuracy_after']}, {summary['tokens_generated']} tokens generated")
    summary = gfcr.resume(summary["run_dir"], steps=6)  # from the step-4 checkpoint
    steps = [json.loads(line)["step"] for line in Path(summary["metrics"]).read_text().splitlines()]
    print(f"resumed to {summary['steps']} steps; metrics.jsonl has steps {steps}")
    print(f"run directory: {summary['run_dir']}")


if __name__ == "__main__":
    main(Path(sys.argv[1]) if len(sys.argv) > 1 else Path("runs/python-api"))
