"""filter.merge_rounds: later rounds' rollouts join the prompt's round-0 group (kept and removed
ones), the emptied top-up group is dropped, a new prompt's group becomes a base, and ``done``
ends the loop once a later round brings nothing."""

from __future__ import annotations

import numpy as np

from gfcr.records import Rollout, RolloutGroup, RolloutGroups, Segment, StepContext, group_id, rollout_id
from gfcr.stages.filter.merge_rounds import MergeRounds
from gfcr.stages.testing import scored_group


def _ctx(round_: int) -> StepContext:
    return StepContext("run", 0, 0, 0, round=round_)


def _topup(prompt: str, rewards: list[float], round_: int = 1) -> RolloutGroup:
    gid = group_id(prompt, 0, round_)
    rollouts = [Rollout(rollout_id(gid, i), gid, prompt, [1, 2], [Segment(0, 2, 0, np.zeros(2))],
                        reward=float(r), correct=r == 1) for i, r in enumerate(rewards)]
    return RolloutGroup(gid, prompt, 0, len(rewards), rollouts)


def test_a_top_up_joins_its_prompt_s_group_and_leaves_an_empty_dropped_group():
    stage = MergeRounds(MergeRounds.Config())
    stage.before_step(_ctx(0))
    a, b = scored_group("a", [0, 0, 0, 1]), scored_group("b", [1, 1, 1, 1])
    out = stage.run(RolloutGroups([a, b]), _ctx(0))
    assert [g.group_id for g in out] == ["a@s0", "b@s0"] and not stage.done()
    top = _topup("a", [1, 0, 1])
    top.remove("a@s0.r1/1", "some filter")  # a removed rollout moves too (lineage and counts keep it)
    out = stage.run(RolloutGroups([top]), _ctx(1))
    assert [g.group_id for g in out] == ["a@s0", "b@s0"] and not stage.done()
    # a: 4 first + 2 kept top-up rollouts; rewards 0 0 0 1 1 1 -> mean 0.5; target 4 + 3
    assert [r.rollout_id for r in a.rollouts][-2:] == ["a@s0.r1/0", "a@s0.r1/2"]
    assert (len(a.rollouts), a.target_size, a.stats.reward_mean) == (6, 7, 0.5)
    assert [m.rollout.rollout_id for m in a.removed] == ["a@s0.r1/1"]
    assert all(r.group_id == "a@s0" for r in a.generated)
    assert (top.rollouts, top.removed, top.verdict.included, top.verdict.reason) == ([], [], False, "merged into a@s0")
    assert len(b.rollouts) == 4 and b.verdict.included
    # every generated rollout is held by exactly one group: counted once
    assert sum(len(g.generated) for g in (a, b, top)) == 4 + 4 + 3


def test_a_second_top_up_round_merges_too_and_a_new_prompt_becomes_a_base():
    stage = MergeRounds(MergeRounds.Config())
    a = scored_group("a", [0, 1])
    stage.run(RolloutGroups([a]), _ctx(0))
    stage.run(RolloutGroups([_topup("a", [1]), _topup("c", [0, 1])]), _ctx(1))
    out = stage.run(RolloutGroups([_topup("a", [0], round_=2)]), _ctx(2))
    assert [g.group_id for g in out] == ["a@s0", "c@s0.r1"]
    assert [r.rollout_id for r in a.rollouts] == ["a@s0/0", "a@s0/1", "a@s0.r1/0", "a@s0.r2/0"]
    assert not stage.done()


def test_done_once_a_later_round_brings_nothing_and_round_0_starts_afresh():
    stage = MergeRounds(MergeRounds.Config())
    stage.run(RolloutGroups([scored_group("a", [0, 1])]), _ctx(0))
    assert not stage.done()
    assert [g.prompt_id for g in stage.run(RolloutGroups(), _ctx(1))] == ["a"] and stage.done()
    # the next step's round 0 forgets the last step's groups, before_step or not
    out = stage.run(RolloutGroups([scored_group("b", [1, 0], step=1)]), _ctx(0))
    assert [g.prompt_id for g in out] == ["b"] and not stage.done()
    assert len(stage.run(RolloutGroups(), _ctx(0))) == 0 and stage.done()  # nothing sampled: nothing to top up
