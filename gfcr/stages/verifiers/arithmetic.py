"""The ``arithmetic`` verifier: integer answers, scored exactly as the project's peer baseline.

Rule (``../shared/peers/trl_cpu/arith_task.py``): take the text after the LAST ``Answer:``
(case-insensitive) and parse the FIRST integer in it (optional minus, thousands commas
removed); when the response has no ``Answer:``, use the LAST integer anywhere. Correct iff
it equals the integer ground truth.

``formatted`` is true when an ``Answer:`` tag is present, or when the whole stripped
response is one integer (a completion of a prompt that already ends in ``Answer:``, such
as `` 59``).

Deviations from the baseline: none in what counts as correct; the baseline has no
``formatted`` signal.

>>> verify_arithmetic("12 + 47 = 59. Answer: 59", "59", {})
Score(correct=True, formatted=True, answer='59', reason='answer 59 == 59')
>>> verify_arithmetic(" 58", "59", {}).reason
'answer 58 != 59'
"""

from __future__ import annotations

import re
from typing import Any

from gfcr.stages.verifiers.base import Score, VerifierOptions, parse_options

INTEGER = re.compile(r"-?\d[\d,]*")
ANSWER_TAG = re.compile(r"answer\s*:", re.IGNORECASE)


def _to_int(token: str) -> int:
    return int(token.replace(",", ""))  # INTEGER always holds a digit, so this parses


def extract_integer(text: str) -> tuple[int | None, bool]:
    """(the answer, whether it was formatted) by the baseline's rule."""
    tags = list(ANSWER_TAG.finditer(text))
    if tags:
        match = INTEGER.search(text, tags[-1].end())
        return (_to_int(match.group()) if match else None), True
    integers = INTEGER.findall(text)
    value = _to_int(integers[-1]) if integers else None
    return value, INTEGER.fullmatch(text.strip()) is not None


def parse_ground_truth(ground_truth: str) -> int:
    try:
        return int(ground_truth.strip().replace(",", ""))
    except ValueError:
        raise ValueError(f"the arithmetic verifier needs an integer ground truth, got {ground_truth!r}; "
                         "use the `gsm8k` or `math` verifier for other answers") from None


class ArithmeticOptions(VerifierOptions):
    """The arithmetic verifier takes no options."""


def verify_arithmetic(response: str, ground_truth: str, options: dict[str, Any]) -> Score:
    parse_options(ArithmeticOptions, options, "arithmetic")
    truth = parse_ground_truth(ground_truth)
    value, formatted = extract_integer(response)
    if value is None:
        reason = "no integer after the last `Answer:`" if formatted else "no answer found"
        return Score(False, formatted, None, reason)
    relation = "==" if value == truth else "!="
    return Score(value == truth, formatted, str(value), f"answer {value} {relation} {truth}")
