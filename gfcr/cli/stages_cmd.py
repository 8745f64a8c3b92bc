"""``gfcr stages``: every registered stage (alias, family, ports, Config fields, origin), or
with ``--components`` the update's advantage estimators, losses and aggregations, as a table or
JSON (with each Config's schema).
"""

from __future__ import annotations

import dataclasses
import inspect
import json
import sys
import types
import typing
from enum import Enum
from typing import Annotated, Any, Optional

import typer
from rich.markup import escape
from rich.table import Table

from gfcr.cli.common import PluginOption, err, fail, import_plugins, out
from gfcr.errors import RegistryError


class ListFormat(str, Enum):
    table = "table"
    markdown = "markdown"


def stages(alias: Annotated[Optional[str], typer.Argument(help="show this stage in full, e.g. control.greso")] = None,
           family: Annotated[Optional[str], typer.Option(help="only this family")] = None,
           as_json: Annotated[bool, typer.Option("--json", help="machine-readable, with Config schemas")] = False,
           components: Annotated[bool, typer.Option("--components", help="list the update's advantage "
                                                    "estimators, losses and aggregations instead")] = False,
           fmt: Annotated[ListFormat, typer.Option("--format", help="with --components: a table, or Markdown")]
           = ListFormat.table, plugin: PluginOption = None) -> None:
    """List every registered stage: alias, what it does, ports, config keys and origin package;
    given an ALIAS, show that stage in full; with --components, the update's advantage
    estimators, losses and aggregations."""
    from gfcr.registry import FAMILIES, stage_infos

    try:
        import_plugins(plugin)
    except RegistryError as exc:
        fail(exc)
        raise typer.Exit(2) from None
    if alias is not None:
        _show_stage(alias, as_json)
        return
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
        sys.stdout.write(json.dumps([{**i.to_json(), "fidelity": _fidelity_json(_fidelity(i))} for i in infos],
                                    indent=2) + "\n")
    else:
        _print_stage_table(infos)
    if broken:
        raise typer.Exit(2) from None


def _show_stage(alias: str, as_json: bool) -> None:
    """``gfcr stages ALIAS``: the stage in full, or a did-you-mean error."""
    from gfcr.registry import stage_info

    try:
        info = stage_info(alias)
    except RegistryError as exc:
        fail(_with_hint(alias, exc))
        raise typer.Exit(2) from None
    if as_json:
        sys.stdout.write(json.dumps(_detail_json(info), indent=2) + "\n")
    else:
        _print_detail(info)


def _with_hint(alias: str, exc: RegistryError) -> RegistryError:
    """An unknown alias's error, with the aliases it is the last part of (``greso``) or the
    ``--family`` option it meant (``replay``)."""
    from gfcr.registry import FAMILIES, STAGES

    if alias in FAMILIES:
        return RegistryError(exc.message, f"to list the {alias} stages: gfcr stages --family {alias}")
    ends = [a for a in STAGES.names() if a.partition(".")[2] == alias]
    if ends:
        return RegistryError(exc.message, f"did you mean {', '.join(f'`{a}`' for a in ends)}? (aliases are "
                                          "<family>.<name>)")
    if exc.fix and exc.fix.startswith("did you mean"):
        return exc
    return RegistryError(exc.message, "`gfcr stages` lists every stage, `gfcr stages --family control` one family's")


def _print_detail(info: Any) -> None:
    """One stage: what it does, paper and fidelity, ports, roles, capabilities, config, example."""
    from gfcr.registry.stage_docs import stage_doc

    doc = stage_doc(info.alias, info.cls, strict=False)
    if doc.fidelity_problem:  # a plugin's own wording: show the rest, and say how to fix it
        err.print(f"[yellow]warning:[/] {escape(doc.fidelity_problem)}", markup=True)
    about = Table(show_header=False, box=None, title=f"{escape(info.alias)}: {escape(_plain(info.summary))}",
                  title_justify="left", title_style="bold", padding=(0, 2, 0, 0))
    about.add_column(style="bold", no_wrap=True)
    about.add_column()
    fidelity = doc.fidelity.text if doc.fidelity else "not stated (no `Fidelity:` paragraph in its docstring)"
    rows = [("what it does", doc.what if doc.what != info.summary else None), ("paper", doc.paper), ("fidelity", fidelity),
            ("family", f"{info.family} (registered by {info.origin})" + (", a test stage" if info.testing else "")),
            ("ports", _ports(info) + _runtime_note(info)), ("lifecycle", ", ".join(_roles(info.cls)) or "-"),
            ("capabilities", "\n".join(_capabilities(info.config)) or "-")]
    for name, text in rows:
        if text:
            about.add_row(name, escape(_plain(text)))
    out.print(about)
    out.print(_config_table(info.config))
    for example in doc.yaml:
        out.print("\n[bold]example[/] (YAML):", markup=True)
        out.print(escape(example))


