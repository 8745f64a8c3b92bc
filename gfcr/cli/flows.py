"""The flow that Prefect deployments of gfcr pipelines run.

``gfcr deploy`` registers a deployment of ``pipeline_flow`` (renamed after the pipeline) with
the pipeline file and its overrides as parameters; ``gfcr serve`` executes its scheduled and
UI-started runs, each in a fresh process that imports this module by name
(``gfcr.cli.flows:pipeline_flow``). A run made this way is the same as ``gfcr run FILE --set
...``: a new run directory under ``runs/`` of the serving process's working directory, stage
task runs, and MLflow tracking as the spec says.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from gfcr.graph import load_pipeline
from gfcr.runtime.loop.prefect_runner import configure_prefect

configure_prefect()

from prefect import flow  # noqa: E402  (after gfcr's Prefect settings)

FLOW_TAG = "gfcr"


@flow(name="gfcr-pipeline", persist_result=False, log_prints=False, validate_parameters=False)
def pipeline_flow(file: str, overrides: list[str] | None = None, runs_dir: str = "runs",
                  plugins: list[str] | None = None) -> dict[str, Any]:
    """Run the pipeline in ``file`` with ``overrides`` (``KEY=VALUE`` strings) and ``plugins``
    (``--plugin`` modules) to its end."""
    from gfcr.runtime.store.rundir import new_run_dir
    from gfcr.runtime.loop.session import Run
    from gfcr.tracking.mlflow_tracker import start_tracking

    pipeline = load_pipeline(file, list(overrides or []) + ["executor.kind=prefect"], plugins=list(plugins or []))
    run = Run.start(pipeline, new_run_dir(pipeline.spec.name, Path(runs_dir)))
    trackers = start_tracking(run)
    run.hooks = trackers
    try:
        return run.train(new_flow_run=False)  # this flow run is the run
    finally:
        for tracker in trackers:
            tracker.close()
