"""docs/lineage.md: the shapes of `gfcr lineage --json` are the ones it says, and its snippet reading
`lineage/` back from MLflow gives what `gfcr lineage` prints (issue 40)."""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import re
from pathlib import Path

import pytest
from typer.testing import CliRunner

from gfcr.cli.main import app
from gfcr.tracking.lineage_chain import RolloutChain, StageRef
from tests.conftest import BASE, REPO

DOC = (REPO / "docs" / "lineage.md").read_text(encoding="utf-8")
cli = CliRunner()


@pytest.fixture(scope="module")
def tracked_run(tmp_path_factory) -> Path:
    """A 2-step run of the fake pipeline, tracked in an MLflow store of its own folder."""
    root = tmp_path_factory.mktemp("lineage-doc")
    spec = root / "spec.yaml"
    spec.write_text(BASE.replace("tracking: {mlflow: null}\n", f"tracking: {{mlflow: {{uri: 'sqlite:///{root}/mlflow.db'}}}}\n"))
    result = cli.invoke(app, ["run", str(spec), "--run-dir", str(root / "run"), "--executor", "local"])
    assert result.exit_code == 0, result.output
    return root / "run"


def _lineage_json(*args: str) -> dict:
    result = cli.invoke(app, ["lineage", *args, "--json"])
    assert result.exit_code == 0, result.output
    return json.loads(result.output)


def test_the_mlflow_snippet_gives_what_gfcr_lineage_prints(tracked_run):
    (snippet,) = re.findall(r"```python\n(.*?)```", DOC, re.S)
    scope: dict = {}
    with contextlib.redirect_stdout(io.StringIO()):
        exec(snippet.replace('Path("runs/mine")', f"Path({str(tracked_run)!r})"), scope)
    per_step, drops = scope["per_step"], scope["drops"]
    summary = _lineage_json(str(tracked_run))
    assert len(summary["steps"]) == 2
    for step in summary["steps"]:
        assert per_step.loc[step["step"], "rollouts"] == step["rollouts"]
        assert per_step.loc[step["step"], "kept"] == step["kept"]
        mine = {(s, reason): int(n) for (t, s, reason), n in drops.items() if t == step["step"]}
        assert mine == {(d["stage"], d["reason"]): d["rollouts"] for d in step["drops"]}
    assert sum(step["dropped"] for step in summary["steps"]) > 0  # the comparison saw drops


def test_the_json_shapes_are_the_documented_ones(tracked_run):
    summary = _lineage_json(str(tracked_run))
    assert set(summary) == {"run_dir", "steps", "notes"}
    assert set(summary["steps"][0]) == {"step", "rollouts", "generated", "kept", "drops", "dropped", "not_handed_on"}
    assert set(summary["steps"][0]["drops"][0]) == {"stage", "alias", "reason", "rollouts"}
    query = _lineage_json(str(tracked_run), "--dropped")
    assert set(query) == {"run_dir", "query", "rollouts", "notes"}
    assert set(query["query"]) == {"dropped", "step", "stage", "reason", "stale"}
    assert set(query["rollouts"][0]) == {"rollout_id", "step", "prompt_id", "group_id", "reward", "correct",
                                         "dropped_by", "drop_reason", "in_update", "dropped_by_alias"}
    chain = _lineage_json(str(tracked_run), query["rollouts"][0]["rollout_id"])
    fields = {f.name for f in dataclasses.fields(RolloutChain)}
    assert set(chain) == fields and all(f"`{name}`" in DOC for name in fields)
    assert set(chain["created_by"]) == {f.name for f in dataclasses.fields(StageRef)}
