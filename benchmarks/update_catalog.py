"""Every estimator, loss and aggregation of the update catalog against GRPO, on tiny-arith.

    .venv/bin/python benchmarks/update_catalog.py [--task arith-mix] [--variants grpo rloo ...]
        [--seeds 0 1 2] [--steps 60] [--every 10] [--target 0.70] [--jobs 2]

Each variant is ``pipelines/quickstart.yaml`` (uniform prompts, 16 x 8 rollouts, GRPO with
``mean_std``, ``ppo_clip`` [0.2, 0.28] and ``token_mean``) with one component swapped by
``--set`` overrides, so a row differs from GRPO in that component only; ``--task NAME`` (a
shipped task such as ``arith-mix``, or a task file, as ``gfcr compare --task``) replaces
quickstart's policy, data and eval first. For every seed the run
records the greedy eval accuracy every ``--every`` steps; the table gives, over the seeds,
the final accuracy (mean and a 95% t-interval), the tokens generated until the eval accuracy
first reached ``--target`` (runs that never reach it are counted as not reaching it, and the
mean is over those that did), and Welch's t-test p-value of the final accuracy against GRPO.

Runs go on the local runner without tracking (the numbers are the same under Prefect), one
torch thread per run, ``--jobs`` runs at a time. Each finished run is kept in
``--cache`` (one JSON per variant and seed; a rerun skips them, so an interrupted benchmark
continues); a run that fails is reported with its error and left out of the table. Writes
``benchmarks/results/update_catalog.json`` (``update_catalog_<task>.json`` with ``--task``) and
prints the Markdown table.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import tempfile
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any, Callable

REPO = Path(__file__).resolve().parents[1]

# variant -> the --set overrides that swap one component of quickstart's update (a whole
# component is replaced, so quickstart's `loss.with.clip` never reaches a loss without `clip`).
# Values the papers leave open are this benchmark's choices, named here: cispo's and tic_grpo's
# eps_high (0.28, DAPO's clip-higher), stratified's alpha (0.5), lambda_grpo's r (0.3) and
# tr_grpo's tau (1/9).
U = "update.with"
DR_GRPO_AGG = f'{U}.aggregation={{"use": "seq_mean_token_sum", "with": {{"constant": 8}}}}'  # max_new_tokens 8
VARIANTS: dict[str, list[str]] = {
    "grpo": [],
    # advantage estimators
    "mean": [f"{U}.advantage.use=mean"],
    "median": [f"{U}.advantage.use=median"],
    "gapo": [f"{U}.advantage.use=gapo"],
    "mc_grpo": [f"{U}.advantage.use=mc_grpo", "stages.budget.with.n=9"],
    "rloo": [f"{U}.advantage.use=rloo"],
    "reinforce_pp": [f"{U}.advantage.use=reinforce_pp"],
    "dr_grpo": [f"{U}.advantage.use=dr_grpo", DR_GRPO_AGG],
    "krpo": [f"{U}.advantage.use=krpo"],
    "gdpo": [f"{U}.advantage.use=gdpo"],
    "stratified": [f'{U}.advantage={{"use": "stratified", "with": {{"stratum_by": "finish_reason", "alpha": 0.5}}}}'],
    "grpo_lead": [f"{U}.advantage.use=grpo_lead"],
    "xrpo": [f"{U}.advantage.use=xrpo"],
    "tic_grpo_advantage": [f"{U}.advantage.use=tic_grpo"],
    # losses
    "dual_clip": [f"{U}.loss.with.dual_clip=3.0"],
    "gspo": [f'{U}.loss={{"use": "gspo"}}', f"{U}.aggregation.use=seq_mean_token_mean"],
    "gspo_token": [f'{U}.loss={{"use": "gspo_token"}}', f"{U}.aggregation.use=seq_mean_token_mean"],
    "cispo": [f'{U}.loss={{"use": "cispo", "with": {{"eps_high": 0.28}}}}'],
    "tic_grpo_loss": [f'{U}.loss={{"use": "tic_grpo", "with": {{"eps_high": 0.28}}}}',
                      f"{U}.aggregation.use=seq_mean_token_mean"],
    # TR-GRPO with tau = 1/9: the transcribed tau = 9 gives every token weight 1 (see tr_grpo's docstring)
    "tr_grpo": [f'{U}.loss={{"use": "tr_grpo", "with": {{"tau": 0.1111}}}}'],
    # aggregations
    "seq_mean_token_mean": [f"{U}.aggregation.use=seq_mean_token_mean"],
    "seq_mean_token_sum": [DR_GRPO_AGG],
    "daro": [f'{U}.aggregation={{"use": "daro", "with": {{"rollouts_per_prompt": 8}}}}'],
    # r = 0.3 keeps h = 1 + r z > 0 for groups of 8 (|z| <= 7 / sqrt(8) = 2.47 with the sample std)
    "lambda_grpo": [f'{U}.aggregation={{"use": "lambda_grpo", "with": {{"r": 0.3}}}}'],
    # whole methods (more than one component)
    "tic_grpo": [f"{U}.advantage.use=tic_grpo", f'{U}.loss={{"use": "tic_grpo", "with": {{"eps_high": 0.28}}}}',
                 f"{U}.aggregation.use=seq_mean_token_mean"],
}


def cached_run(variant: str, seed: int, steps: int, every: int, cache: str, task: str | None = None) -> dict:
    """``one_run``, read from or written to ``cache``; a failure is returned as ``{"error": ...}``."""
    path = Path(cache) / f"{task + '-' if task else ''}{variant}-seed{seed}-steps{steps}-every{every}.json"
    if path.exists():
        return json.loads(path.read_text())
    try:
        result = one_run(variant, seed, steps, every, task)
    except Exception as exc:  # one variant's failure must not lose the others
        return {"variant": variant, "seed": seed, "error": f"{type(exc).__name__}: {exc}"}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result))
    return result


def one_run(variant: str, seed: int, steps: int, every: int, task: str | None = None) -> dict:
    """The eval curve and tokens generated of one seeded run of ``variant`` (on ``task``)."""
    import torch
    import yaml

    from gfcr.graph import load_pipeline
    from gfcr.runtime.loop.session import Run
    from gfcr.spec.task import apply_task, load_task

    torch.set_num_threads(1)
    overrides = [f"run.steps={steps}", f"run.seed={seed}", f"eval.every={every}", "executor.kind=local",
                 "tracking.mlflow=null", f"run.checkpoint_every={steps}"] + VARIANTS[variant]
    tmp = Path(tempfile.mkdtemp(prefix="gfcr-catalog-"))
    pipeline = REPO / "pipelines" / "quickstart.yaml"
    if task is not None:
        pipeline, doc = tmp / "quickstart.yaml", apply_task(yaml.safe_load(pipeline.read_text()), load_task(task))
        pipeline.write_text(yaml.safe_dump(doc, sort_keys=False))
    compiled = load_pipeline(pipeline, overrides)
    run_dir = tmp / "run"
    summary = Run.start(compiled, run_dir).train()
    return {"variant": variant, "seed": seed, **eval_curve(run_dir, steps, summary["eval_accuracy_after"])}


def eval_curve(run_dir: Path, steps: int, final_accuracy: float) -> dict:
    """The run's eval accuracy by step and the tokens generated before each eval (JSON keys)."""
    curve, tokens, seen = {}, {}, 0
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        if "eval_accuracy" in record:  # evaluated before the step's update: tokens of the steps before
            curve[record["step"]] = record["eval_accuracy"]
            tokens[record["step"]] = seen
        seen += record.get("tokens_generated", 0)
    curve[steps], tokens[steps] = final_accuracy, seen
    return {"curve": {str(k): v for k, v in curve.items()}, "tokens": {str(k): v for k, v in tokens.items()}}


