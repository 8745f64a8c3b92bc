"""filter.overlong: DAPO's soft overlong punishment (eq. 13) on hand-computed lengths at the
buffer's boundaries, penalty_factor scaling, unscored rollouts refused, the stage inserted after
`reward` in the quickstart pipeline validating through `gfcr validate`, and one step through the
runtime after `generate.fake` (which scores its own rollouts: why no `check_pipeline` demands an
upstream `filter.verify`)."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest
from pydantic import ValidationError
from typer.testing import CliRunner

from gfcr.cli.main import app
from gfcr.graph import compile_pipeline
from gfcr.records import Rollout, RolloutGroup, RolloutGroups, Segment
from gfcr.runtime import LocalRunner
from gfcr.spec import load_spec_text
from gfcr.stages.filter.overlong import Overlong

QUICKSTART = Path(__file__).resolve().parents[3] / "pipelines" / "quickstart.yaml"


def group(lengths: list[int], rewards: list[float | None], gid: str = "g:0") -> RolloutGroup:
    rollouts = [Rollout(f"{gid}/{i}", gid, "p:0", [1] * n, [Segment(0, n, 0, np.zeros(n))], reward=r)
                for i, (n, r) in enumerate(zip(lengths, rewards, strict=True))]
    return RolloutGroup(gid, "p:0", 0, len(rollouts), rollouts)


def shape(lengths, rewards, **config) -> list[Rollout]:
    g = group(lengths, rewards)
    Overlong(Overlong.Config(**config)).run(RolloutGroups([g]))
    return g.rollouts


def test_penalty_at_the_buffer_boundaries():
    # L_max = 20, L_cache = 5, so L_max - L_cache = 15:
    # |y| = 15 -> 0; 16 -> (15 - 16) / 5 = -0.2; 20 -> (15 - 20) / 5 = -1; 21 -> -1 (over L_max)
    rollouts = shape([15, 16, 20, 21, 3], [1.0, 1.0, 0.0, 1.0, 0.0], max_length=20, buffer=5)
    expected_penalty = [0.0, -0.2, -1.0, -1.0, 0.0]
    expected_reward = [1.0, 0.8, -1.0, 0.0, 0.0]
    np.testing.assert_allclose([r.reward_components["overlong"] for r in rollouts], expected_penalty, atol=1e-6)
    np.testing.assert_allclose([r.reward for r in rollouts], expected_reward, atol=1e-6)


def test_penalty_factor_scales_the_penalty():
    # factor 0.5 with L_max = 8, L_cache = 4: |y| = 6 -> 0.5 * (4 - 6) / 4 = -0.25;
    # |y| = 8 -> 0.5 * -1 = -0.5; |y| = 12 -> 0.5 * -1 = -0.5
    rollouts = shape([4, 6, 8, 12], [1.0, 1.0, 1.0, 1.0], max_length=8, buffer=4, penalty_factor=0.5)
    np.testing.assert_allclose([r.reward for r in rollouts], [1.0, 0.75, 0.5, 0.5], atol=1e-6)
    np.testing.assert_allclose([r.reward_components["overlong"] for r in rollouts], [0.0, -0.25, -0.5, -0.5])


def test_buffer_equal_to_max_length_penalises_from_the_first_token():
    # L_max = L_cache = 4 (verl allows the equality): |y| = 1 -> (0 - 1) / 4 = -0.25
    (rollout,) = shape([1], [1.0], max_length=4, buffer=4)
    assert rollout.reward == pytest.approx(0.75)


def test_other_components_are_kept_and_a_second_pass_does_not_penalise_twice():
    g = group([6], [1.0])
    g.rollouts[0].reward_components = {"correct": 1.0, "format": 1.0}
    stage = Overlong(Overlong.Config(max_length=8, buffer=4))
    stage.run(RolloutGroups([g]))
    stage.run(RolloutGroups([g]))  # a replayed rollout already carries its penalty
    assert g.rollouts[0].reward_components == {"correct": 1.0, "format": 1.0, "overlong": -0.5}
    assert g.rollouts[0].reward == pytest.approx(0.5)


def test_unscored_rollouts_are_refused_naming_the_group():
    g = group([4, 6], [1.0, None], gid="g:7")
    with pytest.raises(ValueError, match=r"group g:7: rollouts g:7/1 have no reward.*after the stage that scores"):
        Overlong(Overlong.Config(max_length=8, buffer=4)).run(RolloutGroups([g]))


def test_dropped_groups_pass_through_untouched():
    kept, dropped = group([8], [1.0], gid="g:0"), group([8], [None], gid="g:1")
    dropped.drop("no variance")
    out = Overlong(Overlong.Config(max_length=8, buffer=4)).run(RolloutGroups([kept, dropped]))
    assert [g.group_id for g in out] == ["g:0", "g:1"]
    assert kept.rollouts[0].reward == 0.0 and dropped.rollouts[0].reward is None


@pytest.mark.parametrize("config, message", [
    ({"max_length": 8, "buffer": 9}, "buffer (9) exceeds max_length (8)"),
    ({"max_length": 8, "buffer": 0}, "greater than or equal to 1"),
    ({"buffer": 4}, "max_length"),
    ({"max_length": 8, "penalty_factor": -1.0}, "greater than or equal to 0"),
])
def test_bad_configs_are_refused(config, message):
    with pytest.raises(ValidationError, match=re.escape(message)):
        Overlong.Config(**config)


def with_overlong(tmp_path: Path, entry: str) -> Path:
    """A copy of the quickstart with `length` inserted after `reward` and the update reading it."""
    text = QUICKSTART.read_text()
    reward_line = "  reward:  {use: filter.verify, from: rollout}\n"
    assert reward_line in text and "update: {use: update.grpo, from: reward," in text
    text = text.replace(reward_line, reward_line + f"  length:  {entry}\n")
    text = text.replace("update: {use: update.grpo, from: reward,", "update: {use: update.grpo, from: length,")
    path = tmp_path / "quickstart_overlong.yaml"
    path.write_text(text)
    return path


def test_the_quickstart_with_the_stage_after_reward_validates(tmp_path):
    # the quickstart generates max_new_tokens: 8; a buffer of 2 penalises lengths 7 and 8
    path = with_overlong(tmp_path, "{use: filter.overlong, from: reward, with: {max_length: 8, buffer: 2}}")
    result = CliRunner().invoke(app, ["validate", str(path)])
    assert result.exit_code == 0, result.output


def test_the_quickstart_with_a_buffer_over_max_length_fails_validation(tmp_path):
    path = with_overlong(tmp_path, "{use: filter.overlong, from: reward, with: {max_length: 8}}")
    result = CliRunner().invoke(app, ["validate", str(path)])
    assert result.exit_code == 2, result.output
    assert "stages.length.with" in result.output and "buffer (4096) exceeds max_length (8)" in result.output
    assert "Traceback" not in result.output


FAKE = """\
name: overlong
data: {source: arithmetic, with: {n: 50}}
stages:
  pick:    {use: control.uniform, with: {batch_size: 4}}
  budget:  {use: control.fixed_n, from: pick, with: {n: 4}}
  rollout: {use: generate.fake, from: budget, with: {length: 16}}
  length:  {use: filter.overlong, from: rollout, with: {max_length: 20, buffer: 8}}
update: {use: update.fake, from: length}
"""


def test_a_step_through_the_runtime_penalises_by_length():
    report = LocalRunner(compile_pipeline(load_spec_text(FAKE))).run_step()
    rollouts = [r for g in report.groups for r in g.rollouts]
    assert len(rollouts) == 16 and {len(r) for r in rollouts} == {16}  # generate.fake: `length` tokens each
    for r in rollouts:  # generate.fake rewards are 0 or 1; |y| = 16 in (20 - 8, 20]: (12 - 16) / 8 = -0.5
        assert r.reward_components == {"overlong": -0.5}
        assert r.reward == pytest.approx(float(r.correct) - 0.5)
