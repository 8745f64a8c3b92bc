"""Ablations: one pipeline, a grid of variants x seeds, one command (``gfcr ablate``).

Each ``--vary KEY=V1,V2`` is a `--set` override with several values; the grid is their
product, crossed with the seeds (``run.seed``). Every cell is checked before anything runs,
so a typo in the third value fails at once, not an hour in.

Tracking: one MLflow parent run for the ablation and a child run per cell (tag
``gfcr.variant`` holds the cell's name, ``pick=control.greso`` for ``--vary
stages.pick.use=...``, ``gfcr.seed`` its seed; the params hold the whole spec), all in the
pipeline's experiment. The cell's run directory is named the same (``pick=control.greso-seed0``). Orchestration: under the Prefect runner the ablation is one flow run, each cell
a task whose run is a subflow run (a flow run of the pipeline with its stage tasks); with
``executor.kind: local``, plain threads. ``parallel`` cells run at once in threads of this
process (sampling is serialised by the engine's lock, so each cell stays reproducible; on 2
cores, more than 2 gains nothing). At the end the report (``gfcr.tracking.report``) is
written from the child runs as MLflow holds them.
"""

from __future__ import annotations

import itertools
import re
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

from gfcr.errors import GfcrError
from gfcr.graph import CompiledPipeline, load_pipeline
from gfcr.runtime.store.rundir import new_run_dir
from gfcr.runtime.loop.session import Run
from gfcr.spec.yaml_source import parse_scalar
from gfcr.tracking.mlflow_store import create_parent_run, finish_run
from gfcr.tracking.mlflow_tracker import start_tracking
from gfcr.tracking.report import ReportPaths, write_report
from gfcr.tracking.report_series import series_from_mlflow

VARIANT_TAG, SEED_TAG, ABLATION_TAG = "gfcr.variant", "gfcr.seed", "gfcr.ablation"


@dataclass(frozen=True)
class Cell:
    """One run of the grid: a value for every varied key, and a seed. ``names`` are the settings
    as a person reads them (``pick=control.greso``; see ``short_setting``), given by ``grid``."""

    settings: tuple[tuple[str, str], ...]
    seed: int
    names: tuple[str, ...] = field(default=(), compare=False)

    @property
    def label(self) -> str:
        return ", ".join(self.names or (f"{k}={v}" for k, v in self.settings))

    @property
    def slug(self) -> str:
        text = "-".join(self.names or (short_setting(k, v) for k, v in self.settings)) or "base"
        return re.sub(r"[^A-Za-z0-9_.=-]+", "_", text) + f"-seed{self.seed}"

    def overrides(self) -> list[str]:
        return [f"{k}={v}" for k, v in self.settings] + [f"run.seed={self.seed}"]


def short_setting(key: str, value: str) -> str:
    """A varied setting as a person reads it: the stage (or component) a ``use`` swaps and its new
    alias (``stages.pick.use=control.greso`` -> ``pick=control.greso``), a whole stage given as a
    mapping by its alias (``stages.budget={use: control.coba, ...}`` -> ``budget=control.coba``),
    any other key by its last part (``stages.pick.with.batch_size=8`` -> ``batch_size=8``)."""
    parts = key.split(".")
    name = parts[-2] if parts[-1] == "use" and len(parts) > 1 else parts[-1]
    try:
        parsed = parse_scalar(value)
    except ValueError:
        parsed = None
    alias = parsed.get("use") if isinstance(parsed, dict) else None
    return f"{name}={alias if isinstance(alias, str) else value}"


@dataclass
class CellResult:
    """How one cell of an ablation (a ``Cell``) or of a comparison (``compare.Cell``) went."""

    cell: Any
    run_dir: Path
    summary: dict[str, Any] | None = None
    error: str | None = None
    seconds: float = 0.0


