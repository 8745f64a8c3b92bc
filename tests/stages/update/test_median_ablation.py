"""Must-show 4 (part): ``--set update.with.advantage.use=median`` is the estimator ablation of
quickstart; it compiles, and two steps run end to end with the median estimator."""

from __future__ import annotations

import json
from pathlib import Path

from gfcr.graph import load_pipeline
from gfcr.runtime.loop.session import Run

REPO = Path(__file__).resolve().parents[3]


def test_the_median_ablation_of_quickstart_runs(tmp_path: Path) -> None:
    compiled = load_pipeline(REPO / "pipelines" / "quickstart.yaml",
                             ["update.with.advantage.use=median", "run.steps=2", "executor.kind=local",
                              "tracking.mlflow=null"])
    Run.start(compiled, tmp_path / "run").train()
    lines = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [line["step"] for line in lines] == [0, 1]
    assert all(not line["update_skipped"] for line in lines) and lines[-1]["policy_version"] == 2
    resolved = (tmp_path / "run").glob("*.yaml")
    assert any("median" in p.read_text() for p in resolved)
