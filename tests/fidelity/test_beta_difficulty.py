"""MoPPS's posterior band (``filter.beta_difficulty``) against ``PosteriorSampler`` of
thu-rllab/MoPPS: each step's decayed Beta update and the threshold strategy's band test
(``in_range_mask``), applied to the posterior mean after the update as gfcr's filter does."""

from __future__ import annotations

from typing import Any

import pytest

from gfcr.records import RolloutGroups, StepContext
from gfcr.registry import STAGES
from gfcr.stages.testing import scored_group
from tests.fidelity.cases import case_ids, cases, check

METHOD = "beta_difficulty"


def steps(inp: dict[str, Any]) -> list[dict[str, Any]]:
    cls = STAGES.get("filter.beta_difficulty")
    stage = cls(cls.Config(low=inp["low"], high=inp["high"], decay=inp["decay"],
                           prior_alpha=inp["prior"][0], prior_beta=inp["prior"][1]))
    n, seen, out = inp["n"], set(), []
    for step, batch in enumerate(inp["steps"]):
        stage.before_step(StepContext("r", step, 0, step))
        groups = RolloutGroups([scored_group(p, [1] * k + [0] * (n - k), step) for p, k in batch])
        kept = [g.prompt_id for g in stage.run(groups)]
        seen |= {p for p, _ in batch}
        out.append({"kept": kept, "posterior": {p: [float(stage.stats[p].beta_alpha), float(stage.stats[p].beta_beta)]
                                                for p in sorted(seen)}})
    return out


@pytest.mark.parametrize("case", cases(METHOD), ids=case_ids(METHOD))
def test_beta_difficulty_matches_the_reference(case):
    check(METHOD, case, steps)
