"""verifiers.scoring: the reward and verdict of a text, for callers with no stage in front of them."""

from __future__ import annotations

import numpy as np
import pytest

from gfcr.errors import RegistryError
from gfcr.records import Rollout, Segment, VerifierSpec
from gfcr.stages.verifiers import Score
from gfcr.stages.verifiers.scoring import score_rollout, score_text


def test_scoring_without_a_pool_for_evaluation():
    assert score_text("Answer: 7", VerifierSpec("arithmetic", "7"), timeout_s=None) == (
        1.0, Score(True, True, "7", "answer 7 == 7"))
    with pytest.raises(RegistryError, match="unknown verifier `gsm9k`"):  # a configuration mistake stops the run
        score_text("7", VerifierSpec("gsm9k", "7"))
    r = Rollout("e:0@s0/0", "e:0@s0", "e:0", [1], [Segment(0, 1, 0, np.zeros(1))], text="so 7")
    score_rollout(r, VerifierSpec("arithmetic", "7"), format_weight=0.5)
    assert (r.reward, r.reward_components) == (0.5, {"correct": 1.0, "format": 0.0})
