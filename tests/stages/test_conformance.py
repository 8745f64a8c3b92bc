"""Every registered stage honours the contract: its ports are annotated, its Config
round-trips through YAML, and its docstring's example runs (and its YAML snippet names it)."""

from __future__ import annotations

import doctest
import json
import importlib
import inspect
import re

import pytest
import yaml

from gfcr.registry import STAGES, stage_info
from gfcr.spec.dump import dump_yaml
from gfcr.spec.yaml_source import parse_yaml

ALIASES = STAGES.names()


def _docs(cls) -> str:
    return (inspect.getmodule(cls).__doc__ or "") + (cls.__doc__ or "")


def _yaml_snippets(cls) -> list:
    blocks = re.findall(r"\.\. code-block:: yaml\n\n((?:(?:    .*)?\n)+)", _docs(cls))
    return [parse_yaml(inspect.cleandoc("\n" + b))[0] for b in blocks]


def _entries(data, alias):
    if isinstance(data, dict):
        if data.get("use") == alias:
            yield data
        for value in data.values():
            yield from _entries(value, alias)


@pytest.mark.parametrize("alias", ALIASES)
def test_ports_are_annotated(alias):
    info = stage_info(alias)
    assert info.inputs or info.family in ("control", "replay"), "only sources may have no inputs"
    assert all(isinstance(p.type, type) for p in info.inputs)
    assert isinstance(info.output, type) or (info.in_flight and info.output is None)


@pytest.mark.parametrize("alias", ALIASES)
def test_config_round_trips_through_yaml(alias):
    info = stage_info(alias)
    entries = [e for snippet in _yaml_snippets(info.cls) for e in _entries(snippet, alias)]
    assert entries, f"{alias}: the docstring needs a YAML snippet that uses it"
    for entry in entries:
        config = info.config.model_validate_json(json.dumps(entry.get("with", {})), strict=True)
        text = dump_yaml(config.model_dump(mode="json"))
        again = info.config.model_validate_json(json.dumps(yaml.safe_load(text) or {}), strict=True)
        assert again == config


@pytest.mark.parametrize("alias", ALIASES)
def test_docstring_example_runs(alias):
    cls = stage_info(alias).cls
    module = importlib.import_module(cls.__module__)
    finder, runner = doctest.DocTestFinder(), doctest.DocTestRunner(optionflags=doctest.ELLIPSIS)
    tests = [t for t in finder.find(module) if t.name in (module.__name__, f"{module.__name__}.{cls.__qualname__}")]
    examples = sum(len(t.examples) for t in tests)
    assert examples > 0, f"{alias}: the docstring needs a runnable example"
    for test in tests:
        runner.run(test)
    assert runner.summarize(verbose=False).failed == 0


@pytest.mark.parametrize("alias", ALIASES)
def test_docstring_states_deviations_or_is_a_test_stage(alias):
    info = stage_info(alias)
    docs = _docs(info.cls)
    assert (info.testing and "TEST STAGE" in docs) or "Deviations" in docs, \
        f"{alias}: say where the stage deviates from its paper or reference code (a `Deviations:` paragraph)"
