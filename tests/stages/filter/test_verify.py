"""filter.verify: rewards, the format term, failing and hanging verifiers, overrides."""

from __future__ import annotations

import time

import numpy as np
import pytest
from pydantic import ValidationError

from gfcr.errors import GraphError
from gfcr.graph import load_pipeline
from gfcr.records import Prompt, PromptPool, Rollout, RolloutGroup, RolloutGroups, Segment, VerifierSpec
from gfcr.stages.filter.verify import Verify
from gfcr.stages.verifiers import Score, make_verifier_registry
from tests.conftest import BASE


def group(prompt: str, texts: list[str | None]) -> RolloutGroup:
    gid = f"{prompt}@s0"
    rollouts = [Rollout(f"{gid}/{i}", gid, prompt, [1], [Segment(0, 1, 0, np.zeros(1))], text=t)
                for i, t in enumerate(texts)]
    return RolloutGroup(gid, prompt, 0, len(texts), rollouts)


def pool(*specs: VerifierSpec) -> PromptPool:
    return PromptPool([Prompt(f"p:{i}", text="q", verifier=s) for i, s in enumerate(specs)])


def verify(groups: list[RolloutGroup], prompts: PromptPool, registry=None, **config) -> RolloutGroups:
    stage = Verify(Verify.Config(**config)) if registry is None else Verify(Verify.Config(**config), registry)
    return stage.run(RolloutGroups(groups), prompts)


def test_rewards_components_and_reasons():
    g = group("p:0", [" 59", "Answer: 58", "I think it is 59", "no idea"])
    out = verify([g], pool(VerifierSpec("arithmetic", "59")))
    assert out.groups == [g]  # scored in place, nothing dropped
    assert [r.reward for r in g.rollouts] == [1.0, 0.0, 1.0, 0.0]
    assert [r.correct for r in g.rollouts] == [True, False, True, False]
    assert [r.reward_components for r in g.rollouts] == [
        {"correct": 1.0, "format": 1.0}, {"correct": 0.0, "format": 1.0},
        {"correct": 1.0, "format": 0.0}, {"correct": 0.0, "format": 0.0}]
    assert [r.reward_reason for r in g.rollouts] == [
        "answer 59 == 59", "answer 58 != 59", "answer 59 == 59", "no answer found"]
    assert g.stats.n_correct == 2 and g.stats.reward_mean == 0.5


def test_format_weight_mixes_correctness_and_format():
    g = group("p:0", [" 59", "Answer: 58", "I think it is 59", "no idea"])
    verify([g], pool(VerifierSpec("arithmetic", "59")), format_weight=0.25)
    assert [r.reward for r in g.rollouts] == [1.0, 0.25, 0.75, 0.0]
    with pytest.raises(ValidationError, match="less than or equal to 1"):
        Verify.Config(format_weight=1.5)


def test_already_scored_rollouts_are_left_alone():
    g = group("p:0", ["Answer: 58", "Answer: 59"])
    g.rollouts[0].reward, g.rollouts[0].reward_reason = 1.0, "replayed"
    verify([g], pool(VerifierSpec("arithmetic", "59")))
    assert [(r.reward, r.reward_reason) for r in g.rollouts] == [(1.0, "replayed"), (1.0, "answer 59 == 59")]


def test_each_prompt_uses_its_own_verifier_and_the_math_verifier_works_in_the_worker_thread():
    groups = [group("p:0", ["Answer: 18"]), group("p:1", ["\\boxed{0.5}"])]
    verify(groups, pool(VerifierSpec("gsm8k", "18"), VerifierSpec("math", "\\frac{1}{2}")))
    assert [g.rollouts[0].reward for g in groups] == [1.0, 1.0]


def test_the_config_can_override_the_prompts_verifier():
    text = "The answer is 18, not 20"
    by_prompt, overridden = group("p:0", [text]), group("p:0", [text])
    verify([by_prompt], pool(VerifierSpec("gsm8k", "18")))
    verify([overridden], pool(VerifierSpec("gsm8k", "18")), verifier="arithmetic")
    assert by_prompt.rollouts[0].reward_reason == "answer 18 == 18"  # gsm8k: after "answer is"
    assert overridden.rollouts[0].reward_reason == "answer 20 != 18"  # arithmetic: the last integer
    with pytest.raises(ValidationError, match=r"unknown verifier `gms8k`; did you mean `gsm8k`\?"):
        Verify.Config(verifier="gms8k")


