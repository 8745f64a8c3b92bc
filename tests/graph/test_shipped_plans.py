"""Every shipped pipeline compiles to the recorded plan: the same units in the same order, the
same stages with the same aliases, bindings and in-flight controllers. A structural change
(moving helpers, renaming modules, capabilities replacing alias scans) must leave them as they
were; a change that moves a plan on purpose re-records it and says why in its commit:

    GFCR_RECORD_FIXTURES=1 .venv/bin/python -m pytest tests/graph/test_shipped_plans.py
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from gfcr.graph import load_pipeline

REPO = Path(__file__).resolve().parents[2]
FIXTURE = REPO / "tests" / "fixtures" / "plans" / "shipped.json"
PIPELINES = sorted((REPO / "pipelines").glob("*.yaml")) + sorted((REPO / "pipelines" / "examples").glob("*.yaml"))


def _unit(item) -> str | dict:
    return item if isinstance(item, str) else {"loop": item.name, "body": list(item.body), "until": item.until,
                                               "max_rounds": item.max_rounds}


def plan_of(path: Path) -> dict:
    compiled = load_pipeline(path)
    return {"plan": [_unit(item) for item in compiled.plan],
            "stages": {sid: {"use": node.info.alias, "in_flight": list(node.in_flight),
                             "from": [[b.param, b.source, b.type.__name__, b.feedback] for b in node.bindings]}
                       for sid, node in compiled.nodes.items()}}


def test_every_shipped_pipeline_compiles_to_its_recorded_plan():
    got = {str(p.relative_to(REPO)): plan_of(p) for p in PIPELINES}
    if os.environ.get("GFCR_RECORD_FIXTURES"):
        FIXTURE.write_text(json.dumps(got, indent=1, sort_keys=True) + "\n")
        pytest.skip("recorded")
    expected = json.loads(FIXTURE.read_text())
    assert sorted(got) == sorted(expected), "a shipped pipeline was added or removed: re-record the plans"
    moved = [name for name in expected if got[name] != expected[name]]
    assert not moved, f"these pipelines compile to another plan than recorded: {moved}"
