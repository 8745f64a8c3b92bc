"""MoPPS (``control.beta_thompson``) against ``PosteriorSampler`` of thu-rllab/MoPPS: the
decayed Beta posterior after each step, and the top-k choice of given Thompson draws."""

from __future__ import annotations

import sys
from typing import Any

import pytest

from gfcr.records import StepReport
from gfcr.registry import STAGES
from gfcr.stages.testing import scored_group
from tests.fidelity.cases import case_ids, cases, check

METHOD = "mopps"


def _stage(**fields: Any) -> Any:
    cls = STAGES.get("control.beta_thompson")
    return cls(cls.Config(batch_size=1, **fields))


def update(inp: dict[str, Any]) -> list[dict[str, list[float]]]:
    stage, seen, out = _stage(decay=inp["decay"]), set(), []
    n = inp["n"]
    for step, batch in enumerate(inp["steps"]):
        groups = tuple(scored_group(p, [1] * k + [0] * (n - k), step) for p, k in batch)
        stage.observe(StepReport("run", step, step + 1, groups, None, {}, {}))
        seen |= {p for p, _ in batch}
        out.append({p: [float(v) for v in stage.posterior(p)] for p in sorted(seen)})
    return out


def select(inp: dict[str, Any]) -> list[int]:
    module = sys.modules[STAGES.get("control.beta_thompson").__module__]
    return sorted(int(i) for i in module.closest_to_target(inp["draws"], inp["target"], inp["batch"]))


@pytest.mark.parametrize("case", cases(METHOD), ids=case_ids(METHOD))
def test_mopps_matches_the_reference(case):
    check(METHOD, case, update if case["input"]["kind"] == "update" else select)