def test_an_unknown_verifier_override_is_a_compile_error_with_its_location(write_spec):
    text = BASE.replace("  keep:    {use: filter.nonzero_variance, from: rollout}\n",
                        "  reward:  {use: filter.verify, from: rollout, with: {verifier: gms8k}}\n"
                        "  keep:    {use: filter.nonzero_variance, from: reward}\n")
    with pytest.raises(GraphError) as info:
        load_pipeline(write_spec(text))
    (problem,) = info.value.problems
    assert problem.path == "stages.reward.with.verifier" and str(problem.where).endswith("pipeline.yaml:7:65")
    assert "did you mean `gsm8k`?" in problem.message


def test_a_raising_verifier_scores_zero_with_the_reason_and_the_run_goes_on():
    def broken(text: str, truth: str, options: dict) -> Score:
        raise ValueError(f"cannot read {text!r}")

    registry = make_verifier_registry(entry_points=False)
    registry.register("broken", broken)
    groups = [group("p:0", ["x"]), group("p:1", ["Answer: 2"])]
    verify(groups, pool(VerifierSpec("broken", "1"), VerifierSpec("arithmetic", "2")), registry)
    assert (groups[0].rollouts[0].reward, groups[0].rollouts[0].reward_reason) == (
        0.0, "verifier error: ValueError: cannot read 'x'")
    assert groups[0].rollouts[0].correct is False and groups[1].rollouts[0].reward == 1.0


def test_a_hanging_verifier_s_worker_is_killed_at_the_timeout():
    def hangs(text: str, truth: str, options: dict) -> Score:
        time.sleep(30)
        return Score(True, True, truth)

    registry = make_verifier_registry(entry_points=False)
    registry.register("hangs", hangs)
    verify([group("p:0", ["1", "2"])], pool(VerifierSpec("arithmetic", "1")), registry, workers=2)  # both started
    start = time.monotonic()
    g = group("p:0", ["a", "b"])
    verify([g], pool(VerifierSpec("hangs", "1")), registry, timeout_s=0.2, workers=2)
    assert time.monotonic() - start < 0.2 + 0.5  # both at once, each killed at 0.2 s
    assert [(r.reward, r.correct, r.reward_reason) for r in g.rollouts] == [
        (0.0, False, "verifier timeout after 0.2s (worker killed)")] * 2


def test_a_slow_first_import_in_prepare_does_not_count_against_the_timeout():
    def quick(text: str, truth: str, options: dict) -> Score:
        return Score(text == truth, True, text)

    quick.prepare = lambda: time.sleep(0.3)  # e.g. importing sympy, in each worker, once
    registry = make_verifier_registry(entry_points=False)
    registry.register("quick", quick)
    g = group("p:0", ["1", "2"])
    verify([g], pool(VerifierSpec("quick", "1")), registry, timeout_s=0.1)
    assert [r.reward for r in g.rollouts] == [1.0, 0.0]


def test_the_worker_limits_are_config_fields_with_loud_bounds():
    config = Verify.Config()
    assert (config.timeout_s, config.memory_mb, config.workers) == (5.0, 2048, None)
    with pytest.raises(ValidationError, match="needs at least 256 MiB"):
        Verify.Config(memory_mb=64)
    with pytest.raises(ValidationError, match="greater than 0"):
        Verify.Config(timeout_s=0)
    with pytest.raises(ValidationError, match="greater than or equal to 1"):
        Verify.Config(workers=0)


def test_misconfigured_pipelines_stop_with_a_clear_error():
    with pytest.raises(ValueError, match="prompt p:9 is not in the pool 'pool'"):
        verify([group("p:9", ["1"])], pool(VerifierSpec("arithmetic", "1")))
    with pytest.raises(ValueError, match="prompt p:0 has no verifier spec"):
        verify([group("p:0", ["1"])], PromptPool([Prompt("p:0", text="q")]))
    with pytest.raises(ValueError, match="has no text to verify"):
        verify([group("p:0", [None])], pool(VerifierSpec("arithmetic", "1")))
