"""``gfcr stages``: every registered stage (alias, family, ports, Config fields, origin), or
with ``--components`` the update's advantage estimators, losses and aggregations, as a table or
JSON (with each Config's schema).
"""

from __future__ import annotations

import dataclasses
import json
import sys
import types
import typing
from enum import Enum
from typing import Annotated, Any, Optional

import typer
from rich.markup import escape
from rich.table import Table

from gfcr.cli.common import err, fail, out
from gfcr.errors import RegistryError


class ListFormat(str, Enum):
    table = "table"
    markdown = "markdown"


def stages(family: Annotated[Optional[str], typer.Option(help="only this family")] = None,
           as_json: Annotated[bool, typer.Option("--json", help="machine-readable, with Config schemas")] = False,
           components: Annotated[bool, typer.Option("--components", help="list the update's advantage "
                                                    "estimators, losses and aggregations instead")] = False,
           fmt: Annotated[ListFormat, typer.Option("--format", help="with --components: a table, or Markdown")]
           = ListFormat.table) -> None:
    """List every registered stage: alias, family, ports, Config fields and origin package; with
    --components, the update's advantage estimators, losses and aggregations."""
    from gfcr.registry import FAMILIES, stage_infos

    if components:
        _list_components(family, as_json, fmt)
        return
    if fmt is not ListFormat.table:
        err.print("`--format markdown` lists the update's components: add `--components`")
        raise typer.Exit(2) from None
    if family is not None and family not in FAMILIES:
        err.print(f"unknown family `{family}`; families are {', '.join(FAMILIES)}")
        raise typer.Exit(2) from None
    try:
        infos, broken = stage_infos(family=family)
    except RegistryError as exc:  # e.g. two packages register the same alias
        fail(exc)
        raise typer.Exit(2) from None
    for alias, exc in broken.items():
        err.print(f"[red]error:[/] stage `{escape(alias)}` cannot be loaded: {escape(str(exc))}", markup=True)
    if as_json:
        sys.stdout.write(json.dumps([i.to_json() for i in infos], indent=2) + "\n")
    else:
        _print_stage_table(infos)
    if broken:
        raise typer.Exit(2) from None


def _list_components(family: str | None, as_json: bool, fmt: ListFormat) -> None:
    """``gfcr stages --components``: every advantage estimator, loss and aggregation."""
    from gfcr.stages.components.describe import COLUMNS, component_infos, markdown_table

    if family is not None:
        err.print("`--family` filters stages; `--components` lists the update's components, drop one of them")
        raise typer.Exit(2) from None
    try:
        infos, broken = component_infos()
    except RegistryError as exc:  # e.g. two packages register the same alias
        fail(exc)
        raise typer.Exit(2) from None
    for name, exc in broken.items():
        err.print(f"[red]error:[/] {escape(name)} cannot be loaded: {escape(str(exc))}", markup=True)
    if as_json:
        sys.stdout.write(json.dumps([dataclasses.asdict(i) for i in infos], indent=2) + "\n")
    elif fmt is ListFormat.markdown:
        sys.stdout.write(markdown_table(infos))
    else:
        table = Table(*COLUMNS, title="update components (update.with.<kind>: {use: <alias>, with: {...}})")
        for info in infos:
            table.add_row(*(escape(cell) for cell in info.row()))
        out.print(table)
    if broken:
        raise typer.Exit(2) from None


def _print_stage_table(infos: list) -> None:
    table = Table("alias", "inputs", "output", "config", "origin", title="gfcr stages")
    for info in infos:
        fields = ", ".join(_field_text(name, f) for name, f in info.config.model_fields.items())
        inputs = ", ".join(f"{p.name}: {p.type.__name__}" + ("" if p.required else "?") for p in info.inputs)
        tags = (" [dim](test stage)[/]" if info.testing else "") + (" [dim](can end loop)[/]" if info.can_end_loop else "")
        table.add_row(escape(info.alias) + tags, escape(inputs), info.output_name, escape(fields), info.origin)
    out.print(table)


def _field_text(name: str, field: Any) -> str:
    """``name: type = default``: a Literal as its allowed values, a default from a factory computed."""
    text = f"{name}: {_type_name(field.annotation)}"
    if field.is_required():
        return text
    try:
        default = field.get_default(call_default_factory=True)
    except TypeError:  # a factory that needs the other fields' values
        return f"{text} = (computed)"
    return f"{text} = {default!r}"


def _type_name(annotation: object) -> str:
    """A type as a user writes it: ``'flat' | 'ivf'`` for a Literal, ``int | None``, ``list[str]``."""
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is typing.Literal:
        return " | ".join(repr(a) for a in args)
    if origin is typing.Annotated:
        return _type_name(args[0])
    if origin in (typing.Union, types.UnionType):
        return " | ".join("None" if a is type(None) else _type_name(a) for a in args)
    if origin is not None and args:
        return f"{getattr(origin, '__name__', str(origin))}[{', '.join(_type_name(a) for a in args)}]"
    if annotation is Ellipsis:
        return "..."
    return getattr(annotation, "__name__", None) or str(annotation).replace("typing.", "")
