"""What does the Prefect runner cost? Step time of the same pipeline under `--executor prefect`
(a flow run, a task run per stage execution) and `--executor local` (in-process), side by
side in one invocation, alternating runs so that drifts in machine load hit both.

    .venv/bin/python benchmarks/prefect_overhead.py [--pipeline pipelines/quickstart.yaml]
        [--steps 30] [--repeats 2] [--set KEY=VALUE]...

Per step it reads `time.step_s` from metrics.jsonl (the step itself: every stage call, with
Prefect's task bookkeeping under the Prefect runner; not evaluation, checkpoints or start-up).
Both runners do identical work step for step (same seed, same rollouts: the script checks
that the metrics agree), so the headline ratio is paired: the total time of steps 1..N-1
under Prefect over the same steps under the local runner (step 0 warms caches up). It also
prints the ratio of medians and each run's wall time from start to exit (which includes
starting Prefect's embedded server). Results: benchmarks/results/prefect_overhead_<pipeline>.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def one_run(pipeline: str, executor: str, steps: int, overrides: list[str], workdir: Path) -> dict:
    run_dir = workdir / f"{executor}-{time.monotonic_ns()}"
    cmd = [str(REPO / ".venv" / "bin" / "gfcr"), "run", pipeline, "--steps", str(steps), "--executor", executor,
           "--run-dir", str(run_dir), "--set", "tracking.mlflow=null", "--set", f"eval.every={10 * steps}"]
    for override in overrides:
        cmd += ["--set", override]
    start = time.perf_counter()
    subprocess.run(cmd, check=True, env={**os.environ, "HF_HUB_OFFLINE": "1", "PREFECT_HOME": str(workdir / "prefect")},
                   stdout=subprocess.DEVNULL)
    wall = time.perf_counter() - start
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    step_s = [line["time"]["step_s"] for line in lines]
    return {"executor": executor, "wall_s": wall, "step_s": step_s,
            "metrics": [{k: v for k, v in line.items() if k != "time"} for line in lines]}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--pipeline", default=str(REPO / "pipelines" / "quickstart.yaml"))
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--set", dest="overrides", action="append", default=[])
    args = parser.parse_args()
    workdir = Path(tempfile.mkdtemp(prefix="gfcr-prefect-bench-"))
    runs = []
    for _ in range(args.repeats):
        for executor in ("local", "prefect"):
            runs.append(one_run(args.pipeline, executor, args.steps, args.overrides, workdir))
            print(f"{executor:8s} wall {runs[-1]['wall_s']:7.1f} s  steps {[round(s, 3) for s in runs[-1]['step_s']]}")
    summary = {}
    for executor in ("local", "prefect"):
        mine = [r for r in runs if r["executor"] == executor]
        steady = [s for r in mine for s in r["step_s"][1:]]  # the first step of a run warms caches up
        summary[executor] = {"median_step_s": statistics.median(steady), "mean_step_s": statistics.fmean(steady),
                             "wall_s": [round(r["wall_s"], 1) for r in mine], "steps_measured": len(steady)}
    ratio = summary["prefect"]["median_step_s"] / summary["local"]["median_step_s"]
    paired = (sum(s for r in runs if r["executor"] == "prefect" for s in r["step_s"][1:])
              / sum(s for r in runs if r["executor"] == "local" for s in r["step_s"][1:]))
    same = all(r["metrics"] == runs[0]["metrics"] for r in runs)
    print(f"median step: local {summary['local']['median_step_s']:.3f} s, prefect "
          f"{summary['prefect']['median_step_s']:.3f} s, ratio of medians {ratio:.3f}")
    print(f"paired ratio (total time of steps 1..N-1, prefect over local): {paired:.3f}")
    print(f"metrics (all but time) identical across all {len(runs)} runs: {same}")
    out = REPO / "benchmarks" / "results" / f"prefect_overhead_{Path(args.pipeline).stem}.json"
    out.write_text(json.dumps({"pipeline": args.pipeline, "steps": args.steps, "repeats": args.repeats,
                               "overrides": args.overrides, "summary": summary, "ratio_of_medians": ratio,
                               "paired_ratio_prefect_over_local": paired,
                               "metrics_identical": same,
                               "runs": [{k: v for k, v in r.items() if k != "metrics"} for r in runs]},
                              indent=2) + "\n")


if __name__ == "__main__":
    main()