@dataclass
class Ablation:
    """What ``run_ablation`` did: the cells' results, the MLflow parent run and the report."""

    name: str
    root: Path
    parent_run_id: str
    tracking_uri: str
    experiment: str
    results: list[CellResult] = field(default_factory=list)
    report: ReportPaths | None = None

    @property
    def failed(self) -> list[CellResult]:
        return [r for r in self.results if r.error is not None]


def split_values(text: str) -> list[str] | None:
    """The comma-separated values of ``text``, commas inside brackets, braces or quotes kept
    (``[0.2,0.28],[0.2,0.2]`` is two lists); None when a bracket or quote is left open."""
    values, current, closers, quote = [], "", [], None
    for char in text:
        if quote is not None:
            quote = None if char == quote else quote
        elif char in "'\"":
            quote = char
        elif char in "[{":
            closers.append("]" if char == "[" else "}")
        elif char in "]}":
            if not closers or closers.pop() != char:
                return None
        elif char == "," and not closers:
            values.append(current.strip())
            current = ""
            continue
        current += char
    return None if closers or quote is not None else values + [current.strip()]


def parse_vary(items: Sequence[str]) -> list[tuple[str, list[str]]]:
    """``["a.b=1,2", "c=[1,2],[3,4]"]`` -> ``[("a.b", ["1", "2"]), ("c", ["[1,2]", "[3,4]"])]``: values
    are split at the commas outside brackets, braces and quotes; every problem at once, with a fix."""
    parsed, problems = [], []
    for item in items:
        key, sep, values = item.partition("=")
        options = split_values(values) if sep else []
        if options is None:
            problems.append(f"--vary {item!r}: a bracket or quote is left open; write list values whole, "
                            "e.g. --vary 'update.with.loss.with.clip=[0.2,0.28],[0.2,0.2]'")
        elif not key.strip() or not sep or not all(options):
            problems.append(f"--vary {item!r}: expected KEY=V1,V2[,...], e.g. update.with.advantage.use=mean_std,median")
        elif key.strip() in {k for k, _ in parsed}:
            problems.append(f"--vary {item!r}: `{key.strip()}` is varied twice; give all its values in one --vary")
        elif key.strip() == "run.seed":
            problems.append(f"--vary {item!r}: seeds are given with --seeds 0,1,2")
        else:
            parsed.append((key.strip(), options))
    if problems:
        raise GfcrError("\n".join(problems))
    return parsed


def parse_seeds(text: str) -> list[int]:
    try:
        seeds = [int(s) for s in text.split(",") if s.strip()]
    except ValueError:
        raise GfcrError(f"--seeds {text!r}: expected integers separated by commas, e.g. 0,1,2") from None
    if not seeds or len(set(seeds)) != len(seeds):
        raise GfcrError(f"--seeds {text!r}: give one or more distinct seeds, e.g. 0,1,2")
    return seeds


def grid(vary: list[tuple[str, list[str]]], seeds: Sequence[int]) -> list[Cell]:
    """Every combination of the values, for every seed; a key whose short names would not tell its
    values apart (two mappings of one alias) is named by its whole ``key=value``."""
    keys = [k for k, _ in vary]
    readable = {k for k, values in vary if len({short_setting(k, v) for v in values}) == len(set(values))}
    combos = itertools.product(*[values for _, values in vary]) if vary else [()]
    return [Cell(tuple(zip(keys, combo)), seed,
                 tuple(short_setting(k, v) if k in readable else f"{k}={v}" for k, v in zip(keys, combo)))
            for combo in combos for seed in seeds]


def compile_cells(file: Path, cells: Sequence[Cell], base: Sequence[str]) -> dict[Cell, CompiledPipeline]:
    """Compile every cell's pipeline; raise one GfcrError naming each cell that fails."""
    compiled, problems = {}, []
    for cell in cells:
        try:
            compiled[cell] = load_pipeline(file, [*base, *cell.overrides()])
        except GfcrError as exc:
            problems.append(f"cell {cell.label or 'base'} (seed {cell.seed}):\n{exc}")
    if problems:
        raise GfcrError("\n".join(problems))
    spec = next(iter(compiled.values())).spec
    if spec.tracking.mlflow is None:
        raise GfcrError(f"{file}: `tracking.mlflow` is null, but an ablation's runs and report live in MLflow\n"
                        "    fix: remove `tracking: {mlflow: null}` from the spec (or --set tracking.mlflow.uri=...)")
    return compiled


