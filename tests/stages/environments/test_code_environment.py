"""The ``code`` environment step by step (no model): submissions run with the tests, failures come
back as feedback, the reward is the tests' verdict; the ``python`` tool and the ``hermes`` parser."""

from __future__ import annotations

from pathlib import Path

import pytest

from gfcr.records import Prompt, VerifierSpec
from gfcr.stages.data.humaneval import HumanEvalSource
from gfcr.stages.environments import Action, make_environment
from gfcr.stages.environments.tools import parse_hermes
from gfcr.stages.verifiers.code import verify_code

REPO = Path(__file__).resolve().parents[3]
TINY_CODE = REPO / "pipelines" / "examples" / "data" / "tiny_code.jsonl"


def tiny_problems() -> list[Prompt]:
    return list(HumanEvalSource(HumanEvalSource.Config(path=str(TINY_CODE), template="{prompt}")).load())


def episode(prompt: Prompt | None = None, **options):
    env = make_environment("code", options)
    env.reset(prompt or tiny_problems()[0], seed=0)
    return env


def call(code: str) -> Action:
    text = f'<tool_call>{{"name": "python", "arguments": {{"code": {code!r}}}}}</tool_call>'.replace("'", '"')
    return Action(text, parse_hermes(text))


def test_a_passing_submission_ends_the_episode_with_reward_1():
    obs = episode().step(Action(" a + n"))
    assert (obs.done, obs.reward, obs.metadata) == (True, 1.0, {"correct": True, "reason": "all tests passed",
                                                                "attempts": 1, "tool_calls": 0})


def test_failing_tests_come_back_as_feedback_until_the_attempts_are_spent():
    env = episode(max_attempts=3)
    obs = env.step(Action(" a - n"))
    assert not obs.done and obs.reward is None
    assert obs.text == ("Failed: assert candidate(2, 3) == 5 (a test failed: AssertionError)\n"
                        "Fix the code and reply with the whole function.\n")
    obs = env.step(Action(" a +"))
    assert obs.text.startswith("Failed: def add(a, n):") is False and "SyntaxError" in obs.text and not obs.done
    obs = env.step(Action(" print('trying') or a * n"))
    assert (obs.done, obs.reward, obs.metadata["correct"], obs.metadata["attempts"]) == (True, 0.0, False, 3)
    assert obs.metadata["reason"] == "a test failed: AssertionError"


def test_the_program_output_is_part_of_the_feedback_and_is_cut():
    env = episode(feedback_chars=160)
    obs = env.step(Action(" print('x' * 500) or 0"))
    assert obs.text.startswith("Failed: assert candidate(2, 3) == 5 (a test failed: AssertionError)\nOutput:\nxxx")
    assert obs.text.endswith("xx ...\nFix the code and reply with the whole function.\n")
    assert len(obs.text) == 160


def test_a_retry_that_passes_scores_1():
    env = episode()
    assert not env.step(Action(" 0")).done
    obs = env.step(Action("```python\ndef add(a, n):\n    return a + n\n```"))
    assert (obs.done, obs.reward, obs.metadata["attempts"]) == (True, 1.0, 2)


def test_the_python_tool_returns_the_output_and_how_the_program_ended():
    env = episode()
    obs = env.step(call("print(6 * 7)"))
    assert (obs.text, obs.done, obs.metadata["tool"]) == ("Output:\n42\n\nExit: ran to the end.\n", False, "python")
    obs = env.step(call("print(1); 1 / 0"))
    assert obs.text == "Output:\n1\n\nExit: ZeroDivisionError: division by zero.\n"
    assert env.step(Action(" a + n")).metadata == {"correct": True, "reason": "all tests passed", "attempts": 1,
                                                   "tool_calls": 2}


def test_unknown_tools_and_malformed_calls_are_answered_and_counted():
    env = episode(max_tool_calls=2)
    bad = Action("<tool_call>{oops}</tool_call>", parse_hermes("<tool_call>{oops}</tool_call>"))
    assert env.step(bad).text.startswith("Tool call failed: not a tool call of the form")
    other = '<tool_call>{"name": "shell", "arguments": {}}</tool_call>'
    assert env.step(Action(other, parse_hermes(other))).text.startswith("Tool call failed: there is no tool `shell`")
    obs = env.step(call("print(1)"))
    assert (obs.done, obs.reward, obs.metadata["reason"]) == (True, 0.0, "more than 2 tool calls")


def test_a_humaneval_canonical_solution_passes_as_the_code_verifier_says():
    prompt = HumanEvalSource(HumanEvalSource.Config(limit=3)).load()[2]
    solution = prompt.verifier.options["prompt"] + prompt.metadata["canonical_solution"]
    response = f"```python\n{solution}```"
    obs = episode(prompt).step(Action(response))
    verdict = verify_code(response, prompt.verifier.ground_truth, dict(prompt.verifier.options))
    assert (obs.reward == 1.0) == verdict.correct is True and obs.metadata["reason"] == verdict.reason


def test_a_prompt_that_is_no_code_problem_is_refused():
    with pytest.raises(ValueError, match="is not a code problem"):
        episode(Prompt("a:0", text="What is 1 + 1?", verifier=VerifierSpec("arithmetic", "2")))


@pytest.mark.parametrize("options, message", [({"max_attempts": 0}, "max_attempts is 0"),
                                              ({"output_kb": 0}, "output_kb is 0")])
def test_bad_options_say_which(options, message):
    with pytest.raises(ValueError, match=message):
        make_environment("code", options)
