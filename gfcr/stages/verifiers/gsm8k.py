"""The ``gsm8k`` verifier: a numeric final answer, compared with GSM8K's ``#### N``.

The ground truth is the number after ``####`` in GSM8K's solution (the data source passes
it with commas removed). From the response, the answer is the first number after the LAST
answer marker that is followed by one: ``#### N``, ``\\boxed{N}``, ``Answer: N`` or
``... answer is N`` (case-insensitive); with no such marker, the last number in the text.
``formatted`` says a marker gave the answer.

Numbers may carry thousands commas (``1,234``), a currency sign (``$18``, ``-$5``), units
or a percent sign after them (``18 dollars``, ``18%``), a sentence's full stop (``18.``),
and decimals (``18.00`` counts as 18); ``\\boxed{\\frac{a}{b}}`` is read as ``a/b``. Two
integers compare exactly; otherwise within ``rel_tol`` (default 1e-6) relative tolerance.

Deviations: lm-evaluation-harness's GSM8K task has two filters, ``strict-match`` (only
``#### N``) and ``flexible-extract`` (the last number); this verifier is one rule between
them: markers first, then the last number (verl's ``utils/reward_score/gsm8k.py`` has the
same two modes, ``strict`` and ``flexible``, and likewise lets you pick only one).

>>> verify_gsm8k("She makes 9 * 2 = $18 a day.\\n#### 18", "18", {})
Score(correct=True, formatted=True, answer='18', reason='answer 18 == 18')
>>> verify_gsm8k("So she earns 1,234.00 dollars.", "1234", {}).correct
True
"""

from __future__ import annotations

import math
import re
from decimal import Decimal, InvalidOperation
from typing import Any

from gfcr.stages.verifiers.base import Score, VerifierOptions, parse_options

# a number not glued to a word or a decimal point before it; thousands groups only when
# well-formed ("1,234" is one number, "1,2" two); a trailing full stop is not a decimal point
NUMBER = re.compile(
    r"(?<![\w.])(?P<sign>[-\u2212])?\$?(?P<digits>\d{1,3}(?:,\d{3})+(?:\.\d+)?(?!\d)|\d+(?:\.\d+)?)"
)
MARKER = re.compile(r"####|\\boxed\s*\{|\\fbox\s*\{|\banswer\s*(?::|is\b)", re.IGNORECASE)
FRACTION = re.compile(r"^\s*(-)?\s*\\[dt]?frac\s*\{\s*(-?\d+)\s*\}\s*\{\s*(-?\d+)\s*\}")


def _number(match: re.Match[str]) -> Decimal:
    value = Decimal(match["digits"].replace(",", ""))
    return -value if match["sign"] else value


def _braced(text: str, start: int) -> str:
    """The text from ``start`` up to the brace that closes the one just before it."""
    depth = 1
    for i in range(start, len(text)):
        depth += {"{": 1, "}": -1}.get(text[i], 0)
        if depth == 0:
            return text[start:i]
    return text[start:]


def _after_marker(text: str, marker: re.Match[str]) -> Decimal | None:
    if marker.group().endswith("{"):  # \boxed{...}: read inside the braces only
        content = _braced(text, marker.end())
        fraction = FRACTION.match(content)
        if fraction and int(fraction[3]) != 0:
            value = Decimal(int(fraction[2])) / Decimal(int(fraction[3]))
            return -value if fraction[1] else value
        found = NUMBER.search(content)
    else:
        found = NUMBER.search(text, marker.end())
    return _number(found) if found else None


def extract_number(text: str) -> tuple[Decimal | None, bool]:
    """(the answer, whether an answer marker gave it)."""
    for marker in reversed(list(MARKER.finditer(text))):
        value = _after_marker(text, marker)
        if value is not None:
            return value, True
    numbers = list(NUMBER.finditer(text))
    return (_number(numbers[-1]) if numbers else None), False


def parse_ground_truth(ground_truth: str) -> Decimal:
    try:
        value = Decimal(ground_truth.strip().replace(",", "").removeprefix("$"))
    except InvalidOperation:
        raise ValueError(f"the gsm8k verifier needs a number as ground truth, got {ground_truth!r}; "
                         "pass the number after `####` (the `gsm8k` data source does)") from None
    if not value.is_finite():
        raise ValueError(f"the gsm8k verifier needs a finite number as ground truth, got {ground_truth!r}")
    return value


def show(value: Decimal) -> str:
    """``18`` for 18.00, ``0.5`` for 0.50."""
    if value == value.to_integral_value():
        return str(int(value))
    return format(value.normalize(), "f")


def same_number(a: Decimal, b: Decimal, rel_tol: float) -> bool:
    if a == a.to_integral_value() and b == b.to_integral_value():
        return a == b  # exact, also for integers too large for a float
    return math.isclose(float(a), float(b), rel_tol=rel_tol, abs_tol=0.0)


class Gsm8kOptions(VerifierOptions):
    rel_tol: float = 1e-6


def verify_gsm8k(response: str, ground_truth: str, options: dict[str, Any]) -> Score:
    opts = parse_options(Gsm8kOptions, options, "gsm8k")
    truth = parse_ground_truth(ground_truth)
    value, formatted = extract_number(response)
    if value is None:
        return Score(False, False, None, "no answer found")
    correct = same_number(value, truth, opts.rel_tol)
    return Score(correct, formatted, show(value), f"answer {show(value)} {'==' if correct else '!='} {show(truth)}")
