"""CoPRIS's cross-stage importance-sampling correction against 777pomingzi/CoPRIS: the old
log-probs its trainer splices for a row generated over several rounds (each token keeps the value
of the round that generated it) equal the behaviour log-probs ``generate.partial`` splices when it
resumes a row (``gfcr.stages.engine.splice``), on which ``update.grpo`` computes its ratio."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from gfcr.stages.engine import Completion, ResponsePrefix, splice
from tests.fidelity.cases import case_ids, cases, check

METHOD = "copris"


def run(inp: dict[str, Any]) -> list[dict[str, list[list[float]]]]:
    rows: dict[tuple[str, int], tuple[list[int], list]] = {}  # (uid, gid) -> tokens, segments
    out = []
    for version, rnd in enumerate(inp["rounds"]):
        for row in rnd["rows"]:
            key, values = (row["uid"], row["gid"]), row["old"]
            tokens, segments = rows.get(key, ([], []))
            if len(values) == len(tokens):  # a finished row comes back unchanged: carried as it is
                continue
            # the round's new tokens, with the log-probs of the policy that sampled them (CoPRIS
            # recomputes them with the same weights before the next update)
            new = Completion(tuple(range(len(tokens), len(values))), np.asarray(values[len(tokens):], np.float32),
                             "length", "")
            prefix = ResponsePrefix(tuple(tokens), tuple(segments)) if tokens else None
            rows[key] = splice(prefix, new, version)
        out.append({uid: [np.concatenate([s.behavior_logprobs for s in rows[(uid, g)][1]]).tolist()
                          for g in range(inp["n"])] for uid in rnd["kept"]})
    return out


@pytest.mark.parametrize("case", cases(METHOD), ids=case_ids(METHOD))
def test_spliced_behaviour_logprobs_match_copris(case):
    check(METHOD, case, run)
