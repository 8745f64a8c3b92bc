"""The gsm8k verifier on the real GSM8K test set: every gold solution is scored correct
against its own answer, and wrong against another problem's answer unless the two answers
are the same number.

Measured (1319 problems): gold 1319/1319 correct; paired with problem i+1, 1304/1319
(98.86%) marked wrong, the other 15 pairs share their answer; with i+7, 1306/1319 (99.01%)
wrong, 13 share their answer. Among pairs whose answers differ, 100% are marked wrong.
"""

from __future__ import annotations

import json
from decimal import Decimal
from pathlib import Path

import pytest

from gfcr.stages.data.gsm8k import Gsm8kSource
from gfcr.stages.verifiers.gsm8k import verify_gsm8k

GSM8K_TEST = Path(__file__).resolve().parents[3] / ".." / "shared" / "data" / "gsm8k" / "test.jsonl"

pytestmark = pytest.mark.skipif(not GSM8K_TEST.is_file(), reason=f"the GSM8K test file is not at {GSM8K_TEST}")


@pytest.fixture(scope="module")
def problems() -> list[tuple[str, str]]:
    """(gold solution, ground truth) per problem, as the gsm8k data source extracts them."""
    pool = Gsm8kSource(Gsm8kSource.Config(path=str(GSM8K_TEST), split="test")).load()
    rows = [json.loads(line) for line in GSM8K_TEST.read_text(encoding="utf-8").splitlines()]
    assert len(pool) == len(rows) == 1319
    for prompt, row in zip(pool, rows):  # the source's ground truth is the #### number, commas removed
        assert prompt.verifier.ground_truth == row["answer"].split("####")[-1].strip().replace(",", "")
    return [(p.metadata["solution"], p.verifier.ground_truth) for p in pool]


def test_every_gold_solution_is_correct(problems):
    wrong = [i for i, (solution, truth) in enumerate(problems) if not verify_gsm8k(solution, truth, {}).correct]
    assert wrong == []
    assert all(verify_gsm8k(solution, truth, {}).formatted for solution, truth in problems)


@pytest.mark.parametrize("shift, same_answer", [(1, 15), (7, 13)])
def test_another_problems_solution_is_wrong_unless_the_answers_agree(problems, shift, same_answer):
    n = len(problems)
    verdicts = []
    for i, (_, truth) in enumerate(problems):
        other_solution, other_truth = problems[(i + shift) % n]
        agree = Decimal(truth) == Decimal(other_truth)
        verdicts.append((agree, verify_gsm8k(other_solution, truth, {}).correct))
    assert all(agree == correct for agree, correct in verdicts), "correct exactly when the answers agree"
    marked_wrong = sum(not correct for _, correct in verdicts) / n
    assert sum(agree for agree, _ in verdicts) == same_answer
    assert marked_wrong == pytest.approx(1 - same_answer / n) and marked_wrong > 0.988


@pytest.mark.parametrize("ending", ["The answer is ${n:,}.", "\\boxed{{{n}}}", "Answer: {n:,}.00 dollars",
                                    "So the final answer is {n}"])
def test_gold_reasoning_with_other_answer_formats_is_correct(problems, ending):
    """A model rarely writes ``#### N``; the same solutions ending in other common forms score correct."""
    for solution, truth in problems:
        reasoning = solution.rsplit("####", 1)[0]
        score = verify_gsm8k(reasoning + ending.format(n=int(truth)), truth, {})
        assert score.correct and score.formatted, (ending, truth, score)
