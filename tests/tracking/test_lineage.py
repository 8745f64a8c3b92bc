"""Lineage on a real tiny-arith GRPO run with ``filter.nonzero_variance`` (issue 5 item 2), and
``gfcr lineage RUN_DIR ROLLOUT_ID`` on a kept and a dropped rollout of that run."""

from __future__ import annotations

import json
import textwrap

import pytest
from typer.testing import CliRunner

from gfcr.cli.main import app
from gfcr.graph import load_pipeline
from gfcr.runtime.store.lineage import read_lineage
from gfcr.runtime.store.rundir import RunDir
from gfcr.runtime.loop.session import Run

cli = CliRunner()

GRPO = textwrap.dedent("""\
    name: grpo-lineage
    policy: {model: tiny-arith}
    data: {source: arithmetic, with: {n: 64, seed: 0, digits: 2, operators: ["+", "-"]}}
    stages:
      pick:    {use: control.uniform, with: {batch_size: 8}}
      budget:  {use: control.fixed_n, from: pick, with: {n: 4}}
      rollout: {use: generate.sample, from: budget, with: {max_new_tokens: 8}}
      reward:  {use: filter.verify, from: rollout}
      keep:    {use: filter.nonzero_variance, from: reward}
    update: {use: update.grpo, from: keep, with: {lr: 3.0e-4, loss: {use: ppo_clip, with: {clip: [0.2, 0.28]}}}}
    run: {steps: 2, seed: 0}
    executor: {kind: local}
    tracking: {mlflow: null}
    """)


@pytest.fixture(scope="module")
def grpo_run(tmp_path_factory):
    """A two-step tiny-arith GRPO run: its directory, metrics lines and lineage rows."""
    base = tmp_path_factory.mktemp("lineage")
    spec = base / "grpo.yaml"
    spec.write_text(GRPO, encoding="utf-8")
    Run.start(load_pipeline(spec), base / "run").train()
    rd = RunDir(base / "run")
    return rd.path, rd.read_metrics(), read_lineage(rd.lineage_dir).to_pylist()


def test_dropped_rollouts_name_the_stage_and_reason_and_match_the_metrics(grpo_run):
    _, records, rows = grpo_run
    assert sum(r["zero_variance_groups"] for r in records) > 0, "this seed has zero-variance groups to drop"
    sampled_with = [0] + [r["policy_version"] for r in records[:-1]]  # the version before each step's update
    for record, version in zip(records, sampled_with):
        step_rows = [row for row in rows if row["step"] == record["step"]]
        assert len(step_rows) == record["rollouts_generated"]
        dropped = [row for row in step_rows if row["dropped_by"] is not None]
        assert len({row["group_id"] for row in dropped}) == record["zero_variance_groups"]
        assert all(row["dropped_by"] == "keep" and row["drop_reason"].startswith("zero variance") for row in dropped)
        assert not any(row["in_update"] for row in dropped)
        assert all(row["changed_by"] == ["reward", "keep"] for row in dropped)  # scored, then dropped
        kept = [row for row in step_rows if row["dropped_by"] is None]
        assert len({row["group_id"] for row in kept}) == record["groups_kept"]
        assert all(row["in_update"] and row["drop_reason"] is None for row in kept)
        assert all(row["changed_by"] == ["reward", "update"] for row in kept)  # scored, then given advantages
        assert all(row["created_by"] == "rollout" and row["origin"] == "fresh" and row["replica"] for row in step_rows)
        assert {(row["policy_version_min"], row["policy_version_max"]) for row in step_rows} == {(version, version)}
        assert all(row["reward"] is not None and row["reward_reason"] for row in step_rows)
        assert all(row["replayed_from"] is None and row["tree_id"] is None for row in step_rows)


def _first(rows, dropped: bool) -> dict:
    return next(row for row in rows if (row["dropped_by"] is not None) == dropped)


def test_gfcr_lineage_prints_the_chain_of_a_kept_rollout(grpo_run):
    run_dir, _, rows = grpo_run
    row = _first(rows, dropped=False)
    result = cli.invoke(app, ["lineage", str(run_dir), row["rollout_id"]])
    assert result.exit_code == 0, result.output
    text = " ".join(result.output.split())  # the table wraps long cells
    assert f"prompt {row['prompt_id']} from arithmetic" in text and "text: 'What is" in text
    assert f"step {row['step']}, by pick (control.uniform) -> budget (control.fixed_n)" in text
    assert f"by rollout (generate.sample), origin fresh, policy version {row['policy_version_min']}" in text
    assert "kept by every filter" in text and "reached update (update.grpo)" in text


def test_gfcr_lineage_prints_the_chain_of_a_dropped_rollout(grpo_run):
    run_dir, _, rows = grpo_run
    row = _first(rows, dropped=True)
    result = cli.invoke(app, ["lineage", str(run_dir), row["rollout_id"], "--json"])
    assert result.exit_code == 0, result.output
    chain = json.loads(result.output)
    assert chain["row"]["rollout_id"] == row["rollout_id"] and chain["prompt"]["prompt_id"] == row["prompt_id"]
    assert chain["dropped_by"] == {"id": "keep", "alias": "filter.nonzero_variance"}
    assert [s["id"] for s in chain["selected_by"]] == ["pick", "budget"]
    table = cli.invoke(app, ["lineage", str(run_dir), row["rollout_id"]])
    text = " ".join(table.output.split())
    assert f"dropped by keep (filter.nonzero_variance): {row['drop_reason']}" in text
    assert "did not reach update (update.grpo): dropped by keep" in text


def test_gfcr_lineage_suggests_near_ids_and_rejects_folders_that_are_not_runs(grpo_run, tmp_path):
    run_dir, _, rows = grpo_run
    group = rows[0]["group_id"]
    result = cli.invoke(app, ["lineage", str(run_dir), group])  # a group id, not a rollout id
    assert result.exit_code == 2 and f"has no rollout `{group}`" in result.output
    assert f"did you mean `{group}/0`" in result.output
    result = cli.invoke(app, ["lineage", str(tmp_path), "x"])
    assert result.exit_code == 2 and "not a gfcr run directory" in result.output


def test_lineage_written_before_a_column_existed_reads_it_as_null(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    from gfcr.runtime.store.lineage import SCHEMA

    old = SCHEMA.remove(SCHEMA.get_field_index("changed_by"))
    pq.write_table(pa.Table.from_pylist([{"run_id": "r", "step": 0, "rollout_id": "p@s0/0"}], schema=old),
                   tmp_path / "step-000000.parquet")
    (row,) = read_lineage(tmp_path).to_pylist()
    assert row["rollout_id"] == "p@s0/0" and row["changed_by"] is None
