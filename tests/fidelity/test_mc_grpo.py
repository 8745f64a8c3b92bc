"""MC-GRPO (advantage ``mc_grpo`` of ``update.grpo``) against the ``mc`` advantage block of
lotusroot-kim/MC-GRPO's GRPO trainer: the pivot's reward and every rollout's advantage. The
pivot's index among rollouts tied at the median is counted, not compared (see the JSON)."""

from __future__ import annotations

from typing import Any

import pytest

from gfcr.registry.catalog import ADVANTAGE_ESTIMATORS
from gfcr.stages.testing import scored_group
from tests.fidelity.cases import case_ids, cases, check

METHOD = "mc_grpo"
TIE_INDEX_DIFFERS = 8  # cases where torch.median picks another of the tied rollouts than gfcr's first


def _estimate(rewards: list[float]) -> Any:
    cls = ADVANTAGE_ESTIMATORS.get("mc_grpo")
    return cls(cls.Config()).estimate(scored_group("p", rewards))


def _pivot(out: Any) -> int:
    return next(i for i, mask in enumerate(out.loss_masks) if not mask.any())


def advantages(inp: dict[str, Any]) -> dict[str, Any]:
    out = _estimate(inp["rewards"])
    return {"pivot_reward": float(inp["rewards"][_pivot(out)]), "advantages": [float(a) for a in out.values]}


@pytest.mark.parametrize("case", cases(METHOD), ids=case_ids(METHOD))
def test_mc_grpo_matches_the_reference(case):
    check(METHOD, case, advantages)


def test_the_pivot_differs_only_among_tied_rollouts():
    differ = [c for c in cases(METHOD) if _pivot(_estimate(c["input"]["rewards"])) != c["reference_pivot"]]
    assert len(differ) == TIE_INDEX_DIFFERS
    for c in differ:
        r = c["input"]["rewards"]
        assert r[_pivot(_estimate(r))] == r[c["reference_pivot"]]
