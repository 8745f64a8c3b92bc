"""Trajectory records: turns tile the response, environment tokens are never trained on or
counted as generated, and a single-turn rollout is exactly what it was."""

import numpy as np
import pytest

from gfcr.records import Rollout, Segment, SegmentOrigin, Turn, TurnRole
from gfcr.stages.generate.rollout_state import rollout_from_state, rollout_state


def trajectory() -> Rollout:
    """Model turn [0, 3), environment turn [3, 5), model turn [5, 7)."""
    segments = [Segment(0, 3, 2, np.array([-0.1, -0.2, -0.3])),
                Segment(3, 5, 2, np.zeros(2), SegmentOrigin.ENVIRONMENT),
                Segment(5, 7, 3, np.array([-0.4, -0.5]))]
    turns = [Turn(TurnRole.MODEL, 0, 3, "a?", tool_call={"name": "calc", "arguments": {"expression": "1+1"}}),
             Turn(TurnRole.ENVIRONMENT, 3, 5, " 2"), Turn(TurnRole.MODEL, 5, 7, " 2", reward=1.0)]
    return Rollout("p:0@s0/0", "p:0@s0", "p:0", list(range(10, 17)), segments, turns=turns)


def test_trained_mask_is_false_exactly_on_environment_tokens():
    r = trajectory()
    assert r.trained_mask().tolist() == [True, True, True, False, False, True, True]
    assert r.environment_tokens == 2


def test_environment_tokens_are_not_generated():
    assert trajectory().generated_length == 5


def test_single_turn_rollout_is_unchanged():
    r = Rollout("p:0@s0/0", "p:0@s0", "p:0", [1, 2, 3], [Segment(0, 3, 0, np.zeros(3))])
    assert r.trained_mask() is None and r.environment_tokens == 0 and r.generated_length == 3 and r.turns is None


def test_turns_must_tile_the_response():
    r = trajectory()
    with pytest.raises(ValueError, match="turns cover 5 tokens, the response has 7"):
        Rollout(r.rollout_id, r.group_id, r.prompt_id, r.response_token_ids, r.segments, turns=r.turns[:2])
    with pytest.raises(ValueError, match="turn starts at 5, expected 3"):
        Rollout(r.rollout_id, r.group_id, r.prompt_id, r.response_token_ids, r.segments,
                turns=[r.turns[0], r.turns[2]])


def test_a_turn_holds_segments_of_its_own_kind_only():
    r = trajectory()
    wrong = [Turn(TurnRole.MODEL, 0, 4), Turn(TurnRole.ENVIRONMENT, 4, 5), Turn(TurnRole.MODEL, 5, 7)]
    with pytest.raises(ValueError, match=r"model turn \[0, 4\) overlaps a segment of origin environment \[3, 5\)"):
        Rollout(r.rollout_id, r.group_id, r.prompt_id, r.response_token_ids, r.segments, turns=wrong)


def test_turns_survive_the_state_tree():
    r = trajectory()
    back = rollout_from_state(rollout_state(r))
    assert [t.state() for t in back.turns] == [t.state() for t in r.turns]
    assert back.trained_mask().tolist() == r.trained_mask().tolist()
    assert rollout_from_state(rollout_state(Rollout("a:0@s0/0", "a:0@s0", "a:0", [], []))).turns is None


def test_behaviour_logprobs_keep_environment_zeros_in_place():
    r = trajectory()
    assert r.behavior_logprobs.tolist() == pytest.approx([-0.1, -0.2, -0.3, 0, 0, -0.4, -0.5])
    assert r.policy_versions().tolist() == [2, 2, 2, 2, 2, 3, 3]
