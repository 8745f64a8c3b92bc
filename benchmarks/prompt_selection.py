"""Prompt selectors against uniform selection on tiny-arith: zero-variance groups and compute to
the accuracy uniform GRPO reaches.

    .venv/bin/python benchmarks/prompt_selection.py [--variants uniform mopps beta_band] [--seeds 0 1 2]
        [--steps 100] [--every 10] [--jobs 2]

Every variant trains the quickstart's GRPO (16 prompts x 8 rollouts, lr 3e-4, clip [0.2, 0.28])
on the same 400 arithmetic prompts (so that MoPPS's posteriors see each prompt every few
steps); only the selection differs:

- ``uniform``: ``control.uniform`` (the quickstart with ``data.with.n=400``);
- ``mopps``: ``pipelines/mopps_arith.yaml`` (``control.beta_thompson``, MoPPS, with the
  reference config's ``decay: 1.0``);
- ``mopps_decay05``: the same with ``decay: 0.5``, what the reference's launch scripts use;
- ``beta_band``: uniform selection, then ``filter.beta_difficulty`` after the verifier (groups
  whose Beta posterior mean lies outside [0.3, 0.7] are dropped before the update);
- any other name ``X`` is the shipped ``pipelines/X_arith.yaml`` (selectors ``vade``, ``sgpo``,
  ``hive``, ``dots``; allocators ``dars``, ``gdro``, ``xrpo``, ``coba``, ``pilot_commit``) with
  the quickstart's policy, eval and 400 training prompts put in, and the overrides in
  ``EQUAL_BUDGET`` that give it the same 128 rollouts a step as uniform where its Config sets
  the budget (DARS tops up beyond it by design; DOTS and sGPO also pay for their reference and
  profiling rollouts, which count in the tokens; GPS and DEPO, selectors too, pay for their
  embedding pass in scored tokens, not generated ones, so it is not in the tokens column).

Per run: the fraction of generated groups whose rewards are all equal (``zero_variance_groups /
groups`` over the steps), the fraction of generated rollouts in such groups (a runner hook,
``ZeroVarianceRollouts``: with uneven group sizes the two differ), the eval accuracy every ``--every`` steps, and the tokens generated
before the eval accuracy first reached the target, uniform's mean final accuracy. Writes
``benchmarks/results/prompt_selection.json`` and prints a Markdown table (means, 95% t-intervals over
the seeds, Welch's p against uniform). Runs are cached in ``.benchmark-cache/prompt_selection``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
from update_catalog import t_interval, welch_p  # noqa: E402  (a sibling script)

REPO = Path(__file__).resolve().parents[1]
BAND = {"use": "filter.beta_difficulty", "from": "reward"}


# per shipped pipeline: the (stage, key, value) edits that spend uniform's 16 x 8 rollouts a step
EQUAL_BUDGET = {
    "gdro": [("budget", "mean_rollouts", 8), ("budget", "max_rollouts", 24)],  # n_max = 3 n_bar, as the script
}


def variant_spec(variant: str) -> dict:
    """The pipeline of ``variant`` as YAML data."""
    if variant not in ("uniform", "beta_band") and not variant.startswith("mopps"):
        quickstart = yaml.safe_load((REPO / "pipelines" / "quickstart.yaml").read_text())
        spec = yaml.safe_load((REPO / "pipelines" / f"{variant}_arith.yaml").read_text())
        spec["policy"], spec["eval"], spec["data"] = quickstart["policy"], quickstart["eval"], quickstart["data"]
        spec["data"]["with"]["n"] = 400
        for stage, key, value in EQUAL_BUDGET.get(variant, []):
            spec["stages"][stage]["with"][key] = value
        return spec
    if variant.startswith("mopps"):
        spec = yaml.safe_load((REPO / "pipelines" / "mopps_arith.yaml").read_text())
        if variant == "mopps_decay05":
            spec["stages"]["pick"]["with"]["decay"] = 0.5
        return spec
    spec = yaml.safe_load((REPO / "pipelines" / "quickstart.yaml").read_text())
    spec["data"]["with"]["n"] = 400
    if variant == "beta_band":
        spec["stages"]["band"] = dict(BAND)
        spec["update"]["from"] = "band"
    return spec


class ZeroVarianceRollouts:
    """A runner hook: the rollouts generated in groups whose rewards are all equal, and all the
    rollouts generated (reused ones left out, as in ``rollouts_generated``), over a run."""

    def __init__(self) -> None:
        self.in_zero_variance = self.generated = 0

    def after_step(self, event) -> None:
        for group in event.report.groups:
            fresh = sum(1 for r in group.generated if not r.reused)
            self.generated += fresh
            if group.stats.n_scored > 1 and group.stats.reward_std == 0.0:  # as StepReport.zero_variance_groups
                self.in_zero_variance += fresh


def one_run(variant: str, seed: int, steps: int, every: int, cache: str) -> dict:
    path = Path(cache) / f"{variant}-seed{seed}-steps{steps}-every{every}.json"
    if path.exists():
        return json.loads(path.read_text())
    import torch

    from gfcr.graph import load_pipeline
    from gfcr.runtime.loop.session import Run

    torch.set_num_threads(1)
    work = Path(tempfile.mkdtemp(prefix="gfcr-selection-"))
    (work / "pipeline.yaml").write_text(yaml.safe_dump(variant_spec(variant), sort_keys=False))
    overrides = [f"run.steps={steps}", f"run.seed={seed}", f"eval.every={every}", "executor.kind=local",
                 "tracking.mlflow=null", f"run.checkpoint_every={steps}"]
    run, counted = Run.start(load_pipeline(work / "pipeline.yaml", overrides), work / "run"), ZeroVarianceRollouts()
    run.runner.hooks = (*run.runner.hooks, counted)
    summary = run.train()
    curve, tokens, zero_var, groups, seen = {}, {}, 0, 0, 0
    for line in (work / "run" / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        if "eval_accuracy" in record:  # evaluated before the step's update
            curve[str(record["step"])], tokens[str(record["step"])] = record["eval_accuracy"], seen
        seen += record.get("tokens_generated", 0)
        zero_var += record.get("zero_variance_groups", 0)
        groups += record.get("groups", 0)
    curve[str(steps)], tokens[str(steps)] = summary["eval_accuracy_after"], seen
    result = {"variant": variant, "seed": seed, "curve": curve, "tokens": tokens,
              "zero_variance_fraction": zero_var / max(groups, 1), "tokens_generated": seen,
              "zero_variance_rollout_fraction": counted.in_zero_variance / max(counted.generated, 1),
              "rollouts_generated": counted.generated}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result))
    return result


def tokens_to(run: dict, target: float) -> int | None:
    hits = [s for s in sorted(run["curve"], key=int) if run["curve"][s] >= target]
    return run["tokens"][hits[0]] if hits else None


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--variants", nargs="+", default=["uniform", "mopps", "mopps_decay05", "beta_band"])
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--every", type=int, default=10)
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--cache", default=str(REPO / ".benchmark-cache" / "prompt_selection"))
    parser.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "prompt_selection.json"))
    args = parser.parse_args()
    jobs = [(v, s) for v in args.variants for s in args.seeds]
    with ProcessPoolExecutor(args.jobs) as pool:
        runs = list(pool.map(one_run, *zip(*[(v, s, args.steps, args.every, args.cache) for v, s in jobs])))
    by = {(r["variant"], r["seed"]): r for r in runs}
    final = {v: [by[v, s]["curve"][str(args.steps)] for s in args.seeds] for v in args.variants}
    target = statistics.mean(final["uniform"]) if "uniform" in final else 0.7
    lines = [f"| selection | zero-variance groups: mean ± 95% CI | rollouts in zero-variance groups: mean ± 95% CI "
             f"| rollouts generated: mean | final accuracy: mean ± 95% CI [seeds] | p vs uniform "
             f"| tokens to {target:.3f}: mean [seeds] |", "|---|---|---|---|---|---|---|"]
    rows = []
    for v in args.variants:
        zv = [by[v, s]["zero_variance_fraction"] for s in args.seeds]
        zr = [by[v, s].get("zero_variance_rollout_fraction") for s in args.seeds]  # runs cached before it: None
        made = [by[v, s].get("rollouts_generated") for s in args.seeds]
        (zm, zh), (fm, fh) = t_interval(zv), t_interval(final[v])
        zr_text = "-" if None in zr else "{:.3f} ± {:.3f}".format(*t_interval(zr))
        made_text = "-" if None in made else f"{statistics.mean(made):,.0f}"
        hits = [tokens_to(by[v, s], target) for s in args.seeds]
        reached = [h for h in hits if h is not None]
        p = welch_p(final[v], final["uniform"]) if v != "uniform" and "uniform" in final else None
        tok = (f"{statistics.mean(reached):,.0f} [{', '.join('-' if h is None else f'{h:,}' for h in hits)}]"
               if reached else "never")
        lines.append(f"| {v} | {zm:.3f} ± {zh:.3f} | {zr_text} | {made_text} "
                     f"| {fm:.3f} ± {fh:.3f} [{', '.join(f'{x:.3f}' for x in final[v])}] "
                     f"| {'-' if p is None else f'{p:.2f}'} | {tok} |")
        rows.append({"variant": v, "zero_variance_fraction": zv, "zero_variance_rollout_fraction": zr,
                     "rollouts_generated": made, "final": final[v], "p_vs_uniform": p,
                     "tokens_to_target": hits})
    Path(args.out).write_text(json.dumps({"steps": args.steps, "every": args.every, "target": target,
                                          "seeds": args.seeds, "rows": rows, "runs": runs}, indent=1))
    plot(by, args.variants, args.seeds, target, Path(args.out).with_suffix(".png"))
    print("\n".join(lines))


def plot(by: dict, variants: list[str], seeds: list[int], target: float, path: Path) -> None:
    """Mean eval accuracy against mean generated tokens, one line per variant, the target dashed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    colours = plt.get_cmap("tab20").colors
    for i, v in enumerate(variants):
        steps = sorted(by[v, seeds[0]]["curve"], key=int)
        tokens = [statistics.mean(by[v, s]["tokens"][k] for s in seeds) for k in steps]
        accuracy = [statistics.mean(by[v, s]["curve"][k] for s in seeds) for k in steps]
        ax.plot(tokens, accuracy, marker="o", markersize=3, label=v, color="black" if v == "uniform" else colours[i],
                linewidth=2.5 if v == "uniform" else 1)
    ax.axhline(target, color="grey", linestyle="--", linewidth=1, label=f"target {target:.3f}")
    ax.set(xlabel="generated tokens (mean over seeds)", ylabel="eval accuracy (mean over seeds)",
           title=f"Selectors and allocators on tiny-arith, {len(seeds)} seeds")
    ax.legend(fontsize=8, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    main()
