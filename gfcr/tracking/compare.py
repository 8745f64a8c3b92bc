"""``gfcr compare``: whole pipelines side by side, on one task, at one compute budget.

    gfcr compare pipelines/quickstart.yaml pipelines/greso_arith.yaml --task arith-mix \\
        --seeds 0,1,2 --budget tokens=200000

Each pipeline keeps its stages, loops, update and run settings; with ``--task`` its
``policy``, ``data`` and ``eval`` are the task's (``gfcr.spec.task``), otherwise its own. The
budget is the same for every cell: ``steps=N`` sets ``run.steps``; ``rollouts=N`` and
``tokens=N`` set ``run.max_rollouts`` / ``run.max_tokens`` (a run stops after the step that
reaches them) and lift ``run.steps`` to ``STEP_CAP``. A cell is one pipeline and one seed.

The comparison lives in one folder (``--out``, default ``runs/compare-<task>-<fingerprint>``,
the fingerprint hashing the task's text, the budget and the overrides: what every cell
shares), so the same command finds the same folder, and so does one with more pipelines or
more seeds, which reuses the cells already run:

    comparison.json       what was compared, and the MLflow parent run
    specs/<pipeline>.yaml each pipeline with the task put in (what the cells compile)
    <pipeline>-seed<N>/   each cell's run directory; DONE once it finished and was tracked
    report/               index.html, compare.md, compare.json and the plots

Tracking and orchestration are ``gfcr ablate``'s: one MLflow parent run, a child run per
cell (tags ``gfcr.variant`` = the pipeline's name, ``gfcr.seed``); under the Prefect runner
one flow run whose task runs each start a cell's subflow run, ``parallel`` at a time.

Resuming: run the same command again (or one with more pipelines or seeds). A cell with
``DONE`` is not rerun, unless its pipeline changed since (its run directory's ``spec.yaml``
differs from the cell's spec now: an error that names the folder to delete); a cell with a
checkpoint resumes from it and continues its MLflow run (``gfcr resume``'s mechanism, which
gives the metrics of an uninterrupted run); a cell that died before its first checkpoint
starts over, its half-written MLflow run deleted. The report is computed from the MLflow
child runs, so it equals an uninterrupted comparison's, wall-clock figures aside.
"""

from __future__ import annotations

import hashlib
import json
import re
import shutil
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Literal, Sequence

import yaml

from gfcr.errors import GfcrError, SpecError
from gfcr.graph import CompiledPipeline, load_pipeline
from gfcr.runtime.store.checkpoint import latest_checkpoint
from gfcr.runtime.store.rundir import RunDir, write_text
from gfcr.runtime.loop.session import Run
from gfcr.spec.loader import pipeline_path
from gfcr.spec.models import resolve_plugin_path
from gfcr.spec.task import Task, apply_task, load_task
from gfcr.spec.yaml_source import parse_yaml
from gfcr.tracking.ablation import SEED_TAG, VARIANT_TAG, CellResult, train_cell
from gfcr.tracking.compare_figures import Comparison, compare
from gfcr.tracking.compare_report import ComparisonPaths, write_comparison
from gfcr.tracking.mlflow_store import connect, create_parent_run, finish_run, quiet
from gfcr.tracking.mlflow_tracker import TRACKING_FILE
from gfcr.tracking.report_series import RunSeries, series_from_mlflow

STEP_CAP = 1_000_000  # run.steps under a rollouts or tokens budget: only the budget stops a run
MANIFEST, DONE, COMPARE_TAG = "comparison.json", "DONE", "gfcr.compare"


@dataclass(frozen=True)
class Budget:
    """The compute every cell gets: ``steps``, ``rollouts`` or ``tokens``."""

    kind: Literal["steps", "rollouts", "tokens"]
    amount: int

    def overrides(self) -> list[str]:
        if self.kind == "steps":
            return [f"run.steps={self.amount}"]
        return [f"run.max_{self.kind}={self.amount}", f"run.steps={STEP_CAP}"]

    def __str__(self) -> str:
        return f"{self.kind}={self.amount}"


