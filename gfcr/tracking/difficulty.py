"""Accuracy by difficulty bin, step by step, from a run's lineage (issue 42, Build 3: the data of a
per-difficulty breakdown).

A difficulty-driven method (GRESO, DARS, CoBA, MoPPS, ...) changes which prompts get rollouts
and how many; whether it helps shows bin by bin. ``accuracy_by_bin`` joins a run's lineage rows
(every rollout's prompt, step and correctness) with its prompts' metadata (the data source is
loaded again from the run's resolved spec, as ``gfcr lineage`` does) and counts, per bin and
step, the rollouts generated and those correct. A bin is a prompt's ``metadata[key]`` for each of
``keys``: ``("task", "level")`` for the ``reasoning_gym`` source, ``("category",)`` for
``arithmetic_mix``. Rollouts reused from earlier steps (replayed, cached) are counted at the step
that generated them only.

``draw_by_bin`` plots it: per bin, the accuracy of the step's rollouts against the tokens the run
had generated before that step (all bins together), with a 95% Wilson interval as the band. These
are training rollouts, sampled at the pipeline's temperature from the prompts its Control stages
chose: what the method saw, not a held-out evaluation.

Example (a run of ``pipelines/grpo_reasoning_gym.yaml``)::

    for (task, level), points in accuracy_by_bin(Path("runs/rg")).items():
        print(task, level, [(p.step, p.correct / p.rollouts) for p in points])
    draw_by_bin(Path("runs/rg"), Path("runs/rg"))  # runs/rg/accuracy_by_bin.png
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from gfcr.errors import GfcrError
from gfcr.graph import load_pipeline
from gfcr.runtime.store.lineage import read_lineage
from gfcr.runtime.store.rundir import RunDir
from gfcr.tracking.plots import PlotSpec, draw
from gfcr.tracking.report_variants import Curve

Z95 = 1.959963984540054  # the normal quantile of a two-sided 95% interval


@dataclass(frozen=True)
class BinStep:
    """One bin at one step: rollouts generated for its prompts, and how many were correct."""

    step: int
    rollouts: int
    correct: int
    tokens_before: int  # response tokens the run generated before this step, all bins together


def accuracy_by_bin(run_dir: Path, keys: Sequence[str] = ("task", "level")) -> dict[tuple, list[BinStep]]:
    """Per bin (the tuple of the prompts' ``metadata[key]`` for ``keys``), the steps in order."""
    rd = RunDir(Path(run_dir))
    pool = load_pipeline(rd.spec).data.load()
    counts: dict[tuple, dict[int, list[int]]] = {}
    tokens: dict[int, int] = {}
    for row in read_lineage(rd.lineage_dir).to_pylist():
        if row["created_step"] is not None and row["created_step"] != row["step"]:
            continue  # a reused rollout: counted where it was generated
        tokens[row["step"]] = tokens.get(row["step"], 0) + (row["n_tokens"] or 0)
        if row["prompt_id"] not in pool:
            raise GfcrError(f"{run_dir}: the data source has no prompt `{row['prompt_id']}` any more",
                            "run this against the data the run was made with")
        meta = pool.get(row["prompt_id"]).metadata
        missing = [k for k in keys if k not in meta]
        if missing:
            raise GfcrError(f"{run_dir}: prompt `{row['prompt_id']}` has no metadata {missing} (it has {sorted(meta)})",
                            "pass the keys its data source records, e.g. ('category',) for arithmetic_mix")
        cell = counts.setdefault(tuple(meta[k] for k in keys), {}).setdefault(row["step"], [0, 0])
        cell[0] += 1
        cell[1] += bool(row["correct"])
    before = {step: sum(t for s, t in tokens.items() if s < step) for step in tokens}
    return {b: [BinStep(step, n, c, before[step]) for step, (n, c) in sorted(steps.items())]
            for b, steps in sorted(counts.items())}


def wilson(correct: int, n: int) -> tuple[float, float]:
    """The 95% Wilson score interval of a proportion ``correct / n``."""
    p, z2 = correct / n, Z95 ** 2
    centre, half = (p + z2 / (2 * n)) / (1 + z2 / n), Z95 * (p * (1 - p) / n + z2 / (4 * n * n)) ** 0.5 / (1 + z2 / n)
    return max(0.0, centre - half), min(1.0, centre + half)


def bin_curves(bins: dict[tuple, list[BinStep]]) -> list[Curve]:
    """One curve per bin: rollout accuracy against tokens generated before the step, Wilson band."""
    curves = []
    for key, points in bins.items():
        bands = [wilson(p.correct, p.rollouts) for p in points]
        curves.append(Curve("/".join(map(str, key)), tuple(float(p.tokens_before) for p in points),
                            tuple(p.correct / p.rollouts for p in points), tuple(lo for lo, _ in bands),
                            tuple(hi for _, hi in bands)))
    return curves


def draw_by_bin(run_dir: Path, out_dir: Path, keys: Sequence[str] = ("task", "level")) -> Path:
    """``<out_dir>/accuracy_by_bin.png``: ``bin_curves`` of the run."""
    spec = PlotSpec("accuracy_by_bin", "Rollout accuracy by difficulty bin", "tokens generated before the step",
                    "accuracy of the step's rollouts", markers=True)
    return draw(bin_curves(accuracy_by_bin(run_dir, keys)), spec, Path(out_dir))
