"""The per-step series a report is drawn from, read from run directories or from MLflow.

A ``RunSeries`` is one run: its flattened resolved spec (``update.with.advantage`` ->
``median``), its seed, per step the counts the report plots, and its evaluations. Run
directories give them from ``metrics.jsonl`` and ``summary.json``; an MLflow experiment gives
them from the metrics the tracker logged under the same keys (nested keys joined with ``.``,
MLflow step = gfcr step), read back through MLflow's API so that a report shows exactly what
MLflow holds.

Steps and evaluations: the runtime evaluates *before* step ``s`` runs (every ``eval.every``
steps, step 0 included) and once more after the last step. ``evals`` holds ``(s, accuracy)``
with ``s`` the number of training steps done when the evaluation ran, so the final evaluation
of an ``N``-step run is ``(N, accuracy)``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Mapping

from gfcr.errors import GfcrError, SpecError, did_you_mean
from gfcr.runtime.store.rundir import RunDir
from gfcr.spec.yaml_source import parse_yaml
from gfcr.tracking.mlflow_store import connect, quiet, resolve_uri
from gfcr.tracking.mlflow_values import flatten, spec_params

COUNTS = ("rollouts_generated", "tokens_generated", "rollouts_in_update", "tokens_in_update", "groups",
          "zero_variance_groups")
OPTIONAL_COUNTS = ("tokens_with_signal", "tokens_scored")  # absent from runs of older gfcr versions
CLOCK = ("time.step_s", "time.eval_s")  # a step's wall-clock seconds, and those of the evaluation before it
EVAL = "eval_accuracy"
FINAL_EVAL = "eval_accuracy_after"  # summary.json's final evaluation


@dataclass(frozen=True)
class StepCounts:
    """What one step generated and fed to the update, and how long it took."""

    step: int
    rollouts_generated: int
    tokens_generated: int
    rollouts_in_update: int
    tokens_in_update: int
    groups: int
    zero_variance_groups: int
    seconds: float  # the step's wall clock plus that of the evaluation that ran before it
    step_seconds: float = 0.0  # the step's wall clock alone
    tokens_with_signal: int | None = None  # tokens of groups that reached the update with unequal rewards
    tokens_scored: int | None = None  # response tokens stages scored without generating them


@dataclass(frozen=True)
class RunSeries:
    """One run, as a report sees it."""

    name: str
    params: Mapping[str, str]  # the flattened resolved spec, values as strings (as MLflow params are)
    steps: tuple[StepCounts, ...]  # sorted by step
    evals: tuple[tuple[int, float], ...]  # (training steps done, accuracy), sorted
    seed: int | None = None
    variant: str | None = None  # the `gfcr.variant` tag of an ablation cell, when there is one
    run_dir: Path | None = None
    source: str = ""  # the folder or the MLflow run id it was read from

    def cumulative_before(self, counter: str, step: int) -> int:
        """The sum of ``counter`` over the steps before ``step``: what was spent before an
        evaluation at ``step`` (``step`` past the last step sums them all)."""
        return sum(getattr(s, counter) for s in self.steps if s.step < step)

    @property
    def final_accuracy(self) -> float | None:
        return self.evals[-1][1] if self.evals else None

    @property
    def wall_seconds(self) -> float:
        return sum(s.seconds for s in self.steps)


# --- run directories --------------------------------------------------------------------------

def series_from_run_dirs(paths: Iterable[Path]) -> list[RunSeries]:
    """One series per run directory made by ``gfcr run`` (or ``gfcr ablate``)."""
    return [_series_from_run_dir(Path(p)) for p in paths]


def _series_from_run_dir(path: Path) -> RunSeries:
    rd = RunDir(path)
    if not rd.spec.is_file() or not rd.metrics.is_file():
        missing = "spec.yaml" if not rd.spec.is_file() else "metrics.jsonl"
        raise GfcrError(f"{path} is not a gfcr run directory with metrics (no {missing})\n"
                        "    fix: pass folders that `gfcr run` printed, e.g. runs/quickstart-20261130-101500, "
                        "after at least one step")
    records = rd.read_metrics()
    steps = tuple(sorted((_counts(r, path) for r in records), key=lambda s: s.step))
    evals = [(r["step"], float(r[EVAL])) for r in records if r.get(EVAL) is not None]
    summary = json.loads(rd.summary.read_text(encoding="utf-8")) if rd.summary.is_file() else {}
    if summary.get(FINAL_EVAL) is not None:
        evals.append((int(summary["steps"]), float(summary[FINAL_EVAL])))
    params = _spec_params(rd.spec)
    return RunSeries(name=path.name, params=params, steps=steps, evals=tuple(sorted(evals)),
                     seed=_int_or_none(params.get("run.seed")), run_dir=path, source=str(path))


def _spec_params(spec: Path) -> dict[str, str]:
    """The params the MLflow tracker logs for this spec (resolved, defaults included), so that
    run directories and MLflow runs group into variants alike. A spec this version of gfcr no
    longer accepts (an older run's) falls back to its keys as written."""
    from gfcr.graph import load_pipeline

    try:
        return spec_params(load_pipeline(spec))
    except GfcrError:
        data, _, problems = parse_yaml(spec.read_text(encoding="utf-8"), str(spec))  # aliases and depth capped
        if problems:
            raise SpecError(problems) from None
        return {k: str(v) for k, v in flatten(data)}


def _counts(record: Mapping[str, Any], where: Path | str) -> StepCounts:
    try:
        clock = record.get("time") or {}
        step_s = float(clock.get("step_s") or 0.0)
        optional = {k: int(record[k]) for k in OPTIONAL_COUNTS if record.get(k) is not None}
        return StepCounts(int(record["step"]), *(int(record[k]) for k in COUNTS),
                          step_s + float(clock.get("eval_s") or 0.0), step_s, **optional)
    except KeyError as exc:
        raise GfcrError(f"{where}: step {record.get('step', '?')} has no `{exc.args[0]}`\n"
                        "    fix: report on runs written by this version of gfcr") from None


def _int_or_none(value: str | None) -> int | None:
    try:
        return int(value) if value is not None else None
    except ValueError:
        return None


# --- MLflow -----------------------------------------------------------------------------------

def series_from_mlflow(experiment: str, parent_run_id: str | None = None,
                       tracking_uri: str | None = None) -> list[RunSeries]:
    """One series per run of an MLflow experiment, oldest first. The store is
    ``tracking_uri``, else ``$MLFLOW_TRACKING_URI``, else ``sqlite:///mlflow.db``.

    With ``parent_run_id``, only the children of that run (the cells of one ``gfcr ablate``);
    otherwise every run except ablation parents (runs other runs name as ``mlflow.parentRunId``).
    Runs that logged no step metrics are left out, so the list may be empty; an experiment
    that does not exist is an error.
    """
    uri = tracking_uri or resolve_uri()
    client = connect(uri)
    with quiet():
        return _read_experiment(client, uri, experiment, parent_run_id)


def _read_experiment(client: Any, uri: str, experiment: str, parent_run_id: str | None) -> list[RunSeries]:
    exp = client.get_experiment_by_name(experiment)
    if exp is None:
        names = [e.name for e in client.search_experiments()]
        hint = did_you_mean(experiment, names) or f"experiments there: {', '.join(sorted(names)) or 'none'}"
        raise GfcrError(f"no MLflow experiment `{experiment}` in {uri}\n    fix: {hint} "
                        "(or point --tracking-uri / MLFLOW_TRACKING_URI at the store the runs went to)")
    runs = _search_all(client, exp.experiment_id, parent_run_id)
    parents = {r.data.tags.get("mlflow.parentRunId") for r in runs}
    series = [_series_from_mlflow_run(client, r) for r in runs if r.info.run_id not in parents]
    return [s for s in series if s.steps]


def _search_all(client: Any, experiment_id: str, parent_run_id: str | None) -> list[Any]:
    query = f"tags.`mlflow.parentRunId` = '{parent_run_id}'" if parent_run_id else ""
    runs, token = [], None
    while True:
        page = client.search_runs([experiment_id], query, order_by=["attributes.start_time ASC"],
                                  page_token=token)
        runs.extend(page)
        token = page.token
        if not token:
            return runs


def _series_from_mlflow_run(client: Any, run: Any) -> RunSeries:
    run_id = run.info.run_id
    history = {key: _last_per_step(client.get_metric_history(run_id, key))
               for key in (*COUNTS, *OPTIONAL_COUNTS, *CLOCK, EVAL) if key in run.data.metrics}
    if any(key not in history for key in COUNTS):
        return RunSeries(name=run.info.run_name or run_id, params={}, steps=(), evals=(), source=run_id)
    steps = tuple(
        StepCounts(step, *(int(history[k].get(step, 0)) for k in COUNTS),
                   sum(history.get(k, {}).get(step, 0.0) for k in CLOCK), history.get(CLOCK[0], {}).get(step, 0.0),
                   **{k: int(history[k][step]) for k in OPTIONAL_COUNTS if step in history.get(k, {})})
        for step in sorted(history[COUNTS[0]]))
    evals = history.get(EVAL, {})  # the tracker logs the final evaluation at step = run.steps
    tags, params = run.data.tags, dict(run.data.params)
    run_dir = tags.get("gfcr.run_dir")
    return RunSeries(name=run.info.run_name or run_id, params=params, steps=steps, evals=tuple(sorted(evals.items())),
                     seed=_int_or_none(tags.get("gfcr.seed", params.get("run.seed"))), variant=tags.get("gfcr.variant"),
                     run_dir=Path(run_dir) if run_dir else None, source=run_id)


def _last_per_step(metrics: Iterable[Any]) -> dict[int, float]:
    """The value logged last at each step (a resumed run logs its replayed steps again)."""
    out: dict[int, float] = {}
    for m in sorted(metrics, key=lambda m: m.timestamp):
        out[int(m.step)] = float(m.value)
    return out
