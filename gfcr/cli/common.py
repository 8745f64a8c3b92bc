"""What every ``gfcr`` command shares: the consoles, the ``--set`` and ``--executor`` options,
compiling a pipeline file, and printing a user's mistake.

The command modules import this module and nothing of ``gfcr.cli.app`` or ``gfcr.cli.main``,
so the CLI's imports point one way: main -> app -> commands -> common (import-linter's CLI
contract in pyproject.toml keeps it so). It imports nothing heavier than typer and rich:
``gfcr.graph`` is imported when a pipeline is compiled, not for ``gfcr --help``.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Optional

import typer
from rich.console import Console
from rich.markup import escape

from gfcr.errors import GfcrError, StageError

if TYPE_CHECKING:
    from gfcr.graph import CompiledPipeline

# tables stay readable when piped: at least 120 columns
_WIDTH = max(shutil.get_terminal_size((120, 24)).columns, 120)
out = Console(highlight=False, soft_wrap=True, width=_WIDTH)
err = Console(stderr=True, highlight=False, soft_wrap=True, width=_WIDTH)

SetOption = Annotated[Optional[list[str]], typer.Option("--set", "-s", metavar="KEY=VALUE",
                                                        help="override a spec key, e.g. run.steps=20")]

PluginOption = Annotated[Optional[list[str]], typer.Option(
    "--plugin", "-p", metavar="MODULE",
    help="import a module that registers stages (a module name, or a .py file); repeat for several")]

ExecutorOption = Annotated[Optional[str], typer.Option(
    "--executor", metavar="prefect|local|ray", help="override executor.kind (default: the spec's, else prefect)")]


def compile_file(file: Path, overrides: list[str] | None, inputs: bool = False,
                 plugins: list[str] | None = None) -> CompiledPipeline:
    """Load and compile ``file`` (a path, or the name of a shipped pipeline); with ``inputs``, also
    check its data files and policy model cheaply (``gfcr.runtime.preflight.inputs``: first rows, the model's
    folder; nothing loaded). ``plugins`` (``--plugin``) join the spec's ``plugins``."""
    from gfcr.graph import load_pipeline

    pipeline = load_pipeline(file, overrides or [], plugins=plugins or [])
    print_notes(pipeline.spec.source.notes)
    if inputs:
        from gfcr.runtime.preflight.inputs import check_inputs

        check_inputs(pipeline)
    return pipeline


def print_notes(notes: list[str]) -> None:
    """What loading a spec changed that the user should hear (a stage swap's dropped keys)."""
    for note in notes:
        out.print(f"[yellow]note:[/] {escape(note)}", markup=True)


def import_plugins(plugins: list[str] | None) -> None:
    """Import the ``--plugin`` modules into this process (RegistryError: what failed, the fix)."""
    if plugins:
        from gfcr.registry.plugins import import_plugins as import_all

        import_all(plugins)


def fail(exc: GfcrError) -> None:
    """Print a user's mistake: what and where, then the fix (each problem's, for spec and data errors)."""
    if isinstance(exc, StageError) and isinstance(exc.cause, GfcrError):  # a stage met a user's mistake
        where = f"step {exc.step}" + (f", loop round {exc.round}" if exc.round is not None else "")
        err.print(f"[red]error:[/] stage `{escape(exc.stage_id)}` failed at {where} of run {escape(exc.run_id)}:",
                  markup=True)
        exc = exc.cause
    problems = getattr(exc, "problems", None)
    if problems is None:
        err.print(f"[red]error:[/] {escape(exc.message)}", markup=True)
        if exc.fix:
            err.print(f"    [green]fix:[/] {escape(exc.fix)}", markup=True)
        return
    for p in problems:
        path = escape(p.path + ": ") if p.path else ""
        err.print(f"[bold]{escape(str(p.where))}[/]: {path}[red]{escape(p.message)}[/]", markup=True)
        if p.fix:
            err.print(f"    [green]fix:[/] {escape(p.fix)}", markup=True)
