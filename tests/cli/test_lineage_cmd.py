"""``gfcr lineage RUN_DIR`` without a rollout id, on a real short run (fake engine, GRPO-style
groups, ``filter.nonzero_variance``): the summary per step, the rollouts a query matches, and
``gfcr lineage RUN_DIR ROLLOUT_ID`` as before."""

from __future__ import annotations

import json
import textwrap

import pytest
from typer.testing import CliRunner

from gfcr.cli.main import app
from gfcr.runtime.store.lineage import read_lineage

cli = CliRunner()

SPEC = textwrap.dedent("""\
    name: lineage-query
    data: {source: arithmetic, with: {n: 50}}
    stages:
      pick:    {use: control.uniform, with: {batch_size: 4}}
      budget:  {use: control.fixed_n, from: pick, with: {n: 4}}
      rollout: {use: generate.fake, from: budget}
      keep:    {use: filter.nonzero_variance, from: rollout}
    update: {use: update.fake, from: keep}
    run: {steps: 3, seed: 0}
    """)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A three-step run made by ``gfcr run``: its directory, metrics lines and lineage rows."""
    base = tmp_path_factory.mktemp("lineage-query")
    (base / "spec.yaml").write_text(SPEC, encoding="utf-8")
    result = cli.invoke(app, ["run", str(base / "spec.yaml"), "--run-dir", str(base / "run"),
                              "--set", "executor.kind=local", "--set", "tracking.mlflow=null"])
    assert result.exit_code == 0, result.output
    metrics = [json.loads(line) for line in (base / "run" / "metrics.jsonl").read_text().splitlines()]
    return base / "run", metrics, read_lineage(base / "run" / "lineage").to_pylist()


def _column(output: str, index: int) -> str:
    """A table column's text, its wrapped lines joined: each cell's words stay in order."""
    cells = [line.split("│")[index].strip() for line in output.splitlines() if line.startswith("│")]
    return " ".join(c for c in cells if c)


def _lineage(*args: str):
    result = cli.invoke(app, ["lineage", *args])
    return result, " ".join(result.output.split())  # tables wrap long cells


def test_the_summary_counts_each_step_as_the_metrics_do(run):
    run_dir, metrics, rows = run
    assert sum(m["zero_variance_groups"] for m in metrics) > 0, "this seed has zero-variance groups to drop"
    result, text = _lineage(str(run_dir), "--json")
    assert result.exit_code == 0, result.output
    steps = json.loads(result.output)["steps"]
    assert [s["step"] for s in steps] == [0, 1, 2]
    for s, m in zip(steps, metrics):
        assert s["generated"] == s["rollouts"] == m["rollouts_generated"]
        assert s["dropped"] == 4 * m["zero_variance_groups"] and s["kept"] == 4 * m["groups_kept"]
        assert all(d["stage"] == "keep" and d["alias"] == "filter.nonzero_variance"
                   and d["reason"].startswith("zero variance: every reward = ") for d in s["drops"])
    table, text = _lineage(str(run_dir))
    assert table.exit_code == 0, table.output
    first = steps[0]["drops"][0]
    assert f"{first['rollouts']} by keep (filter.nonzero_variance): {first['reason']}" in _column(table.output, 6)
    total = sum(s["dropped"] for s in steps)
    assert f"all │ {sum(s['rollouts'] for s in steps)} │" in text and f"│ {total} │" in text


def test_dropped_zero_variance_lists_exactly_those_rollouts(run):
    run_dir, _, rows = run
    expected = [r["rollout_id"] for r in rows if r["drop_reason"] and "zero variance" in r["drop_reason"]]
    assert expected
    result, text = _lineage(str(run_dir), "--dropped", "--reason", "zero variance")
    assert result.exit_code == 0, result.output
    assert f"{len(expected)} rollouts matching --dropped --reason 'zero variance'" in text
    assert all(i in result.output for i in expected)
    assert "reached the update" not in text and "dropped by keep (filter.nonzero_variance): zero variance" in text
    assert f"follow one: gfcr lineage {run_dir} '{expected[0]}'" in text
    listed, _ = _lineage(str(run_dir), "--dropped", "--reason", "zero variance", "--json")
    assert [r["rollout_id"] for r in json.loads(listed.output)["rollouts"]] == expected


def test_step_and_stage_narrow_the_list(run):
    run_dir, _, rows = run
    step = next(r["step"] for r in rows if r["dropped_by"])
    expected = [r["rollout_id"] for r in rows if r["dropped_by"] == "keep" and r["step"] == step]
    for stage in ("keep", "filter.nonzero_variance"):  # a stage id or its alias
        result, _ = _lineage(str(run_dir), "--step", str(step), "--stage", stage, "--json")
        assert [r["rollout_id"] for r in json.loads(result.output)["rollouts"]] == expected
    every, _ = _lineage(str(run_dir), "--step", str(step), "--json")  # kept ones too
    assert len(json.loads(every.output)["rollouts"]) == sum(r["step"] == step for r in rows)


def test_a_query_that_cannot_match_says_why(run):
    run_dir, _, _ = run
    result, text = _lineage(str(run_dir), "--stage", "kepe")
    assert result.exit_code == 2 and "has no stage `kepe`" in text and "did you mean `keep`?" in text
    result, text = _lineage(str(run_dir), "--step", "9")
    assert result.exit_code == 2 and "has no step 9 in its lineage (steps 0-2)" in text
    result, text = _lineage(str(run_dir), "--reason", "too long")
    assert result.exit_code == 0 and "matches --reason 'too long'; its drop reasons: `zero variance" in text


def test_one_rollout_s_chain_works_as_before(run):
    run_dir, _, rows = run
    dropped = next(r for r in rows if r["dropped_by"])
    result, text = _lineage(str(run_dir), dropped["rollout_id"])
    assert result.exit_code == 0, result.output
    assert f"verdict │ dropped by keep (filter.nonzero_variance): {dropped['drop_reason']}" in text
    result, text = _lineage(str(run_dir), dropped["rollout_id"], "--dropped")
    assert result.exit_code == 2 and "drop the rollout id to list the matching rollouts" in text
