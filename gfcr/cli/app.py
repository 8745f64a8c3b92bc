"""The ``gfcr`` app: ``--version`` and the commands, each imported from its module when it runs.

``COMMANDS`` names every command's function (or sub-app) in the order ``gfcr --help`` lists
them. ``gfcr validate`` imports ``gfcr.cli.validate_cmd`` and no other command's module;
``gfcr --help`` imports them all to show their help. The command modules import
``gfcr.cli.common``, never this module or ``gfcr.cli.main``.

Exit codes: 0 done; 2 a mistake the user can fix (any ``GfcrError``: a bad spec, data,
checkpoint, model or run directory, an evaluation that cannot score, a stage that raised one),
printed as what, where and the fix, without a traceback; 1 a bug (a stage that raised
anything else), printed with its traceback.
"""

from __future__ import annotations

import importlib
from collections.abc import Iterator, Mapping
from typing import Annotated, Any

import click
import typer
import typer.main
from typer.core import TyperGroup

from gfcr.cli.common import out

COMMANDS = {
    "validate": "gfcr.cli.validate_cmd:validate",
    "graph": "gfcr.cli.validate_cmd:graph",
    "stages": "gfcr.cli.stages_cmd:stages",
    "run": "gfcr.cli.run_cmd:run",
    "resume": "gfcr.cli.run_cmd:resume",
    "sync": "gfcr.cli.sync_cmd:sync",
    "report": "gfcr.cli.report_cmd:report",
    "lineage": "gfcr.cli.lineage_cmd:lineage",
    "deploy": "gfcr.cli.orchestrate:deploy",
    "serve": "gfcr.cli.orchestrate:serve",
    "ui": "gfcr.cli.orchestrate:ui",
    "ablate": "gfcr.cli.ablate_cmd:ablate",
    "compare": "gfcr.cli.compare_cmd:compare",
    "replay": "gfcr.cli.replay_cmd:replay_app",
}


class _LazyCommands(Mapping[str, click.Command]):
    """The group's commands by name: a command is built (its module imported) when first asked for."""

    def __init__(self, targets: dict[str, str]) -> None:
        self._targets, self._built = targets, {}

    def __getitem__(self, name: str) -> click.Command:
        if name not in self._built:
            self._built[name] = _build(name, self._targets[name])  # KeyError: no such command
        return self._built[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._targets)

    def __len__(self) -> int:
        return len(self._targets)


def _build(name: str, target: str) -> click.Command:
    """The click command of ``module:function``, or the group of ``module:sub_app``, named ``name``."""
    module, attr = target.split(":")
    found = getattr(importlib.import_module(module), attr)
    if isinstance(found, typer.Typer):  # a group of commands, e.g. `gfcr replay inspect`
        command: click.Command = typer.main.get_group(found)
    else:
        single = typer.Typer(add_completion=False)
        single.command(name=name)(found)
        command = typer.main.get_command(single)
    command.name = name
    return command


class LazyGroup(TyperGroup):
    """``gfcr``'s command group, its commands those of ``COMMANDS``, built on first use."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.commands = _LazyCommands(COMMANDS)

    def list_commands(self, ctx: click.Context) -> list[str]:
        return list(self.commands)  # the names, in COMMANDS' order, without building the commands


app = typer.Typer(cls=LazyGroup, add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  help="gfcr: compose, check and run rollout pipelines for LLM RL.")


def _print_version(value: bool) -> None:
    if value:
        from gfcr.runtime.store.rundir import gfcr_version

        out.print(f"gfcr {gfcr_version()}")
        raise typer.Exit()


@app.callback()
def _main(version: Annotated[bool, typer.Option("--version", callback=_print_version, is_eager=True,
                                                help="print gfcr's version and exit")] = False) -> None:
    """gfcr: compose, check and run rollout pipelines for LLM RL."""
