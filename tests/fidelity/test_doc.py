"""``docs/fidelity.md`` and every checked unit's docstring status line stay in step with the
case files (regenerate the page with ``python scripts/fidelity_doc.py``)."""

from __future__ import annotations

import json

import pytest

from tests.conftest import REPO
from tests.fidelity.cases import fidelity_markdown, method_files, status, unit_module_doc


def test_the_fidelity_page_is_current():
    assert (REPO / "docs" / "fidelity.md").read_text() == fidelity_markdown(), (
        "docs/fidelity.md is stale: run `python scripts/fidelity_doc.py`")


@pytest.mark.parametrize("path", method_files(), ids=[p.stem for p in method_files()])
def test_the_unit_docstring_states_its_fidelity(path):
    data = json.loads(path.read_text())
    doc = " ".join(unit_module_doc(data["stage"]).split())
    assert status(data) in doc, f"the docstring of {data['stage']} should say: {status(data)!r}"


@pytest.mark.parametrize("path", method_files(), ids=[p.stem for p in method_files()])
def test_a_case_file_names_its_source_and_its_deviations_exist(path):
    data = json.loads(path.read_text())
    assert {"method", "stage", "repository", "commit", "file", "function", "cases"} <= data.keys()
    assert len(data["commit"]) == 40
    ids = [c["id"] for c in data["cases"]]
    assert len(ids) == len(set(ids)), "case ids must be unique"
    assert {d["case"] for d in data.get("deviations", [])} <= set(ids)
    assert all(d["reason"] for d in data.get("deviations", []))
