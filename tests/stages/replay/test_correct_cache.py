"""replay.correct_cache (AR3PO response reuse) on hand-built groups: who joins which group, the
cache's per-prompt, staleness and size rules, and the advantages a joined group gets."""

from __future__ import annotations

import numpy as np
import pytest
from pydantic import ValidationError

from gfcr.records import Origin, RolloutGroup, RolloutGroups, Segment, StepContext
from gfcr.stages.replay.correct_cache import CorrectCache
from gfcr.stages.testing import scored_group
from gfcr.stages.components.advantage.mean_std import MeanStd


def ctx(step: int, version: int | None = None) -> StepContext:
    return StepContext("r", step, 0, step if version is None else version)


def cache(**config) -> CorrectCache:
    stage = CorrectCache(CorrectCache.Config(**config))
    stage.before_step(ctx(0))
    return stage


def group(prompt: str, rewards, step: int, tokens=None) -> RolloutGroup:
    """Rollouts generated at ``step`` by policy version ``step``; token i of rollout j is ``tokens[j]``."""
    g = scored_group(prompt, list(rewards), step=step)
    for j, r in enumerate(g.rollouts):
        r.created_step = step
        r.response_token_ids = [tokens[j] if tokens else 10 * step + j]
        r.segments = [Segment(0, 1, step, np.array([-1.0], dtype=np.float32))]
    return g


def run(stage: CorrectCache, step: int, *groups: RolloutGroup, version: int | None = None) -> RolloutGroups:
    stage.before_step(ctx(step, version))
    return stage.run(RolloutGroups(list(groups)), ctx(step, version))


def test_a_group_with_no_correct_response_gets_the_newest_cached_one_appended():
    s = cache()
    run(s, 0, group("a", [0, 1, 0], 0), group("b", [1, 1], 0))
    run(s, 1, group("a", [0, 0, 1], 1))  # a's newest correct response is now step 1's
    wrong_a, wrong_b, wrong_c, mixed = group("a", [0, 0], 2), group("b", [0, 0], 2), group("c", [0, 0], 2), \
        group("d", [1, 0], 2)
    run(s, 2, wrong_a, wrong_b, wrong_c, mixed)
    assert [r.reward for r in wrong_a.rollouts] == [0.0, 0.0, 1.0]
    joined = wrong_a.rollouts[2]
    assert (joined.rollout_id, joined.origin, joined.replayed_from, joined.created_step) == \
        ("a@s2/2", Origin.CACHED_CORRECT, "a@s1/2", 1)
    assert joined.policy_versions().tolist() == [1] and joined.correct is True
    assert wrong_b.rollouts[2].replayed_from == "b@s0/1"  # per_prompt 1: the newest of b's two correct ones
    assert len(wrong_c.rollouts) == 2 and len(mixed.rollouts) == 2  # nothing cached / already has a correct one
    assert s.step_metrics() == {"groups_without_correct": 3, "groups_joined": 2, "rollouts_replayed": 2,
                                "tokens_replayed": 2, "evicted_stale": 0, "cache_prompts": 3, "cache_responses": 3}  # a, b, d


def test_the_joined_group_s_advantages_by_hand():
    s = cache()
    run(s, 0, group("a", [1, 0], 0))
    wrong = group("a", [0, 0, 0], 1)
    run(s, 1, wrong)
    # rewards [0, 0, 0, 1]: mean 1/4, sample std sqrt(1/4 * 3/4 * 4/3) = 1/2 (GRPO's ddof=1)
    values = MeanStd(MeanStd.Config()).estimate(wrong).values
    assert values == pytest.approx([-0.5, -0.5, -0.5, 1.5], abs=1e-5)


def test_a_group_never_gets_its_own_step_s_response_and_reused_ones_are_not_cached_again():
    s = cache()
    out = run(s, 0, group("a", [0, 0], 0), group("a", [1, 0], 0))  # the same prompt twice in one step
    assert len(out.groups[0].rollouts) == 2  # the cache was empty when the first was looked at
    run(s, 1, group("a", [0, 0], 1))
    before = s.next_entry_id
    run(s, 2, group("b", [1], 2))  # one new entry; the cached_correct copy at step 1 was not stored
    assert s.next_entry_id == before + 1 and [e.rollout_id for e in s.cached("a")] == ["a@s0/0"]


def test_per_prompt_keeps_the_newest_distinct_responses_and_join_takes_the_newest_first():
    s = cache(per_prompt=2, join=2)
    run(s, 0, group("a", [1, 1], 0, tokens=[5, 6]))
    run(s, 1, group("a", [1, 0], 1, tokens=[5, 9]))  # token 5 again: the newer copy replaces the older
    assert [(e.rollout_id, int(e.response_token_ids[0])) for e in s.cached("a")] == [("a@s1/0", 5), ("a@s0/1", 6)]
    wrong = group("a", [0], 2)
    run(s, 2, wrong)
    assert [r.replayed_from for r in wrong.rollouts[1:]] == ["a@s1/0", "a@s0/1"]


def test_stale_responses_leave_and_never_join():
    s = cache(max_staleness=2)
    run(s, 0, group("a", [1], 0))  # policy version 0
    kept = group("a", [0], 2)
    run(s, 2, kept, version=2)  # staleness 2: still allowed
    assert len(kept.rollouts) == 2
    late = group("a", [0], 3)
    run(s, 3, late, version=3)  # staleness 3 > 2: evicted first, so nothing joins
    assert len(late.rollouts) == 1 and s.step_metrics()["evicted_stale"] == 1 and s.cached("a") == []


def test_max_prompts_evicts_the_least_recently_refreshed_prompt():
    s = cache(max_prompts=2)
    run(s, 0, group("a", [1], 0), group("b", [1], 0))
    run(s, 1, group("a", [1], 1))  # a refreshed: b is now the least recent
    run(s, 2, group("c", [1], 2))
    assert sorted(s.cache) == ["a", "c"]


def test_join_cannot_exceed_what_the_cache_keeps():
    with pytest.raises(ValidationError, match="per_prompt"):
        CorrectCache.Config(join=2, per_prompt=1)
