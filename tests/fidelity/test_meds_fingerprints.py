"""MEDS's fingerprint (``filter.meds``'s default ``features: answer_logits``) against Linxi000/MEDS's
``find_brace_positions_in_responses`` and ``extract_layer_logits_from_output``: where the answer is
read in each response, and the logit-lens logit of its first token at each of the last 14 layers.
gfcr computes a model's rows in one left-padded batch, as the stage does. The SmolLM2 cases load a
30-layer model and are marked slow; the tiny-arith ones run by default."""

from __future__ import annotations

from functools import cache
from typing import Any

import pytest

from gfcr.engines import load_policy
from gfcr.spec import PolicySpec
from gfcr.stages.common.fingerprints import answer_logits, boxed_anchor, first_token_anchor
from tests.fidelity.cases import cases, check

METHOD = "meds_fingerprints"


@cache
def policy(model: str):
    return load_policy(PolicySpec(model=model))


def anchor(inp: dict[str, Any]) -> int | None:
    tok = policy(inp["model"]).tokenizer
    if inp["anchor"] == "first_token":
        return first_token_anchor([tok.decode([t]) for t in inp["response"]])
    return boxed_anchor(inp["response"], tok.encode("\\boxed{", add_special_tokens=False),
                        tok.convert_ids_to_tokens(inp["response"]))


@cache
def batch_logits(model: str) -> dict[str, list[float]]:
    """Every fingerprinted case of ``model`` in one padded batch, by case id."""
    rows = [(c["id"], c["input"], anchor(c["input"])) for c in cases(METHOD) if c["input"]["model"] == model]
    rows = [(cid, inp, at) for cid, inp, at in rows if at is not None and at + 1 < len(inp["response"])]
    tok = policy(model).tokenizer
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    values = answer_logits(policy(model).model, [(i["prompt"], i["response"], at) for _, i, at in rows], pad, 14)
    return {cid: [float(x) for x in v] for (cid, _, _), v in zip(rows, values)}


def fingerprint(inp: dict[str, Any], cid: str) -> dict[str, Any]:
    return {"anchor": anchor(inp), "logits": batch_logits(inp["model"]).get(cid)}


PARAMS = [pytest.param(c, id=c["id"], marks=[pytest.mark.slow] if c["input"]["model"] != "tiny-arith" else [])
          for c in cases(METHOD)]


@pytest.mark.parametrize("case", PARAMS)
def test_meds_fingerprint_matches_the_reference(case):
    check(METHOD, case, lambda inp: fingerprint(inp, case["id"]))