def parse_budget(text: str | None) -> Budget | None:
    """``"tokens=200000"`` -> ``Budget("tokens", 200000)``; None keeps each pipeline's run.steps."""
    if text is None:
        return None
    kind, _, amount = text.partition("=")
    if kind.strip() not in ("steps", "rollouts", "tokens") or not amount.strip().isdigit() or int(amount) < 1:
        raise GfcrError(f"--budget {text!r}: expected steps=N, rollouts=N or tokens=N with N >= 1",
                        "e.g. --budget tokens=200000 (each cell stops after the step that reaches it)")
    return Budget(kind.strip(), int(amount))  # type: ignore[arg-type]


@dataclass(frozen=True)
class Cell:
    """One pipeline (by its name) and one seed."""

    pipeline: str
    seed: int

    @property
    def slug(self) -> str:
        return re.sub(r"[^A-Za-z0-9_.-]+", "_", self.pipeline) + f"-seed{self.seed}"


@dataclass
class ComparisonRun:
    """What ``run_comparison`` did: its folder, MLflow parent run, cells, figures and report."""

    root: Path
    parent_run_id: str
    tracking_uri: str
    experiment: str
    results: list[CellResult] = field(default_factory=list)
    comparison: Comparison | None = None
    report: ComparisonPaths | None = None

    @property
    def failed(self) -> list[CellResult]:
        return [r for r in self.results if r.error is not None]


# --- planning ---------------------------------------------------------------------------------

@dataclass(frozen=True)
class Plan:
    """Every cell compiled, and what to write before the first one runs."""

    root: Path
    fingerprint: str
    specs: dict[str, str]  # pipeline name -> its spec YAML, task applied
    cells: dict[Cell, CompiledPipeline]
    experiment: str
    task: Task | None


def plan_comparison(files: Sequence[Path], *, task: str | None = None, seeds: Sequence[int] = (0,),
                    budget: Budget | None = None, overrides: Sequence[str] = (), out_dir: Path | None = None,
                    runs_dir: Path = Path("runs")) -> Plan:
    """Apply the task, compile every cell (every problem of every cell at once) and name the folder."""
    if not files:
        raise GfcrError("nothing to compare: no pipeline given", "e.g. gfcr compare pipelines/quickstart.yaml "
                        "pipelines/greso_arith.yaml --task arith-mix")
    loaded = load_task(task) if task is not None else None
    docs = {}
    for file in files:
        load_pipeline(file)  # the pipeline's own problems, at its own file:line
        name, doc = _merged(Path(file), loaded)
        if name in docs:
            raise GfcrError(f"two pipelines are named `{name}` ({file} is the second)",
                            "give each compared pipeline its own `name`: the report labels rows by it")
        docs[name] = doc
    cell_overrides = [*(budget.overrides() if budget else []), *overrides]
    fingerprint = _fingerprint(loaded, budget, overrides)
    root = Path(out_dir) if out_dir is not None else runs_dir / f"compare-{loaded.spec.name if loaded else 'own'}-" \
                                                               f"{fingerprint[:8]}"
    specs = {name: f"# {name}, as `gfcr compare` runs it" + (f" on task {loaded.spec.name}" if loaded else "")
             + "\n" + yaml.safe_dump(doc, sort_keys=False) for name, doc in docs.items()}
    cells = _compile_cells(specs, seeds, cell_overrides)
    spec = next(iter(cells.values())).spec
    if spec.tracking.mlflow is None:
        raise GfcrError("`tracking.mlflow` is null, but a comparison's runs and figures live in MLflow",
                        "remove `tracking: {mlflow: null}` from the pipelines (or --set tracking.mlflow.uri=...)")
    experiment = f"gfcr-compare-{loaded.spec.name}" if loaded else "gfcr-compare"
    return Plan(root, fingerprint, specs, cells, experiment, loaded)


