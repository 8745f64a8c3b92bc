"""Record invariants: segments tile the response, ids are stable strings, stats are derived."""

from __future__ import annotations

import numpy as np
import pytest

from gfcr.records import (
    Allocation, AllocationEntry, Observation, Prompt, PromptPool, PromptStats, Rollout, RolloutGroup,
    Segment, SegmentOrigin, group_id, prompt_id, rollout_id,
)
from gfcr.stages.testing import scored_group


def rollout(tokens=3, segments=None, **kw):
    segments = segments if segments is not None else [Segment(0, tokens, 0, np.zeros(tokens))]
    return Rollout("g/0", "g", "p:0", list(range(tokens)), segments, **kw)


def test_segments_must_cover_every_response_token():
    with pytest.raises(ValueError, match="segments cover 2 tokens, the response has 3"):
        rollout(3, [Segment(0, 2, 0, np.zeros(2))])


def test_segments_must_be_contiguous():
    with pytest.raises(ValueError, match="segment starts at 2, expected 1"):
        rollout(3, [Segment(0, 1, 0, np.zeros(1)), Segment(2, 3, 0, np.zeros(1))])


def test_segment_needs_one_logprob_per_token():
    with pytest.raises(ValueError, match="needs one per token"):
        Segment(0, 3, 0, np.zeros(2))


@pytest.mark.parametrize("bad", ["", "has space", None, 3])
def test_ids_are_non_empty_strings_without_whitespace(bad):
    with pytest.raises(ValueError, match="rollout_id must be a non-empty string"):
        Rollout(bad, "g", "p:0", [], [])


def test_staleness_per_token_follows_segment_versions():
    r = rollout(0, [])
    r.append([5, 6], np.array([-0.1, -0.2]), policy_version=3)
    r.append([7], np.array([-0.3]), policy_version=3)  # same version: merged
    r.append([8], np.array([-0.4]), policy_version=5, origin=SegmentOrigin.SAMPLED)
    assert len(r.segments) == 2
    np.testing.assert_allclose(r.behavior_logprobs, [-0.1, -0.2, -0.3, -0.4], rtol=1e-6)
    assert r.staleness(6).tolist() == [3, 3, 3, 1]


def test_stable_ids():
    pid = prompt_id("gsm8k", "train", 17)
    gid = group_id(pid, step=4)
    assert (pid, gid, rollout_id(gid, 2)) == ("gsm8k:train:17", "gsm8k:train:17@s4", "gsm8k:train:17@s4/2")
    assert group_id(pid, 4, round=1) == "gsm8k:train:17@s4.r1"


def test_group_stats_are_derived_from_rollouts():
    g = scored_group("p:0", [1, 0, 1, 1])
    s = g.stats
    assert (s.n, s.n_correct, s.reward_mean, s.reward_median) == (4, 3, 0.75, 1.0)
    assert s.reward_std == pytest.approx(np.std([1, 0, 1, 1]))
    g.rollouts[1].reward = 1.0
    assert g.stats.reward_std == 0.0


def test_group_rejects_rollouts_of_another_prompt():
    other = scored_group("p:1", [1]).rollouts[0]
    with pytest.raises(ValueError, match="is for prompt p:1, not p:0"):
        RolloutGroup("p:0@s0", "p:0", 0, 1, [other])


def test_prompt_needs_text_or_messages_and_pool_rejects_duplicates():
    with pytest.raises(ValueError, match="exactly one of `text` or `messages`"):
        Prompt("p:0")
    with pytest.raises(ValueError, match="appears twice"):
        PromptPool([Prompt("p:0", text="a"), Prompt("p:0", text="b")])
    pool = PromptPool([Prompt("p:0", text="a"), Prompt("p:1", messages=[{"role": "user", "content": "b"}])])
    assert pool.get("p:1").messages[0]["content"] == "b" and "p:0" in pool and len(pool) == 2


def test_allocation_counts_active_entries():
    a = Allocation(0, (AllocationEntry(Prompt("p:0", text="a"), 8), AllocationEntry(Prompt("p:1", text="b"), 0)))
    assert [e.prompt_id for e in a.active()] == ["p:0"] and a.total_rollouts == 8
    with pytest.raises(ValueError, match="n_rollouts must be >= 0"):
        AllocationEntry(Prompt("p:2", text="c"), -1)


def test_prompt_stats_streaks_survive_a_short_history():
    stats = PromptStats("p:0", history_size=2)
    for correct in (8, 8, 8, 8):
        stats.record(Observation(step=0, policy_version=0, n=8, n_correct=correct, mean_reward=1.0, reward_std=0.0))
    assert (stats.easy_streak, stats.hard_streak, len(stats.history)) == (4, 0, 2)
    stats.record(Observation(step=1, policy_version=1, n=8, n_correct=0, mean_reward=0.0, reward_std=0.0))
    assert (stats.easy_streak, stats.hard_streak) == (0, 1)


def test_a_group_dropped_twice_keeps_its_first_reason():
    from gfcr.stages.testing import scored_group

    group = scored_group("p:0", [1, 0])
    group.drop("stopped in flight")
    group.drop("zero variance")
    assert not group.verdict.included and group.verdict.reason == "stopped in flight"


def test_a_removed_rollout_leaves_the_group_but_stays_in_what_was_generated():
    group = scored_group("p:0", [1.0, 0.0, 0.0])
    removed_id = group.rollouts[1].rollout_id
    group.remove(removed_id, "finish reason `aborted`")
    assert [r.reward for r in group.rollouts] == [1.0, 0.0] and group.stats.n == 2
    assert group.rewards.tolist() == [1.0, 0.0]  # what a group baseline sees
    assert [r.rollout_id for r in group.generated][-1] == removed_id and len(group.generated) == 3
    assert [(m.rollout.rollout_id, m.reason, m.removed_by) for m in group.removed] == [
        (removed_id, "finish reason `aborted`", None)]  # the runtime stamps removed_by
    assert group.verdict.included
    with pytest.raises(ValueError, match=f"has no rollout {removed_id} to remove"):
        group.remove(removed_id, "again")


def test_a_downstream_stage_does_not_hand_on_the_upstream_controller_state():
    """GRESO's p_easy belongs to the stage that computed it: `control.fixed_n` after it hands on
    the entries, not the state, so metrics.jsonl and MLflow show it once, under GRESO (issue 40)."""
    from gfcr.records import Allocation, AllocationEntry, Prompt

    upstream = Allocation(0, (AllocationEntry(Prompt("p:0", text="0"), 1),), controller_state={"p_easy": 0.5})
    handed_on = upstream.with_entries(list(upstream))
    assert handed_on.controller_state == {} and upstream.controller_state == {"p_easy": 0.5}
    assert list(handed_on) == list(upstream)
