"""``gfcr run`` and ``gfcr resume``: train a pipeline with a progress bar, then print a summary
saying where the results are.

A user's mistake exits 2 (what, where, the fix), a bug in a stage 1 (its traceback), a full disk 1
(the write that failed, the space it needed, the ``gfcr resume`` that continues the run), a lost
worker 1 (a trainer rank that died, or an engine replica on Ray lost for good: which, why, and the
``gfcr resume`` that continues the run), Ctrl-C 130
(where the run stopped and the ``gfcr resume`` that continues it).
"""

from __future__ import annotations

import signal
import threading
import traceback
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Optional

import typer
from rich.markup import escape

from gfcr.cli.common import ExecutorOption, PluginOption, SetOption, compile_file, err, fail, import_plugins, out
from gfcr.errors import GfcrError, StageError, WorkerLost
from gfcr.runtime.store.diskspace import DiskFullError

if TYPE_CHECKING:
    from gfcr.graph import CompiledPipeline


def run(file: Path, set_: SetOption = None,
        steps: Annotated[Optional[int], typer.Option(help="override run.steps")] = None,
        run_dir: Annotated[Optional[Path], typer.Option("--run-dir", help="default: runs/<name>-<time>")] = None,
        executor: ExecutorOption = None, plugin: PluginOption = None) -> None:
    """Run a pipeline (a file, or a shipped pipeline's name: `gfcr run quickstart`): a progress bar per step, then a summary saying where the results are.

    By default a run is a Prefect flow run with a task run per stage execution (see it in
    `gfcr ui`); `--executor local` runs it in-process, without Prefect.
    """
    overrides = list(set_ or []) + ([f"run.steps={steps}"] if steps is not None else [])
    overrides += [f"executor.kind={executor}"] if executor is not None else []
    try:
        pipeline = compile_file(file, overrides, inputs=True, plugins=plugin)
    except GfcrError as exc:
        fail(exc)
        raise typer.Exit(2) from None
    _train(lambda hooks: _start_run(pipeline, run_dir, hooks))


def resume(run_dir: Annotated[Path, typer.Argument(help="a run directory made by `gfcr run`")],
           steps: Annotated[Optional[int], typer.Option(help="run until this many steps in all")] = None,
           executor: ExecutorOption = None, plugin: PluginOption = None,
           strict: Annotated[bool, typer.Option(help="refuse (exit 2) when the newest checkpoint is damaged, "
                                                 "instead of continuing from the newest intact one")] = False) -> None:
    """Continue a run from its newest intact checkpoint, up to run.steps (or --steps). The run's
    own `plugins` are imported again; --plugin imports more first (e.g. a plugin that moved)."""
    from gfcr.runtime.store.manifest import check_resumable
    from gfcr.runtime.store.rundir import RunDir
    from gfcr.runtime.store.rundir_lock import lock_run_dir
    from gfcr.tracking.mlflow_tracker import check_run_store

    def resumed(hooks: tuple) -> object:
        import_plugins(plugin)
        rd = RunDir(run_dir)
        if rd.spec.is_file():  # one process at a time: a run in use is refused at once, naming its holder
            lock_run_dir(run_dir)
        check_run_store(run_dir)  # a store that is down fails before the run directory changes
        if rd.spec.is_file():  # a damaged checkpoint or lost metrics, found before torch loads
            check_resumable(rd, strict)
        from gfcr.runtime.loop.session import Run

        return Run.resume(run_dir, steps, hooks, executor=executor, strict=strict)

    _train(resumed)


def _start_run(pipeline: CompiledPipeline, run_dir: Path | None, hooks: tuple) -> object:
    from gfcr.runtime.store.rundir import RunDir, check_new_run_dir
    from gfcr.runtime.store.rundir_lock import lock_run_dir

    if run_dir is not None:  # a --run-dir in use fails before torch loads
        if RunDir(run_dir).spec.is_file():
            lock_run_dir(run_dir)  # a run going on there: refused, naming its process
        check_new_run_dir(run_dir)
    from gfcr.tracking.mlflow_tracker import check_store

    check_store(pipeline.spec)  # a wrong MLflow URI fails before the run directory is written (and torch loads)
    from gfcr.runtime.loop.session import Run

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
    from gfcr.cli.progress import ProgressHook, summary_table
    from gfcr.tracking.mlflow_tracker import start_tracking

    hook, trackers, session = None, (), None
    interrupted = _CtrlC()
    try:
        with out.status("loading the pipeline, data and policy..."):
            session = make_run(())
            # MLflow, unless the spec says `tracking: {mlflow: null}`; a store that goes away mid-run is said here
            trackers = start_tracking(session, notify=lambda m: err.print(f"[yellow]warning:[/] {escape(m)}",
                                                                            markup=True))
        total = session.spec.run.steps
        hook = ProgressHook(out, total, session.runner.step, session.spec.name)
        session.hooks = (hook, *trackers)  # one channel: the run's events and its runner's (loop rounds, limits)
        out.print(f"run directory: {session.dir.path}")
        if getattr(session, "restarted", False):
            out.print("no checkpoint yet (stopped before its first one): running it again from step 0")
        for pool in (session.pool, session.eval_pool):
            _print_skipped(pool)
        for skipped in getattr(session, "skipped_checkpoints", ()):
            err.print(f"[yellow]warning:[/] skipped a damaged checkpoint: {escape(skipped.message)}", markup=True)
        if getattr(session, "skipped_checkpoints", ()):
            err.print(f"    continuing from {escape(str(session.last_checkpoint))}; metrics.jsonl and lineage/ are cut back to step "
                      f"{session.runner.step} and its later steps run again", markup=True)
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
        if isinstance(exc, DiskFullError) or _lost_worker(exc):  # not the command's mistake: exit 1, how to go on
            fail(exc)
            err.print(f"    {escape(_stopped_at(session))}", markup=True)
            raise typer.Exit(1) from None
        if isinstance(exc, StageError) and not exc.user_error:  # a bug in a stage: its traceback, then what failed
            err.print(escape("".join(traceback.format_exception(exc.cause)).rstrip()), markup=True)
            err.print(f"[red]error:[/] {escape(str(exc))}", markup=True)
            raise typer.Exit(1) from None
        fail(exc)
        raise typer.Exit(2) from None
    finally:
        interrupted.restore()
        for tracker in trackers:
            tracker.close()  # marks the MLflow run FAILED unless the run finished
    out.print(summary_table(summary))
    for tracker in trackers:
        out.print(tracker.describe())


def _lost_worker(exc: GfcrError) -> bool:
    """A process the run placed on Ray lost for good (a trainer rank, or an engine replica that died
    more often than the run allows), met by a stage or eval."""
    return isinstance(exc.cause if isinstance(exc, StageError) else exc, WorkerLost)


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
    from gfcr.runtime.store.checkpoint import latest_checkpoint

    done, total, path = session.dir.recorded_steps(), session.spec.run.steps, session.dir.path
    checkpoint = latest_checkpoint(session.dir)
    start = (f"its checkpoint of step {int(checkpoint.name.removeprefix('step-'))}" if checkpoint is not None
             else "step 0 (no checkpoint yet)")
    return (f"stopped after {done} of {total} steps ({path / 'metrics.jsonl'}); `gfcr resume` continues "
            f"from {start} and gives the metrics of an uninterrupted run:\n    gfcr resume {path}")