def _merged(file: Path, task: Task | None) -> tuple[str, dict[str, Any]]:
    file = pipeline_path(file)  # a shipped pipeline may be named: `quickstart`
    data, _, problems = parse_yaml(file.read_text(encoding="utf-8"), str(file))
    if problems:
        raise SpecError(problems)
    if isinstance(data.get("plugins"), list):  # the cell's spec is compiled from another folder
        data["plugins"] = [resolve_plugin_path(p, file.parent) for p in data["plugins"]]
    return str(data["name"]), apply_task(data, task) if task is not None else data


def _compile_cells(specs: dict[str, str], seeds: Sequence[int], overrides: Sequence[str]) -> dict[Cell, Any]:
    """Compile each cell from its spec text (through a temporary file, so errors name it)."""
    import tempfile

    compiled, problems = {}, []
    with tempfile.TemporaryDirectory(prefix="gfcr-compare-") as tmp:
        for name, text in specs.items():
            path = Path(tmp) / f"{name}.yaml"
            path.write_text(text, encoding="utf-8")
            for seed in seeds:
                try:
                    compiled[Cell(name, seed)] = load_pipeline(path, [*overrides, f"run.seed={seed}"])
                except GfcrError as exc:
                    problems.append(f"pipeline {name} (seed {seed}):\n{exc}")
                    break  # the other seeds fail the same way
    if problems:
        raise GfcrError("\n".join(problems))
    return compiled


def _fingerprint(task: Task | None, budget: Budget | None, overrides: Sequence[str]) -> str:
    """What every cell of a comparison shares: cells of equal fingerprints are comparable."""
    what = {"task": task.text if task else None, "budget": str(budget) if budget else None,
            "overrides": list(overrides)}
    return hashlib.sha256(json.dumps(what, sort_keys=True).encode()).hexdigest()


# --- running ----------------------------------------------------------------------------------

def run_comparison(plan: Plan, *, parallel: int = 1, baseline: str | None = None, target: float | None = None,
                   on_cell: Callable[[CellResult], None] | None = None) -> ComparisonRun:
    """Run (or continue) every cell of ``plan``, then write the report from the MLflow child runs."""
    spec = next(iter(plan.cells.values())).spec
    _check_same_comparison(plan)
    _check_cells_current(plan)
    parent, uri = _parent_run(plan, spec)
    done = ComparisonRun(plan.root, parent, uri, plan.experiment)

    def run_cell(cell: Cell) -> CellResult:
        result = _run_cell(cell, plan.cells[cell], plan.root / cell.slug, parent)
        if on_cell is not None:
            on_cell(result)
        return result

    cells, status = list(plan.cells), "FAILED"
    try:
        if spec.executor.kind == "local":
            with ThreadPoolExecutor(max_workers=parallel) as pool:
                done.results = list(pool.map(run_cell, cells))
        else:
            from gfcr.runtime.loop.prefect_runner import map_in_flow

            done.results = map_in_flow("gfcr-compare", plan.root.name, run_cell, cells, [c.slug for c in cells],
                                       parallel)
        if not done.failed:
            mine = {_mlflow_run_id(r.run_dir) for r in done.results}  # this plan's cells, not every child run
            runs = [r for r in series_from_mlflow(plan.experiment, parent_run_id=parent, tracking_uri=uri)
                    if r.source in mine]
            order = list(plan.specs)  # the command line's order: the first pipeline is the default baseline
            done.comparison = compare(in_report_order(runs, order), baseline or order[0], target)
            what = f"on task {plan.task.spec.name}" if plan.task else "on their own tasks"
            done.report = write_comparison(done.comparison, plan.root / "report",
                                           f"gfcr compare: {len(plan.specs)} pipelines {what}")
            status = "FINISHED"
    finally:
        finish_run(uri, parent, status)
    return done


def in_report_order(runs: Sequence[RunSeries], pipelines: Sequence[str]) -> list[RunSeries]:
    """``runs`` by pipeline in ``pipelines``' order (the command line's), then by seed: MLflow
    returns them in the order they finished, which cells run in parallel, or by several
    commands on one folder, leave mixed."""
    def key(run: RunSeries) -> tuple:
        where = pipelines.index(run.variant) if run.variant in pipelines else len(pipelines)
        return where, run.seed is None, run.seed or 0
    return sorted(runs, key=key)


