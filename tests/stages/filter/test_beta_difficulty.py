"""filter.beta_difficulty: the decayed Beta update then the band verdict, by hand; upstream
verdicts and replayed groups; checkpoints; and `gfcr validate` of quickstart with the stage."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from pydantic import ValidationError
from typer.testing import CliRunner

from gfcr.cli.main import app
from gfcr.records import RolloutGroups, StepContext
from gfcr.stages.filter.beta_difficulty import BetaDifficulty
from gfcr.stages.testing import scored_group

QUICKSTART = Path(__file__).resolve().parents[3] / "pipelines" / "quickstart.yaml"


def stage(step: int = 0, **kw) -> BetaDifficulty:
    s = BetaDifficulty(BetaDifficulty.Config(**kw))
    s.before_step(StepContext("run", step=step, seed=0, policy_version=step))
    return s


def posterior(s: BetaDifficulty, pid: str) -> tuple[float, float]:
    return s.stats[pid].beta_alpha, s.stats[pid].beta_beta


def test_update_then_band_verdicts_by_hand():
    s = stage()
    groups = RolloutGroups([
        scored_group("p:0", [1, 1, 1, 1]),  # Beta(1+4, 1+0) = Beta(5, 1): mean 5/6 = 0.833 > 0.7 -> drop
        scored_group("p:1", [0, 0, 0, 0]),  # Beta(1, 5): mean 1/6 = 0.167 < 0.3 -> drop
        scored_group("p:2", [1, 0, 0, 0]),  # Beta(2, 4): mean 2/6 = 0.333 in [0.3, 0.7] -> keep
        scored_group("p:3", [1, 1, 0, 0]),  # Beta(3, 3): mean 0.5 -> keep
    ])
    assert [g.prompt_id for g in s.run(groups)] == ["p:2", "p:3"]
    assert [posterior(s, f"p:{i}") for i in range(4)] == [(5, 1), (1, 5), (2, 4), (3, 3)]
    assert [g.verdict.reason for g in groups.groups[:2]] == [
        "posterior mean 0.833 outside [0.3, 0.7] (Beta(5, 1))",
        "posterior mean 0.167 outside [0.3, 0.7] (Beta(1, 5))",
    ]


def test_decayed_update_over_two_steps_by_hand():
    s = stage(decay=0.5)
    s.run(RolloutGroups([scored_group("p:0", [1, 1, 1, 1])]))
    assert posterior(s, "p:0") == (5.0, 1.0)  # 0.5*1 + 0.5*1 + 4, 0.5*1 + 0.5*1 + 0
    s.before_step(StepContext("run", step=1, seed=0, policy_version=1))
    out = s.run(RolloutGroups([scored_group("p:0", [0, 0, 0, 0], step=1)]))
    # alpha = 0.5*5 + 0.5*1 + 0 = 3, beta = 0.5*1 + 0.5*1 + 4 = 5: mean 3/8 = 0.375 -> keep
    assert posterior(s, "p:0") == (3.0, 5.0) and [g.prompt_id for g in out] == ["p:0"]
    # without decay the same evidence gives Beta(5, 5): mean 0.5
    s = stage()
    s.run(RolloutGroups([scored_group("p:0", [1, 1, 1, 1])]))
    s.before_step(StepContext("run", step=1, seed=0, policy_version=1))
    s.run(RolloutGroups([scored_group("p:0", [0, 0, 0, 0], step=1)]))
    assert posterior(s, "p:0") == (5.0, 5.0)


def test_band_bounds_are_inclusive():
    # Beta(1+2, 1+0) = Beta(3, 1): mean 3/4 = 0.75, exactly `high`
    out = stage(low=0.25, high=0.75).run(RolloutGroups([scored_group("p:0", [1, 1]), scored_group("p:1", [0, 0])]))
    assert [g.prompt_id for g in out] == ["p:0", "p:1"]  # Beta(1, 3): mean 0.25, exactly `low`
    out = stage(low=0.26, high=0.74).run(RolloutGroups([scored_group("p:0", [1, 1]), scored_group("p:1", [0, 0])]))
    assert list(out) == []


def test_only_judged_rollouts_count():
    group = scored_group("p:0", [1, 0, 0])
    group.rollouts[2].correct = None  # scored but not judged: n = 2, s = 1
    s = stage()
    s.run(RolloutGroups([group]))
    assert posterior(s, "p:0") == (2.0, 2.0)
    group = scored_group("p:1", [0.5, 0.5])  # partial credit, judged wrong: s = 0
    group.rollouts[0].correct = group.rollouts[1].correct = None
    out = s.run(RolloutGroups([group]))  # none judged: no update, judged on the prior's mean 0.5
    assert "p:1" not in s.stats and [g.prompt_id for g in out] == ["p:1"]


def test_dropped_groups_update_but_keep_their_verdict_and_replayed_groups_do_not_update():
    s = stage(step=3)
    dropped = scored_group("p:0", [1, 0], step=3)
    dropped.drop("earlier filter")
    replayed = scored_group("p:1", [1, 1, 1, 1], step=1)
    out = s.run(RolloutGroups([dropped, replayed]))
    assert dropped.verdict.reason == "earlier filter" and posterior(s, "p:0") == (2.0, 2.0)
    assert "p:1" not in s.stats and [g.prompt_id for g in out] == ["p:1"]  # prior mean 0.5 -> keep


def test_unscored_rollouts_are_refused_naming_the_group():
    group = scored_group("p:0", [1, 0])
    group.rollouts[1].reward, group.rollouts[1].correct = None, None
    with pytest.raises(ValueError, match=r"group p:0@s0 has unscored rollouts.*filter\.verify"):
        stage().run(RolloutGroups([group]))


def test_config_band_must_be_ordered():
    with pytest.raises(ValidationError, match=r"low \(0.8\) must be at most high \(0.2\)"):
        BetaDifficulty.Config(low=0.8, high=0.2)


def test_state_round_trips_through_json_and_resumes_the_same():
    s = stage(decay=0.5)
    s.run(RolloutGroups([scored_group("p:0", [1, 1, 1, 0]), scored_group("p:1", [0, 0])]))
    state = json.loads(json.dumps(s.state_dict()))
    again = stage(decay=0.5)
    again.load_state_dict(state)
    assert again.stats == s.stats
    for t in (s, again):
        t.before_step(StepContext("run", step=1, seed=0, policy_version=1))
    # p:0 was Beta(4, 2); + 1 of 2 with decay 0.5: Beta(0.5*4 + 0.5 + 1, 0.5*2 + 0.5 + 1) = Beta(3.5, 2.5)
    verdicts = [[g.prompt_id for g in t.run(RolloutGroups([scored_group("p:0", [1, 0], step=1)]))] for t in (s, again)]
    assert verdicts == [["p:0"], ["p:0"]] and posterior(again, "p:0") == (3.5, 2.5) == posterior(s, "p:0")


def test_quickstart_with_the_stage_after_verify_validates(tmp_path):
    text = QUICKSTART.read_text()
    text = text.replace(
        "  reward:  {use: filter.verify, from: rollout}\n",
        "  reward:  {use: filter.verify, from: rollout}\n"
        "  band:    {use: filter.beta_difficulty, from: reward, with: {low: 0.3, high: 0.7, decay: 0.5}}\n")
    text = text.replace("update: {use: update.grpo, from: reward,", "update: {use: update.grpo, from: band,")
    assert "from: band" in text and "filter.beta_difficulty" in text
    path = tmp_path / "quickstart_band.yaml"
    path.write_text(text)
    result = CliRunner().invoke(app, ["validate", str(path)])
    assert result.exit_code == 0, result.output
    bad = CliRunner().invoke(app, ["validate", str(path), "--set", "stages.band.with.hgih=0.7"])
    assert bad.exit_code == 2 and "hgih" in bad.output and "Traceback" not in bad.output
