"""The shipped pipelines that compose a catalog stage with GRESO or DAPO dynamic sampling run:
each for 3 real steps on tiny-arith (4 prompts a step, local executor, no eval, no MLflow),
every step recorded, the stage in front (GRESO or the DAPO loop) and the composed stage both
at work. The compile-only check of every shipped pipeline is tests/graph/test_compile.py.

Marked ``slow``: 13 runs, each loading tiny-arith (and MiniLM for the store, uniqueness and
MEDS), about 3 minutes on 2 quiet cores.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gfcr.graph import load_pipeline
from gfcr.runtime.loop.session import Run
from tests.conftest import REPO

COMPOSED = sorted(p for p in (REPO / "pipelines").rglob("*_arith.yaml")
                  if ("control.greso" in p.read_text() or "filter.dynamic_sampling" in p.read_text())
                  and p.stem not in {"greso_arith", "dapo_arith"})  # the two methods alone
STEPS = 3


def _overrides(text: str) -> list[str]:
    out = [f"run.steps={STEPS}", "eval=null", "tracking.mlflow=null", "executor.kind=local",
           f"run.checkpoint_every={STEPS}"]
    if "control.pilot_commit" not in text:
        out.append("stages.pick.with.batch_size=4")
    if "filter.dynamic_sampling" in text:
        out.append("stages.enough.with.target_groups=4")
    return out


def test_the_compositions_are_found():
    assert len(COMPOSED) >= 12, [p.name for p in COMPOSED]


@pytest.mark.slow
@pytest.mark.parametrize("path", COMPOSED, ids=[p.stem for p in COMPOSED])
def test_a_composed_pipeline_runs_and_both_halves_act(path: Path, tmp_path):
    text = path.read_text()
    pipeline = load_pipeline(path, _overrides(text))
    Run.start(pipeline, tmp_path / "run").train()
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(STEPS))
    assert sum(r["rollouts_generated"] for r in records) > 0
    if "filter.dynamic_sampling" in text:  # the DAPO loop ran its rounds and reported them
        assert all(r["loop_rounds"] for r in records), [r["loop_rounds"] for r in records]
    if "control.greso" in text:  # GRESO decided on every prompt it was shown
        assert all("p_easy" in r["control"].get("pick", {}) for r in records), records[0]["control"]
    assert any(not r["update_skipped"] for r in records), [r["skip_reason"] for r in records]
