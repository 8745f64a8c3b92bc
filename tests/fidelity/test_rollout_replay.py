"""DOTS rollout replay (``replay.rollout_replay``) against ``select_buffer`` of
ASTRAL-Group/data-efficient-llm-rl: per step, how many groups are replayed, the buffer the draw
comes from, that the replayed groups come out in buffer order, and the buffer after the step.
The draw itself (torch.randperm in the reference) is not compared (see the JSON's driver)."""

from __future__ import annotations

from typing import Any

import pytest

from gfcr.records import RolloutGroups, StepContext
from gfcr.registry import STAGES
from gfcr.stages.testing import scored_group
from tests.fidelity.cases import case_ids, cases, check

METHOD = "rollout_replay"
REWARDS = [1, 0, 1, 0, 0, 1, 1, 0]  # groups of 8, as the reference asserts


def steps(inp: dict[str, Any]) -> list[dict[str, Any]]:
    cls = STAGES.get("replay.rollout_replay")
    stage = cls(cls.Config(fresh_fraction=inp["sigma"], buffer_size=inp["buffer_size"]))
    out = []
    for step, prompts in enumerate(inp["steps"]):
        pool = [int(p) for p in stage.buffered_prompts()]
        fresh = RolloutGroups([scored_group(str(p), REWARDS, step=step) for p in prompts])
        result = stage.run(fresh, StepContext("r", step, 0, step))
        replayed = [int(g.prompt_id) for g in list(result)[len(prompts):]]
        positions = [pool.index(p) if p in pool else -1 for p in replayed]
        out.append({"replayed": len(replayed), "pool": pool,
                    "in_buffer_order": -1 not in positions and positions == sorted(positions),
                    "buffer_after": [int(p) for p in stage.buffered_prompts()]})
    return out


@pytest.mark.parametrize("case", cases(METHOD), ids=case_ids(METHOD))
def test_rollout_replay_matches_the_reference(case):
    check(METHOD, case, steps)
