"""DARS (``control.dars``) against ``schedule_ET`` / ``schedule_HW`` of yangzhch6/DARS: the
top-up ``ΔN`` of every (correct, N, N_max, schedule, std) case, with the default arithmetic
and then with exact fractions (whose differences are counted here)."""

from __future__ import annotations

import sys
from typing import Any

import pytest

from gfcr.registry import STAGES
from tests.fidelity.cases import case_ids, cases, check

METHOD = "dars"
EXACT_DIFFERS = 5  # cases where exact fractions give one less than the reference's float ceiling


def topup(inp: dict[str, Any], **options: Any) -> int:
    module = sys.modules[STAGES.get("control.dars").__module__]
    return module.topup_size(inp["correct"], inp["n"], inp["n_max"], inp["schedule"], inp["std"], **options)


@pytest.mark.parametrize("case", cases(METHOD), ids=case_ids(METHOD))
def test_dars_topup_matches_the_reference(case):
    check(METHOD, case, topup)


def test_exact_fractions_differ_from_the_reference_only_where_rounding_adds_one():
    differ = [c for c in cases(METHOD) if topup(c["input"], arithmetic="exact") != c["expected"]]
    assert len(differ) == EXACT_DIFFERS
    assert all(topup(c["input"], arithmetic="exact") == c["expected"] - 1 for c in differ)
