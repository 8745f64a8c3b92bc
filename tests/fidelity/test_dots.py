"""DOTS (``control.dots``'s sampling distribution) against the selection distribution of
ASTRAL-Group/data-efficient-llm-rl's trainer: ``softmax(-|p_hat - alpha| / tau)``."""

from __future__ import annotations

import sys
from typing import Any

import pytest

from gfcr.registry import STAGES
from tests.fidelity.cases import case_ids, cases, check

METHOD = "dots"


def probabilities(inp: dict[str, Any]) -> list[float]:
    module = sys.modules[STAGES.get("control.dots").__module__]
    return [float(w) for w in module.sampling_weights(inp["p_hat"], inp["alpha"], inp["tau"])]


@pytest.mark.parametrize("case", cases(METHOD), ids=case_ids(METHOD))
def test_dots_sampling_distribution_matches_the_reference(case):
    check(METHOD, case, probabilities)
