"""``gfcr.run``: run a pipeline from Python as ``gfcr run`` runs it from the shell.

A pipeline is a YAML file or a ``PipelineSpec`` built in Python; ``overrides`` are the
command line's ``--set KEY=VALUE``. The run gets its own run directory (``metrics.jsonl``,
checkpoints, lineage), is tracked to MLflow unless the spec says ``tracking: {mlflow: null}``,
and runs on the spec's executor (Prefect unless ``executor: {kind: local}``). It returns the
run's summary, the table ``gfcr run`` prints: ``run_dir``, ``steps``, eval accuracy before and
after, rollouts and tokens generated, and the paths of its metrics, lineage and checkpoint.
``gfcr resume RUN_DIR`` (or ``gfcr.resume``) continues it. While it runs it prints a line per
step and per evaluation (``progress=False``: silent), plain lines that read the same in a
terminal, a notebook or a log file:

    quickstart: run directory runs/quickstart-20261201-201500
    quickstart: step 1/2: reward 0.312, 128 rollouts, 1.4 s
    quickstart: eval after 2 steps: accuracy 38.0%

>>> import gfcr
>>> summary = gfcr.run("pipelines/quickstart.yaml", overrides=["run.steps=2"])  # doctest: +SKIP
>>> summary["eval_accuracy_after"], summary["run_dir"]  # doctest: +SKIP
(0.38, 'runs/quickstart-20261201-201500')

Errors a user can fix (a bad spec, data, model, run directory or store) are ``GfcrError``s
with what, where and the fix, raised before the run directory is written.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Iterable

from gfcr.graph import compile_pipeline, load_pipeline
from gfcr.spec import PipelineSpec, SourceMap
from gfcr.spec.loader import build_spec


def run(pipeline: str | Path | PipelineSpec, *, overrides: Iterable[str] = (), run_dir: str | Path | None = None,
        hooks: tuple[Any, ...] = (), progress: bool = True) -> dict[str, Any]:
    """Run ``pipeline`` (a file, a shipped pipeline's name, or a ``PipelineSpec``) to its ``run.steps``
    in a new run directory (default ``runs/<name>-<time>``); ``hooks`` are runtime hooks
    (``after_step(record)`` and the others of ``gfcr.runtime``); ``progress`` prints a line a step."""
    from gfcr.runtime.loop.session import Run
    from gfcr.tracking.mlflow_tracker import check_store

    compiled = _compile(pipeline, list(overrides))
    check_store(compiled.spec)  # a wrong MLflow URI fails before anything is written
    return _train(lambda: Run.start(compiled, None if run_dir is None else Path(run_dir), _with(hooks, progress)))


def resume(run_dir: str | Path, *, steps: int | None = None, hooks: tuple[Any, ...] = (),
           progress: bool = True) -> dict[str, Any]:
    """Continue the run in ``run_dir`` from its newest checkpoint, to ``steps`` (default: its own);
    ``progress`` prints a line a step."""
    from gfcr.runtime.loop.session import Run
    from gfcr.tracking.mlflow_tracker import check_run_store

    check_run_store(Path(run_dir))  # a store that is down fails before the run directory changes
    return _train(lambda: Run.resume(Path(run_dir), steps, _with(hooks, progress)))


class PrintProgress:
    """A run hook printing a plain line per step and per evaluation (``gfcr run`` draws a bar instead)."""

    def __init__(self) -> None:
        self.name, self.total = "", 0

    def before_run(self, event: Any) -> None:
        run = event.run
        self.name, self.total = run.spec.name, run.spec.run.steps
        print(f"{self.name}: run directory {run.dir.path}", flush=True)

    def step_recorded(self, event: Any) -> None:
        record = event.record
        reward = record.get("reward_mean")
        said = "-" if reward is None else f"{reward:.3f}"
        print(f"{self.name}: step {record['step'] + 1}/{self.total}: reward {said}, "
              f"{record['rollouts_generated']} rollouts, {record['time']['step_s']:.1f} s", flush=True)

    def after_eval(self, event: Any) -> None:
        print(f"{self.name}: eval after {event.step} steps: accuracy {event.result.accuracy:.1%}", flush=True)


def _with(hooks: tuple[Any, ...], progress: bool) -> tuple[Any, ...]:
    return (PrintProgress(), *hooks) if progress else tuple(hooks)


def _compile(pipeline: str | Path | PipelineSpec, overrides: list[str]):
    if not isinstance(pipeline, PipelineSpec):
        return load_pipeline(pipeline, overrides)
    if overrides:  # the same override rules as a file's; errors still point at the user's lines
        source = SourceMap(pipeline.source.file, dict(pipeline.source.spans))
        return compile_pipeline(build_spec(pipeline.to_data(), source, overrides))
    return compile_pipeline(pipeline)


def _train(make_run) -> dict[str, Any]:
    from gfcr.tracking.mlflow_tracker import start_tracking

    session = make_run()
    trackers = start_tracking(session)
    session.hooks = (*session.hooks, *trackers)
    try:
        return session.train()
    finally:
        for tracker in trackers:
            tracker.close()  # marks the MLflow run FAILED unless the run finished
