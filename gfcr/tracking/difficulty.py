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

Example (a run of ``pipelines/grpo_reasoning_gym.yaml``)::

    for (task, level), points in accuracy_by_bin(Path("runs/rg")).items():
        print(task, level, [(p.step, p.correct / p.rollouts) for p in points])
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from gfcr.errors import GfcrError
from gfcr.graph import load_pipeline
from gfcr.runtime.store.lineage import read_lineage
from gfcr.runtime.store.rundir import RunDir


@dataclass(frozen=True)
class BinStep:
    """One bin at one step: rollouts generated for its prompts, and how many were correct."""

    step: int
    rollouts: int
    correct: int


def accuracy_by_bin(run_dir: Path, keys: Sequence[str] = ("task", "level")) -> dict[tuple, list[BinStep]]:
    """Per bin (the tuple of the prompts' ``metadata[key]`` for ``keys``), the steps in order."""
    rd = RunDir(Path(run_dir))
    pool = load_pipeline(rd.spec).data.load()
    counts: dict[tuple, dict[int, list[int]]] = {}
    for row in read_lineage(rd.lineage_dir).to_pylist():
        if row["created_step"] is not None and row["created_step"] != row["step"]:
            continue  # a reused rollout: counted where it was generated
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
    return {b: [BinStep(step, n, c) for step, (n, c) in sorted(steps.items())] for b, steps in sorted(counts.items())}
