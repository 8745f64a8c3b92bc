"""APRIL's abort (``control.stop_at_target``) against THUDM/slime's over-sampling rollout
(``generate_rollout_async``, ``abort``): on rows that decode one token per step, when the stage
stops the call, which groups have ended and which are aborted with a partial."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from gfcr.registry import STAGES
from gfcr.stages.engine import InFlightView, LiveRow
from tests.fidelity.cases import case_ids, cases, check

METHOD = "stop_at_target"


def _view(lengths: list[list[int]], decoded: int) -> InFlightView:
    rows = tuple(LiveRow(f"g{g}", i, (0,) * min(n, decoded), np.zeros(min(n, decoded)), None,
                         "stop" if n <= decoded else None)
                 for g, group in enumerate(lengths) for i, n in enumerate(group))
    return InFlightView(decoded, rows, group_sizes={f"g{g}": len(group) for g, group in enumerate(lengths)})


def stopped(inp: dict[str, Any]) -> dict[str, Any]:
    cls = STAGES.get("control.stop_at_target")
    stage, lengths = cls(cls.Config(groups=inp["target"])), inp["lengths"]
    for step in range(1, max(max(group) for group in lengths) + 1):
        if stage.steer(_view(lengths, step)).stop:
            ended = [g for g, group in enumerate(lengths) if max(group) <= step]
            return {"stop_step": step, "kept": len(ended), "ended": ended,
                    "aborted": [g for g, group in enumerate(lengths) if max(group) > step]}
    return {"stop_step": None, "kept": len(lengths), "ended": list(range(len(lengths))), "aborted": []}


@pytest.mark.parametrize("case", cases(METHOD), ids=case_ids(METHOD))
def test_stop_at_target_matches_the_reference(case):
    check(METHOD, case, stopped)
