"""The new generators and in-flight controllers against GRPO on tiny-arith, 3 seeds (issue 11).

    PYTHONPATH=. .venv/bin/python benchmarks/generators.py [--variants grpo april ...] [--seeds 0 1 2]
        [--steps 60] [--every 10] [--target 0.70] [--jobs 2]

Each variant is a shipped pipeline (with ``--set`` overrides where named), all on the same
tiny-arith data and eval, 16 prompts a step and 8 rollouts per group in the update:

- ``grpo``: ``pipelines/quickstart.yaml``; ``grpo_pool400``: the same on SPEC-RL's 400-prompt pool
  (every prompt returns each 25-step epoch), SPEC-RL's baseline; ``grpo_n16``: 16 rollouts a
  prompt, all kept (early exit's oversampling without pruning);
- ``april`` / ``copris``: ``pipelines/april_arith.yaml`` / ``copris_arith.yaml`` (generate.partial;
  32 groups started, stop at 16 complete);
- ``spec_rl``: ``pipelines/spec_rl_arith.yaml`` (drafts from the previous epoch, lenience 0.5);
- ``early_exit``: ``pipelines/early_exit_arith.yaml`` (16 started, 8 kept per group).

Per run: the greedy eval accuracy every ``--every`` steps, tokens generated and scored, the
rollout stage's wall per step, and the method's own numbers (SPEC-RL's reused-token fraction
per epoch; early exit's pruned rows and the head's calibration from its final checkpoint).
The table gives, over the seeds, the final accuracy (mean and 95% t-interval), Welch's p
against ``grpo`` (``grpo_pool400`` for ``spec_rl``), tokens generated in the run, and tokens
until the eval accuracy first reached ``--target``. Runs are cached in ``--cache`` (a rerun
skips finished ones). Writes ``benchmarks/results/generators.json`` and prints the table.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path

from benchmarks.update_catalog import eval_curve, run_jobs, t_interval, tokens_to_target, welch_p

REPO = Path(__file__).resolve().parents[1]
VARIANTS: dict[str, tuple[str, list[str]]] = {
    "grpo": ("quickstart", []),
    "grpo_pool400": ("quickstart", ["data.with.n=400"]),
    "grpo_n16": ("quickstart", ["stages.budget.with.n=16"]),
    "april": ("april_arith", []),
    "copris": ("copris_arith", []),
    "spec_rl": ("spec_rl_arith", []),
    "early_exit": ("early_exit_arith", []),
}
BASELINE = {"spec_rl": "grpo_pool400"}


def cached_run(variant: str, seed: int, steps: int, every: int, cache: str) -> dict:
    path = Path(cache) / f"{variant}-seed{seed}-steps{steps}-every{every}.json"
    if path.exists():
        return json.loads(path.read_text())
    try:
        result = one_run(variant, seed, steps, every)
    except Exception as exc:  # one variant's failure must not lose the others
        return {"variant": variant, "seed": seed, "error": f"{type(exc).__name__}: {exc}"}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result))
    return result


def one_run(variant: str, seed: int, steps: int, every: int) -> dict:
    import torch

    from gfcr.graph import load_pipeline
    from gfcr.runtime.loop.session import Run

    torch.set_num_threads(1)
    name, extra = VARIANTS[variant]
    overrides = [f"run.steps={steps}", f"run.seed={seed}", f"eval.every={every}", "executor.kind=local",
                 "tracking.mlflow=null", f"run.checkpoint_every={steps}"] + extra
    run_dir = Path(tempfile.mkdtemp(prefix="gfcr-generators-")) / "run"
    summary = Run.start(load_pipeline(REPO / "pipelines" / f"{name}.yaml", overrides), run_dir).train()
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    stage_metrics = [record.get("stages", {}) for record in records]
    out = {"variant": variant, "seed": seed, **eval_curve(run_dir, steps, summary["eval_accuracy_after"]),
           "tokens_generated": sum(r.get("tokens_generated", 0) for r in records),
           "tokens_scored": sum(r.get("tokens_scored", 0) for r in records),
           "rollout_s_per_step": statistics.mean(r["time"]["stages_s"].get("rollout", 0.0) for r in records)}
    if variant == "spec_rl":
        per_epoch = {}
        for step, m in enumerate(stage_metrics):
            e = per_epoch.setdefault(step // 25, [0, 0])
            e[0] += m["rollout"]["accepted_tokens"]
            e[1] += m["rollout"]["response_tokens"]
        out["reused_fraction_per_epoch"] = {str(k): (a / t if t else 0.0) for k, (a, t) in per_epoch.items()}
    if variant == "early_exit":
        out["pruned"] = sum(m["prune"]["pruned"] for m in stage_metrics if "pruned" in m.get("prune", {}))
        out["calibration"] = _calibration(run_dir, steps)
    return out


def _calibration(run_dir: Path, steps: int) -> list[list[float]]:
    """The head's calibration bins from the checkpoint: [count, mean predicted, mean realised] per bin."""
    from gfcr.runtime.store.state_tree import read_tree

    folder = run_dir / "checkpoints" / f"step-{steps:06d}" / "stages" / "prune"
    bins = read_tree(folder, folder)["calibration"]
    return [[float(c), float(p / c) if c else 0.0, float(y / c) if c else 0.0] for c, p, y in bins.tolist()]


