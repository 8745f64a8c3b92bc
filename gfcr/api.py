"""``gfcr.run``: run a pipeline from Python as ``gfcr run`` runs it from the shell.

A pipeline is a YAML file or a ``PipelineSpec`` built in Python; ``overrides`` are the
command line's ``--set KEY=VALUE``. The run gets its own run directory (``metrics.jsonl``,
checkpoints, lineage), is tracked to MLflow unless the spec says ``tracking: {mlflow: null}``,
and runs on the spec's executor (Prefect unless ``executor: {kind: local}``). It returns the
run's summary, the table ``gfcr run`` prints: ``run_dir``, ``steps``, eval accuracy before and
after, rollouts and tokens generated, and the paths of its metrics, lineage and checkpoint.
``gfcr resume RUN_DIR`` (or ``gfcr.resume``) continues it.

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
from gfcr.spec import PipelineSpec, load_spec_text


def run(pipeline: str | Path | PipelineSpec, *, overrides: Iterable[str] = (), run_dir: str | Path | None = None,
        hooks: tuple[Any, ...] = ()) -> dict[str, Any]:
    """Run ``pipeline`` to its ``run.steps`` in a new run directory (default ``runs/<name>-<time>``);
    ``hooks`` are runtime hooks (``after_step(record)`` and the others of ``gfcr.runtime``)."""
    from gfcr.runtime.session import Run
    from gfcr.tracking.mlflow_tracker import check_store

    compiled = _compile(pipeline, list(overrides))
    check_store(compiled.spec)  # a wrong MLflow URI fails before anything is written
    return _train(lambda: Run.start(compiled, None if run_dir is None else Path(run_dir), hooks))


def resume(run_dir: str | Path, *, steps: int | None = None, hooks: tuple[Any, ...] = ()) -> dict[str, Any]:
    """Continue the run in ``run_dir`` from its newest checkpoint, to ``steps`` (default: its own)."""
    from gfcr.runtime.session import Run
    from gfcr.tracking.mlflow_tracker import check_run_store

    check_run_store(Path(run_dir))  # a store that is down fails before the run directory changes
    return _train(lambda: Run.resume(Path(run_dir), steps, hooks))


def _compile(pipeline: str | Path | PipelineSpec, overrides: list[str]):
    if not isinstance(pipeline, PipelineSpec):
        return load_pipeline(pipeline, overrides)
    if overrides:  # the same override rules as a file's: through the spec's YAML
        return compile_pipeline(load_spec_text(pipeline.to_yaml(), overrides=overrides))
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
