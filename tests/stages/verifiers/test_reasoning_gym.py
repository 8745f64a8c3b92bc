"""The reasoning_gym verifier against reasoning-gym's own scorers (issue 42, Must show 2): for each
task the shipped pipeline and benchmark use, 50 generated items across its difficulty bins; the
reference answer scores 1 (in each answer format) and a perturbed answer 0, as reasoning-gym's
``score_answer`` says; and the verifier runs in filter.verify's worker pool."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gfcr.records import VerifierSpec
from gfcr.stages.data.reasoning_gym import ReasoningGymSource
from gfcr.stages.verifiers.reasoning_gym import build_dataset, extract, freeze, verify_reasoning_gym
from gfcr.stages.verifiers.scoring import score_texts


def terms(n: int, digits: int) -> dict[str, int]:
    return {"min_terms": n, "max_terms": n, "min_digits": digits, "max_digits": digits}


PLAIN = {"operators": ["+", "-", "*"], "allow_parentheses": False, "allow_negation": False}
CHOSEN = {  # task -> its difficulty bins, as benchmarks/rg_pass_rates.py and the shipped pipeline use them
    "chain_sum": [terms(2, 1), terms(2, 2), terms(3, 1), terms(3, 2)],
    "products": [terms(2, 1), {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 2}, terms(2, 2)],
    "basic_arithmetic": [{**terms(2, 1), **PLAIN}, {**terms(2, 2), **PLAIN}, {**terms(3, 1), **PLAIN}],
    "leg_counting": [{"min_animals": 1, "max_animals": 1, "min_instances": 1, "max_instances": 3},
                     {"min_animals": 4, "max_animals": 4, "min_instances": 1, "max_instances": 5}],
    "gcd": [{"min_value": 1, "max_value": 20}, {"min_value": 1, "max_value": 100}],
}


def items(task: str, n: int = 50):
    levels = [{"name": f"l{i}", "config": c} for i, c in enumerate(CHOSEN[task])]
    return ReasoningGymSource(ReasoningGymSource.Config(n=n, seed=7, tasks=[{"task": task, "levels": levels}])).load()


def perturbed(answer: str) -> str:
    """Another integer (the chosen tasks' answers are integers): never contains the reference."""
    return str(int(answer) + 1)


@pytest.mark.parametrize("task", sorted(CHOSEN))
def test_the_reference_answer_scores_1_and_a_perturbed_one_0(task):
    pool = items(task)
    assert len(pool) == 50
    for prompt in pool:
        spec = prompt.verifier
        truth, options = spec.ground_truth, spec.options
        dataset = build_dataset(task, freeze(options["settings"]))
        entry = dataset[options["index"]]
        assert entry["answer"] == truth
        assert dataset.score_answer(truth, entry) == 1.0 and dataset.score_answer(perturbed(truth), entry) == 0.0
        for response in (f"<answer>{truth}</answer>", f"So the total is {truth}.\nAnswer: {truth}.", f" {truth}"):
            score = verify_reasoning_gym(response, truth, options)
            assert score.correct and score.formatted and score.answer == truth, (response, score)
            assert score.reason.startswith(f"{task}: score 1 ")
        wrong = verify_reasoning_gym(f"<answer>{perturbed(truth)}</answer>", truth, options)
        assert not wrong.correct and wrong.reason.startswith(f"{task}: score 0 "), wrong


def test_partial_credit_is_not_correct():
    prompt = items("chain_sum", 1)[0]
    truth = prompt.verifier.ground_truth
    score = verify_reasoning_gym(f"Answer: {truth}0000", truth, prompt.verifier.options)  # contains the oracle
    assert not score.correct and "score 0 " not in score.reason and "score 1 " not in score.reason


def test_extraction_rules():
    assert extract("think <answer>1</answer> then <answer> 42 </answer>") == ("42", True)
    assert extract("blah\nAnswer: 17.\nmore") == ("17", True)
    assert extract("7 * 2 = 14\nThe answer is 14.") == ("14", True)  # SmolLM2's way of putting it
    assert extract("4 * 2 = 8") == ("4 * 2 = 8", True)  # an equation is not the result asked for
    assert extract(" 59") == ("59", True)
    assert extract("no\nmarker 5") == ("no\nmarker 5", False)


def test_a_changed_item_is_an_error_not_a_silent_zero():
    prompt = items("gcd", 1)[0]
    with pytest.raises(ValueError, match="now has answer .* not the ground truth"):
        verify_reasoning_gym("1", prompt.verifier.ground_truth + "999", prompt.verifier.options)


def test_it_scores_in_filter_verifys_worker_pool():
    pool = items("leg_counting", 4)
    scored = score_texts([(f"Answer: {p.verifier.ground_truth}", p.verifier) for p in pool]
                         + [("Answer: -1", pool[0].verifier)], timeout_s=60.0, workers=1)
    assert [reward for reward, _ in scored] == [1.0, 1.0, 1.0, 1.0, 0.0]
    bad = score_texts([("1", VerifierSpec("reasoning_gym", "1", {"task": "gcd"}))], timeout_s=60.0, workers=1)
    assert bad[0][0] == 0.0 and "bad options" in bad[0][1].reason


CASES = Path(__file__).parent / "cases" / "reasoning_gym_0.1.25.json"


def test_the_pinned_cases_of_reasoning_gym_0_1_25_still_hold():
    """Fidelity and drift: 100 items (20 a task) and four answers each, scored by reasoning-gym 0.1.25's own
    score_answer when the file was written; the installed version must give the same items and scores, and
    the verifier calls exactly the score-1 answers correct."""
    cases = json.loads(CASES.read_text())["cases"]
    assert len(cases) == 100
    for case in cases:
        dataset = build_dataset(case["task"], freeze(case["settings"]))
        entry = dataset[case["index"]]
        assert (entry["question"], entry["answer"]) == (case["question"], case["answer"])
        options = {"task": case["task"], "settings": case["settings"], "index": case["index"]}
        for answer, score in case["scores"].items():
            assert dataset.score_answer(answer, entry) == pytest.approx(score)
            assert verify_reasoning_gym(f"<answer>{answer}</answer>", case["answer"], options).correct == (score == 1.0)
