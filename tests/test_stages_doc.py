"""``docs/stages.md`` is what ``python scripts/stages_doc.py`` writes from the registries, and every
key it lists (data sources' and verifiers') says what it does."""

from __future__ import annotations

import functools
import importlib.util

import pytest

from gfcr.registry import BUILTIN_DATA_SOURCES, BUILTIN_STAGES, DATA_SOURCES
from gfcr.stages.verifiers import BUILTIN_VERIFIERS
from tests.conftest import REPO


@functools.cache
def stages_doc():
    spec = importlib.util.spec_from_file_location("stages_doc", REPO / "scripts" / "stages_doc.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_stage_catalog_is_current():
    assert (REPO / "docs" / "stages.md").read_text(encoding="utf-8") == stages_doc().render(), (
        "docs/stages.md is stale: run `python scripts/stages_doc.py`")


def test_the_catalog_has_a_line_per_stage_and_a_section_per_source_and_verifier():
    page = (REPO / "docs" / "stages.md").read_text(encoding="utf-8")
    assert all(f"| `{alias}` |" in page for alias in BUILTIN_STAGES)
    assert all(f"### `{name}`" in page for name in [*BUILTIN_DATA_SOURCES, *BUILTIN_VERIFIERS])


@pytest.mark.parametrize("source", sorted(BUILTIN_DATA_SOURCES))
def test_every_data_source_key_is_described(source):
    doc = stages_doc()
    config = DATA_SOURCES.get(source).Config
    missing = [name for name, field in config.model_fields.items() if not doc._description(field)]
    assert not missing, f"data source `{source}`: give these keys a Field(description=...): {missing}"


def test_every_verifier_option_is_described():
    page = (REPO / "docs" / "stages.md").read_text(encoding="utf-8")
    verifiers = page.split("## Verifiers", 1)[1]
    option_rows = [row for row in verifiers.splitlines() if row.startswith("| `")]
    assert option_rows and all(not row.rstrip().endswith("|  |") for row in option_rows), option_rows
