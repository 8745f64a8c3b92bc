"""replay.rollout_replay (DOTS-RR) on hand-built groups: the FIFO keeps the latest group per
prompt, the sigma split, what a replayed rollout carries, and how the step counts it."""

from __future__ import annotations

import numpy as np
import pytest

from gfcr.records import Origin, RolloutGroup, RolloutGroups, Segment, StepContext, StepReport
from gfcr.stages.replay.rollout_replay import RolloutReplay
from gfcr.stages.testing import scored_group


def ctx(step: int, version: int | None = None, seed: int = 0) -> StepContext:
    return StepContext("r", step, seed, step if version is None else version)


def stage(**config) -> RolloutReplay:
    return RolloutReplay(RolloutReplay.Config(**config))


def fresh(prompt: str, step: int, rewards=(1, 0)) -> RolloutGroup:
    """A group generated at ``step`` by policy version ``step`` (segments and created_step say so)."""
    g = scored_group(prompt, list(rewards), step=step)
    for r in g.rollouts:
        r.created_step = step
        r.segments = [Segment(0, 1, step, np.array([-0.5], dtype=np.float32))]
    return g


def test_the_buffer_keeps_the_latest_group_per_prompt_first_in_first_out():
    s = stage(fresh_fraction=1.0, buffer_size=3)  # sigma 1: nothing replayed, only buffering
    s.run(RolloutGroups([fresh("a", 0), fresh("b", 0)]), ctx(0))
    s.run(RolloutGroups([fresh("c", 1), fresh("a", 1)]), ctx(1))  # a's new group goes to the back
    assert s.buffered_prompts() == ["b", "c", "a"] and s.buffer["a"].group_id == "a@s1"
    s.run(RolloutGroups([fresh("d", 2)]), ctx(2))  # 4 prompts > 3: the oldest, b, leaves
    assert s.buffered_prompts() == ["c", "a", "d"]
    assert s.step_metrics()["buffer_prompts"] == 3 and s.step_metrics()["groups_replayed"] == 0


@pytest.mark.parametrize("sigma, n_fresh, replayed", [(0.5, 2, 2), (0.5, 3, 3), (0.25, 2, 6), (0.75, 3, 1)])
def test_sigma_is_the_fresh_share_of_the_update_batch(sigma, n_fresh, replayed):
    s = stage(fresh_fraction=sigma)
    s.run(RolloutGroups([fresh(f"old{i}", 0) for i in range(10)]), ctx(0))
    out = s.run(RolloutGroups([fresh(f"new{i}", 1) for i in range(n_fresh)]), ctx(1))
    # k = round(n (1 - sigma) / sigma): 2 -> 2, 3 -> 3, 2 x 3 -> 6, 3 / 3 -> 1
    assert len(out) == n_fresh + replayed
    assert [g.group_id for g in out][:n_fresh] == [f"new{i}@s1" for i in range(n_fresh)]  # fresh first
    assert all(g.group_id.endswith("~rr1") for g in out.groups[n_fresh:])
    assert n_fresh / len(out) == pytest.approx(sigma, abs=0.05)


def test_the_draw_is_uniform_without_replacement_seeded_by_the_step_and_skips_fresh_prompts():
    s = stage(buffer_size=50)
    s.run(RolloutGroups([fresh(f"p{i}", 0) for i in range(40)]), ctx(0))
    counts: dict[str, int] = {}
    for trial in range(200):  # the same buffer, drawn with 200 seeds
        out = s._draw(4, {"p0"}, StepContext("r", 1, trial, 1))
        assert len({b.prompt_id for b in out}) == 4 and "p0" not in {b.prompt_id for b in out}
        for b in out:
            counts[b.prompt_id] = counts.get(b.prompt_id, 0) + 1
    assert len(counts) == 39 and max(counts.values()) < 3 * 200 * 4 / 39  # every prompt drawn, none favoured
    again = [b.prompt_id for b in s._draw(4, set(), ctx(1, seed=7))]
    assert again == [b.prompt_id for b in s._draw(4, set(), ctx(1, seed=7))]


def test_fewer_buffered_groups_than_wanted_replays_them_all_and_zero_variance_can_be_left_out():
    s = stage(fresh_fraction=0.5, zero_variance=False)
    s.run(RolloutGroups([fresh("easy", 0, (1, 1)), fresh("mixed", 0, (1, 0))]), ctx(0))
    out = s.run(RolloutGroups([fresh(f"n{i}", 1) for i in range(3)]), ctx(1))  # wants 3
    assert [g.prompt_id for g in out.groups[3:]] == ["mixed"]  # `easy` (all 1) is not drawn
    assert stage().config.zero_variance  # the reference replays them (its filter is commented out)


def test_a_replayed_rollout_names_its_original_step_and_policy_version():
    s = stage(fresh_fraction=0.5)
    s.run(RolloutGroups([fresh("a", 3, (1, 0))]), ctx(3))
    out = s.run(RolloutGroups([fresh("b", 7)]), ctx(7, version=7))
    replayed = out.groups[1]
    assert (replayed.group_id, replayed.prompt_id, replayed.step) == ("a@s3~rr7", "a", 7)
    r0, r1 = replayed.rollouts
    assert (r0.rollout_id, r0.origin, r0.replayed_from, r0.created_step) == ("a@s3~rr7/0", Origin.REPLAYED, "a@s3/0", 3)
    assert r0.reward == 1.0 and r1.reward == 0.0 and r0.advantage is None  # the update recomputes it
    assert r0.policy_versions().tolist() == [3] and r0.staleness(7).tolist() == [4]
    assert r0.behavior_logprobs.tolist() == [-0.5]  # mu as stored at generation
    assert s.step_metrics() == {"groups_replayed": 1, "rollouts_replayed": 2, "tokens_replayed": 2,
                                "replayed_staleness_mean": 4.0, "buffer_prompts": 2}


def test_replayed_rollouts_are_not_generated_tokens_of_the_step():
    s = stage(fresh_fraction=0.5)
    s.run(RolloutGroups([fresh("a", 0)]), ctx(0))
    out = s.run(RolloutGroups([fresh("b", 1)]), ctx(1))
    report = StepReport("r", 1, 2, tuple(out), None, {}, {}, update_group_ids=frozenset(g.group_id for g in out))
    assert (report.rollouts_generated, report.tokens_generated, report.rollouts_replayed) == (2, 2, 2)
    assert report.tokens_with_signal == 2  # b's two tokens; a's replayed ones were counted at step 0
