"""Step-GRPO's Dynamic Truncated Rollout (``control.truncate_steps``) against ``answer_confidence``,
``should_early_exit`` and ``is_repetition`` of davidweidawang/Step-GRPO (``deer_utils.py``)."""

from __future__ import annotations

from typing import Any

import pytest

from gfcr.stages.control.truncate_steps import TruncateSteps, confidence, is_repetition, should_exit
from tests.fidelity.cases import case_ids, cases, check

METHOD = "step_grpo"
DEFAULTS = TruncateSteps.Config()


def run(inp: dict[str, Any]) -> Any:
    if inp["kind"] == "exit":
        return should_exit(inp["confidence"], inp["threshold"])
    if inp["kind"] == "repetition":
        return is_repetition(inp["previous"], inp["chunk"], inp["n"])
    # the reference's first generated token is the `{` that gfcr's inducer already holds
    conf = confidence(inp["logprobs"][1:], inp["closed"], DEFAULTS.confidence)
    return conf if inp["kind"] == "confidence" else should_exit(conf, inp["threshold"])


@pytest.mark.parametrize("case", cases(METHOD), ids=case_ids(METHOD))
def test_truncate_steps_matches_the_reference(case):
    check(METHOD, case, run)


def test_the_defaults_are_the_references():
    """Step-GRPO's RolloutConfig: delta 0.95, max_judge_steps 10, prob_check_max_tokens 20, trigger Wait,
    repetition exit on (3 repeats)."""
    assert (DEFAULTS.threshold, DEFAULTS.max_checks, DEFAULTS.probe_tokens) == (0.95, 10, 20)
    assert (DEFAULTS.markers, DEFAULTS.confidence, DEFAULTS.repeats) == (["Wait"], "geometric", 3)
