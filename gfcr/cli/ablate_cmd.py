"""``gfcr ablate``: run a grid of variants x seeds of one pipeline, then write its report."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.markup import escape

from gfcr.cli.common import ExecutorOption, PluginOption, SetOption, err, fail, import_plugins, out, print_notes
from gfcr.errors import GfcrError


def ablate(file: Path,
           vary: Annotated[list[str], typer.Option("--vary", metavar="KEY=V1,V2",
                                                   help="a spec key and its values, split at commas outside "
                                                        "brackets (clip=[0.2,0.28],[0.2,0.2]); repeat to cross keys")],
           seeds: Annotated[str, typer.Option(help="run seeds, e.g. 0,1,2")] = "0",
           steps: Annotated[Optional[int], typer.Option(help="override run.steps in every cell")] = None,
           parallel: Annotated[int, typer.Option(min=1, help="cells run at once (threads of this process)")] = 1,
           out_dir: Annotated[Optional[Path], typer.Option("--out", help="report folder (default: <ablation>/report)")]
           = None,
           set_: SetOption = None, executor: ExecutorOption = None, plugin: PluginOption = None) -> None:
    """Run every combination of the --vary values for every seed, as MLflow child runs of one
    parent run (Prefect subflows under the Prefect runner), and write the comparison report."""
    from gfcr.tracking.ablation import parse_seeds, parse_vary, run_ablation

    base = list(set_ or []) + ([f"run.steps={steps}"] if steps is not None else [])
    base += [f"executor.kind={executor}"] if executor is not None else []
    try:
        import_plugins(plugin)  # into this process, whose threads and subflows run the cells
        grid, seed_list = parse_vary(vary), parse_seeds(seeds)
        cells = math.prod(len(values) for _, values in grid)
        out.print(f"ablation of {escape(str(file))}: {cells} variant(s) x {len(seed_list)} seed(s) = "
                  f"{cells * len(seed_list)} runs, {parallel} at a time")
        ablation = run_ablation(file, grid, seed_list, base=base, parallel=parallel, out_dir=out_dir,
                                on_cell=_print_cell, on_notes=print_notes)
    except GfcrError as exc:
        fail(exc)
        raise typer.Exit(2) from None
    out.print(f"MLflow parent run {ablation.parent_run_id} (experiment `{escape(ablation.experiment)}`) "
              f"in {escape(ablation.tracking_uri)}")
    if ablation.report is not None:
        from gfcr.tracking.report import markdown_table

        out.print(markdown_table(ablation.report.rows, ablation.report.target))
        for note in ablation.report.notes:  # variants whose results are identical, as `gfcr compare` says them
            out.print(f"note: {note}", markup=False)
        out.print(f"report: {ablation.report.html}\n        {ablation.report.markdown}")
    if ablation.failed:
        for result in ablation.failed:
            err.print(f"[red]failed:[/] {escape(result.cell.label)} seed {result.cell.seed}: "
                      f"{escape(result.error or '')}", markup=True)
        raise typer.Exit(1)


def _print_cell(result) -> None:
    cell, summary = result.cell, result.summary
    if summary is None:
        out.print(f"  [red]✗[/] {escape(cell.label)} seed {cell.seed} ({result.seconds:.0f} s)", markup=True)
        return
    before, after = summary.get("eval_accuracy_before"), summary.get("eval_accuracy_after")
    acc = f"eval {before:.1%} -> {after:.1%}" if before is not None and after is not None else ""
    out.print(f"  [green]✓[/] {escape(cell.label)} seed {cell.seed}: {acc} ({result.seconds:.0f} s) "
              f"{escape(str(result.run_dir))}", markup=True)
