"""The shipped calculator environment and the calc tool parser, step by step (no model)."""

import pytest

from gfcr.records import Prompt, VerifierSpec
from gfcr.stages.environments import TOOL_PARSERS, Action, make_environment
from gfcr.stages.environments.tools import calculate, parse_calc


def test_calc_parser_reads_a_call_from_a_turn_ending_in_a_question_mark():
    assert parse_calc(" 12 + 30?").state() == {"name": "calc", "arguments": {"expression": "12 + 30"}}
    assert parse_calc(" 7 Answer: 3 * 4? ").state()["arguments"] == {"expression": "3 * 4"}
    assert parse_calc(" 42") is None and TOOL_PARSERS["calc"] is parse_calc


@pytest.mark.parametrize(("expression", "value"), [("12 + 30", 42), ("5 - 9", -4), ("-3 * 4", -12),
                                                    ("__import__('os')", None), ("1 + 2 + 3", None), ("", None)])
def test_calculate_takes_one_operation_of_two_integers_and_never_evaluates_text(expression, value):
    assert calculate(expression) == value


def episode(max_tool_calls: int = 2):
    env = make_environment("calculator", {"max_tool_calls": max_tool_calls})
    env.reset(Prompt("a:0", text="What is 12 + 30? Answer:", verifier=VerifierSpec("arithmetic", "42")), seed=0)
    return env


def test_a_call_is_answered_and_an_answer_ends_the_episode():
    env = episode()
    obs = env.step(Action(" 12 + 30?", parse_calc(" 12 + 30?")))
    assert (obs.text, obs.done, obs.reward) == (" 42 Answer:", False, None)
    obs = env.step(Action(" x?", parse_calc(" x?")))
    assert obs.text == " nAn Answer:" and not obs.done
    obs = env.step(Action(" 42"))
    assert (obs.done, obs.reward, obs.metadata["correct"], obs.metadata["tool_calls"]) == (True, 1.0, True, 2)
    assert episode().step(Action(" 41")).reward == 0.0


def test_too_many_calls_end_the_episode_with_nothing():
    env = episode(max_tool_calls=1)
    env.step(Action(" 1 + 1?", parse_calc(" 1 + 1?")))
    obs = env.step(Action(" 1 + 1?", parse_calc(" 1 + 1?")))
    assert (obs.done, obs.reward, obs.metadata["reason"]) == (True, 0.0, "more than 1 calculator calls")


def test_a_prompt_with_no_ground_truth_is_refused():
    with pytest.raises(ValueError, match="has no verifier"):
        make_environment("calculator", {}).reset(Prompt("a:0", text="What is 1 + 1?"), seed=0)


def test_a_withheld_result_keeps_the_turn_and_drops_the_value():
    env = make_environment("calculator", {"show_result": False})
    env.reset(Prompt("a:0", text="What is 12 + 30? Answer:", verifier=VerifierSpec("arithmetic", "42")), seed=0)
    obs = env.step(Action(" 12 + 30?", parse_calc(" 12 + 30?")))
    assert (obs.text, obs.done, obs.metadata["result"]) == (" Answer:", False, "withheld")
    assert env.step(Action(" 42")).reward == 1.0
