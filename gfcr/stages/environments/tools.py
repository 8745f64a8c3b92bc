"""Tool-call parsers (a ``generate.multi_turn`` stage declares one with ``tool_parser``) and the
calculator tool.

A parser reads a model turn's decoded text and returns the ``ToolCall`` in it, or None when the
turn calls no tool (then it is an answer). Parsers are pure functions of the text, so a turn's
tool call is a fact of the record (``Turn.tool_call``), not of the environment's state.

``calc``: a turn that ends with ``?`` calls the calculator on the text before it (stripped, from
after the last ``Answer:``), e.g. ``" 12 + 30?"`` -> ``calc(expression="12 + 30")``. The syntax
keeps to the characters of the ``tiny-arith`` tokenizer (digits, ``+ - *``, space, ``?``,
``:`` and a few letters), so a tiny policy can write it.

``hermes``: the tool-call format of Hermes and Qwen chat templates (and of verl's and
verifiers' tool environments): a JSON object inside ``<tool_call>...</tool_call>``,
``<tool_call>{"name": "python", "arguments": {"code": "print(6 * 7)"}}</tool_call>``. The first
such block is the call (a missing closing tag is forgiven: a stop string may have cut it);
``arguments`` may be an object or a JSON string of one. A block that is not such JSON is still a
call, named ``invalid``, with the reason in ``arguments["error"]``, so the environment can say
what was wrong instead of taking the turn as an answer.
"""

from __future__ import annotations

import json
import re
from typing import Any, Callable

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


HERMES = re.compile(r"<tool_call>(.*?)(?:</tool_call>|\Z)", re.DOTALL)
INVALID = "invalid"


def parse_hermes(text: str) -> ToolCall | None:
    """The first ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` of the turn (see the module docstring)."""
    m = HERMES.search(text)
    if m is None:
        return None
    try:
        call = json.loads(m.group(1))
        name, arguments = call["name"], call.get("arguments", {})
        if isinstance(arguments, str):
            arguments = json.loads(arguments)
        if not isinstance(name, str) or not isinstance(arguments, dict):
            raise TypeError("`name` must be a string and `arguments` an object")
    except (ValueError, TypeError, KeyError, AttributeError) as exc:
        why = f"missing {exc}" if isinstance(exc, KeyError) else str(exc)
        shape = '{"name": ..., "arguments": {...}}'
        return ToolCall(INVALID, {"error": f"not a tool call of the form {shape}: {why}"})
    return ToolCall(name, _plain(arguments))


def _plain(arguments: dict[str, Any]) -> dict[str, Any]:
    return {str(k): v for k, v in arguments.items()}


TOOL_PARSERS: dict[str, Parser] = {"calc": parse_calc, "hermes": parse_hermes}
