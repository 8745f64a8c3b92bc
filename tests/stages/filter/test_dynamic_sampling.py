"""filter.dynamic_sampling's group criterion, verl's ``filter_groups.metric`` rule, by hand:
keep a group iff the population std of the metric over its rollouts is > 0, or it has one
rollout; the default (no metric) keeps every included group, as before."""

from __future__ import annotations

import pytest

from gfcr.records import RolloutGroups, StepContext
from gfcr.stages.filter.dynamic_sampling import DynamicSampling, metric_values
from gfcr.stages.testing import scored_group


def stage(**kw) -> DynamicSampling:
    s = DynamicSampling(DynamicSampling.Config(**{"target_groups": 8, **kw}))
    s.before_step(StepContext("run", step=0, seed=0, policy_version=0))
    return s


def test_default_has_no_criterion():
    groups = RolloutGroups([scored_group("p:0", [1, 1]), scored_group("p:1", [0, 0])])
    assert [g.prompt_id for g in stage().run(groups)] == ["p:0", "p:1"]
    assert all(g.verdict.included for g in groups)


def test_acc_drops_all_correct_and_all_wrong_keeps_mixed_and_singletons():
    groups = RolloutGroups([
        scored_group("p:0", [1, 1, 1]),   # acc 1,1,1: std 0 -> drop
        scored_group("p:1", [0, 0]),      # acc 0,0:   std 0 -> drop
        scored_group("p:2", [1, 0, 0]),   # acc 1,0,0: mean 1/3, std sqrt(2/9) > 0 -> keep
        scored_group("p:3", [0]),         # G = 1: kept (verl: `or len == 1`)
    ])
    kept = stage(metric="acc").run(groups)
    assert [g.prompt_id for g in kept] == ["p:2", "p:3"]
    assert [g.verdict.reason for g in groups.groups[:2]] == ["acc std 0 (every acc = 1)", "acc std 0 (every acc = 0)"]


def test_acc_and_reward_differ_on_partial_credit():
    # rewards 0.5 and 0.25, neither correct (correct is reward == 1): acc 0,0 -> std 0;
    # reward 0.5,0.25 -> mean 0.375, std sqrt((0.125^2 + 0.125^2)/2) = 0.125 > 0.
    group = scored_group("p:0", [0.5, 0.25])
    assert list(metric_values(group, "acc")) == [0.0, 0.0]
    assert list(metric_values(group, "reward")) == [0.5, 0.25]
    assert [g.prompt_id for g in stage(metric="reward").run(RolloutGroups([group]))] == ["p:0"]
    group = scored_group("p:0", [0.5, 0.25])
    assert list(stage(metric="acc").run(RolloutGroups([group]))) == []
    assert group.verdict.reason == "acc std 0 (every acc = 0)"

    # the converse: rewards 1 and 1 with one rollout judged wrong (correct False, reward 1)
    group = scored_group("p:1", [1, 1])
    group.rollouts[1].correct = False
    assert [g.prompt_id for g in stage(metric="acc").run(RolloutGroups([group]))] == ["p:1"]
    group = scored_group("p:1", [1, 1])
    group.rollouts[1].correct = False
    assert list(stage(metric="reward").run(RolloutGroups([group]))) == []
    assert group.verdict.reason == "reward std 0 (every reward = 1)"


def test_exact_zero_like_verl_no_tolerance():
    # np.std([0.1, 0.1, 0.1]) = 1.39e-17 > 0 in float64 (the mean 0.3/3 rounds), so verl keeps it
    group = scored_group("p:0", [0.1, 0.1, 0.1])
    assert [g.prompt_id for g in stage(metric="reward").run(RolloutGroups([group]))] == ["p:0"]
    group = scored_group("p:1", [0.3, 0.3, 0.3])  # np.std is exactly 0 here
    assert list(stage(metric="reward").run(RolloutGroups([group]))) == []


def test_missing_values_are_refused_naming_the_group():
    group = scored_group("p:0", [1, 0])
    group.rollouts[0].correct = None
    with pytest.raises(ValueError, match=r"group p:0.*correct.*acc"):
        stage(metric="acc").run(RolloutGroups([group]))
    group = scored_group("p:0", [1, 0])
    group.rollouts[1].reward = None
    with pytest.raises(ValueError, match=r"group p:0.*reward"):
        stage(metric="reward").run(RolloutGroups([group]))


def test_already_dropped_groups_are_left_alone_and_target_still_counts_kept_groups():
    dropped = scored_group("p:0", [1, 1])
    dropped.drop("earlier filter")
    s = stage(metric="acc", target_groups=2)
    out = s.run(RolloutGroups([dropped, scored_group("p:1", [1, 1]), scored_group("p:2", [0, 1])]))
    assert dropped.verdict.reason == "earlier filter"
    assert [g.prompt_id for g in out] == ["p:2"] and not s.done()
    out = s.run(RolloutGroups([scored_group("p:3", [1, 0]), scored_group("p:4", [0, 1])]))
    assert [g.prompt_id for g in out] == ["p:2", "p:3"] and s.done()