def _check_same_comparison(plan: Plan) -> None:
    """Refuse a folder that holds a comparison with another task, budget or overrides."""
    manifest = plan.root / MANIFEST
    if manifest.is_file() and json.loads(manifest.read_text(encoding="utf-8"))["fingerprint"] != plan.fingerprint:
        raise GfcrError(f"{plan.root} holds a comparison with another task, budget or overrides",
                        "pass --out with a new folder, or delete that one")


def _check_cells_current(plan: Plan) -> None:
    """Refuse to reuse a cell whose pipeline changed since it ran (its resolved spec differs)."""
    stale = [plan.root / cell.slug for cell, pipeline in plan.cells.items()
             if RunDir(plan.root / cell.slug).spec.is_file()
             and RunDir(plan.root / cell.slug).spec.read_text(encoding="utf-8") != pipeline.spec.to_yaml()]
    if stale:
        raise GfcrError(f"{len(stale)} cell(s) in {plan.root} ran with another version of their pipeline: "
                        + ", ".join(p.name for p in stale),
                        f"delete those folders to run them again ({' '.join(str(p) for p in stale)}), or pass --out "
                        "with a new folder")


def _parent_run(plan: Plan, spec: Any) -> tuple[str, str]:
    """The comparison's MLflow parent run: the one its folder names (a rerun), else a new one."""
    manifest = plan.root / MANIFEST
    (plan.root / "specs").mkdir(parents=True, exist_ok=True)
    if manifest.is_file():
        saved = json.loads(manifest.read_text(encoding="utf-8"))
        parent, uri = saved["parent_run_id"], saved["tracking_uri"]
        with quiet():
            connect(uri).update_run(parent, status="RUNNING")
    else:
        tags = {COMPARE_TAG: "parent", "gfcr.compare.task": plan.task.spec.name if plan.task else "(own)",
                "gfcr.run_dir": str(plan.root.resolve())}
        parent, uri = create_parent_run(spec.tracking.mlflow, plan.experiment, plan.root.name, tags)
        write_text(manifest, json.dumps({"fingerprint": plan.fingerprint, "parent_run_id": parent, "tracking_uri": uri,
                                         "experiment": plan.experiment,
                                         "task": plan.task.spec.name if plan.task else None}, indent=2) + "\n")
    for name, text in plan.specs.items():
        write_text(plan.root / "specs" / f"{name}.yaml", text)
    return parent, uri


def _mlflow_run_id(run_dir: Path) -> str | None:
    tracking = run_dir / TRACKING_FILE
    return json.loads(tracking.read_text(encoding="utf-8"))["mlflow_run_id"] if tracking.is_file() else None


def _run_cell(cell: Cell, pipeline: CompiledPipeline, run_dir: Path, parent: str) -> CellResult:
    result = CellResult(cell, run_dir)
    if (run_dir / DONE).is_file():
        result.summary = json.loads(RunDir(run_dir).summary.read_text(encoding="utf-8"))
        result.summary["resumed"] = "done before"
        return result

    def make_run() -> Run:
        if latest_checkpoint(RunDir(run_dir)) is not None:
            return Run.resume(run_dir)
        _discard(run_dir)
        return Run.start(pipeline, run_dir)

    # DONE only once the run ended by logging its final evaluation and marking its MLflow run FINISHED
    return train_cell(result, make_run, parent, {VARIANT_TAG: cell.pipeline, SEED_TAG: str(cell.seed)},
                      on_finished=lambda: write_text(run_dir / DONE, ""))


def _discard(run_dir: Path) -> None:
    """Remove a cell that died before its first checkpoint, and its half-written MLflow run."""
    tracking = run_dir / TRACKING_FILE
    if tracking.is_file():
        saved = json.loads(tracking.read_text(encoding="utf-8"))
        with quiet():
            connect(saved["tracking_uri"]).delete_run(saved["mlflow_run_id"])
    shutil.rmtree(run_dir, ignore_errors=True)
