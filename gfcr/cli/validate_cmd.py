"""``gfcr validate`` and ``gfcr graph``: check pipelines without running them, and draw one.

``validate`` never imports torch, prefect, mlflow or vllm, so it stays fast enough for an
editor's save hook.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.markup import escape

from gfcr.cli.common import PluginOption, SetOption, compile_file, err, fail, out
from gfcr.errors import GfcrError


def validate(files: Annotated[list[Path], typer.Argument(help="pipeline YAML files")],
             set_: SetOption = None,
             inputs: Annotated[bool, typer.Option(
                 "--inputs/--no-inputs",
                 help="also check data files (first rows) and the policy model (found, not loaded); "
                      "--no-inputs checks the spec alone, e.g. on a machine without a pipeline's data")] = True,
             plugin: PluginOption = None) -> None:
    """Parse, validate, resolve, compile and type-check pipelines, and check their data files
    (the first rows) and policy model (found, not loaded). Exit 2 on any problem."""
    failed = 0
    for file in files:
        try:
            pipeline = compile_file(file, set_, inputs=inputs, plugins=plugin)
        except GfcrError as exc:
            failed += 1
            fail(exc)
            count = len(getattr(exc, "problems", [exc]))
            err.print(f"[red]✗[/] {escape(str(file))}: {count} problem{'s' if count != 1 else ''}", markup=True)
            continue
        out.print(f"[green]✓[/] {escape(str(file))}: {len(pipeline.nodes)} stages, {len(pipeline.loops)} loop block(s); "
                  f"plan: {escape(pipeline.describe_plan())}", markup=True)
        if (note := lora_note(pipeline.spec)) is not None:
            out.print(f"  note: {escape(note)}", markup=True)
        if inputs:
            warn_about_inputs(pipeline)
    if failed:
        raise typer.Exit(2) from None


def lora_note(spec) -> str | None:
    """What ``policy.lora`` trains and what the weight move carries, on the engine that runs (docs/lora.md)."""
    policy = spec.policy
    if policy is None or policy.lora is None:
        return None
    lora = policy.lora
    trained = f"LoRA rank {lora.rank} on {', '.join(lora.target_modules)}: the update trains the adapter only"
    if policy.engine == "vllm":
        kept = spec.lifecycle.staleness_bound() + 1
        return (f"{trained}; each sync moves the adapter only to vLLM (not merged weights), which keeps the newest "
                f"{kept} adapter version{'s' if kept > 1 else ''} loaded")
    return f"{trained}; the transformers engine samples the trained model itself, so nothing is copied"


def warn_about_inputs(pipeline) -> None:
    """What the pipeline gets less of on this machine than it could (the `code` verifier's sandbox level):
    a warning with its spec line and the fix; the exit status stays 0."""
    from gfcr.runtime.preflight.inputs import input_warnings

    for p in input_warnings(pipeline):
        where = f"[bold]{escape(str(p.where))}[/]: {escape(p.path)}"
        err.print(f"[yellow]warning:[/] {where}: {escape(p.message)}", markup=True)
        err.print(f"    [green]fix:[/] {escape(p.fix)}", markup=True)


def graph(file: Path, out_path: Annotated[Path, typer.Option("--out", "-o", help="a .png, .svg or .dot file")],
          set_: SetOption = None, plugin: PluginOption = None) -> None:
    """Draw the compiled pipeline: stages coloured by family, loop blocks as boxes."""
    from gfcr.graph.draw import render

    try:
        written = render(compile_file(file, set_, plugins=plugin), out_path)
    except GfcrError as exc:
        fail(exc)
        raise typer.Exit(2) from None
    out.print(f"wrote {written}")
