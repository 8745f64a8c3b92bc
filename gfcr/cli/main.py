"""``gfcr``: validate, draw, list and run pipelines.

Commands import only what they need: ``gfcr validate`` never imports torch, prefect,
mlflow or vllm, so it stays fast enough for an editor's save hook.

Exit codes: 0 done; 2 a mistake the user can fix (any ``GfcrError``: a bad spec, data,
checkpoint, model or run directory, an evaluation that cannot score, a stage that raised one),
printed as what, where and the fix, without a traceback; 1 a bug (a stage that raised
anything else), printed with its traceback.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import signal
import sys
import threading
import traceback
import types
import typing
from enum import Enum
from pathlib import Path
from typing import Annotated, Any, Optional

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from gfcr.errors import GfcrError, RegistryError, StageError
from gfcr.graph import CompiledPipeline, load_pipeline

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  help="gfcr: compose, check and run rollout pipelines for LLM RL.")
# tables stay readable when piped: at least 120 columns
_WIDTH = max(shutil.get_terminal_size((120, 24)).columns, 120)
out = Console(highlight=False, soft_wrap=True, width=_WIDTH)
err = Console(stderr=True, highlight=False, soft_wrap=True, width=_WIDTH)

SetOption = Annotated[Optional[list[str]], typer.Option("--set", "-s", metavar="KEY=VALUE",
                                                        help="override a spec key, e.g. run.steps=20")]

ExecutorOption = Annotated[Optional[str], typer.Option(
    "--executor", metavar="prefect|local|ray", help="override executor.kind (default: the spec's, else prefect)")]


def _print_version(value: bool) -> None:
    if value:
        from gfcr.runtime.rundir import gfcr_version

        out.print(f"gfcr {gfcr_version()}")
        raise typer.Exit()


@app.callback()
def _main(version: Annotated[bool, typer.Option("--version", callback=_print_version, is_eager=True,
                                                help="print gfcr's version and exit")] = False) -> None:
    """gfcr: compose, check and run rollout pipelines for LLM RL."""


def _compile(file: Path, overrides: list[str] | None, inputs: bool = False) -> CompiledPipeline:
    """Load and compile ``file``; with ``inputs``, also check its data files and policy model
    cheaply (``gfcr.runtime.inputs``: first rows, the model's folder; nothing loaded)."""
    pipeline = load_pipeline(file, overrides or [])
    if inputs:
        from gfcr.runtime.inputs import check_inputs

        check_inputs(pipeline)
    return pipeline


def _fail(exc: GfcrError) -> None:
    """Print a user's mistake: what and where, then the fix (each problem's, for spec and data errors)."""
    if isinstance(exc, StageError) and isinstance(exc.cause, GfcrError):  # a stage met a user's mistake
        where = f"step {exc.step}" + (f", loop round {exc.round}" if exc.round is not None else "")
        err.print(f"[red]error:[/] stage `{escape(exc.stage_id)}` failed at {where} of run {escape(exc.run_id)}:",
                  markup=True)
        exc = exc.cause
    problems = getattr(exc, "problems", None)
    if problems is None:
        err.print(f"[red]error:[/] {escape(exc.message)}", markup=True)
        if exc.fix:
            err.print(f"    [green]fix:[/] {escape(exc.fix)}", markup=True)
        return
    for p in problems:
        path = escape(p.path + ": ") if p.path else ""
        err.print(f"[bold]{escape(str(p.where))}[/]: {path}[red]{escape(p.message)}[/]", markup=True)
        if p.fix:
            err.print(f"    [green]fix:[/] {escape(p.fix)}", markup=True)


@app.command()
def validate(files: Annotated[list[Path], typer.Argument(help="pipeline YAML files")],
             set_: SetOption = None,
             inputs: Annotated[bool, typer.Option(
                 "--inputs/--no-inputs",
                 help="also check data files (first rows) and the policy model (found, not loaded); "
                      "--no-inputs checks the spec alone, e.g. on a machine without a pipeline's data")] = True,
             ) -> None:
    """Parse, validate, resolve, compile and type-check pipelines, and check their data files
    (the first rows) and policy model (found, not loaded). Exit 2 on any problem."""
    failed = 0
    for file in files:
        try:
            pipeline = _compile(file, set_, inputs=inputs)
        except GfcrError as exc:
            failed += 1
            _fail(exc)
            count = len(getattr(exc, "problems", [exc]))
            err.print(f"[red]✗[/] {escape(str(file))}: {count} problem{'s' if count != 1 else ''}", markup=True)
            continue
        out.print(f"[green]✓[/] {escape(str(file))}: {len(pipeline.nodes)} stages, {len(pipeline.loops)} loop block(s); "
                  f"plan: {escape(pipeline.describe_plan())}", markup=True)
    if failed:
        raise typer.Exit(2) from None


@app.command()
def graph(file: Path, out_path: Annotated[Path, typer.Option("--out", "-o", help="a .png, .svg or .dot file")],
          set_: SetOption = None) -> None:
    """Draw the compiled pipeline: stages coloured by family, loop blocks as boxes."""
    from gfcr.graph.draw import render

    try:
        written = render(_compile(file, set_), out_path)
    except GfcrError as exc:
        _fail(exc)
        raise typer.Exit(2) from None
    out.print(f"wrote {written}")


class ListFormat(str, Enum):
    table = "table"
    markdown = "markdown"


@app.command()
def stages(family: Annotated[Optional[str], typer.Option(help="only this family")] = None,
           as_json: Annotated[bool, typer.Option("--json", help="machine-readable, with Config schemas")] = False,
           components: Annotated[bool, typer.Option("--components", help="list the update's advantage "
                                                    "estimators, losses and aggregations instead")] = False,
           fmt: Annotated[ListFormat, typer.Option("--format", help="with --components: a table, or Markdown")]
           = ListFormat.table) -> None:
    """List every registered stage: alias, family, ports, Config fields and origin package; with
    --components, the update's advantage estimators, losses and aggregations."""
    from gfcr.registry import FAMILIES, stage_infos

    if components:
        _list_components(family, as_json, fmt)
        return
    if fmt is not ListFormat.table:
        err.print("`--format markdown` lists the update's components: add `--components`")
        raise typer.Exit(2) from None
    if family is not None and family not in FAMILIES:
        err.print(f"unknown family `{family}`; families are {', '.join(FAMILIES)}")
        raise typer.Exit(2) from None
    try:
        infos, broken = stage_infos(family=family)
    except RegistryError as exc:  # e.g. two packages register the same alias
        _fail(exc)
        raise typer.Exit(2) from None
    for alias, exc in broken.items():
        err.print(f"[red]error:[/] stage `{escape(alias)}` cannot be loaded: {escape(str(exc))}", markup=True)
    if as_json:
        sys.stdout.write(json.dumps([i.to_json() for i in infos], indent=2) + "\n")
    else:
        _print_stage_table(infos)
    if broken:
        raise typer.Exit(2) from None


def _list_components(family: str | None, as_json: bool, fmt: ListFormat) -> None:
    """``gfcr stages --components``: every advantage estimator, loss and aggregation."""
    from gfcr.stages.update.describe import COLUMNS, component_infos, markdown_table

    if family is not None:
        err.print("`--family` filters stages; `--components` lists the update's components, drop one of them")
        raise typer.Exit(2) from None
    try:
        infos, broken = component_infos()
    except RegistryError as exc:  # e.g. two packages register the same alias
        _fail(exc)
        raise typer.Exit(2) from None
    for name, exc in broken.items():
        err.print(f"[red]error:[/] {escape(name)} cannot be loaded: {escape(str(exc))}", markup=True)
    if as_json:
        sys.stdout.write(json.dumps([dataclasses.asdict(i) for i in infos], indent=2) + "\n")
    elif fmt is ListFormat.markdown:
        sys.stdout.write(markdown_table(infos))
    else:
        table = Table(*COLUMNS, title="update components (update.with.<kind>: {use: <alias>, with: {...}})")
        for info in infos:
            table.add_row(*(escape(cell) for cell in info.row()))
        out.print(table)
    if broken:
        raise typer.Exit(2) from None


def _print_stage_table(infos: list) -> None:
    table = Table("alias", "inputs", "output", "config", "origin", title="gfcr stages")
    for info in infos:
        fields = ", ".join(_field_text(name, f) for name, f in info.config.model_fields.items())
        inputs = ", ".join(f"{p.name}: {p.type.__name__}" + ("" if p.required else "?") for p in info.inputs)
        tags = (" [dim](test stage)[/]" if info.testing else "") + (" [dim](can end loop)[/]" if info.can_end_loop else "")
        table.add_row(escape(info.alias) + tags, escape(inputs), info.output_name, escape(fields), info.origin)
    out.print(table)


def _field_text(name: str, field: Any) -> str:
    """``name: type = default``: a Literal as its allowed values, a default from a factory computed."""
    text = f"{name}: {_type_name(field.annotation)}"
    if field.is_required():
        return text
    try:
        default = field.get_default(call_default_factory=True)
    except TypeError:  # a factory that needs the other fields' values
        return f"{text} = (computed)"
    return f"{text} = {default!r}"


def _type_name(annotation: object) -> str:
    """A type as a user writes it: ``'flat' | 'ivf'`` for a Literal, ``int | None``, ``list[str]``."""
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is typing.Literal:
        return " | ".join(repr(a) for a in args)
    if origin is typing.Annotated:
        return _type_name(args[0])
    if origin in (typing.Union, types.UnionType):
        return " | ".join("None" if a is type(None) else _type_name(a) for a in args)
    if origin is not None and args:
        return f"{getattr(origin, '__name__', str(origin))}[{', '.join(_type_name(a) for a in args)}]"
    if annotation is Ellipsis:
        return "..."
    return getattr(annotation, "__name__", None) or str(annotation).replace("typing.", "")


@app.command()
def run(file: Path, set_: SetOption = None,
        steps: Annotated[Optional[int], typer.Option(help="override run.steps")] = None,
        run_dir: Annotated[Optional[Path], typer.Option("--run-dir", help="default: runs/<name>-<time>")] = None,
        executor: ExecutorOption = None) -> None:
    """Run a pipeline: a progress bar per step, then a summary saying where the results are.

    By default a run is a Prefect flow run with a task run per stage execution (see it in
    `gfcr ui`); `--executor local` runs it in-process, without Prefect.
    """
    overrides = list(set_ or []) + ([f"run.steps={steps}"] if steps is not None else [])
    overrides += [f"executor.kind={executor}"] if executor is not None else []
    try:
        pipeline = _compile(file, overrides, inputs=True)
    except GfcrError as exc:
        _fail(exc)
        raise typer.Exit(2) from None
    _train(lambda hooks: _start_run(pipeline, run_dir, hooks))


@app.command()
def resume(run_dir: Annotated[Path, typer.Argument(help="a run directory made by `gfcr run`")],
           steps: Annotated[Optional[int], typer.Option(help="run until this many steps in all")] = None,
           executor: ExecutorOption = None) -> None:
    """Continue a run from its newest checkpoint, up to run.steps (or --steps)."""
    from gfcr.runtime.manifest import check_resumable
    from gfcr.runtime.rundir import RunDir
    from gfcr.tracking.mlflow_tracker import check_run_store

    def resumed(hooks: tuple) -> object:
        check_run_store(run_dir)  # a store that is down fails before the run directory changes
        rd = RunDir(run_dir)
        if rd.spec.is_file():  # a damaged checkpoint or lost metrics, found before torch loads
            check_resumable(rd)
        from gfcr.runtime.session import Run

        return Run.resume(run_dir, steps, hooks, executor=executor)

    _train(resumed)


def _start_run(pipeline: CompiledPipeline, run_dir: Path | None, hooks: tuple) -> object:
    from gfcr.runtime.rundir import check_new_run_dir

    if run_dir is not None:
        check_new_run_dir(run_dir)  # a --run-dir in use fails before torch loads
    from gfcr.tracking.mlflow_tracker import check_store

    check_store(pipeline.spec)  # a wrong MLflow URI fails before the run directory is written (and torch loads)
    from gfcr.runtime.session import Run

    return Run.start(pipeline, run_dir, hooks)


def _print_skipped(pool: object, limit: int = 10) -> None:
    skipped = getattr(pool, "skipped", ())
    if skipped:
        err.print(f"[yellow]warning:[/] {escape(pool.name)}: skipped {len(skipped)} bad row(s) (on_error: skip)",
                  markup=True)
        for line in skipped[:limit]:
            err.print(f"    {escape(line)}", markup=True)
        if len(skipped) > limit:
            err.print(f"    ... and {len(skipped) - limit} more", markup=True)


def _train(make_run) -> None:
    from gfcr.cli.progress import LoopProgress, ProgressHook, summary_table
    from gfcr.tracking.mlflow_tracker import start_tracking

    hook, trackers, session = None, (), None
    interrupted = _CtrlC()
    try:
        with out.status("loading the pipeline, data and policy..."):
            session = make_run(())
            trackers = start_tracking(session)  # MLflow, unless the spec says `tracking: {mlflow: null}`
        total = session.spec.run.steps
        hook = ProgressHook(out, total, session.runner.step, session.spec.name)
        session.hooks = (hook, *trackers)
        session.runner.hooks = (*session.runner.hooks, LoopProgress(hook))  # loop rounds, loop limits
        out.print(f"run directory: {session.dir.path}")
        if getattr(session, "restarted", False):
            out.print("no checkpoint yet (stopped before its first one): running it again from step 0")
        for pool in (session.pool, session.eval_pool):
            _print_skipped(pool)
        for skipped in getattr(session, "skipped_checkpoints", ()):
            err.print(f"[yellow]warning:[/] skipped a damaged checkpoint: {escape(skipped.message)}", markup=True)
        summary = session.train()
    except (Exception, KeyboardInterrupt) as exc:
        if hook is not None:
            hook.stop()
        # Ctrl-C, or whatever it broke on its way out (Prefect may turn it into its own error):
        # where the run stopped and how to go on, not a traceback
        if interrupted.seen or isinstance(exc, KeyboardInterrupt):
            err.print(f"[yellow]interrupted:[/] {escape(_stopped_at(session))}", markup=True)
            raise typer.Exit(130) from None
        if not isinstance(exc, GfcrError):
            raise
        if isinstance(exc, StageError) and not exc.user_error:  # a bug in a stage: its traceback, then what failed
            err.print(escape("".join(traceback.format_exception(exc.cause)).rstrip()), markup=True)
            err.print(f"[red]error:[/] {escape(str(exc))}", markup=True)
            raise typer.Exit(1) from None
        _fail(exc)
        raise typer.Exit(2) from None
    finally:
        interrupted.restore()
        for tracker in trackers:
            tracker.close()  # marks the MLflow run FAILED unless the run finished
    out.print(summary_table(summary))
    for tracker in trackers:
        out.print(tracker.describe())


class _CtrlC:
    """Notes a Ctrl-C (SIGINT) while a run trains, then interrupts as Python does: so that an
    error it causes on its way out (a Prefect task engine may raise its own) still reads as the
    interruption it is."""

    def __init__(self) -> None:
        self.seen = False
        self._previous = None
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGINT, self._handle)

    def _handle(self, signum: int, frame: Any) -> None:
        self.seen = True
        raise KeyboardInterrupt

    def restore(self) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGINT, self._previous)