def run_ablation(file: Path, vary: list[tuple[str, list[str]]], seeds: Sequence[int], *,
                 base: Sequence[str] = (), parallel: int = 1, out_dir: Path | None = None,
                 on_cell: Callable[[CellResult], None] | None = None,
                 on_notes: Callable[[list[str]], None] | None = None) -> Ablation:
    """Run the whole grid, then write its report; a failed cell is recorded, the others go on.
    ``on_notes`` hears, before anything runs, what loading the cells changed (a stage swap's
    dropped keys, ``gfcr.spec.overrides``), each note once."""
    cells = grid(vary, seeds)
    compiled = compile_cells(file, cells, base)
    if on_notes is not None:
        on_notes(list(dict.fromkeys(note for c in compiled.values() for note in c.spec.source.notes)))
    spec = compiled[cells[0]].spec
    root = new_run_dir(f"{spec.name}-ablation")
    experiment = spec.tracking.mlflow.experiment or spec.name
    tags = {ABLATION_TAG: "parent", "gfcr.ablation.grid": "; ".join(f"{k}={','.join(v)}" for k, v in vary),
            "gfcr.ablation.seeds": ",".join(map(str, seeds)), "gfcr.run_dir": str(root.resolve())}
    parent, uri = create_parent_run(spec.tracking.mlflow, experiment, root.name, tags)
    ablation = Ablation(spec.name, root, parent, uri, experiment)

    def run_cell(cell: Cell) -> CellResult:
        result = _run_cell(cell, compiled[cell], root / cell.slug, parent)
        if on_cell is not None:
            on_cell(result)
        return result

    status = "FAILED"
    try:
        if spec.executor.kind == "local":
            with ThreadPoolExecutor(max_workers=parallel) as pool:
                ablation.results = list(pool.map(run_cell, cells))
        else:
            from gfcr.runtime.loop.prefect_runner import map_in_flow

            ablation.results = map_in_flow(f"{spec.name}-ablation", root.name, run_cell, cells,
                                           [c.slug for c in cells], parallel)
        runs = series_from_mlflow(experiment, parent_run_id=parent, tracking_uri=uri)
        if runs:
            ablation.report = write_report(runs, out_dir or root / "report", title=f"{spec.name} ablation")
        status = "FINISHED" if not ablation.failed else "FAILED"
    finally:
        finish_run(uri, parent, status)
    return ablation


def _run_cell(cell: Cell, pipeline: CompiledPipeline, run_dir: Path, parent: str) -> CellResult:
    return train_cell(CellResult(cell, run_dir), lambda: Run.start(pipeline, run_dir), parent,
                      {VARIANT_TAG: cell.label, SEED_TAG: str(cell.seed)})


def train_cell(result: CellResult, make_run: Callable[[], Run], parent: str, tags: dict[str, str],
               on_finished: Callable[[], None] | None = None) -> CellResult:
    """Make the cell's run, track it as a child of MLflow run ``parent`` and train it to its end;
    ``on_finished`` runs after the run and its MLflow run finished. A ``GfcrError`` becomes
    ``result.error`` (the other cells go on)."""
    start, trackers = time.perf_counter(), ()
    try:
        run = make_run()
        trackers = start_tracking(run, parent_run_id=parent, tags=tags)
        run.hooks = trackers
        result.summary = run.train()
        if on_finished is not None:
            on_finished()
    except GfcrError as exc:
        result.error = str(exc)
    finally:
        for tracker in trackers:
            tracker.close()
        result.seconds = time.perf_counter() - start
    return result
