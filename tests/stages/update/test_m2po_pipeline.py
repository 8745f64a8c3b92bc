"""The shipped M2PO pipeline (``pipelines/examples/m2po_cache_arith.yaml``) runs on tiny-arith:
with 32 prompts an epoch is two steps, and with 2 rollouts per prompt some groups are all wrong,
so from step 2 the cache joins responses sampled by earlier policies to them, and the update
trains on those stale tokens with M2PO's bounds under ``staleness``."""

from __future__ import annotations

import json
import math
from pathlib import Path

from gfcr.graph import load_pipeline
from gfcr.runtime.loop.session import Run

REPO = Path(__file__).resolve().parents[3]


def test_the_m2po_pipeline_trains_on_stale_tokens(tmp_path: Path) -> None:
    compiled = load_pipeline(REPO / "pipelines" / "examples" / "m2po_cache_arith.yaml",
                             ["data.with.n=32", "stages.budget.with.n=2", "run.steps=4", "executor.kind=local",
                              "tracking.mlflow=null", "eval=null"])
    Run.start(compiled, tmp_path / "run").train()
    lines = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [line["step"] for line in lines] == [0, 1, 2, 3]
    assert all(not line["update_skipped"] and math.isfinite(line["loss"]) for line in lines)
    stale = [line["update"]["off_policy_token_fraction"] for line in lines]
    assert stale[:2] == [0.0, 0.0] and any(f > 0.0 for f in stale[2:]), stale
    assert sum(line["stages"]["cache"]["rollouts_replayed"] for line in lines) > 0
