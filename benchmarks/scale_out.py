"""Scale-out on a local Ray cluster (issue 32, Must show 4): step time for 1 and 2 engine
replicas x 1 and 2 trainer ranks, side by side in one invocation.

Each configuration is one ``gfcr run`` of the same seeded pipeline (default
``pipelines/grpo_arith_smollm2.yaml``) on ``executor: {kind: ray}``, with
``stages.rollout.resources.replicas = E`` engine replicas and ``update.resources.replicas = N``
trainer ranks. The configurations run one after another in a rotating order, ``--rounds``
times (round r starts at configuration r), so a drift in the shared machine's load falls on
each of them alike. Per run the script reads ``metrics.jsonl``: the median over the steps
after the first (which carries the engines' warm-up) of the step's wall, the generate stage's,
the update's (which includes the weight sync) and the sync's, and the run's whole wall
(Ray start, model loads and a final evaluation of 8 prompts included). ``N = 1`` is the update
in the driver process (no trainer rank: the default); ``N = 2`` is two trainer ranks over gloo.

    PYTHONPATH=. HF_HUB_OFFLINE=1 python benchmarks/scale_out.py                      # SmolLM2, hf engines
    PYTHONPATH=. HF_HUB_OFFLINE=1 python benchmarks/scale_out.py --pipeline pipelines/quickstart.yaml \\
        --steps 3 --rounds 1                                                          # smoke, tiny-arith

Results: ``benchmarks/results/scale_out.json`` (every run's per-step times too).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def run_config(pipeline: Path, engines: int, ranks: int, steps: int, engine: str, extra: list[str],
               work: Path) -> dict:
    run_dir = work / f"e{engines}-n{ranks}-{time.monotonic_ns()}"
    cmd = [sys.executable, "-m", "gfcr.cli.main", "run", str(pipeline), "--steps", str(steps),
           "--run-dir", str(run_dir), "--executor", "ray",
           "--set", f"policy.engine={engine}",
           "--set", f"stages.rollout.resources.replicas={engines}",
           "--set", f"update.resources.replicas={ranks}",
           "--set", "tracking.mlflow=null", "--set", "eval.every=1000", "--set", "eval.with.n=8"]  # the final eval only, small
    for item in extra:
        cmd += ["--set", item]
    start = time.perf_counter()
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
    wall = time.perf_counter() - start
    if done.returncode != 0:
        raise SystemExit(f"E={engines} N={ranks} failed (exit {done.returncode}):\n{done.stdout[-3000:]}\n"
                         f"{done.stderr[-3000:]}")
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    steady = rows[1:] or rows

    def median(get) -> float:
        return round(statistics.median(get(r) for r in steady), 3)

    return dict(engines=engines, ranks=ranks, run_wall_s=round(wall, 1),
                step_s=median(lambda r: r["time"]["step_s"]),
                generate_s=median(lambda r: r["time"]["stages_s"].get("rollout", 0.0)),
                update_s=median(lambda r: r["time"]["stages_s"].get("update", 0.0)),
                sync_s=median(lambda r: r["time"].get("sync_s", 0.0)),
                steps=[dict(step=r["step"], step_s=r["time"]["step_s"], stages_s=r["time"]["stages_s"],
                            sync_s=r["time"].get("sync_s"), reward_mean=r.get("reward_mean")) for r in rows],
                load_after=" ".join(f"{x:.2f}" for x in os.getloadavg()))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pipeline", type=Path, default=REPO / "pipelines" / "grpo_arith_smollm2.yaml")
    ap.add_argument("--configs", default="1x1,2x1,1x2,2x2", help="E x N: engine replicas x trainer ranks")
    ap.add_argument("--steps", type=int, default=3, help="steps a run (the first is left out of the medians)")
    ap.add_argument("--rounds", type=int, default=2, help="how many times every configuration runs")
    ap.add_argument("--engine", choices=["hf", "vllm", "auto"], default="hf")
    ap.add_argument("--set", dest="extra", action="append", default=[], help="more --set overrides")
    ap.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "scale_out.json")
    args = ap.parse_args()
    configs = [tuple(int(x) for x in c.split("x")) for c in args.configs.split(",")]
    result = dict(pipeline=str(args.pipeline.relative_to(REPO) if args.pipeline.is_relative_to(REPO)
                               else args.pipeline),
                  engine=args.engine, steps=args.steps, rounds=args.rounds, extra=args.extra,
                  cpus=os.cpu_count(), machine=platform.machine(),
                  date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                  load_start=" ".join(f"{x:.2f}" for x in os.getloadavg()), runs=[])
    with tempfile.TemporaryDirectory(prefix="gfcr-scale-out-") as tmp:
        for r in range(args.rounds):
            for i in range(len(configs)):
                engines, ranks = configs[(r + i) % len(configs)]
                record = run_config(args.pipeline, engines, ranks, args.steps, args.engine, args.extra, Path(tmp))
                record["round"] = r
                result["runs"].append(record)
                print(f"round {r} E={engines} N={ranks}: step {record['step_s']} s (generate {record['generate_s']}, "
                      f"update {record['update_s']}, sync {record['sync_s']}), run {record['run_wall_s']} s, "
                      f"load {record['load_after']}", flush=True)
                args.out.parent.mkdir(parents=True, exist_ok=True)
                args.out.write_text(json.dumps(result, indent=2) + "\n")
    base = None
    table = []
    for engines, ranks in configs:
        mine = [x for x in result["runs"] if (x["engines"], x["ranks"]) == (engines, ranks)]
        row = {k: round(statistics.median(x[k] for x in mine), 3) for k in ("step_s", "generate_s", "update_s",
                                                                             "sync_s", "run_wall_s")}
        base = base or row["step_s"]
        row.update(engines=engines, ranks=ranks, speedup=round(base / row["step_s"], 3))
        table.append(row)
    result["table"] = table
    result["load_end"] = " ".join(f"{x:.2f}" for x in os.getloadavg())
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print("| engine replicas | trainer ranks | step (s) | generate (s) | update (s) | sync (s) | run wall (s) | "
          "1x1 step over this |")
    print("|---|---|---|---|---|---|---|---|")
    for row in table:
        print(f"| {row['engines']} | {row['ranks']} | {row['step_s']} | {row['generate_s']} | {row['update_s']} | "
              f"{row['sync_s']} | {row['run_wall_s']} | {row['speedup']}x |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
