"""The turn-level methods of issue 41 (Build 5, Must show 5) each run 3 steps of a shipped
multi-turn pipeline on tiny-arith: HGPO's advantage, ELPO's binary-search tree, TRACE's prefix
allocation."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest

from gfcr.graph import load_pipeline
from gfcr.runtime.loop.session import Run
from gfcr.runtime.store.lineage import read_lineage

REPO = Path(__file__).resolve().parents[3]
EXAMPLES = REPO / "pipelines" / "examples"
QUICK = ["run.steps=3", "tracking.mlflow=null", "run.checkpoint_every=null", "executor.kind=local",
         "stages.pick.with.batch_size=4"]
needs_rgym = pytest.mark.skipif(importlib.util.find_spec("reasoning_gym") is None, reason="`pip install reasoning-gym`")


def _records(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


@needs_rgym
def test_the_hgpo_pipeline_runs_three_steps(tmp_path, monkeypatch):
    from gfcr.stages.components.advantage.hgpo import HGPO

    seen: list[list[list[float]]] = []
    step_advantages = HGPO.step_advantages
    monkeypatch.setattr(HGPO, "step_advantages", lambda self, g: seen.append(step_advantages(self, g)) or seen[-1])
    Run.start(load_pipeline(EXAMPLES / "multi_turn_hgpo_rgym_arith.yaml", QUICK), tmp_path / "run").train()
    records = _records(tmp_path / "run")
    assert [r["step"] for r in records] == [0, 1, 2] and records[-1]["policy_version"] >= 1
    assert all(r["rollouts_generated"] == 16 for r in records)
    rows = read_lineage(tmp_path / "run" / "lineage").to_pylist()
    assert len(rows) == 48 and any(sum(t["role"] == "model" for t in row["turns"]) > 1 for row in rows)
    # the estimator saw the trajectories' steps: one advantage per model turn, and some retried
    # trajectory's turns differ (a per-turn advantage, not one per trajectory)
    assert seen and all(np.isfinite(a).all() for g in seen for a in g)
    assert any(len(set(np.round(a, 6))) > 1 for g in seen for a in g if len(a) > 1)


@needs_rgym
def test_the_elpo_pipeline_runs_three_steps(tmp_path):
    Run.start(load_pipeline(EXAMPLES / "multi_turn_elpo_rgym_arith.yaml", QUICK), tmp_path / "run").train()
    records = _records(tmp_path / "run")
    assert [r["step"] for r in records] == [0, 1, 2] and records[-1]["policy_version"] >= 1
    stages = [r["stages"]["rollout"] for r in records]
    assert all(s["elpo_searches"] > 0 and s["elpo_continuations"] == 2 * s["elpo_probes"] for s in stages)
    rows = read_lineage(tmp_path / "run" / "lineage").to_pylist()
    assert len(rows) == sum(16 + s["elpo_continuations"] for s in stages)
    originals = [row for row in rows if row["branch_token_idx"] is None]
    continuations = [row for row in rows if row["branch_token_idx"] is not None]
    assert len(originals) == 48 and len(continuations) == sum(s["elpo_continuations"] for s in stages)
    # each continuation forks at the start of a model turn of a failed original of its group, which it copies
    by_id = {row["rollout_id"]: row for row in originals}
    for c in continuations:
        source = [o for o in originals if o["group_id"] == c["group_id"] and o["tree_id"] == c["tree_id"]]
        assert len(source) == 1 and source[0]["reward"] < 1.0 and source[0]["rollout_id"] in by_id
        starts = [sum(t["n_tokens"] for t in source[0]["turns"][:i]) for i, t in enumerate(source[0]["turns"])
                  if t["role"] == "model"]
        assert c["branch_token_idx"] in starts[1:]


@needs_rgym
def test_the_trace_pipeline_runs_three_steps_and_checkpoints_its_predictor(tmp_path):
    Run.start(load_pipeline(EXAMPLES / "multi_turn_trace_rgym_arith.yaml", QUICK + ["run.checkpoint_every=3"]),
              tmp_path / "run").train()
    records = _records(tmp_path / "run")
    assert [r["step"] for r in records] == [0, 1, 2] and records[-1]["policy_version"] >= 1
    stages = [r["stages"]["rollout"] for r in records]
    assert all(s["trace_rounds"] == 2 and s["trace_root_branches"] + s["trace_prefix_branches"] == 8 for s in stages)
    assert sum(s["trace_prefix_branches"] for s in stages) > 0
    rows = read_lineage(tmp_path / "run" / "lineage").to_pylist()
    assert len(rows) == 3 * 4 * 6  # every prompt's budget of 6, roots and branches together
    assert sum(row["branch_token_idx"] is not None for row in rows) == sum(s["trace_continuations"] for s in stages)
    # the shared predictor and its 3 calls of anchors are in the checkpoint, and load back
    from gfcr.stages.generate.trace import Trace

    state = json.loads((tmp_path / "run" / "checkpoints" / "step-000003" / "stages" / "rollout" / "state.json").read_text())
    assert len(state["history"]) == 3 and any(w != 0.0 for w in state["predictor"]["weights"])
    stage = Trace(load_pipeline(EXAMPLES / "multi_turn_trace_rgym_arith.yaml").nodes["rollout"].config)
    stage.load_state_dict(state)
    assert stage.predictor.state_dict() == state["predictor"]
