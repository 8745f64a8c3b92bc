"""APRIL's partial-rollout buffer (``generate.partial``) against slime's
``RolloutDataSourceWithBuffer`` (``get_samples``, ``add_samples``, ``pop_first``): which groups a
step generates, in what order, and what stays buffered."""

from __future__ import annotations

from typing import Any

import pytest

from gfcr.stages.generate.partial import serve
from tests.fidelity.cases import case_ids, cases, check

METHOD = "april"


def run(inp: dict[str, Any]) -> list[dict[str, list[str]]]:
    buffer: list[str] = []
    next_fresh, out = 0, []
    for step in inp["steps"]:
        places = step["places"]
        # the allocation offers a step's fresh prompts in order; only those served are used up
        offered = [f"p{next_fresh + i}" for i in range(places)]
        resumed, buffer, fresh = serve(buffer, offered, places)
        next_fresh += len(fresh)
        served = resumed + fresh
        # Partial.run appends the groups left unfinished in the order it served them
        buffer += [g for g in served if g in step["aborted"]]
        out.append({"served": served, "buffer": list(buffer)})
    return out


@pytest.mark.parametrize("case", cases(METHOD), ids=case_ids(METHOD))
def test_partial_buffer_order_matches_slime(case):
    check(METHOD, case, run)