def run_jobs(run: Callable[..., dict], jobs: list[tuple[str, int]], n_jobs: int, steps: int,
             *args: Any) -> tuple[list[dict], dict[str, str]]:
    """``run(variant, seed, steps, *args)`` for every job, ``n_jobs`` at a time: the finished runs
    (step keys back to ints) and, per variant, the error of a run that failed."""
    runs, failed = [], {}
    with ProcessPoolExecutor(n_jobs) as pool:
        futures = [pool.submit(run, v, s, steps, *args) for v, s in jobs]
        for (v, s), f in zip(jobs, futures):
            result = f.result()
            if "error" in result:
                failed[v] = result["error"]
                print(f"{v:22s} seed {s}: FAILED {result['error']}", flush=True)
                continue
            runs.append(_ints(result))
            print(f"{v:22s} seed {s}: final {runs[-1]['curve'][steps]:.3f}", flush=True)
    return runs, failed


def _ints(run: dict) -> dict:
    """JSON keys back to step numbers."""
    return {**run, "curve": {int(k): v for k, v in run["curve"].items()},
            "tokens": {int(k): v for k, v in run["tokens"].items()}}


def tokens_to_target(run: dict, target: float) -> int | None:
    hits = [s for s in sorted(run["curve"]) if run["curve"][s] >= target]
    return run["tokens"][hits[0]] if hits else None