def _stopped_at(session: Any) -> str:
    """Where an interrupted run stopped: the steps recorded, the checkpoint a resume starts
    from, and the command that continues it."""
    if session is None:
        return "before the run started (nothing was run); start it again with the same command"
    from gfcr.runtime.checkpoint import latest_checkpoint

    done, total, path = session.dir.recorded_steps(), session.spec.run.steps, session.dir.path
    checkpoint = latest_checkpoint(session.dir)
    start = (f"its checkpoint of step {int(checkpoint.name.removeprefix('step-'))}" if checkpoint is not None
             else "step 0 (no checkpoint yet)")
    return (f"stopped after {done} of {total} steps ({path / 'metrics.jsonl'}); `gfcr resume` continues "
            f"from {start} and gives the metrics of an uninterrupted run:\n    gfcr resume {path}")


from gfcr.cli import report_cmd  # noqa: E402,F401  (registers `gfcr report`)
from gfcr.cli import lineage_cmd  # noqa: E402,F401  (registers `gfcr lineage`)
from gfcr.cli import orchestrate  # noqa: E402,F401  (registers `gfcr deploy`, `serve` and `ui`)
from gfcr.cli import ablate_cmd  # noqa: E402,F401  (registers `gfcr ablate`)
from gfcr.cli import compare_cmd  # noqa: E402,F401  (registers `gfcr compare`)
from gfcr.cli import replay_cmd  # noqa: E402,F401  (registers `gfcr replay inspect`)

if __name__ == "__main__":  # `python -m gfcr.cli.main`: the command modules register on gfcr.cli.main's app
    from gfcr.cli.main import app as registered

    registered()
