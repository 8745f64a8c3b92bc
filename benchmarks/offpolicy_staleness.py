"""The off-policy update components on stale rollouts (issue 39, Must show 3): final accuracy and
gradient-norm spread of tiny-arith runs at staleness 0, 2 and 8, per component, over seeds.

    .venv/bin/python benchmarks/offpolicy_staleness.py [--components tis decoupled_clip m2po sat vcpo]
        [--staleness 0 2 8] [--seeds 0 1 2 3 4] [--steps 20] [--mode pipelined|async]
        [--out benchmarks/results/offpolicy_staleness.json]

Each cell is ``pipelines/quickstart.yaml`` (16 prompts x 8 rollouts a step, tiny-arith, the
transformers engine) run in this process for ``--steps`` steps with one component's update
settings (``COMPONENTS``; another component is one entry there), at staleness ``K``: by default
``lifecycle: {mode: pipelined, lag: K, overlap: false}`` (step t trains on rollouts sampled with
the weights of step t - K; deterministic, the sequential twin), with ``--mode async``
``lifecycle: {mode: async, max_staleness: K}`` (generation runs ahead in its own thread, at most K
versions; the realised staleness depends on timing, so runs are not bit-reproducible); ``K = 0``
is the synchronous lifecycle in both. Per run: the greedy accuracy on 200 held-out problems
after the last step (``eval_accuracy_after``) and the spread of the update's gradient norm over
its steps (the standard deviation of ``grad_norm`` before clipping, and its maximum). Per cell:
the mean over seeds with a 95% Student-t interval (none for one seed).

Writes ``--out`` (every run's figures, the cell summaries, the load before and after) and prints
a markdown table for BENCHMARKS.md.
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

PIPELINE = REPO / "pipelines" / "quickstart.yaml"
COMMON = ["executor.kind=local", "tracking.mlflow=null", "policy.engine=hf"]
# the update's settings per component (--set overrides on quickstart's update.grpo); the staleness
# limits are above the largest lag, so no token is masked for its age
COMPONENTS: dict[str, list[str]] = {
    "tis": ["update.with.correction={\"use\": \"tis\", \"with\": {\"cap\": 2.0}}"],
    "decoupled_clip": ["update.with.correction={\"use\": \"decoupled_clip\"}"],
    "m2po": ["update.with.loss={\"use\": \"m2po\", \"with\": {\"m2_budget\": 0.04}}",
             "update.with.correction={\"use\": \"staleness\", \"with\": {\"max_staleness\": 16}}"],
    "vcpo": ["update.with.advantage={\"use\": \"opob\"}", "update.with.aggregation={\"use\": \"seq_mean_token_mean\"}",
             "update.with.loss={\"use\": \"ppo_clip\", \"with\": {\"clip\": [1.0, 1.0e9]}}",
             "update.with.correction={\"use\": \"seq_tis\", \"with\": {\"cap\": 8.0}}",
             "update.with.lr_rule={\"use\": \"vcpo_ess\"}", "update.with.weight_decay=0.1"],
    "sat": ["update.with.loss={\"use\": \"sat\", \"with\": {\"clip\": [0.2, 0.2], \"quantile\": 0.9}}",
            "update.with.correction={\"use\": \"staleness\", \"with\": {\"max_staleness\": 16}}"],
    "ppo_ewma": ["update.with.loss={\"use\": \"ppo_clip\", \"with\": {\"clip\": [0.2, 0.2]}}",
                 "update.with.correction={\"use\": \"ewma_proximal\", \"with\": {\"decay\": 0.8}}"],
}
T975 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262}  # by dof


def load_average() -> str:
    return " ".join(f"{x:.1f}" for x in os.getloadavg())


def staleness_overrides(lag: int, mode: str = "pipelined") -> list[str]:
    if lag == 0:
        return []
    if mode == "async":
        return ["lifecycle.mode=async", f"lifecycle.max_staleness={lag}"]
    return ["lifecycle.mode=pipelined", f"lifecycle.lag={lag}", "lifecycle.overlap=false"]


def run_one(component: str, lag: int, seed: int, steps: int, extra: list[str],
            mode: str = "pipelined") -> dict[str, Any]:
    """One run's final accuracy and gradient-norm spread."""
    from gfcr.graph import load_pipeline
    from gfcr.runtime.loop.session import Run

    overrides = (COMMON + COMPONENTS[component] + staleness_overrides(lag, mode)
                 + [f"run.seed={seed}", f"run.steps={steps}", f"run.checkpoint_every={steps + 1}",
                    f"eval.every={steps + 1}"] + extra)
    with tempfile.TemporaryDirectory() as tmp:
        summary = Run.start(load_pipeline(PIPELINE, overrides), Path(tmp) / "run").train()
        records = [json.loads(line) for line in (Path(tmp) / "run" / "metrics.jsonl").read_text().splitlines()]
        ages = trained_staleness(Path(tmp) / "run" / "lineage")
    norms = [r["update"]["grad_norm"] for r in records if "grad_norm" in r.get("update", {})]
    return {"component": component, "mode": mode if lag else "sync", "staleness": lag, "seed": seed, "accuracy": summary["eval_accuracy_after"],
            "grad_norm_std": statistics.pstdev(norms) if len(norms) > 1 else 0.0,
            "grad_norm_max": max(norms) if norms else 0.0, "steps_trained": len(norms),
            "stale_token_fraction": statistics.mean(r["update"].get("off_policy_token_fraction", 0.0)
                                                    for r in records if r.get("update")),
            "staleness_mean": statistics.mean(ages) if ages else 0.0, "staleness_max": max(ages, default=0)}


