"""Stages get the engine through ``Lent.require_engine``: a pass-through that counts the
response tokens stages score without generating them (reported per step as ``tokens_scored``)."""

from __future__ import annotations

from gfcr.engines.fake import FakeEngine
from gfcr.stages.resources import Lent, ScoreRequest


def test_scored_response_tokens_are_counted_and_taken_once_a_step():
    fake = FakeEngine()  # TEST/FAKE engine: the counting is what is tested
    resources = Lent(engine=fake)
    engine = resources.require_engine("test.stage")
    scored = engine.score([ScoreRequest((3, 4), (5, 6, 7)), ScoreRequest((3,), (8, 9))])
    assert [len(s.logprobs) for s in scored] == [3, 2]
    assert resources.take_tokens_scored() == 5 and resources.take_tokens_scored() == 0
    fake.sync_weights(4)
    assert engine.policy_version == 4 and engine.max_batch == fake.max_batch  # the rest passes through
