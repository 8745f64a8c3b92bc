"""Pilot-Commit (``control.pilot_commit``) against databricks/pilot-commit: the verdict on one
prompt's pilots (``filter_batch``, ``exclude_batch``: judged by the stage's ``_judge``) and the
max-variance down-sampling of its pilots (``_maxvar_downsample_binary``, same seed)."""

from __future__ import annotations

import sys
from typing import Any

import numpy as np
import pytest

from gfcr.registry import STAGES
from gfcr.stages.testing import scored_group
from tests.fidelity.cases import case_ids, cases, check

METHOD = "pilot_commit"


def _module() -> Any:
    return sys.modules[STAGES.get("control.pilot_commit").__module__]


def verdict(inp: dict[str, Any]) -> dict[str, Any]:
    cls = STAGES.get("control.pilot_commit")
    stage = cls(cls.Config(thr_lo=inp["thr_lo"], thr_up=inp["thr_up"], exclude_threshold_upper=inp["exclude"]))
    counts = dict.fromkeys(_module().VERDICT_COUNTS, 0)
    stage._judge(scored_group("p", inp["acc"]), 0, counts)
    kind = next(v for v in ("keep", "too_correct", "too_incorrect") if counts[v])
    return {"verdict": kind, "excluded": "p" in stage.evicted}


def maxvar(inp: dict[str, Any]) -> list[int]:
    rng = np.random.default_rng(inp["seed"])
    return sorted(_module().maxvar_indices([r == 1 for r in inp["rewards"]], inp["m"], rng))


@pytest.mark.parametrize("case", cases(METHOD), ids=case_ids(METHOD))
def test_pilot_commit_matches_the_reference(case):
    check(METHOD, case, verdict if case["input"]["kind"] == "verdict" else maxvar)
