"""RLEP (``replay.rlep``) against Kwai-Klear/RLEP: which of a prompt's stored successes are
appended to its group (the dataset's candidates block and the rollout's replay block). Where
the reference draws (``random.sample``), the draw itself is not compared (see the JSON)."""

from __future__ import annotations

from collections import Counter
from typing import Any

import numpy as np
import pytest

from gfcr.records import PromptPool, Rollout, RolloutGroups, Segment, StepContext, group_id, rollout_id
from gfcr.registry import STAGES
from gfcr.stages.resources import Lent
from gfcr.stages.testing import scored_group
from tests.fidelity.cases import case_ids, cases, check

METHOD = "rlep"
EOS = 1  # the reference cases' tokenizer: one token per character, eos 1


def _success(prompt: str, i: int, text: str) -> Rollout:
    gid = group_id(prompt, 0)
    tokens = [ord(c) for c in text] + [EOS]
    return Rollout(rollout_id(gid, i), gid, prompt, tokens, [Segment(0, len(tokens), 0, np.zeros(len(tokens)))],
                   reward=1.0, correct=True)


def appended(inp: dict[str, Any]) -> dict[str, Any]:
    cls = STAGES.get("replay.rlep")
    stage = cls(cls.Config(replayed_per_group=inp["m"], correction="tis", max_per_prompt=None))
    stage.setup(Lent())
    for i, text in enumerate(inp["candidates"]):
        stage.pool.add_rollout(_success("p", i, text), step=0)
    group = scored_group("p", [0, 0], step=1)
    stage.run(RolloutGroups([group]), PromptPool([]), StepContext("r", 1, 0, 1))
    texts = ["".join(chr(t) for t in r.response_token_ids if t != EOS) for r in group.rollouts[2:]]
    nonempty = [t for t in texts if t]
    return {"count": len(texts), "empty": len(texts) - len(nonempty),
            "distinct_candidates": not (Counter(nonempty) - Counter(inp["candidates"])),
            "in_order": texts if len(inp["candidates"]) <= inp["m"] else None}


@pytest.mark.parametrize("case", cases(METHOD), ids=case_ids(METHOD))
def test_rlep_matches_the_reference(case):
    check(METHOD, case, appended)
