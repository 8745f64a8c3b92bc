"""The built-in verifiers: answer extraction edge cases and the registry."""

from __future__ import annotations

import threading

import pytest

from gfcr.stages.verifiers import BUILTIN_VERIFIERS, VERIFIERS, Score, check_verifier_name
from gfcr.stages.verifiers.arithmetic import verify_arithmetic
from gfcr.stages.verifiers.gsm8k import verify_gsm8k
from gfcr.stages.verifiers.math_equiv import verify_math


def test_the_builtins_are_registered_lazily_and_typos_get_a_suggestion():
    assert set(BUILTIN_VERIFIERS) <= set(VERIFIERS.names())
    assert VERIFIERS.get("gsm8k") is verify_gsm8k
    with pytest.raises(ValueError, match=r"unknown verifier `gms8k`; did you mean `gsm8k`\?"):
        check_verifier_name("gms8k")
    with pytest.raises(ValueError, match="known verifiers: `arithmetic`"):
        check_verifier_name("zzzzzz")


# (response, ground truth, correct, formatted, answer) -- the peer baseline's own cases first
ARITHMETIC = [
    ("Answer: 85", "85", True, True, "85"),
    ("37+48=85. Answer: 85. Check 85-48=37", "85", True, True, "85"),
    ("The result is 12", "12", True, False, "12"),
    ("Answer: -3", "-3", True, True, "-3"),
    ("answer: 1,024", "1024", True, True, "1024"),
    ("Answer: 84", "85", False, True, "84"),
    ("no number", "1", False, False, None),
    ("Answer: is ... 7 Answer: 8", "8", True, True, "8"),
    (" 59", "59", True, True, "59"),  # completion of a prompt ending in "Answer:"
    ("-7\n", "-7", True, True, "-7"),
    ("59 apples", "59", True, False, "59"),
    ("ANSWER : 7 (I think)", "7", True, True, "7"),
    ("Answer: 3 and then 4", "4", False, True, "3"),  # the first integer after the tag
    ("I got 3, then 13", "13", True, False, "13"),  # no tag: the last integer
    ("Answer: none", "1", False, True, None),
    ("", "1", False, False, None),
]


@pytest.mark.parametrize("response, truth, correct, formatted, answer", ARITHMETIC)
def test_arithmetic_extraction(response, truth, correct, formatted, answer):
    score = verify_arithmetic(response, truth, {})
    assert (score.correct, score.formatted, score.answer) == (correct, formatted, answer)


def test_arithmetic_reasons_and_bad_inputs():
    assert verify_arithmetic("Answer: 58", "59", {}).reason == "answer 58 != 59"
    assert verify_arithmetic("nothing", "59", {}).reason == "no answer found"
    assert verify_arithmetic("Answer: ?", "59", {}).reason == "no integer after the last `Answer:`"
    with pytest.raises(ValueError, match="needs an integer ground truth, got '1.5'"):
        verify_arithmetic("1", "1.5", {})
    with pytest.raises(ValueError, match="verifier `arithmetic`: bad options .* accepts are none"):
        verify_arithmetic("1", "1", {"strict": True})


GSM8K = [
    ("#### 18", "18", True, True, "18"),
    ("Answer: 18", "18", True, True, "18"),
    ("So the total is \\boxed{18}.", "18", True, True, "18"),
    ("Therefore, the answer is 18.", "18", True, True, "18"),
    ("The final answer is $18", "18", True, True, "18"),
    ("She makes $18 every day", "18", True, False, "18"),
    ("18 dollars", "18", True, False, "18"),
    ("It grew by 18%.", "18", True, False, "18"),
    ("That is 18.0", "18", True, False, "18"),
    ("That is 18.00 dollars.", "18", True, False, "18"),
    ("The house costs 1,234,000 dollars", "1234000", True, False, "1234000"),
    ("Answer: $1,234.50 in total", "1234.5", True, True, "1234.5"),
    ("The temperature fell to -5 degrees", "-5", True, False, "-5"),
    ("The temperature fell to \u22125", "-5", True, False, "-5"),
    ("It lost -$5", "-5", True, False, "-5"),
    ("16-3-4=9 eggs", "9", True, False, "9"),  # subtraction signs are not negative numbers
    ("The answer is 18. Check: 9 * 2 = 18 and 20 - 2 = 18, 7 left", "18", True, True, "18"),
    ("Answer: 5\n#### 18", "18", True, True, "18"),  # the last marker wins
    ("#### 18\nAnswer: 5", "18", False, True, "5"),
    ("#### 18\nso the answer is unclear", "18", True, True, "18"),  # a marker with no number is passed over
    ("First 3, then 4, so 18 in all", "18", True, False, "18"),  # no marker: the last number
    ("\\boxed{\\frac{36}{2}}", "18", True, True, "18"),
    ("\\boxed{\\dfrac{3}{4}}", "0.75", True, True, "0.75"),
    ("\\boxed{1,234}", "1234", True, True, "1234"),
    ("1/3 is about 0.33333333", "0.3333333333", True, False, "0.33333333"),  # within 1e-6 relative
    ("about 0.33", "0.3333333333", False, False, "0.33"),
    ("123456789012345678901", "123456789012345678902", False, False, "123456789012345678901"),  # exact ints
    ("1,2 and 3", "3", True, False, "3"),  # "1,2" is not a thousands group
    ("There is no number here.", "18", False, False, None),
    ("", "18", False, False, None),
]