def trained_staleness(lineage: Path) -> list[int]:
    """The realised staleness of every rollout the update trained (lineage's ``staleness``: versions
    between the one that sampled it and the one that trained it)."""
    import pyarrow.parquet as pq

    ages: list[int] = []
    for file in sorted(lineage.glob("step-*.parquet")):
        table = pq.read_table(file, columns=["staleness", "in_update"]).to_pydict()
        ages += [age for age, used in zip(table["staleness"], table["in_update"]) if used and age is not None]
    return ages


def interval(values: list[float]) -> tuple[float, float | None]:
    """The mean and the half-width of its 95% Student-t interval (None for one value)."""
    mean = statistics.mean(values)
    if len(values) < 2:
        return mean, None
    return mean, T975.get(len(values) - 1, 1.96) * statistics.stdev(values) / math.sqrt(len(values))


def table(runs: list[dict[str, Any]]) -> str:
    cells: dict[tuple[str, int], list[dict[str, Any]]] = {}
    for r in runs:
        cells.setdefault((r["component"], r["staleness"]), []).append(r)
    lines = ["| component | staleness | seeds | final accuracy | grad-norm std | grad-norm max | stale-token share "
             "| realised staleness, mean | max |", "|---|---|---|---|---|---|---|---|---|"]
    for (component, lag), rs in cells.items():
        figures = [_fmt(*interval([r[k] for r in rs]))
                   for k in ("accuracy", "grad_norm_std", "grad_norm_max", "stale_token_fraction")]
        if all("staleness_mean" in r for r in rs):
            figures += [_fmt(*interval([r["staleness_mean"] for r in rs])), str(max(r["staleness_max"] for r in rs))]
        else:  # runs recorded before these columns existed
            figures += ["not recorded", "not recorded"]
        lines.append(f"| {component} | {lag} | {len(rs)} | " + " | ".join(figures) + " |")
    return "\n".join(lines)


def _fmt(mean: float, half: float | None) -> str:
    return f"{mean:.3f}" if half is None else f"{mean:.3f} ± {half:.3f}"


def _write(out: Path, result: dict[str, Any]) -> None:
    result["load_after"] = load_average()
    result["table"] = table(result["runs"])
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--components", nargs="+", default=["tis", "decoupled_clip", "m2po", "sat", "vcpo"])
    parser.add_argument("--staleness", nargs="+", type=int, default=[0, 2, 8])
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2, 3, 4])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--mode", choices=["pipelined", "async"], default="pipelined",
                        help="staleness K as the pipelined twin at lag K (deterministic) or as `async, max_staleness: K` "
                             "(generation in its own thread, overlapped with the update; not deterministic)")
    parser.add_argument("--set", dest="extra", action="append", default=[], help="another override for every run")
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "offpolicy_staleness.json")
    args = parser.parse_args(argv)
    unknown = [c for c in args.components if c not in COMPONENTS]
    if unknown:
        parser.error(f"unknown component(s) {unknown}: known are {sorted(COMPONENTS)} (add one to COMPONENTS)")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    result: dict[str, Any] = {"load_before": load_average(), "steps": args.steps, "mode": args.mode, "runs": []}
    for seed in args.seeds:  # seeds outermost: a partial result still covers every cell
        for lag in args.staleness:
            for component in args.components:
                result["runs"].append(run_one(component, lag, seed, args.steps, args.extra, args.mode))
                print(json.dumps(result["runs"][-1]), f"(load {load_average()})", flush=True)
                _write(args.out, result)  # after every run: an interrupted benchmark keeps what it measured
    _write(args.out, result)
    print(result["table"])
    return result


if __name__ == "__main__":
    main()
