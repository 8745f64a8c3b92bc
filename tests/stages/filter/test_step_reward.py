"""filter.step_reward (Step-GRPO's step-aware relative reward): the step count and Eq. 5 by hand, the
group baseline over correct rollouts only, what it refuses and leaves alone, and a quickstart step
with it after the real verifier (the reference cases are tests/fidelity/test_step_grpo_reward.py)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from gfcr.graph import compile_pipeline
from gfcr.records import Rollout, RolloutGroup, RolloutGroups, Segment
from gfcr.runtime import LocalRunner
from gfcr.runtime.loop.session import build_services
from gfcr.spec import load_spec_text
from gfcr.stages.filter.step_reward import StepReward, count_steps

QUICKSTART = Path(__file__).resolve().parents[3] / "pipelines" / "quickstart.yaml"


def _group(texts: list[str], correct: list[bool | None], fmt: float = 1.0) -> RolloutGroup:
    rollouts = [Rollout(f"g/{i}", "g", "p", [1], [Segment(0, 1, 0, [0.0])], reward=float(bool(ok)), correct=ok,
                        text=t, reward_components={} if ok is None else {"correct": float(ok), "format": fmt})
                for i, (t, ok) in enumerate(zip(texts, correct))]
    return RolloutGroup("g", "p", 0, len(rollouts), rollouts)


@pytest.mark.parametrize("text, steps", [
    ("no steps", 1), ("Wait, then Wait.", 3), ("Waiting; await; AWait; WAIT", 1), ("Wait9 Wait_ (Wait)", 4),
])
def test_a_step_is_a_whole_trigger_word(text, steps):
    assert count_steps(text) == steps


def test_correct_rollouts_are_rewarded_against_the_mean_steps_of_the_correct_ones():
    # steps 1, 3 (correct: mu = 2) and 6 (wrong: not in mu, no step term)
    group = _group(["a", "Wait Wait", "Wait " * 5], [True, True, False], fmt=0.0)
    StepReward(StepReward.Config()).run(RolloutGroups([group]))
    short, long, wrong = group.rollouts
    assert short.reward == pytest.approx(0.9 * (1 + 0.5 * math.tanh(0.5)))
    assert long.reward == pytest.approx(0.9 * (1 - 0.5 * math.tanh(0.5)))
    assert wrong.reward == 0.0 and wrong.reward_components["step_bonus"] == 0.0
    assert short.reward_components["step_bonus"] == pytest.approx(0.45 * math.tanh(0.5))
    assert long.reward_reason.endswith("3 steps, group mean 2")


def test_a_group_with_no_correct_rollout_and_the_all_sample_baseline():
    group = _group(["Wait", "a"], [False, False])
    StepReward(StepReward.Config()).run(RolloutGroups([group]))
    assert [r.reward for r in group.rollouts] == pytest.approx([0.1, 0.1])  # format only
    # baseline all: mu = (2 + 1) / 2 over both, the one correct rollout has 1 step
    group = _group(["Wait", "a"], [False, True])
    StepReward(StepReward.Config(baseline="all", beta=1.0)).run(RolloutGroups([group]))
    assert group.rollouts[1].reward == pytest.approx(0.9 * (1 - math.tanh((1 - 1.5) / 1.5)) + 0.1)


def test_unverified_rollouts_are_refused_and_reshaped_ones_left_alone():
    with pytest.raises(ValueError, match="group g: rollouts g/1 have no verifier verdict.*after filter.verify"):
        StepReward(StepReward.Config()).run(RolloutGroups([_group(["a", "b"], [True, None])]))
    group = _group(["a", "Wait"], [True, True])
    stage = StepReward(StepReward.Config())
    stage.run(RolloutGroups([group]))
    before = [r.reward for r in group.rollouts]
    stage.run(RolloutGroups([group]))  # a replayed group comes back with its step_bonus: unchanged
    assert [r.reward for r in group.rollouts] == before


@pytest.mark.slow  # a real tiny-arith step through the runtime: 207 s measured on the shared 2-core machine
def test_a_quickstart_step_with_the_stage_after_the_verifier():
    text = QUICKSTART.read_text()
    reward_line = "  reward:  {use: filter.verify, from: rollout}\n"
    assert reward_line in text and "update: {use: update.grpo, from: reward," in text
    text = text.replace(reward_line, reward_line + "  steps:   {use: filter.step_reward, from: reward}\n")
    text = text.replace("update: {use: update.grpo, from: reward,", "update: {use: update.grpo, from: steps,")
    pipeline = compile_pipeline(load_spec_text(text))
    report = LocalRunner(pipeline, services=build_services(pipeline.spec)).run_step()
    rollouts = [r for g in report.groups for r in g.rollouts]
    assert rollouts and all("step_bonus" in r.reward_components for r in rollouts)
    for r in rollouts:  # tiny-arith writes no "Wait": one step each, so no step term
        assert r.reward == pytest.approx(0.9 * float(r.correct) + 0.1 * r.reward_components["format"])
