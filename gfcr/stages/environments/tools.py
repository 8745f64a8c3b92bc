"""Tool-call parsers (a ``generate.multi_turn`` stage declares one with ``tool_parser``) and the
calculator tool.

A parser reads a model turn's decoded text and returns the ``ToolCall`` in it, or None when the
turn calls no tool (then it is an answer). Parsers are pure functions of the text, so a turn's
tool call is a fact of the record (``Turn.tool_call``), not of the environment's state.

``calc``: a turn that ends with ``?`` calls the calculator on the text before it (stripped, from
after the last ``Answer:``), e.g. ``" 12 + 30?"`` -> ``calc(expression="12 + 30")``. The syntax
keeps to the characters of the ``tiny-arith`` tokenizer (digits, ``+ - *``, space, ``?``,
``:`` and a few letters), so a tiny policy can write it.
"""

from __future__ import annotations

import re
from typing import Callable

from gfcr.stages.environments.base import ToolCall

Parser = Callable[[str], ToolCall | None]
EXPRESSION = re.compile(r"^\s*(-?\d{1,12})\s*([+\-*])\s*(-?\d{1,12})\s*$")


def parse_calc(text: str) -> ToolCall | None:
    """``<expression>?`` at the end of the turn is a calculator call (see the module docstring)."""
    stripped = text.rstrip()
    if not stripped.endswith("?"):
        return None
    body = stripped[:-1].rsplit("Answer:", 1)[-1]
    return ToolCall("calc", {"expression": body.strip()})


def calculate(expression: str) -> int | None:
    """``a op b`` for integers of at most 12 digits and ``op`` in ``+ - *``; None for anything else
    (never ``eval``: the expression is the model's text)."""
    m = EXPRESSION.match(expression)
    if m is None:
        return None
    a, op, b = int(m.group(1)), m.group(2), int(m.group(3))
    return a + b if op == "+" else a - b if op == "-" else a * b


TOOL_PARSERS: dict[str, Parser] = {"calc": parse_calc}