def table(runs: list[dict], variants: list[str], seeds: list[int], target: float) -> tuple[list[dict], str]:
    by = {(r["variant"], r["seed"]): r for r in runs}
    final = {v: [by[v, s]["curve"][max(by[v, s]["curve"])] for s in seeds] for v in variants}
    lines = ["| variant | final accuracy: mean ± 95% CI [seeds] | p vs baseline | tokens generated (mean) | "
             f"rollout s/step | reached {target:.0%} | tokens to {target:.0%}: mean |", "|---|---|---|---|---|---|---|"]
    rows = []
    for v in variants:
        mean, half = t_interval(final[v])
        base = BASELINE.get(v, "grpo")
        p = welch_p(final[v], final[base]) if base in final and v != base and v not in ("grpo",) else None
        hits = [tokens_to_target(by[v, s], target) for s in seeds]
        reached = [h for h in hits if h is not None]
        gen = statistics.mean(by[v, s]["tokens_generated"] for s in seeds)
        wall = statistics.mean(by[v, s]["rollout_s_per_step"] for s in seeds)
        rows.append({"variant": v, "baseline": base, "final": final[v], "final_mean": mean, "final_ci95": half,
                     "p_vs_baseline": p, "tokens_generated": gen, "rollout_s_per_step": wall,
                     "tokens_to_target": hits})
        tok = f"{statistics.mean(reached):,.0f}" if reached else "never"
        lines.append(f"| {v} | {mean:.3f} ± {half:.3f} [{', '.join(f'{x:.3f}' for x in final[v])}] | "
                     f"{'-' if p is None else f'{p:.2f} ({base})'} | {gen:,.0f} | {wall:.3f} | "
                     f"{len(reached)}/{len(seeds)} | {tok} |")
    return rows, "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS))
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--every", type=int, default=10)
    parser.add_argument("--target", type=float, default=0.70)
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "generators.json"))
    parser.add_argument("--cache", default=str(REPO / ".benchmark-cache" / "generators"))
    args = parser.parse_args()
    unknown = [v for v in args.variants if v not in VARIANTS]
    if unknown:
        parser.error(f"unknown variants {unknown}; known: {', '.join(VARIANTS)}")
    jobs = [(v, s) for v in args.variants for s in args.seeds]
    runs, failed = run_jobs(cached_run, jobs, args.jobs, args.steps, args.every, args.cache)
    variants = [v for v in args.variants if v not in failed]
    rows, markdown = table(runs, variants, args.seeds, args.target)
    extras = {r["variant"] + f"-seed{r['seed']}": {k: r[k] for k in ("reused_fraction_per_epoch", "pruned", "calibration")
                                                   if k in r} for r in runs}
    Path(args.out).write_text(json.dumps({"steps": args.steps, "every": args.every, "target": args.target,
                                          "seeds": args.seeds, "rows": rows, "failed": failed,
                                          "extras": {k: v for k, v in extras.items() if v}, "runs": runs}, indent=1))
    print(markdown)
    for v, error in failed.items():
        print(f"failed: {v}: {error}")


if __name__ == "__main__":
    main()
