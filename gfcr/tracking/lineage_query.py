"""A run's lineage as a whole, for ``gfcr lineage RUN_DIR`` without a rollout id: per step,
how many rollouts it handled, how many it generated, how many reached the update and which
stage dropped the others and why (``summarise_lineage``); and the rollouts that match a query
(dropped, at a step, by a stage, for a reason: ``find_rollouts``), whose ids ``gfcr lineage
RUN_DIR ROLLOUT_ID`` then follows one by one.

It reads the rows of ``lineage/step-*.parquet`` (``gfcr.runtime.store.lineage.SCHEMA``) and the
stage aliases of the run's ``spec.yaml``. A rollout's row counts as generated at its step
unless it copies another (``replayed_from``: replayed or cached), as ``metrics.jsonl``'s
``rollouts_generated`` counts.

Example:

>>> q = RolloutQuery(reason="zero variance")
>>> q.matches({"dropped_by": "keep", "drop_reason": "zero variance: every reward = 1", "step": 0}, {})
True
>>> q.matches({"dropped_by": None, "drop_reason": None, "step": 0}, {})
False
"""

from __future__ import annotations

import difflib
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gfcr.errors import GfcrError
from gfcr.runtime.store.lineage import read_lineage
from gfcr.runtime.store.rundir import RunDir
from gfcr.spec import load_spec
from gfcr.tracking.lineage_chain import open_run_dir, stage_aliases


@dataclass(frozen=True)
class Drop:
    """The rollouts of a step one stage dropped for one reason."""

    stage: str  # the stage id (``keep``)
    alias: str | None  # its alias (``filter.nonzero_variance``), None when the spec does not compile
    reason: str
    rollouts: int


@dataclass(frozen=True)
class StepSummary:
    step: int
    rollouts: int  # every rollout the step handled (lineage rows)
    generated: int  # of them, made at this step (not copies of earlier ones)
    kept: int  # reached the update
    drops: tuple[Drop, ...]  # most rollouts first

    @property
    def dropped(self) -> int:
        return sum(d.rollouts for d in self.drops)

    @property
    def not_handed_on(self) -> int:
        """Neither dropped nor in the update (e.g. a step whose update was skipped)."""
        return self.rollouts - self.kept - self.dropped


@dataclass(frozen=True)
class LineageSummary:
    run_dir: Path
    steps: tuple[StepSummary, ...]
    notes: tuple[str, ...] = ()


@dataclass(frozen=True)
class RolloutQuery:
    """Which rollouts to list; every option given must hold. ``stage`` and ``reason`` are about
    the drop: a stage id or alias that dropped it, a case-insensitive part of the drop reason."""

    dropped: bool = False
    step: int | None = None
    stage: str | None = None
    reason: str | None = None
    stale: bool = False  # trained on with tokens older than the update's version

    @property
    def given(self) -> bool:
        return (self.dropped or self.stale or self.step is not None or self.stage is not None
                or self.reason is not None)

    def matches(self, row: dict[str, Any], aliases: dict[str, str]) -> bool:
        by = row["dropped_by"]
        return ((by is not None or not (self.dropped or self.stage or self.reason))
                and (not self.stale or (row["staleness"] or 0) > 0)
                and (self.step is None or row["step"] == self.step)
                and (self.stage is None or self.stage in (by, aliases.get(by)))
                and (self.reason is None or self.reason.lower() in (row["drop_reason"] or "").lower()))


@dataclass(frozen=True)
class StaleHandling:
    """What the run's update does with a stale token: its off-policy correction (None: the update
    has none, or the spec no longer compiles) and the staleness past which it masks tokens."""

    correction: str | None = None
    max_staleness: int | None = None

    def fate(self, staleness: int) -> str:
        """What became of a rollout trained ``staleness`` versions stale, in words."""
        trained = f"trained {staleness} version(s) stale"
        if self.max_staleness is not None and staleness > self.max_staleness:
            return f"{trained}: its tokens past max_staleness={self.max_staleness} masked by `{self.correction}`"
        if self.correction in (None, "none"):
            return f"{trained}, with no off-policy correction (`correction: none`)"
        return f"{trained}, corrected by `{self.correction}`"


