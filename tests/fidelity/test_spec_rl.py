"""SPEC-RL (``generate.speculative``) against ``spec_cut`` / ``spec_cut_with_knobs`` of
ShopeeLLM/Spec-RL: the accepted prefix length of every draft row, given the same uniforms."""

from __future__ import annotations

import sys
from typing import Any

import numpy as np
import pytest

from gfcr.registry import STAGES
from tests.fidelity.cases import case_ids, cases, check

METHOD = "spec_rl"


def cuts(inp: dict[str, Any]) -> list[int]:
    module = sys.modules[STAGES.get("generate.speculative").__module__]
    f32 = lambda xs: np.asarray(xs, np.float32)  # noqa: E731 - the reference's log-probs are float32
    return [module.accepted_length(f32(r["new"]), f32(r["old"]), inp["lenience"], f32(r["u"]))
            for r in inp["rows"]]


@pytest.mark.parametrize("case", cases(METHOD), ids=case_ids(METHOD))
def test_spec_rl_cut_matches_the_reference(case):
    check(METHOD, case, cuts)
