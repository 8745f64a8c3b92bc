"""Each method against its own paper's baseline and metric: a claims file, run row by row with
``gfcr compare``'s machinery, Holm-corrected across the rows (issue 42, Builds 2 and 3).

A claims file (``benchmarks/claims.yaml``) lists, per method, the claim as its paper states it
(quoted), the paper's baseline and metric, the metric gfcr measures it with, and the method's and
the baseline's gfcr pipelines. Each row is one comparison of two pipelines (the row's own
baseline, not one baseline for all: ``run_claim``), on the row's task and budget, at the same
seeds. Per row, one figure and one test (``measure``):

=====================  ==========================================================  ==============
metric                 measured (per seed; method against baseline)                test
=====================  ==========================================================  ==============
``tokens_to_target``   baseline mean / method mean of the tokens generated before  paired t on
``rollouts_to_target`` the first eval at the target (the baseline's lowest final   the seeds, or
``wall_to_target``     accuracy, as ``gfcr compare``), or of seconds (the warm-up  the sign test
                       step left out); > 1: the method needs less                  (a seed never
                                                                                   reached it)
``final_accuracy``     method - baseline final eval accuracy (accuracy at budget)  paired t
``wall_per_step``      baseline / method wall per step, warm-up left out           paired t
                       (throughput at a fixed batch: APRIL's and CoPRIS's claims)
=====================  ==========================================================  ==============

The p-values of all rows are corrected together with Holm's step-down method (``holm``): the
family is the table. A row's verdict: ``reproduced`` when its corrected p < 0.05 and the
measured direction is the claimed one, ``contradicted`` when corrected p < 0.05 the other way,
``inconclusive`` otherwise (``verdict``). ``render`` writes the table of ``docs/claims.md``, with
the command that regenerates each row and the scale gap (the paper's model and data against
gfcr's) stated plainly.

Deviations: the papers' own metrics (pass@k on AIME, GPU-hours) are not what a CPU run can
measure; each row says which gfcr figure stands in for which paper figure, in ``metric_note``.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path
from statistics import mean
from typing import Annotated, Callable, Literal, Sequence

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from gfcr.errors import GfcrError
from gfcr.tracking.compare_figures import (
    Comparison, Estimate, PairedTest, paired_t, ratio_of_means, seconds_before, sign_test, steady_steps,
)
from gfcr.tracking.report_series import RunSeries
from gfcr.tracking.report_variants import TOLERANCE, Variant

Metric = Literal["tokens_to_target", "rollouts_to_target", "wall_to_target", "final_accuracy", "wall_per_step"]
COSTS = ("tokens_to_target", "rollouts_to_target", "wall_to_target")
SIGNIFICANT = 0.05


class Claim(BaseModel):
    """One row: a method's claim, its paper's baseline and metric, and the gfcr pipelines that test it."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    id: Annotated[str, Field(pattern=r"^[a-z0-9][a-z0-9_-]*$", description="the row's name")]
    method: str = Field(description="the method, as the paper names it")
    paper: str = Field(description="arXiv id or title")
    claim: str = Field(description="the claim as the paper states it (quoted, with its number and metric)")
    paper_baseline: str = Field(description="what the paper compares against")
    paper_scale: str = Field(description="the paper's models and data")
    metric: Metric = Field(description="the gfcr figure the claim is tested with")
    metric_note: str = Field(description="which paper figure the gfcr figure stands in for, and what differs")
    method_pipeline: str = Field(description="the method's pipeline file (relative to the repository root)")
    baseline_pipeline: str = Field(description="the paper's baseline as a gfcr pipeline")
    task: str = Field("arith-mix", description="a shipped task or a task file")
    budget: str = Field("tokens=12000", description=(
        "`gfcr compare --budget`; the default is sized for the 2-core CPU (issue 29's 60,000 is five times it)"))
    overrides: list[str] = Field(default_factory=list, description="`--set` overrides for both pipelines")