@dataclass(frozen=True)
class RolloutMatches:
    run_dir: Path
    query: RolloutQuery
    rows: tuple[dict[str, Any], ...]  # the matching lineage rows, in step order
    aliases: dict[str, str]  # stage id -> alias
    reasons: tuple[str, ...]  # every drop reason of the run: what ``--reason`` can match
    notes: tuple[str, ...] = ()
    stale: StaleHandling = StaleHandling()


def summarise_lineage(run_dir: Path) -> LineageSummary:
    """Per step: rollouts handled, generated, kept, and dropped by stage and reason."""
    rd, rows = _rows(run_dir)
    notes: list[str] = []
    aliases = stage_aliases(rd, notes)
    steps = sorted({r["step"] for r in rows})
    return LineageSummary(rd.path, tuple(_step_summary(s, [r for r in rows if r["step"] == s], aliases)
                                         for s in steps), tuple(notes))


def find_rollouts(run_dir: Path, query: RolloutQuery) -> RolloutMatches:
    """The rollouts of the run that match ``query``; a GfcrError, with the fix, for a step the
    run does not have or a stage its pipeline does not have."""
    rd, rows = _rows(run_dir)
    notes: list[str] = []
    aliases = stage_aliases(rd, notes)
    _check_step(run_dir, query.step, rows)
    _check_stage(run_dir, query.stage, rows, aliases)
    reasons = tuple(dict.fromkeys(r["drop_reason"] for r in rows if r["drop_reason"]))
    found = tuple(r for r in rows if query.matches(r, aliases))
    return RolloutMatches(rd.path, query, found, aliases, reasons, tuple(notes), stale_handling(rd, notes))


def stale_handling(rd: RunDir, notes: list[str]) -> StaleHandling:
    """The run's update's correction, as its spec writes it (``update.with.correction``; the
    default ``none`` where an update with components leaves it out)."""
    try:
        spec = load_spec(rd.spec)
    except GfcrError:
        return StaleHandling()  # stage_aliases has noted why the spec does not load
    if spec.update.use != "update.grpo":
        return StaleHandling()
    correction = spec.update.with_.get("correction") or {}
    settings = correction.get("with") or {}
    return StaleHandling(correction.get("use", "none"), settings.get("max_staleness"))


def _rows(run_dir: Path) -> tuple[RunDir, list[dict[str, Any]]]:
    rd = open_run_dir(run_dir)
    rows = read_lineage(rd.lineage_dir).to_pylist()
    if not rows:
        raise GfcrError(f"{run_dir} has no lineage yet (lineage/ is empty)",
                        "pass a run that has finished at least one step")
    return rd, rows


def _step_summary(step: int, rows: list[dict[str, Any]], aliases: dict[str, str]) -> StepSummary:
    drops = Counter((r["dropped_by"], r["drop_reason"] or "(no reason given)") for r in rows if r["dropped_by"])
    return StepSummary(step=step, rollouts=len(rows), generated=sum(r["replayed_from"] is None for r in rows),
                       kept=sum(bool(r["in_update"]) for r in rows),
                       drops=tuple(Drop(stage, aliases.get(stage), reason, n) for (stage, reason), n
                                   in drops.most_common()))


def _check_step(run_dir: Path, step: int | None, rows: list[dict[str, Any]]) -> None:
    steps = sorted({r["step"] for r in rows})
    if step is not None and step not in steps:
        raise GfcrError(f"{run_dir} has no step {step} in its lineage (steps {steps[0]}-{steps[-1]})",
                        f"pass a step from {steps[0]} to {steps[-1]}")


def _check_stage(run_dir: Path, stage: str | None, rows: list[dict[str, Any]], aliases: dict[str, str]) -> None:
    """A stage the run's pipeline (or its lineage) does not know is a typo, not an empty answer."""
    known = {*aliases, *aliases.values(), *(r["dropped_by"] for r in rows if r["dropped_by"])}
    if stage is None or stage in known:
        return
    droppers = sorted({r["dropped_by"] for r in rows if r["dropped_by"]})
    near = difflib.get_close_matches(stage, sorted(known), n=3, cutoff=0.6)
    hint = f"did you mean {', '.join(f'`{n}`' for n in near)}? " if near else ""
    raise GfcrError(f"{run_dir}'s pipeline has no stage `{stage}`",
                    hint + ("stages that dropped rollouts in this run: " + ", ".join(f"`{d}`" for d in droppers)
                            if droppers else "no stage dropped a rollout in this run"))
