"""The stage conformance kit: the five checks every registered stage passes, for your own stages.

gfcr's own suite (``tests/stages/test_conformance.py``) runs them over every registered alias;
a stage of yours, registered by a plugin module or an installed package, is checked the same
way, from a test of your own or from the shell::

    # test_max_solve_rate.py
    import max_solve_rate  # noqa: F401  (the plugin module: importing it registers the stage)
    from gfcr.testing import check_stage

    def test_max_solve_rate_conforms():
        check_stage("filter.max_solve_rate")

    $ python -m gfcr.testing --plugin max_solve_rate.py filter.max_solve_rate

The checks (each raises ``ConformanceError``, an ``AssertionError``, saying what to fix):

1. ``check_ports``: the stage describes (the registry's checks, the near-miss rule included),
   its inputs and output are port types, and only control and replay stages have no input;
2. ``check_config_round_trip``: every ``.. code-block:: yaml`` snippet of its docstrings that
   ``use``s the alias validates its ``with`` against ``Config`` (strictly), and the Config
   dumped to YAML and read back is equal;
3. ``check_docstring_example``: the module's and the class's doctests run and pass (at least
   one example);
4. ``check_deviations``: a ``Deviations`` paragraph, or ``testing = True`` on the class and
   ``TEST STAGE`` in its docstring;
5. ``check_fidelity``: a ``Fidelity:`` paragraph in one of the fixed forms
   (``gfcr.registry.stage_docs``), or a test stage as above.

It imports no pytest: a plain ``assert``-style error works under any runner.
"""

from __future__ import annotations

import argparse
import doctest
import importlib
import inspect
import io
import json
import re
import sys
from typing import Any, Callable, Iterator

import yaml

from gfcr.registry import STAGES, Registry, stage_info
from gfcr.registry.stage_docs import FidelityError, fidelity_statement, parse_fidelity
from gfcr.spec.dump import dump_yaml
from gfcr.spec.yaml_source import parse_yaml

__all__ = ["CHECKS", "ConformanceError", "check_config_round_trip", "check_deviations", "check_docstring_example",
           "check_fidelity", "check_ports", "check_stage"]


class ConformanceError(AssertionError):
    """A stage breaks the stage contract; the message says which part and how to fix it."""


def _require(condition: object, message: str) -> None:
    if not condition:
        raise ConformanceError(message)


def _docs(cls: type) -> str:
    return (inspect.getmodule(cls).__doc__ or "") + (cls.__doc__ or "")


def yaml_snippets(cls: type) -> list[Any]:
    """The parsed ``.. code-block:: yaml`` snippets of a stage's module and class docstrings."""
    blocks = re.findall(r"\.\. code-block:: yaml\n\n((?:(?:    .*)?\n)+)", _docs(cls))
    return [parse_yaml(inspect.cleandoc("\n" + b))[0] for b in blocks]


def _entries(data: Any, alias: str) -> Iterator[dict]:
    if isinstance(data, dict):
        if data.get("use") == alias:
            yield data
        for value in data.values():
            yield from _entries(value, alias)


def check_ports(alias: str, registry: Registry[type] = STAGES) -> None:
    """The stage describes, its ports are port types, and only sources have no input."""
    info = stage_info(alias, registry)
    _require(info.inputs or info.family in ("control", "replay"),
             f"{alias}: only control and replay stages may have no input; annotate `run`'s parameters")
    _require(all(isinstance(p.type, type) for p in info.inputs), f"{alias}: every input of `run` needs a port type")
    _require(isinstance(info.output, type) or (info.in_flight and info.output is None),
             f"{alias}: annotate `run`'s return with a port type")


def check_config_round_trip(alias: str, registry: Registry[type] = STAGES) -> None:
    """Every docstring YAML snippet that uses ``alias`` validates, and its Config round-trips."""
    info = stage_info(alias, registry)
    entries = [e for snippet in yaml_snippets(info.cls) for e in _entries(snippet, alias)]
    _require(entries, f"{alias}: the docstring needs a `.. code-block:: yaml` snippet that uses it")
    for entry in entries:
        config = info.config.model_validate_json(json.dumps(entry.get("with", {})), strict=True)
        text = dump_yaml(config.model_dump(mode="json"))
        again = info.config.model_validate_json(json.dumps(yaml.safe_load(text) or {}), strict=True)
        _require(again == config, f"{alias}: its Config dumped to YAML reads back as {again!r}, not {config!r}")


