"""The ``gsm8k`` verifier: a numeric final answer, compared with GSM8K's ``#### N``.

The ground truth is the number after ``####`` in GSM8K's solution (the data source passes
it with commas removed). From the response, the answer is the first number after the LAST
answer marker that is followed by one: ``#### N``, ``\\boxed{N}``, ``Answer: N`` or
``... answer is N`` (case-insensitive); with no such marker, the last number in the text.
``formatted`` says a marker gave the answer.

Numbers may carry thousands commas (``1,234``), a currency sign (``$18``, ``-$5``), units
or a percent sign after them (``18 dollars``, ``18%``), a sentence's full stop (``18.``),
and decimals (``18.00`` counts as 18); ``\\boxed{\\frac{a}{b}}`` is read as ``a/b``. Two
integers compare exactly; otherwise within ``rel_tol`` (default 1e-6) relative tolerance,
computed in decimal arithmetic (exact at any size: no float, so no overflow to inf). The
answer is found in time linear in the response's length (see ``extract_number``).

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

import bisect
import re
from decimal import MAX_EMAX, MIN_EMIN, Context, Decimal, InvalidOperation, localcontext
from typing import Any

from pydantic import Field

from gfcr.stages.verifiers.base import Score, VerifierOptions, parse_options

# a number not glued to a word or a decimal point before it; thousands groups only when
# well-formed ("1,234" is one number, "1,2" two); a trailing full stop is not a decimal point
NUMBER = re.compile(
    r"(?<![\w.])(?P<sign>[-\u2212])?\$?(?P<digits>\d{1,3}(?:,\d{3})+(?:\.\d+)?(?!\d)|\d+(?:\.\d+)?)"
)
BRACE = re.compile(r"[{}]")
MARKER = re.compile(r"####|\\boxed\s*\{|\\fbox\s*\{|\banswer\s*(?::|is\b)", re.IGNORECASE)
FRACTION = re.compile(r"\s*(-)?\s*\\[dt]?frac\s*\{\s*(-?\d+)\s*\}\s*\{\s*(-?\d+)\s*\}")  # used with match()
# decimal arithmetic at any size: 28 significant digits (the default), no overflow to inf
EXACT = Context(prec=28, Emax=MAX_EMAX, Emin=MIN_EMIN)


def _number(match: re.Match[str]) -> Decimal:
    value = Decimal(match["digits"].replace(",", ""))  # exact at any length: no int(), no float()
    return -value if match["sign"] else value


def _closing_braces(text: str) -> dict[int, int]:
    """For each ``{`` at index i, the index of the ``}`` that closes it (len(text) if none),
    in one pass over the text."""
    closes, stack = {}, []
    for brace in BRACE.finditer(text):
        i = brace.start()
        if brace.group() == "{":
            stack.append(i)
        elif stack:
            closes[stack.pop()] = i
    for i in stack:
        closes[i] = len(text)
    return closes


def _first_number(numbers: list[re.Match[str]], starts: list[int], start: int, end: int) -> re.Match[str] | None:
    """The first of ``numbers`` (sorted by start) that starts in [start, end) and ends by ``end``."""
    i = bisect.bisect_left(starts, start)
    while i < len(numbers) and numbers[i].start() < end:
        if numbers[i].end() <= end:
            return numbers[i]
        i += 1
    return None


def extract_number(text: str) -> tuple[Decimal | None, bool]:
    """(the answer, whether an answer marker gave it), in time linear in the text: the numbers,
    the markers and the braces are each found in one pass, and each marker looks its number
    up by bisection (a response of 100,000 repeated markers with no number costs one pass,
    not one scan of the rest of the text per marker)."""
    numbers = list(NUMBER.finditer(text))
    starts = [m.start() for m in numbers]
    closes: dict[int, int] | None = None
    for marker in reversed(list(MARKER.finditer(text))):
        if marker.group().endswith("{"):  # \boxed{...}: read inside the braces only
            closes = _closing_braces(text) if closes is None else closes
            end = closes[marker.end() - 1]
            fraction = FRACTION.match(text, marker.end(), end)
            if fraction and Decimal(fraction[3]) != 0:
                with localcontext(EXACT):
                    value = Decimal(fraction[2]) / Decimal(fraction[3])
                return (-value if fraction[1] else value), True
            found = _first_number(numbers, starts, marker.end(), end)
        else:
            found = _first_number(numbers, starts, marker.end(), len(text))
        if found is not None:
            return _number(found), True
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


def show(value: Decimal, limit: int = 40) -> str:
    """``18`` for 18.00, ``0.5`` for 0.50; a number of more than ``limit`` characters is shown
    by its ends and its length (``12345678901234567890...1234567890 (5000 digits)``). Made
    from the decimal's own digits: no ``int()`` (whose string conversion stops at 4,300
    digits) and no rounding to the context's precision."""
    text = format(value, "f")
    if "." in text:
        text = text.rstrip("0").rstrip(".")
    if text in ("-0", ""):
        text = "0"
    if len(text) > limit:
        digits = len(text.lstrip("-").replace(".", ""))
        return f"{text[:20]}...{text[-10:]} ({digits} digits)"
    return text


def same_number(a: Decimal, b: Decimal, rel_tol: float) -> bool:
    """Equal integers exactly; otherwise ``|a - b| <= rel_tol * max(|a|, |b|)`` in decimal
    arithmetic (no float: two different numbers above 1e308 would both be inf)."""
    if a == b:
        return True
    with localcontext(EXACT):
        if a == a.to_integral_value() and b == b.to_integral_value():
            return False  # exact, also for integers too large for a float
        return abs(a - b) <= Decimal(rel_tol) * max(abs(a), abs(b))


class Gsm8kOptions(VerifierOptions):
    rel_tol: float = Field(1e-6, description="relative tolerance when comparing two numbers")


def verify_gsm8k(response: str, ground_truth: str, options: dict[str, Any]) -> Score:
    opts = parse_options(Gsm8kOptions, options, "gsm8k")
    truth = parse_ground_truth(ground_truth)
    value, formatted = extract_number(response)
    if value is None:
        return Score(False, False, None, "no answer found")
    correct = same_number(value, truth, opts.rel_tol)
    return Score(correct, formatted, show(value), f"answer {show(value)} {'==' if correct else '!='} {show(truth)}")
