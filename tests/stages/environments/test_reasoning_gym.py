"""The ``reasoning_gym`` environment (no model): its rewards are reasoning-gym's own ``score_answer``
(the pinned cases), a wrong answer is retried with feedback, and mistakes are caught at validate."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gfcr.records import Prompt, VerifierSpec
from gfcr.stages.environments import Action, make_environment
from gfcr.stages.generate.multi_turn import MultiTurn

pytest.importorskip("reasoning_gym", reason="the reasoning_gym environment needs `pip install reasoning-gym`")
CASES = json.loads((Path(__file__).resolve().parents[2] / "fixtures" / "environments" / "reasoning_gym_scores.json").read_text())
CHAIN_SUM = {"seed": 0, "size": 5, "min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 2}


def episode(prompt: Prompt, dataset: str = "chain_sum", config: dict | None = None, **options):
    env = make_environment("reasoning_gym", {"dataset": dataset, "config": CHAIN_SUM if config is None else config,
                                             **options})
    env.reset(prompt, seed=0)
    return env


def test_rewards_are_reasoning_gyms_own_scores():
    """checked against reasoning-gym 0.1.25 (PyPI): 168/168 cases over 8 datasets, partial credit included."""
    assert CASES["source"].startswith("reasoning-gym 0.1.25") and len(CASES["cases"]) == 168
    for case in CASES["cases"]:
        prompt = Prompt(f"{case['dataset']}:{case['index']}", text=case["question"],
                        metadata={"source_index": case["index"]})
        obs = episode(prompt, case["dataset"], case["config"], max_attempts=1).step(Action(case["turn"]))
        assert obs.done and obs.reward == case["score"], case


def question(i: int) -> Prompt:
    case = next(c for c in CASES["cases"] if c["dataset"] == "chain_sum" and c["index"] == i)
    return Prompt(f"chain_sum:{i}", text=case["question"])


def test_a_wrong_answer_is_told_so_and_retried():
    env = episode(question(0), max_attempts=3, feedback="No ({score:g}), again:")
    obs = env.step(Action(" 12"))
    assert (obs.text, obs.done, obs.reward) == ("No (0), again:", False, None)
    obs = env.step(Action(" -28"))
    assert (obs.done, obs.reward, obs.metadata["correct"], obs.metadata["attempts"]) == (True, 1.0, True, 2)


def test_the_last_attempt_ends_with_its_score():
    env = episode(question(0), max_attempts=2)
    assert env.step(Action("1")).text == "That is not correct (score 0). Try again."
    obs = env.step(Action("2"))
    assert (obs.done, obs.reward, obs.metadata["reason"]) == (True, 0.0, "score 0 after 2 attempts")


def test_an_answer_tag_reads_the_answer_inside_it():
    env = episode(question(0), answer_tag="answer", max_attempts=1)
    assert env.step(Action("thinking... <answer>-28</answer>")).reward == 1.0
    assert episode(question(0), answer_tag="answer", max_attempts=1).step(Action("-28")).reward == 0.0


def test_the_entry_is_found_by_index_in_another_template_or_by_the_question():
    templated = Prompt("c:0", text="What is 15 - 43? Answer:", verifier=VerifierSpec("arithmetic", "-28"),
                       metadata={"source_index": 0})
    assert episode(templated, max_attempts=1).step(Action(" -28")).reward == 1.0
    assert episode(question(1), max_attempts=1).step(Action("3")).reward == 1.0  # by the question's text


@pytest.mark.parametrize("prompt, message", [
    (Prompt("c:0", text="What is 2 + 2?"), "is no question of dataset `chain_sum`"),
    (Prompt("c:0", text="What is 2 + 2?", verifier=VerifierSpec("arithmetic", "4"), metadata={"source_index": 0}),
     "is not entry 0 of dataset `chain_sum`"),
    (Prompt("c:0", text="x", metadata={"source_index": 99}), "source_index 99 is not an index"),
])
def test_a_prompt_from_other_data_is_refused(prompt, message):
    with pytest.raises(ValueError, match=message):
        episode(prompt)


@pytest.mark.parametrize("options, message", [
    ({"dataset": "chain_sun"}, "unknown dataset `chain_sun`; did you mean `chain_sum`"),
    ({"dataset": "chain_sum", "config": {"min_term": 2}}, "dataset `chain_sum` refuses config .*unexpected keyword"),
    ({"dataset": "chain_sum", "feedback": "wrong {answer}"}, "may use `{score}` and no other field"),
    ({"dataset": "chain_sum", "max_attempts": 0}, "max_attempts is 0"),
])
def test_validate_names_a_bad_dataset_or_config(options, message):
    with pytest.raises(ValueError, match=message):
        MultiTurn.Config.model_validate({"environment": {"use": "reasoning_gym", "with": options}})
