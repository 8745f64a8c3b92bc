"""Sequence-level truncated IS (correction ``seq_tis``) against verl's
``compute_rollout_correction_weights`` with ``rollout_is='sequence'``, as the VCPO authors' fork
carries it (mit-han-lab/vcpo): each case is a batch of responses (``pi_old`` and behaviour
log-probs, a response mask); expected are the per-token weights (0 on padding)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from gfcr.registry.catalog import CORRECTIONS
from tests.fidelity.cases import case_ids, cases, check
from tests.fidelity.update_terms import build

METHOD = "seq_tis"


def seq_tis(inp: dict[str, Any]) -> dict[str, Any]:
    correction = build(CORRECTIONS, "seq_tis", cap=inp["threshold"])
    logp = torch.tensor(inp["old_log_prob"], dtype=torch.float32)
    mask = torch.tensor(inp["mask"], dtype=torch.float32)
    c = correction.correct_sequences(logp, torch.tensor(inp["rollout_log_prob"], dtype=torch.float32), mask > 0, mask)
    assert torch.equal(c.proximal, logp)  # every ratio against pi_old
    return {"weights": (c.weight * mask).tolist()}


@pytest.mark.parametrize("case", cases(METHOD), ids=case_ids(METHOD))
def test_seq_tis_matches_the_reference(case):
    check(METHOD, case, seq_tis)