def check_docstring_example(alias: str, registry: Registry[type] = STAGES) -> None:
    """The module's and the class's doctests run and pass; there is at least one."""
    cls = stage_info(alias, registry).cls
    module = importlib.import_module(cls.__module__)
    finder, runner = doctest.DocTestFinder(), doctest.DocTestRunner(optionflags=doctest.ELLIPSIS)
    tests = [t for t in finder.find(module) if t.name in (module.__name__, f"{module.__name__}.{cls.__qualname__}")]
    _require(sum(len(t.examples) for t in tests) > 0, f"{alias}: the docstring needs a runnable `>>>` example")
    report = io.StringIO()
    # the failures counted from each run: ``runner.summarize`` would print doctest's own banner
    failed = sum(runner.run(test, out=report.write).failed for test in tests)
    _require(failed == 0, f"{alias}: its docstring example fails:\n{report.getvalue()}")


def check_deviations(alias: str, registry: Registry[type] = STAGES) -> None:
    """A ``Deviations`` paragraph, or a labelled test stage."""
    info = stage_info(alias, registry)
    docs = _docs(info.cls)
    _require((info.testing and "TEST STAGE" in docs) or "Deviations" in docs,
             f"{alias}: say where the stage deviates from its paper or reference code (a `Deviations:` paragraph)")


def check_fidelity(alias: str, registry: Registry[type] = STAGES) -> None:
    """A ``Fidelity:`` paragraph in one of the fixed forms (``gfcr.registry.stage_docs``), or a
    labelled test stage."""
    info = stage_info(alias, registry)
    if info.testing:
        return
    statement = fidelity_statement(inspect.getdoc(info.cls) or "") or fidelity_statement(
        inspect.getdoc(inspect.getmodule(info.cls)) or "")
    _require(statement is not None, f"{alias}: state how faithful the stage is in a `Fidelity:` paragraph, e.g. "
                                    "`Fidelity: gfcr's own: <what it is>` or `Fidelity: from the abstract: no public code`")
    try:
        parse_fidelity(statement, where=alias)
    except FidelityError as exc:
        raise ConformanceError(str(exc)) from None


CHECKS: tuple[Callable[[str, Registry[type]], None], ...] = (
    check_ports, check_config_round_trip, check_docstring_example, check_deviations, check_fidelity)


def check_stage(alias: str, registry: Registry[type] = STAGES) -> list[str]:
    """Run the five checks on ``alias``; raise the first ``ConformanceError``, else return their names."""
    for check in CHECKS:
        check(alias, registry)
    return [check.__name__ for check in CHECKS]


def main(argv: list[str] | None = None) -> int:
    """``python -m gfcr.testing [--plugin MODULE]... ALIAS...``: check stages, one line per check."""
    from gfcr.errors import GfcrError
    from gfcr.registry.plugins import import_plugins

    parser = argparse.ArgumentParser(prog="python -m gfcr.testing", description=__doc__.split("\n\n")[0])
    parser.add_argument("aliases", nargs="+", metavar="ALIAS", help="registered stage aliases, e.g. filter.verify")
    parser.add_argument("--plugin", action="append", default=[], metavar="MODULE",
                        help="a module name or .py file to import first (it registers the stages)")
    args = parser.parse_args(argv)
    failed = 0
    try:
        import_plugins(args.plugin)
    except GfcrError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    for alias in args.aliases:
        for check in CHECKS:
            try:
                check(alias, STAGES)
            except (ConformanceError, GfcrError) as exc:
                failed += 1
                print(f"✗ {alias}: {check.__name__}: {exc}")
                continue
            print(f"✓ {alias}: {check.__name__}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
