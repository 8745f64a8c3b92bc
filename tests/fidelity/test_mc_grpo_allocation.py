"""MC-GRPO's allocation (``control.mc_grpo``) against lotusroot-kim/MC-GRPO: the G + 1 rollouts
each selected prompt gets in training (the trainer's ``use_extra_rollout`` block)."""

from __future__ import annotations

from typing import Any

import pytest

from gfcr.records import Allocation, AllocationEntry, Prompt
from gfcr.registry import STAGES
from tests.fidelity.cases import case_ids, cases, check

METHOD = "mc_grpo_allocation"


def allocated(inp: dict[str, Any]) -> dict[str, Any]:
    cls = STAGES.get("control.mc_grpo")
    entries = tuple(AllocationEntry(Prompt(p, text=p), 1) for p in inp["prompts"])
    out = cls(cls.Config(g=inp["g"])).run(Allocation(0, entries))
    per_prompt = [e.n_rollouts for e in out]
    return {"per_prompt": per_prompt, "total": sum(per_prompt)}


@pytest.mark.parametrize("case", cases(METHOD), ids=case_ids(METHOD))
def test_mc_grpo_allocation_matches_the_reference(case):
    check(METHOD, case, allocated)