@pytest.mark.parametrize("response, truth, correct, formatted, answer", GSM8K)
def test_gsm8k_extraction(response, truth, correct, formatted, answer):
    score = verify_gsm8k(response, truth, {})
    assert (score.correct, score.formatted, score.answer) == (correct, formatted, answer)


def test_gsm8k_reasons_options_and_bad_ground_truth():
    assert verify_gsm8k("Answer: 18.00", "18", {}) == Score(True, True, "18", "answer 18 == 18")
    assert verify_gsm8k("", "18", {}).reason == "no answer found"
    assert verify_gsm8k("Answer: 19", "18.5", {"rel_tol": 0.1}).correct
    assert verify_gsm8k("Answer: 1,234", "1,234", {}).correct  # commas in the ground truth are tolerated
    with pytest.raises(ValueError, match="needs a number as ground truth, got 'eighteen'"):
        verify_gsm8k("18", "eighteen", {})
    with pytest.raises(ValueError, match="accepts are `rel_tol`"):
        verify_gsm8k("18", "18", {"tolerance": 0.1})


def test_gsm8k_compares_numbers_past_int_and_float_limits_exactly():
    big = "9" * 5000  # beyond Python's 4,300-digit int() limit
    assert verify_gsm8k(f"Answer: {big}", big, {}).correct
    assert not verify_gsm8k(f"Answer: {big[:-1]}8", big, {}).correct  # an integer off by one is wrong, exactly
    huge = "1" + "0" * 400  # 1e400: a float would be inf for both, and equal
    assert not verify_gsm8k(f"Answer: {huge}1", huge + "0", {}).correct
    assert verify_gsm8k(f"Answer: {huge}", huge, {}).correct
    assert verify_gsm8k("Answer: 1000000.5", "1000000.50000001", {}).correct  # rel_tol 1e-6 on decimals
    score = verify_gsm8k(f"Answer: {big}", "7", {})
    assert not score.correct and len(score.reason) < 200  # the reason shows the number cut short


MATH = [
    ("So the result is \\boxed{\\frac{1}{2}}.", "0.5", True, True),
    ("The probability is $0.5$.", "\\frac{1}{2}", True, False),
    ("Answer: x^2+1", "1+x^2", True, True),
    ("the answer is \\sqrt{2}.", "\\sqrt{2}", True, True),
    ("\\boxed{3}", "4", False, True),
    ("no answer at all", "4", False, False),
    ("", "4", False, False),
]


@pytest.mark.parametrize("response, truth, correct, formatted", MATH)
def test_math_equivalence(response, truth, correct, formatted):
    score = verify_math(response, truth, {})
    assert (score.correct, score.formatted) == (correct, formatted), score


def test_math_runs_off_the_main_thread_and_rejects_an_unparsable_ground_truth():
    scores: list = []
    worker = threading.Thread(target=lambda: scores.append(verify_math("\\boxed{0.5}", "\\frac{1}{2}", {})))
    worker.start()
    worker.join(30)
    assert scores and scores[0].correct  # math-verify's signal timeouts would raise here
    with pytest.raises(ValueError, match="cannot parse the ground truth"):
        verify_math("1", "", {})


@pytest.mark.parametrize("module", ["arithmetic", "gsm8k", "math_equiv", "reasoning_gym"])
def test_docstring_examples_run(module):
    import doctest
    import importlib

    result = doctest.testmod(importlib.import_module(f"gfcr.stages.verifiers.{module}"))
    assert result.attempted > 0 and result.failed == 0