def _runtime_note(info: Any) -> str:
    fed = [p.name for p in info.inputs if p.from_runtime]
    return f" ({', '.join(fed)} fed by the runtime, not by `from`)" if fed else ""


def _roles(cls: type) -> list[str]:
    """The lifecycle roles ``cls`` plays, each with the methods the runtime calls: ``Observes (observe)``."""
    from gfcr.registry.lifecycle import METHODS, ROLES, Stage, has_role

    return [f"{r.__name__} ({', '.join(METHODS[r])})" for r in ROLES if r is not Stage and has_role(cls, r)]


def _capabilities(config: type) -> list[str]:
    """The capabilities ``config`` declares, each with its names and what it means to the other stages."""
    from gfcr.registry.lifecycle import CAPABILITIES, capability_members, declares

    return [f"{c.__name__} ({', '.join(capability_members(c))}): {_plain(inspect.getdoc(c) or '').split(chr(10) * 2)[0]}"
            .replace("\n", " ") for c in CAPABILITIES if declares(config, c)]


def _config_table(config: Any) -> Table:
    table = Table("key", "type", "default", "description", title="config (the stage's `with:`)", title_justify="left")
    for name, field in config.model_fields.items():
        table.add_row(escape(name), escape(_type_name(field.annotation)), escape(_default_text(field)),
                      escape(field.description or ""))
    if not config.model_fields:
        table.add_row("-", "", "", "this stage takes no settings")
    return table


def _detail_json(info: Any) -> dict[str, Any]:
    from gfcr.registry.stage_docs import stage_doc

    doc = stage_doc(info.alias, info.cls, strict=False)
    return {**info.to_json(), **dataclasses.asdict(doc), "fidelity": _fidelity_json(doc.fidelity),
            "lifecycle": _roles(info.cls),
            "capabilities": [c.split(" (")[0] for c in _capabilities(info.config)]}


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
        out.print("\nDeviations (each component's docstring: where it differs from its paper or reference code, "
                  "and the setting that gives the reference's behaviour)")
        for info in infos:
            out.print(f"\n{info.kind} {info.alias}:\n" + escape(info.deviations or "not stated"), soft_wrap=True)
    if broken:
        raise typer.Exit(2) from None


def _fidelity(info: Any) -> Any:
    """The stage's parsed ``Fidelity:`` statement, or None (a plugin's stage may not state one, or
    not in a fixed form: the list still shows it)."""
    from gfcr.registry.stage_docs import stage_doc

    return stage_doc(info.alias, info.cls, strict=False).fidelity


def _fidelity_json(fidelity: Any) -> dict[str, Any] | None:
    return None if fidelity is None else {**dataclasses.asdict(fidelity), "label": fidelity.label}


def _print_stage_table(infos: list) -> None:
    table = Table("alias", "what it does", "inputs -> output", "config keys", "fidelity", "origin",
                  title="gfcr stages", expand=True)
    for column, ratio in zip(table.columns[1:5], (5, 3, 3, 2)):  # the summary gets the room
        column.ratio = ratio
    for info in infos:
        fields = ", ".join(name + ("*" if f.is_required() else "") for name, f in info.config.model_fields.items())
        tags = ("\n[dim](test stage)[/]" if info.testing else "") + ("\n[dim](can end loop)[/]" if info.can_end_loop else "")
        fidelity = _fidelity(info)
        table.add_row(escape(info.alias) + tags, escape(_plain(info.summary)), escape(_ports(info)), escape(fields),
                      escape(fidelity.label if fidelity else "not stated"), info.origin)
    out.print(table)
    out.print("* required.  fidelity: checked N/M (reference cases from the authors' code pass), code public, "
              "cases pending, from the abstract (no public code), or gfcr's own (not a published method); "
              "docs/fidelity.md has the cases.  `gfcr stages ALIAS` shows one stage in full: what it does, its "
              "config with defaults, ports, roles, fidelity and an example")


def _ports(info: Any) -> str:
    """``groups: RolloutGroups, pool?: PromptPool -> RolloutGroups`` (``?``: optional)."""
    inputs = ", ".join(f"{p.name}{'' if p.required else '?'}: {p.type.__name__}" for p in info.inputs)
    return f"{inputs or '(none)'} -> {info.output_name}"


def _plain(text: str) -> str:
    """Docstring text for the terminal: ``code`` as `code`."""
    return text.replace("``", "`")


def _field_text(name: str, field: Any) -> str:
    """``name: type = default``: a Literal as its allowed values, a default from a factory computed."""
    text = f"{name}: {_type_name(field.annotation)}"
    return text if field.is_required() else f"{text} = {_default_text(field)}"


def _default_text(field: Any) -> str:
    """A field's default as Python writes it, ``(required)``, or ``(computed)`` for a factory that
    needs the other fields' values."""
    if field.is_required():
        return "(required)"
    try:
        return repr(field.get_default(call_default_factory=True))
    except TypeError:
        return "(computed)"


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
