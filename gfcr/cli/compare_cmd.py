"""``gfcr compare``: several pipelines on one task, at one budget, seeds with intervals, one table."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.markup import escape

from gfcr.cli.common import ExecutorOption, PluginOption, SetOption, err, fail, import_plugins, out
from gfcr.errors import GfcrError


def compare(files: Annotated[list[Path], typer.Argument(help="pipeline YAML files; the first is the baseline")],
            task: Annotated[Optional[str], typer.Option(help="a shipped task (arith-mix, rg-arith, gsm8k-smollm2) or a task "
                                                        "file; default: each pipeline keeps its own")] = None,
            seeds: Annotated[str, typer.Option(help="run seeds, e.g. 0,1,2")] = "0,1,2",
            budget: Annotated[Optional[str], typer.Option(metavar="steps=N|rollouts=N|tokens=N",
                                                          help="the same compute for every cell")] = None,
            parallel: Annotated[int, typer.Option(min=1, help="cells run at once")] = 1,
            baseline: Annotated[Optional[str], typer.Option(help="the pipeline (by name) others are compared "
                                                            "to; default: the first")] = None,
            target: Annotated[Optional[float], typer.Option(min=0.0, max=1.0, help="accuracy for the to-target "
                                                            "columns; default: the baseline's final (its "
                                                            "lowest seed)")] = None,
            out_dir: Annotated[Optional[Path], typer.Option("--out", help="the comparison's folder (default: "
                                                            "runs/compare-<task>-<hash of the inputs>)")] = None,
            set_: SetOption = None, executor: ExecutorOption = None, plugin: PluginOption = None) -> None:
    """Run every pipeline for every seed at the same budget (MLflow child runs of one parent,
    Prefect subflows), then write the report: curves, intervals, compute to target, speed-up.
    Run the same command again to continue a comparison that was stopped."""
    from gfcr.tracking.ablation import parse_seeds
    from gfcr.tracking.compare import parse_budget, plan_comparison, run_comparison
    from gfcr.tracking.compare_report import markdown_table, notes, paired_statements, paired_table

    overrides = list(set_ or []) + ([f"executor.kind={executor}"] if executor is not None else [])
    try:
        import_plugins(plugin)  # into this process, whose threads and subflows run the cells
        plan = plan_comparison(files, task=task, seeds=parse_seeds(seeds), budget=parse_budget(budget),
                               overrides=overrides, out_dir=out_dir)
        out.print(f"comparison of {len(plan.specs)} pipelines x {len(parse_seeds(seeds))} seed(s) "
                  f"({len(plan.cells)} cells, {parallel} at a time) in {escape(str(plan.root))}")
        done = run_comparison(plan, parallel=parallel, baseline=baseline, target=target, on_cell=_print_cell)
    except GfcrError as exc:
        fail(exc)
        raise typer.Exit(2) from None
    out.print(f"MLflow parent run {done.parent_run_id} (experiment `{escape(done.experiment)}`) "
              f"in {escape(done.tracking_uri)}")
    if done.failed:
        for result in done.failed:
            err.print(f"[red]failed:[/] {escape(result.cell.slug)}: {escape(result.error or '')}", markup=True)
        err.print("fix what failed, then run the same command again: finished cells are kept")
        raise typer.Exit(1)
    assert done.comparison is not None and done.report is not None
    out.print(markdown_table(done.comparison), markup=False)
    for note in notes(done.comparison):
        out.print(f"note: {note}", markup=False)
    if len(done.comparison.rows) > 1:
        out.print(paired_table(done.comparison), markup=False)
        differ = paired_statements(done.comparison)
        for line in differ:
            out.print(f"p < 0.05: {line}", markup=False)
        if not differ:
            out.print("no pipeline differs from the baseline with p < 0.05", markup=False)
    out.print(f"report: {done.report.html}\n        {done.report.markdown}\n        {done.report.json}", markup=False)


def _print_cell(result) -> None:
    cell, summary = result.cell, result.summary
    if summary is None:
        out.print(f"  [red]✗[/] {escape(cell.slug)} ({result.seconds:.0f} s)", markup=True)
        return
    if summary.get("resumed") == "done before":
        out.print(f"  [green]✓[/] {escape(cell.slug)}: finished earlier, kept", markup=True)
        return
    before, after = summary.get("eval_accuracy_before"), summary.get("eval_accuracy_after")
    acc = f"eval {before:.1%} -> {after:.1%}, " if before is not None and after is not None else ""
    out.print(f"  [green]✓[/] {escape(cell.slug)}: {acc}{summary['steps']} steps, {summary['tokens_generated']:,} "
              f"tokens ({result.seconds:.0f} s)", markup=True)