def t_interval(values: list[float]) -> tuple[float, float]:
    """Mean and the half-width of its 95% t-interval."""
    from scipy import stats

    mean = statistics.mean(values)
    if len(values) < 2:
        return mean, float("nan")
    return mean, stats.t.ppf(0.975, len(values) - 1) * statistics.stdev(values) / math.sqrt(len(values))


def welch_p(a: list[float], b: list[float]) -> float:
    from scipy import stats

    if statistics.pstdev(a) == 0 and statistics.pstdev(b) == 0:
        return 1.0 if a == b else 0.0
    return float(stats.ttest_ind(a, b, equal_var=False).pvalue)


def table(runs: list[dict], variants: list[str], seeds: list[int], target: float) -> tuple[list[dict], str]:
    by = {(r["variant"], r["seed"]): r for r in runs}
    final = {v: [by[v, s]["curve"][max(by[v, s]["curve"])] for s in seeds] for v in variants}
    rows, lines = [], ["| variant | final accuracy: mean ± 95% CI [seeds] | p vs grpo | reached "
                       f"{target:.0%} | tokens to {target:.0%}: mean [seeds] |", "|---|---|---|---|---|"]
    for v in variants:
        mean, half = t_interval(final[v])
        hits = [tokens_to_target(by[v, s], target) for s in seeds]
        reached = [h for h in hits if h is not None]
        p = welch_p(final[v], final["grpo"]) if "grpo" in final and v != "grpo" else None
        rows.append({"variant": v, "overrides": VARIANTS[v], "final": final[v], "final_mean": mean,
                     "final_ci95": half, "p_vs_grpo": p, "tokens_to_target": hits})
        seeds_text = ", ".join(f"{x:.3f}" for x in final[v])
        tok = (f"{statistics.mean(reached):,.0f} [{', '.join('-' if h is None else f'{h:,}' for h in hits)}]"
               if reached else "never")
        lines.append(f"| {v} | {mean:.3f} ± {half:.3f} [{seeds_text}] | {'-' if p is None else f'{p:.2f}'} | "
                     f"{len(reached)}/{len(seeds)} | {tok} |")
    return rows, "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--task", default=None, help="a shipped task (e.g. arith-mix) or a task file; "
                                                     "default: quickstart's own tiny-arith")
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS))
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--every", type=int, default=10)
    parser.add_argument("--target", type=float, default=0.70)
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--out", default=None, help="default: benchmarks/results/update_catalog[_TASK].json")
    parser.add_argument("--cache", default=str(REPO / ".benchmark-cache" / "update_catalog"))
    args = parser.parse_args()
    unknown = [v for v in args.variants if v not in VARIANTS]
    if unknown:
        parser.error(f"unknown variants {unknown}; known: {', '.join(VARIANTS)}")
    task_name = None if args.task is None else Path(args.task).stem
    out = args.out or str(REPO / "benchmarks" / "results" / f"update_catalog{'_' + task_name if task_name else ''}.json")
    jobs = [(v, s) for v in args.variants for s in args.seeds]
    runs, failed = run_jobs(cached_run, jobs, args.jobs, args.steps, args.every, args.cache, args.task)
    variants = [v for v in args.variants if v not in failed]
    rows, markdown = table(runs, variants, args.seeds, args.target)
    runs = [r for r in runs if r["variant"] not in failed]
    Path(out).write_text(json.dumps({"task": task_name or "tiny-arith (quickstart)", "steps": args.steps,
                                     "every": args.every, "target": args.target, "seeds": args.seeds,
                                     "rows": rows, "failed": failed, "runs": runs}, indent=1))
    print(markdown)
    for v, error in failed.items():
        print(f"failed: {v}: {error}")


if __name__ == "__main__":
    main()
