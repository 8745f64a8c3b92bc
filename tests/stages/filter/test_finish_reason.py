"""filter.finish_reason: `mask` keeps a rollout's reward in its group's baseline and zeroes its
loss mask (DAPO's overlong filtering); `drop` removes the rollout before the advantage and
lineage keeps it; both on real records, through `gfcr validate` and through a run."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from pydantic import ValidationError
from typer.testing import CliRunner

from gfcr.cli.main import app
from gfcr.graph import compile_pipeline
from gfcr.records import RolloutGroup, RolloutGroups
from gfcr.runtime import LocalRunner
from gfcr.runtime.store.lineage import lineage_rows
from gfcr.spec import load_spec_text
from gfcr.stages.filter.finish_reason import FinishReasonFilter
from gfcr.stages.testing import scored_group
from gfcr.stages.components.advantage.mean import Mean

QUICKSTART = Path(__file__).resolve().parents[3] / "pipelines" / "quickstart.yaml"


def group(rewards: list[float], reasons: list[str], prompt: str = "p:0") -> RolloutGroup:
    g = scored_group(prompt, rewards)
    for rollout, reason in zip(g.rollouts, reasons, strict=True):
        rollout.finish_reason = reason
    return g


def run(groups: list[RolloutGroup], **config) -> RolloutGroups:
    return FinishReasonFilter(FinishReasonFilter.Config(**config)).run(RolloutGroups(groups))


def test_mask_keeps_the_reward_in_the_baseline_and_zeroes_the_loss_mask():
    g = group([1.0, 0.0, 0.0, 1.0], ["stop", "stop", "length", "length"])
    assert run([g]).groups == [g]
    assert [None if r.loss_mask is None else r.loss_mask.tolist() for r in g.rollouts] == [None, None, [False], [False]]
    # the baseline is still over all four rewards: mean 0.5, so A = r - 0.5
    assert Mean(Mean.Config()).estimate(g).values == (0.5, -0.5, -0.5, 0.5)
    assert g.removed == [] and g.verdict.included


def test_drop_removes_the_rollout_before_the_advantage():
    g = group([1.0, 0.0, 0.0, 1.0], ["stop", "stop", "stop", "aborted"])
    run([g], reasons=["aborted", "pruned"], action="drop")
    # the baseline is over the three left: mean 1/3, so A = (1 - 1/3, 0 - 1/3, 0 - 1/3)
    np.testing.assert_allclose(Mean(Mean.Config()).estimate(g).values, [2 / 3, -1 / 3, -1 / 3], atol=1e-12)
    assert [(m.rollout.finish_reason, m.reason) for m in g.removed] == [("aborted", "finish reason `aborted`")]
    assert len(g.generated) == 4 and all(r.loss_mask is None for r in g.generated)


def test_a_group_left_empty_is_dropped_and_left_out():
    emptied = group([0.0, 1.0], ["pruned", "aborted"], "p:0")
    kept = group([0.0, 1.0], ["stop", "length"], "p:1")
    out = run([emptied, kept], reasons=["aborted", "pruned"], action="drop")
    assert out.groups == [kept] and kept.removed == []
    assert emptied.verdict.reason == "every rollout removed by its finish reason (`aborted`, `pruned`)"


def test_only_the_listed_reasons_and_only_included_groups_are_touched():
    g = group([1.0, 0.0, 0.0], ["stop", "", "aborted"])  # "": a stage that records no finish reason
    run([g])  # default: [length], mask
    assert all(r.loss_mask is None for r in g.rollouts)
    dropped = group([1.0, 0.0], ["length", "length"])
    dropped.drop("zero variance")
    assert run([dropped], action="drop").groups == []
    assert dropped.removed == [] and dropped.verdict.reason == "zero variance"  # the first decision stands


def test_config_defaults_and_bad_values():
    config = FinishReasonFilter.Config()
    assert (config.reasons, config.action) == (["length"], "mask")
    with pytest.raises(ValidationError):
        FinishReasonFilter.Config(reasons=[])
    with pytest.raises(ValidationError):
        FinishReasonFilter.Config(reasons=["truncated"])


def _variant(tmp_path: Path, action: str) -> str:
    text = QUICKSTART.read_text()
    filtered = text.replace("  reward:  {use: filter.verify, from: rollout}\n",
                            "  reward:  {use: filter.verify, from: rollout}\n"
                            f"  overlong: {{use: filter.finish_reason, from: reward, with: {{action: {action}}}}}\n")
    path = tmp_path / "overlong.yaml"
    path.write_text(filtered.replace("update: {use: update.grpo, from: reward,", "update: {use: update.grpo, from: overlong,"))
    return str(path)


def test_a_pipeline_with_overlong_filtering_validates(tmp_path):
    result = CliRunner().invoke(app, ["validate", _variant(tmp_path, "mask")])
    assert result.exit_code == 0, result.output
    assert "reward -> overlong -> update" in result.output


def test_a_near_miss_action_fails_validation_at_its_line(tmp_path):
    path = _variant(tmp_path, "dorp")
    result = CliRunner().invoke(app, ["validate", path])
    assert result.exit_code == 2, result.output
    line = next(n for n, text in enumerate(Path(path).read_text().splitlines(), 1) if "overlong:" in text)
    assert f"{path}:{line}:" in result.output and "stages.overlong.with.action" in result.output
    assert "fix: did you mean `drop`?" in result.output and "Traceback" not in result.output


STOP = """\
name: stop
data: {source: arithmetic, with: {n: 50}}
stages:
  pick:    {use: control.uniform, with: {batch_size: 6}}
  budget:  {use: control.fixed_n, from: pick, with: {n: 4}}
  stop:    {use: control.fake_stop, with: {groups: 2, every: 1}}
  rollout: {use: generate.fake, from: budget, in_flight: [stop], with: {length: 16}}
  partial: {use: filter.finish_reason, from: rollout, with: {reasons: [aborted], action: drop}}
update: {use: update.fake, from: partial}
"""


def test_lineage_names_the_stage_that_removed_a_rollout_and_counts_it_as_generated():
    report = LocalRunner(compile_pipeline(load_spec_text(STOP))).run_step()
    removed = [m for g in report.groups for m in g.removed]
    assert removed and all(m.removed_by == "partial" for m in removed)  # stamped by the runtime
    rows = lineage_rows(report)
    assert len(rows) == report.rollouts_generated == sum(len(g.generated) for g in report.groups)
    gone = [row for row in rows if row["finish_reason"] == "aborted"]
    assert len(gone) == len(removed)
    assert all(row["dropped_by"] == "partial" and row["drop_reason"] == "finish reason `aborted`"
               and not row["in_update"] for row in gone)
    assert all("partial" in row["changed_by"] for row in gone)
