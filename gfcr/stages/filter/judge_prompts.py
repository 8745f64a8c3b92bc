"""What ``filter.judge`` asks and how it reads the answer: the prompt template and the score parsers.

Pure functions of strings (no engine, no torch), so ``gfcr validate`` checks a template and the
tests pin every hostile answer without a model.

The template is a ``str.format`` string over three placeholders: ``{response}`` (required: the
judged response), ``{prompt}`` (the prompt the policy answered) and ``{reference}`` (the
prompt's ground truth, from its ``VerifierSpec``). Literal braces are doubled (``{{``, ``}}``);
any other field (``{answer}``, ``{}``, ``{response!r}``, ``{response:10}``) is an error at
validate time, with the fix.

A parser reads the judge's answer (only its first ``max_output_chars`` characters, so a 10 MB
answer costs what a short one does) and gives a ``Judged``: a value in [0, 1], or None with the
reason no value could be read (the stage then writes its declared fallback):

- ``number``: the first number in the answer (``-?\\d+(\\.\\d+)?``, a leading ``+`` or ``-`` kept),
  mapped from ``range: [lo, hi]`` onto [0, 1]; outside the range, ``out_of_range: fallback`` (the
  default) reads no value, ``clip`` clips it into the range;
- ``yes_no``: the first whole word ``yes`` or ``no`` (any case) in the answer: 1 or 0.

Example:

>>> check_template("Question: {prompt}\\nAnswer: {response}\\nCorrect? yes or no:")
('prompt', 'response')
>>> NumberParse(range=(0, 10)).read("Score: 7/10")
Judged(value=0.7, reason='judge score 7 in [0, 10]')
>>> YesNoParse().read("I think... No.")
Judged(value=0.0, reason='judge said no')
"""

from __future__ import annotations

import math
import re
import string
from dataclasses import dataclass
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from gfcr.errors import did_you_mean
from gfcr.spec.problems import fixable

PLACEHOLDERS = ("prompt", "response", "reference")
REQUIRED = ("response",)
MAX_OUTPUT_CHARS = 2000
_NUMBER = re.compile(r"[-+]?\d+(?:\.\d+)?")
_YES_NO = re.compile(r"\b(yes|no)\b", re.IGNORECASE)


def check_template(template: str) -> tuple[str, ...]:
    """The placeholders ``template`` uses, sorted; a validator's error (``fixable``) saying what is wrong
    and the fix."""
    try:
        fields = [(name, conv, spec) for _, name, spec, conv in string.Formatter().parse(template) if name is not None]
    except ValueError as exc:  # a single `{` or `}`
        raise fixable(f"the judge's template does not parse as a format string ({exc})", "write a literal brace "
                      "as `{{` or `}}`, and placeholders as `{prompt}`, `{response}`, `{reference}`") from None
    used = set()
    for name, conv, spec in fields:
        if name not in PLACEHOLDERS:
            hint = (did_you_mean(name, PLACEHOLDERS) or "no placeholder is near it") if name else \
                "an empty `{}` names no placeholder"
            raise fixable(f"the judge's template has the placeholder `{{{name}}}`, which is not one of "
                          f"{', '.join(f'`{{{p}}}`' for p in PLACEHOLDERS)}",
                          f"{hint}; write a literal brace as `{{{{` or `}}}}`")
        if conv or spec:
            shown = (f"!{conv}" if conv else "") + (f":{spec}" if spec else "")
            raise fixable(f"the judge's template formats `{{{name}{shown}}}`",
                          f"write the bare placeholder `{{{name}}}`")
        used.add(name)
    missing = [p for p in REQUIRED if p not in used]
    if missing:
        raise fixable(f"the judge's template has no `{{{missing[0]}}}` placeholder, so the judge would never see "
                      "the response it scores", f"add `{{{missing[0]}}}` where the response goes")
    return tuple(sorted(used))


def render(template: str, prompt: str, response: str, reference: str | None) -> str:
    """The judge's prompt text (``check_template`` has passed; ``reference`` is needed only when used)."""
    return template.format(prompt=prompt, response=response, reference="" if reference is None else reference)


@dataclass(frozen=True, slots=True)
class Judged:
    """What a parser read: ``value`` in [0, 1], or None (no score: the stage's fallback applies)."""

    value: float | None
    reason: str


class ParseConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    max_output_chars: Annotated[int, Field(ge=1, le=1_000_000, description=(
        "the parser reads only the answer's first characters: a huge answer costs what a short one does"))] = (
        MAX_OUTPUT_CHARS)

    def head(self, output: str) -> str:
        return output[:self.max_output_chars]


def _shown(text: str, limit: int = 40) -> str:
    return repr(text if len(text) <= limit else text[:limit] + "...")


class NumberParse(ParseConfig):
    """The first number of the answer, mapped from ``range`` onto [0, 1]."""

    kind: Literal["number"] = "number"
    range: tuple[float, float] = Field(description="the scores the template asks for, [lo, hi]")
    out_of_range: Literal["fallback", "clip"] = Field(
        "fallback", description="a number outside `range`: `fallback` (no score) or `clip` it into the range")

    @field_validator("range")
    @classmethod
    def _ordered(cls, range_: tuple[float, float]) -> tuple[float, float]:
        lo, hi = range_
        if not lo < hi:
            raise fixable(f"`range: [{lo:g}, {hi:g}]` is empty", "write `[lo, hi]` with lo < hi, e.g. `[0, 10]`")
        return range_

    def read(self, output: str) -> Judged:
        head = self.head(output)
        if not head.strip():
            return Judged(None, "judge gave an empty answer")
        found = _NUMBER.search(head)
        if found is None:
            return Judged(None, f"no number in the judge's answer {_shown(head)}")
        score, (lo, hi) = float(found.group()), self.range
        if not math.isfinite(score):
            return Judged(None, f"the judge's number {found.group()[:20]} is not finite")
        where = f"[{lo:g}, {hi:g}]"
        if not lo <= score <= hi:
            if self.out_of_range == "fallback":
                return Judged(None, f"judge score {score:g} outside {where}")
            clipped = min(max(score, lo), hi)
            return Judged((clipped - lo) / (hi - lo), f"judge score {score:g} clipped to {clipped:g} in {where}")
        return Judged((score - lo) / (hi - lo), f"judge score {score:g} in {where}")


class YesNoParse(ParseConfig):
    """The first whole word ``yes`` or ``no``: 1 or 0."""

    kind: Literal["yes_no"] = "yes_no"

    def read(self, output: str) -> Judged:
        head = self.head(output)
        if not head.strip():
            return Judged(None, "judge gave an empty answer")
        found = _YES_NO.search(head)
        if found is None:
            return Judged(None, f"no yes or no in the judge's answer {_shown(head)}")
        word = found.group().lower()
        return Judged(1.0 if word == "yes" else 0.0, f"judge said {word}")


Parse = Annotated[NumberParse | YesNoParse, Field(discriminator="kind")]
