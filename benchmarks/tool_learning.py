"""Learning on the tool-using task (issue 41, Must show 3): does a tiny policy's success rate rise
over 200 steps with the calculator, and without the tool's result (the contrast)?

    OMP_NUM_THREADS=1 PYTHONPATH=. HF_HUB_OFFLINE=1 python benchmarks/tool_learning.py \\
        [--steps 200] [--seeds 0 1 2] [--set KEY=VALUE ...] [--out benchmarks/results/tool_learning.json]

Each run is ``pipelines/examples/multi_turn_calc_arith.yaml`` (tiny-arith, the transformers
engine, 8 prompts x 4 trajectories a step, up to 3 model turns, at most 2 calculator calls) for
``--steps`` steps, in two arms: ``tool`` (the calculator answers a call with its value) and
``withheld`` (``show_result: false``: a call is answered with the answer cue alone, so the
trajectory keeps its shape but the tool does not help). ``--set`` overrides apply to both arms
(e.g. a harder ``data``). Per step: the success rate (the share of trajectories whose answer the
environment scored correct, ``reward_mean``) and the tool-call rate (calls per trajectory). Per
arm: the curve's mean over seeds with a 95% Student-t interval per window of 20 steps, and the
first and last window side by side. Writes ``--out`` (every step of every run) and a plot beside
it (``.png``), and prints a markdown table for BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # this checkout's gfcr

PIPELINE = REPO / "pipelines" / "examples" / "multi_turn_calc_arith.yaml"
COMMON = ["executor.kind=local", "tracking.mlflow=null"]
ARMS = {"tool": [], "withheld": ["stages.rollout.with.environment.with.show_result=false"]}
WINDOW = 20
T975 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262}


def run_one(arm: str, seed: int, steps: int, extra: list[str]) -> dict[str, Any]:
    from gfcr.graph import load_pipeline
    from gfcr.runtime.loop.session import Run

    overrides = COMMON + ARMS[arm] + extra + [f"run.seed={seed}", f"run.steps={steps}",
                                              f"run.checkpoint_every={steps + 1}"]
    with tempfile.TemporaryDirectory() as tmp:
        Run.start(load_pipeline(PIPELINE, overrides), Path(tmp) / "run").train()
        records = [json.loads(line) for line in (Path(tmp) / "run" / "metrics.jsonl").read_text().splitlines()]
    rollout = [r["stages"].get("rollout", {}) for r in records]
    return {"arm": arm, "seed": seed, "success": [r["reward_mean"] for r in records],
            "tool_calls": [s.get("tool_calls", 0.0) / max(s.get("trajectories", 1.0), 1.0) for s in rollout],
            "turns": [s.get("turns_mean", 0.0) for s in rollout]}


def interval(values: list[float]) -> tuple[float, float | None]:
    mean = statistics.mean(values)
    if len(values) < 2:
        return mean, None
    return mean, T975.get(len(values) - 1, 1.96) * statistics.stdev(values) / math.sqrt(len(values))


def windows(series: list[float]) -> list[float]:
    return [statistics.mean(series[i:i + WINDOW]) for i in range(0, len(series) - WINDOW + 1, WINDOW)]


def table(runs: list[dict[str, Any]]) -> str:
    lines = [f"| arm | seeds | success, steps 1-{WINDOW} | success, last {WINDOW} steps | change | "
             f"tool calls per trajectory, first {WINDOW} | last {WINDOW} |", "|---|---|---|---|---|---|---|"]
    for arm in ARMS:
        rs = [r for r in runs if r["arm"] == arm]
        if not rs:
            continue
        first = [windows(r["success"])[0] for r in rs]
        last = [windows(r["success"])[-1] for r in rs]
        calls_first = [windows(r["tool_calls"])[0] for r in rs]
        calls_last = [windows(r["tool_calls"])[-1] for r in rs]
        cells = [interval(x) for x in (first, last, [b - a for a, b in zip(first, last)], calls_first, calls_last)]
        lines.append(f"| {arm} | {len(rs)} | " + " | ".join(_fmt(*c) for c in cells) + " |")
    return "\n".join(lines)


def _fmt(mean: float, half: float | None) -> str:
    return f"{mean:.3f}" if half is None else f"{mean:.3f} ± {half:.3f}"


def plot(runs: list[dict[str, Any]], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 3.6))
    for arm, colour in zip(ARMS, ("tab:blue", "tab:orange")):
        rs = [r for r in runs if r["arm"] == arm]
        for ax, key in zip(axes, ("success", "tool_calls")):
            curves = [windows(r[key]) for r in rs]
            if not curves:
                continue
            x = [WINDOW * (i + 1) for i in range(len(curves[0]))]
            means = [statistics.mean(c[i] for c in curves) for i in range(len(x))]
            ax.plot(x, means, color=colour, label=f"{arm} (mean of {len(rs)} seeds)")
            for c in curves:
                ax.plot(x, c, color=colour, alpha=0.25, linewidth=0.8)
    axes[0].set(xlabel="step", ylabel=f"success rate (mean of {WINDOW} steps)", title="calculator task, tiny-arith")
    axes[1].set(xlabel="step", ylabel="calculator calls per trajectory", title="tool use")
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def load_average() -> str:
    return " ".join(f"{x:.1f}" for x in os.getloadavg())


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    parser.add_argument("--arms", nargs="+", default=list(ARMS), choices=list(ARMS))
    parser.add_argument("--set", dest="extra", action="append", default=[], help="an override for every run")
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "tool_learning.json")
    args = parser.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    result: dict[str, Any] = {"load_before": load_average(), "steps": args.steps, "overrides": args.extra, "runs": []}
    for seed in args.seeds:
        for arm in args.arms:
            result["runs"].append(run_one(arm, seed, args.steps, args.extra))
            print(arm, seed, f"success first {WINDOW}: {windows(result['runs'][-1]['success'])[0]:.3f}",
                  f"last {WINDOW}: {windows(result['runs'][-1]['success'])[-1]:.3f}", f"(load {load_average()})",
                  flush=True)
    result["load_after"] = load_average()
    result["table"] = table(result["runs"])
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result) + "\n")
    plot(result["runs"], args.out.with_suffix(".png"))
    print(result["table"])
    return result


if __name__ == "__main__":
    main()
