"""Behaviour of the built-in stages and data source."""

from __future__ import annotations

import pytest

from gfcr.errors import GfcrError
from gfcr.records import Prompt, PromptPool, RolloutGroups, StepContext
from gfcr.stages.control.uniform import UniformControl
from gfcr.stages.data.arithmetic import ArithmeticSource, evaluate
from gfcr.stages.filter.dynamic_sampling import DynamicSampling
from gfcr.stages.filter.nonzero_variance import NonzeroVariance
from gfcr.stages.testing import FakeGenerate, scored_group


def pool(n: int) -> PromptPool:
    return PromptPool([Prompt(f"p:{i}", text=str(i)) for i in range(n)])


def test_uniform_is_without_replacement_within_an_epoch_and_seeded():
    stage = UniformControl(UniformControl.Config(batch_size=3, seed=7))
    batches = [[e.prompt_id for e in stage.run(pool(10))] for _ in range(4)]
    first_epoch = batches[0] + batches[1] + batches[2]
    assert len(set(first_epoch)) == 9  # 10 prompts, drop_last: the tenth waits for the next epoch
    assert stage.epoch == 1 and len(set(batches[3])) == 3
    again = UniformControl(UniformControl.Config(batch_size=3, seed=7))
    assert [[e.prompt_id for e in again.run(pool(10))] for _ in range(4)] == batches


def test_uniform_resumes_from_its_state():
    a = UniformControl(UniformControl.Config(batch_size=4, seed=1))
    a.run(pool(10))
    b = UniformControl(UniformControl.Config(batch_size=4, seed=1))
    b.load_state_dict(a.state_dict())
    assert [e.prompt_id for e in a.run(pool(10))] == [e.prompt_id for e in b.run(pool(10))]


def test_uniform_uses_the_run_seed_by_default():
    def first_batch(seed):
        s = UniformControl(UniformControl.Config(batch_size=5))
        s.before_step(StepContext("r", 0, seed, 0))
        return [e.prompt_id for e in s.run(pool(50))]

    assert first_batch(0) == first_batch(0) != first_batch(1)


def test_uniform_refuses_a_batch_larger_than_the_pool():
    with pytest.raises(GfcrError, match="a call draws 11 prompts, more than the pool's 10") as info:
        UniformControl(UniformControl.Config(batch_size=11)).run(pool(10))
    assert "lower the stage's `batch_size`" in info.value.fix


def test_nonzero_variance_records_why_it_dropped():
    groups = [scored_group("p:0", [1, 1]), scored_group("p:1", [0, 0]), scored_group("p:2", [0.5, 0.52]),
              scored_group("p:3", [1]), scored_group("p:4", [0, 1])]
    kept = NonzeroVariance(NonzeroVariance.Config(tolerance=0.05)).run(RolloutGroups(groups))
    assert [g.prompt_id for g in kept] == ["p:4"]
    reasons = [g.verdict.reason for g in groups[:4]]
    assert "all correct" in reasons[0] and "all wrong" in reasons[1] and "every reward = 0.5" in reasons[2]
    assert reasons[3] == "fewer than 2 rollouts (1)"
    assert {g.verdict.dropped_by for g in groups[:4]} == {None}  # the runtime stamps the stage id


def test_nonzero_variance_needs_scored_groups():
    g = scored_group("p:0", [1, 0])
    g.rollouts[0].reward = None
    with pytest.raises(ValueError, match="put a verifier stage before"):
        NonzeroVariance(NonzeroVariance.Config()).run(RolloutGroups([g]))


def test_dynamic_sampling_resets_each_step_and_marks_excess():
    stage = DynamicSampling(DynamicSampling.Config(target_groups=2))
    stage.before_step(StepContext("r", 0, 0, 0))
    groups = [scored_group(f"p:{i}", [0, 1]) for i in range(3)]
    out = stage.run(RolloutGroups(groups))
    assert stage.done() and len(out) == 2 and groups[2].verdict.reason == "excess beyond target (2 groups)"
    stage.before_step(StepContext("r", 1, 0, 1))
    assert not stage.done()


def test_fake_engine_is_deterministic_and_mixes_easy_and_hard_prompts():
    from gfcr.records import Allocation, AllocationEntry

    alloc = Allocation(3, tuple(AllocationEntry(Prompt(f"p:{i}", text="x"), 8) for i in range(40)))
    a = FakeGenerate(FakeGenerate.Config()).run(alloc)
    b = FakeGenerate(FakeGenerate.Config()).run(alloc)
    assert [r.response_token_ids for r in a.rollouts()] == [r.response_token_ids for r in b.rollouts()]
    means = [g.stats.reward_mean for g in a]
    assert min(means) == 0.0 and max(means) == 1.0 and any(0 < m < 1 for m in means)


def test_arithmetic_source_is_seeded_with_stable_ids_and_correct_answers():
    cfg = ArithmeticSource.Config(n=50, seed=3, terms=3, operators=["+", "-", "*"])
    a, b = ArithmeticSource(cfg).load(), ArithmeticSource(cfg).load()
    assert [p.text for p in a] == [p.text for p in b] and a[7].prompt_id == "arithmetic:train-3:7"
    for p in a:
        assert int(p.verifier.ground_truth) == eval(p.metadata["expr"])  # trusted: we generated it
    assert evaluate([2, 3, 4], ["-", "*"]) == -10


def test_uniform_says_each_prompt_was_next_in_its_epoch():
    stage = UniformControl(UniformControl.Config(batch_size=3, seed=7))
    data = PromptPool([Prompt(f"p:{i}", text=str(i)) for i in range(7)])
    stage.run(data)
    second = stage.run(data)  # positions 3, 4, 5 of epoch 0's permutation
    assert [(e.why.code, e.why.name, e.why.value, e.why.quantities) for e in second] == \
        [("next_in_epoch", "position", float(k), {"epoch": 0.0}) for k in (3, 4, 5)]
    assert [e.why.value for e in stage.run(data)] == [0.0, 1.0, 2.0]  # 1 left < 3: epoch 1 starts
