"""Reference cases computed by the authors' own code, and the one check every fidelity test makes.

Each ``tests/fidelity/<method>.json`` names the ``repository``, ``commit``, ``file`` and
``function`` its cases came from, the gfcr ``stage`` they test, and a ``cases`` list (an
``id``, the ``input`` and the reference's ``expected`` output). The cases were produced by
running the authors' functions in a scratch folder outside this repository (see
``docs/fidelity.md``); none of their source is here.

A case gfcr deliberately computes differently is listed under ``deviations`` with the
``reason`` and the output gfcr gives (``gfcr``): its test asserts that gfcr still differs from
the reference *and* gives exactly that output, so a deviation cannot hide a regression and
the counts in ``docs/fidelity.md`` stay honest.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REL, ABS = 1e-6, 1e-9


def method_files() -> list[Path]:
    return sorted(HERE.glob("*.json"))


def load(method: str) -> dict[str, Any]:
    return json.loads((HERE / f"{method}.json").read_text())


def cases(method: str) -> list[dict[str, Any]]:
    """The method's cases, for ``pytest.mark.parametrize`` (ids via ``case_ids``)."""
    return load(method)["cases"]


def case_ids(method: str) -> list[str]:
    return [c["id"] for c in cases(method)]


def deviations(method: str) -> dict[str, dict[str, Any]]:
    return {d["case"]: d for d in load(method).get("deviations", [])}


def close(actual: Any, expected: Any, rel: float = REL, abs_: float = ABS) -> bool:
    """Equal up to float rounding (relative 1e-6 by default), recursively through lists and dicts."""
    if isinstance(expected, dict):
        return isinstance(actual, dict) and actual.keys() == expected.keys() and all(
            close(actual[k], expected[k], rel, abs_) for k in expected)
    if isinstance(expected, (list, tuple)):
        return isinstance(actual, (list, tuple)) and len(actual) == len(expected) and all(
            close(a, e, rel, abs_) for a, e in zip(actual, expected))
    if isinstance(expected, bool) or expected is None or isinstance(expected, str):
        return actual == expected
    if isinstance(expected, (int, float)):
        if isinstance(actual, bool) or not isinstance(actual, (int, float)):
            return False
        if math.isinf(expected) or math.isnan(expected):
            return actual == expected or (math.isnan(expected) and math.isnan(actual))
        return math.isclose(actual, expected, rel_tol=rel, abs_tol=abs_)
    return actual == expected


def check(method: str, case: dict[str, Any], run: Callable[[dict[str, Any]], Any]) -> None:
    """gfcr's output for ``case`` equals the reference's, or the listed deviation's output (within
    the file's ``tolerance``, ``{"rel", "abs"}``, where the reference computes in float32)."""
    actual = run(case["input"])
    tol = load(method).get("tolerance", {"rel": REL, "abs": ABS})
    deviation = deviations(method).get(case["id"])
    if deviation is None:
        assert close(actual, case["expected"], tol["rel"], tol["abs"]), (
            f"{method}/{case['id']}: gfcr gives {actual!r}, the reference {case['expected']!r}")
        return
    assert not close(actual, case["expected"], tol["rel"], tol["abs"]), (
        f"{method}/{case['id']} is listed as a deviation but gfcr now agrees with the reference: "
        "remove it from `deviations`")
    assert close(actual, deviation["gfcr"], tol["rel"], tol["abs"]), (
        f"{method}/{case['id']}: gfcr gives {actual!r}, the recorded deviation {deviation['gfcr']!r}")
