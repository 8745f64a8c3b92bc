"""``gfcr sync RUN_DIR``: send the MLflow writes a run kept in its outbox while the store was away.

Exit 0 when everything is in MLflow (or nothing was waiting), 1 when some writes are still
pending (what they are and why: the store cannot be reached, or refused one), 2 for a folder
that is not a run directory, or one a run is using (that run sends its outbox itself).
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.markup import escape

from gfcr.cli.common import err, fail, out
from gfcr.errors import GfcrError, RunDirError


def sync(run_dir: Annotated[Path, typer.Argument(help="a run directory made by `gfcr run`")]) -> None:
    """Send the MLflow writes (metrics, lineage, the run's end) a run kept in RUN_DIR/mlflow-outbox.jsonl while its MLflow store could not be reached."""
    from gfcr.runtime.store.rundir import RunDir
    from gfcr.runtime.store.rundir_lock import lock_run_dir, release_run_dir
    from gfcr.tracking.mlflow_tracker import sync_run
    from gfcr.tracking.outbox import Outbox

    try:
        if not RunDir(run_dir).spec.is_file():
            raise RunDirError(f"{run_dir} is not a gfcr run directory (no spec.yaml)",
                              "pass the folder `gfcr run` printed, e.g. runs/quickstart-20261130-101500")
        lock_run_dir(run_dir)  # a run going on there sends its own outbox: refused, naming it
        try:
            waiting = Outbox(run_dir).describe()
            sent, pending, why = sync_run(run_dir)
        finally:
            release_run_dir(run_dir)
    except GfcrError as exc:
        fail(exc)
        raise typer.Exit(2) from None
    if pending:
        err.print(f"[red]not sent:[/] {escape(Outbox(run_dir).describe(pending))} ({len(pending)} write(s)); "
                  f"sent {sent} before that\n    why: {escape(why or '?')}\n"
                  f"    [green]fix:[/] make the MLflow store reachable again, then run `gfcr sync {escape(str(run_dir))}` "
                  "again; nothing is lost meanwhile", markup=True)
        raise typer.Exit(1)
    if sent:
        out.print(f"sent {sent} write(s) to MLflow: {escape(waiting)}; nothing is pending")
    else:
        out.print(f"nothing to send: every MLflow write of {escape(str(run_dir))} is in MLflow")
