"""The ``math`` verifier: mathematical equivalence with Hugging Face's ``math-verify``.

The ground truth (LaTeX or a plain expression: ``\\frac{1}{2}``, ``0.5``, ``x^2+1``) and the
response are parsed by ``math_verify.parse`` (the response's answer is found in
``\\boxed{}``, after "final answer is", or as the last expression) and compared with
``math_verify.verify`` (numeric, symbolic, sets, intervals, matrices). ``formatted`` says
the response marks its answer (``\\boxed{}``, ``Answer:``, "answer is").

Timeouts: math-verify guards its parsing and comparison with ``signal.alarm``, which works
only in the main thread, and only between Python bytecodes. Its own timeouts (``timeout_s``
option, default 5 s) are used in the main thread and switched off elsewhere. ``filter.verify``
runs verifiers in the main thread of worker processes, so they are on there; but sympy can
hold the GIL inside one C call for minutes (``\\boxed{9^{9^{9^{9}}}}``), where no alarm fires,
so the bound that always holds is ``filter.verify``'s ``timeout_s``, enforced by killing the
worker process (``gfcr.stages.verifiers.pool``).

Deviations from ``math_verify``'s defaults: a ground truth without ``$`` delimiters is
wrapped in ``$...$`` before parsing (so ``\\sqrt{2}`` parses as LaTeX), and so is the rest
of the line after the response's last answer marker when math-verify finds no answer in
the response as written (``Answer: x^2+1`` has no LaTeX delimiters); math-verify's
one-time "timeout is disabled" warning is silenced, since the caller bounds the time.

>>> verify_math("So the result is \\\\boxed{\\\\frac{1}{2}}.", "0.5", {}).correct
True
"""

from __future__ import annotations

import functools
import logging
import re
import threading
from typing import Any

from pydantic import Field

from gfcr.stages.verifiers.base import Score, VerifierOptions, parse_options

MARKER = re.compile(r"\\boxed\s*\{|\\fbox\s*\{|\banswer\s*(?::|is\b)", re.IGNORECASE)


class MathOptions(VerifierOptions):
    timeout_s: int = Field(5, description="math-verify's own timeout, seconds (main thread only)")


@functools.cache
def _silence_timeout_warning() -> None:
    def keep(record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("Timeout is disabled")

    for name in ("math_verify.parser", "math_verify.grader"):
        logging.getLogger(name).addFilter(keep)


def _parse_ground_truth(ground_truth: str, limit: int | None) -> list:
    from math_verify import parse

    text = ground_truth.strip()
    parsed = parse(f"${text}$" if "$" not in text and "\\boxed" not in text else text, parsing_timeout=limit)
    parsed = parsed or parse(text, parsing_timeout=limit)
    if not parsed:
        raise ValueError(f"math-verify cannot parse the ground truth {ground_truth!r}; "
                         "write it as LaTeX (`\\frac{1}{2}`) or a plain expression (`1/2`)")
    return parsed


def _shown(parsed: list) -> str:
    """math-verify returns [sympy value, matched string]; show the string the response wrote."""
    return next((p for p in parsed if isinstance(p, str)), str(parsed[0]))


def verify_math(response: str, ground_truth: str, options: dict[str, Any]) -> Score:
    opts = parse_options(MathOptions, options, "math")
    from math_verify import parse, verify

    _silence_timeout_warning()
    limit = opts.timeout_s if threading.current_thread() is threading.main_thread() else None
    gold = _parse_ground_truth(ground_truth, limit)
    markers = list(MARKER.finditer(response))
    predicted = parse(response, parsing_timeout=limit) if response.strip() else []
    if not predicted and markers:  # "Answer: x^2+1" has no LaTeX delimiters for math-verify
        line = response[markers[-1].end():].strip().split("\n")[0].strip().rstrip(".")
        predicted = parse(f"${line}$", parsing_timeout=limit) if line else []
    if not predicted:
        return Score(False, False, None, "no answer found")
    correct = bool(verify(gold, predicted, timeout_seconds=limit))
    answer = _shown(predicted)
    return Score(correct, bool(markers), answer, f"answer {answer} {'==' if correct else '!='} {ground_truth.strip()}")


def _import_math_verify() -> None:
    import math_verify  # noqa: F401  (math-verify and sympy take about a second to import)


verify_math.prepare = _import_math_verify  # type: ignore[attr-defined]  # run once by filter.verify, untimed
