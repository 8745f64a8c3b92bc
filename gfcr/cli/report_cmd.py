"""``gfcr report``: an HTML page, PNG plots and a markdown table comparing runs.

Matplotlib and MLflow are imported only when the command runs.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from gfcr.cli.common import err, fail, out
from gfcr.errors import GfcrError


def report(
    run_dirs: Annotated[Optional[list[Path]], typer.Argument(help="run directories made by `gfcr run`")] = None,
    experiment: Annotated[Optional[str], typer.Option(help="report on the runs of this MLflow experiment")] = None,
    parent: Annotated[Optional[str], typer.Option(help="with --experiment: only the child runs of this "
                                                       "MLflow run (one `gfcr ablate`)")] = None,
    tracking_uri: Annotated[Optional[str], typer.Option(help="MLflow store; default $MLFLOW_TRACKING_URI, "
                                                             "else sqlite:///mlflow.db")] = None,
    out_dir: Annotated[Optional[Path], typer.Option("--out", help="default: report/ beside the first run")] = None,
    target: Annotated[Optional[float], typer.Option(min=0.0, max=1.0, help="accuracy for the 'to target' columns; "
                                                    "default: the highest accuracy every run reaches")] = None,
) -> None:
    """Compare runs: eval accuracy per rollout and per token, zero-variance groups, tokens
    generated against tokens used, and a table with one row per variant (seeds averaged)."""
    if bool(run_dirs) == (experiment is not None):
        err.print("error: give either run directories or --experiment NAME (not both, not neither)\n"
                  "    fix: `gfcr report runs/a runs/b` or `gfcr report --experiment quickstart`")
        raise typer.Exit(2)
    if parent is not None and experiment is None:
        err.print("error: --parent selects runs of an MLflow experiment\n    fix: add --experiment NAME")
        raise typer.Exit(2)
    from gfcr.tracking.report import (default_out_dir, markdown_table, series_from_mlflow, series_from_run_dirs,
                                     write_report)

    try:
        runs = (series_from_run_dirs(run_dirs) if run_dirs
                else series_from_mlflow(experiment, parent_run_id=parent, tracking_uri=tracking_uri))
        if not runs:
            scope = f"child runs of {parent}" if parent else "runs"
            raise GfcrError(f"MLflow experiment `{experiment}` has no {scope} with step metrics\n"
                            "    fix: run a pipeline with MLflow tracking on (the default) first, or check --parent")
        title = f"gfcr report: experiment {experiment}" if experiment else None
        paths = write_report(runs, out_dir or default_out_dir(runs), target, title=title)
    except GfcrError as exc:
        fail(exc)
        raise typer.Exit(2) from None
    for path in (paths.html, paths.markdown, paths.json, *paths.plots.values()):
        out.print(f"wrote {path}", markup=False)
    out.print(markdown_table(paths.rows, paths.target), markup=False)