class ClaimsFile(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    claims: list[Claim] = Field(min_length=1)


def load_claims(path: Path, root: Path | None = None) -> list[Claim]:
    """The claims of ``path``; a GfcrError naming each bad row, a repeated id, or a pipeline file not found
    (relative to ``root``, default the file's parent's parent: the repository root for ``benchmarks/``)."""
    root = root or Path(path).resolve().parent.parent
    try:
        claims = ClaimsFile.model_validate(yaml.safe_load(Path(path).read_text(encoding="utf-8"))).claims
    except ValidationError as exc:
        first = exc.errors()[0]
        raise GfcrError(f"{path}: {'.'.join(map(str, first['loc']))}: {first['msg']} ({exc.error_count()} problem(s))",
                        "fix the row; each has the keys of gfcr.tracking.claims.Claim") from None
    ids = [c.id for c in claims]
    repeated = sorted({i for i in ids if ids.count(i) > 1})
    missing = [f"{c.id}: {p}" for c in claims for p in (c.method_pipeline, c.baseline_pipeline) if not (root / p).is_file()]
    if repeated or missing:
        raise GfcrError(f"{path}: " + "; ".join([f"id `{i}` repeated" for i in repeated] + [f"no file {m}" for m in missing]),
                        "give each row its own id, and pipeline paths relative to the repository root")
    return claims


def holm(pvalues: Sequence[float]) -> list[float]:
    """Holm's step-down adjusted p-values, in the input's order: sorted ascending, the i-th (from 0)
    is multiplied by ``m - i``, made non-decreasing, capped at 1."""
    order = sorted(range(len(pvalues)), key=lambda i: pvalues[i])
    adjusted, running = [0.0] * len(pvalues), 0.0
    for rank, i in enumerate(order):
        running = max(running, min(1.0, (len(pvalues) - rank) * pvalues[i]))
        adjusted[i] = running
    return adjusted


@dataclass(frozen=True)
class Measured:
    """One row's figure against its baseline: ``value`` (a ratio, > 1 the method better, or an accuracy
    difference, > 0 the method better) and its test."""

    metric: str
    value: Estimate | None  # None: not every seed reached the target (the sign test alone says which was faster)
    test: PairedTest | None
    seeds: int


def _first_reach_step(run: RunSeries, target: float) -> int | None:
    return next((step for step, accuracy in run.evals if accuracy >= target - TOLERANCE), None)


def _per_seed(run: RunSeries, metric: str, target: float | None) -> float | None:
    if metric == "final_accuracy":
        return run.final_accuracy
    if metric == "wall_per_step":
        steps = steady_steps(run)
        return mean(s.step_seconds for s in steps) if steps else None
    step = _first_reach_step(run, target) if target is not None else None
    if step is None:
        return None
    if metric == "wall_to_target":
        return seconds_before(run, step)
    return float(run.cumulative_before("rollouts_generated" if metric == "rollouts_to_target" else "tokens_generated",
                                       step))


def _pairs(method: Variant, baseline: Variant, metric: str, target: float | None) -> tuple[list, list]:
    mine = {r.seed: r for r in method.runs}
    base = {r.seed: r for r in baseline.runs}
    seeds = sorted(set(mine) & set(base), key=lambda s: (s is None, s))
    return [_per_seed(base[s], metric, target) for s in seeds], [_per_seed(mine[s], metric, target) for s in seeds]


def measure(comparison: Comparison, method: str, metric: str) -> Measured:
    """The row's figure and test from a two-pipeline comparison (``method`` against ``comparison.baseline``)."""
    variants = {v.label: v for v in comparison.variants}
    base, other = _pairs(variants[method], variants[comparison.baseline], metric, comparison.target)
    if metric == "final_accuracy":
        kept = [(b, o) for b, o in zip(base, other) if b is not None and o is not None]
        test = paired_t([b for b, _ in kept], [o for _, o in kept])
        return Measured(metric, test.difference if test else None, test, len(kept))
    if None in base or None in other:  # a seed never reached the target: only which reached it first is known
        return Measured(metric, None, sign_test(base, other), len(base))
    test = paired_t(base, other, higher_is_better=False)
    value = ratio_of_means(base, other) if all(v > 0 for v in other) else None
    return Measured(metric, value, test, len(base))


Verdict = Literal["reproduced", "contradicted", "inconclusive"]


def verdict(measured: Measured, corrected_p: float | None) -> Verdict:
    """Reproduced or contradicted when the corrected p < 0.05, by the side the method came out on."""
    test = measured.test
    if test is None or corrected_p is None or corrected_p >= SIGNIFICANT:
        return "inconclusive"
    if test.difference is not None:  # paired t: the mean difference's sign (method - baseline)
        gain = test.difference.mean if measured.metric == "final_accuracy" else -test.difference.mean
    else:  # the sign test: the pairs each side won
        gain = test.better - test.worse
    return "inconclusive" if gain == 0 else "reproduced" if gain > 0 else "contradicted"


def _fmt(measured: Measured | None) -> str:
    if measured is None:
        return "not run"
    e = measured.value
    if e is None:
        if measured.test is None:
            return "n/a"
        if measured.test.test == "sign":
            return "n/a (a seed never reached the target)"
        # paired t over cost to target, but some method seed's cost is 0: it was at the target before
        # generating anything (the baseline ended no better than where it started), so no ratio
        return "n/a (target met at the first evaluation, before any rollout)"
    if measured.metric == "final_accuracy":
        return f"{e.mean:+.3f} [{e.lo:+.3f}, {e.hi:+.3f}]"
    return f"{e.mean:.2f}x [{e.lo:.2f}, {e.hi:.2f}]"


def command(claim: Claim, seeds: str) -> str:
    """The ``gfcr compare`` command that regenerates the row."""
    sets = "".join(f" --set {o}" for o in claim.overrides)
    return (f"gfcr compare {claim.baseline_pipeline} {claim.method_pipeline} --task {claim.task} --seeds {seeds} "
            f"--budget {claim.budget}{sets}")


def render(claims: Sequence[Claim], measured: dict[str, Measured], seeds: str) -> str:
    """The table of ``docs/claims.md``: one row per claim, Holm-corrected across the rows that ran."""
    ran = [c.id for c in claims if c.id in measured and measured[c.id].test is not None]
    corrected = dict(zip(ran, holm([measured[i].test.p for i in ran])))  # type: ignore[union-attr]
    lines = ["| method | claim (quoted) | paper baseline | gfcr metric | measured [95% CI] | seeds | p (Holm) | verdict "
             "| scale gap |", "|---|---|---|---|---|---|---|---|---|"]
    for c in claims:
        m = measured.get(c.id)
        p = corrected.get(c.id)
        shown_p = "n/a" if p is None else f"{m.test.p:.3g} ({p:.3g})"  # type: ignore[union-attr]
        lines.append(f"| {c.method} | \"{c.claim}\" | {c.paper_baseline} | `{c.metric}`: {c.metric_note} | {_fmt(m)} "
                     f"| {m.seeds if m else 0} | {shown_p} | {verdict(m, p) if m else 'not run'} | "
                     f"{c.paper_scale}; here: the `{c.task}` task's policy, {c.budget} |")
    return "\n".join(lines)


def run_claim(claim: Claim, seeds: Sequence[int], out_dir: Path, repo: Path, parallel: int = 1,
              executor: str | None = None) -> Measured:
    """Run the row's comparison (baseline first) into ``out_dir`` (continuing it if it ran before) and
    measure it."""
    return _run_group([claim], seeds, out_dir, repo, parallel, executor)[claim.id]


def run_claims(claims: Sequence[Claim], seeds: Sequence[int], out_dir: Path, repo: Path, parallel: int = 1,
               executor: str | None = None, done_with: Callable[[dict[str, Measured]], None] | None = None,
               ) -> dict[str, Measured]:
    """Run many rows, the rows that share a baseline, task, budget and overrides as one comparison
    (``<out_dir>/<task>--<baseline>--<budget>``: the baseline's cells run once, each method's once), and
    measure each row against its baseline. A row's figures equal its own two-pipeline comparison's
    (``command``): every cell is seeded and runs alone, and the target is the baseline's. ``done_with``
    gets the figures so far after each group."""
    groups: dict[tuple[str, str, str, tuple[str, ...]], list[Claim]] = {}
    for claim in claims:
        groups.setdefault((claim.baseline_pipeline, claim.task, claim.budget, tuple(claim.overrides)), []).append(claim)
    measured: dict[str, Measured] = {}
    for (baseline_file, task, budget, sets), rows in groups.items():
        folder = f"{task}--{Path(baseline_file).stem}--{budget.replace('=', '')}"
        if sets:
            folder += "--" + hashlib.sha256("\n".join(sets).encode()).hexdigest()[:8]
        measured.update(_run_group(rows, seeds, out_dir / folder, repo, parallel, executor))
        if done_with is not None:
            done_with(measured)
    return measured


def _run_group(rows: Sequence[Claim], seeds: Sequence[int], out_dir: Path, repo: Path, parallel: int,
               executor: str | None) -> dict[str, Measured]:
    """One comparison of the rows' shared baseline (the first row's baseline, task, budget and
    overrides) and each row's method, in ``out_dir``; each row measured against the baseline."""
    from gfcr.tracking.compare import parse_budget, plan_comparison, run_comparison  # noqa: PLC0415 (runtime)

    first = rows[0]
    methods = list(dict.fromkeys(row.method_pipeline for row in rows))
    overrides = [*first.overrides, *([f"executor.kind={executor}"] if executor else [])]
    plan = plan_comparison([repo / first.baseline_pipeline, *(repo / m for m in methods)], task=first.task,
                           seeds=seeds, budget=parse_budget(first.budget), overrides=overrides, out_dir=out_dir)
    baseline, *names = list(plan.specs)
    done = run_comparison(plan, parallel=parallel, baseline=baseline)
    if done.failed or done.comparison is None:
        ids = ", ".join(f"`{row.id}`" for row in rows)
        raise GfcrError(f"claim {ids}: {len(done.failed)} cell(s) failed in {out_dir}",
                        "read the cells' logs, fix what failed and run again: finished cells are kept")
    name_of = dict(zip(methods, names))
    return {row.id: measure(done.comparison, name_of[row.method_pipeline], row.metric) for row in rows}


__all__ = ["Claim", "ClaimsFile", "Measured", "command", "holm", "load_claims", "measure", "render", "run_claim",
           "run_claims", "verdict"]
