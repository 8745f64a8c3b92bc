"""The decode loop itself (on the fake engine's model) and ``generate.sample`` on the v2 protocol:
finished rows leave the batch, the in-flight cap holds, the stage maps finish reasons, records
entropy, splices nothing it was not given, and drops groups stopped in flight."""

from __future__ import annotations

import numpy as np

from gfcr.engines.decode import decode_requests, score_requests
from gfcr.engines.fake import FakeEngine, HashBatch
from gfcr.records import Allocation, AllocationEntry, Prompt, RolloutStatus
from gfcr.stages.control.stop_at_target import StopAtTarget
from gfcr.stages.engine import GenerationRequest, SamplingParams, ScoreRequest
from gfcr.stages.generate.sample import Sample
from gfcr.stages.resources import Lent


class CountingBatch(HashBatch):
    """Counts the rows each step computes and the most rows held at once."""

    def __init__(self, vocab: int):
        super().__init__(vocab)
        self.row_steps = self.most = 0

    def add(self, contexts):
        out = super().add(contexts)
        self.most = max(self.most, len(self.contexts))
        return out

    def step(self, tokens):
        self.row_steps += len(tokens)
        return super().step(tokens)


def _run(requests, max_in_flight=None, controller=None):
    engine = FakeEngine()
    batch = CountingBatch(len(engine.ALPHABET))
    out = decode_requests(requests, batch, eos=0, decode=engine.decode, max_in_flight=max_in_flight,
                          controller=controller)
    return out, batch


def _requests(n=4, count=5, max_new_tokens=40):
    e = FakeEngine()
    return [GenerationRequest(f"r{i}", e.encode(f"{i}-{i}="), n, SamplingParams(max_new_tokens=max_new_tokens, seed=1))
            for i in range(count)]


def test_finished_rows_leave_the_batch():
    out, batch = _run(_requests())
    lengths = [len(c.token_ids) for g in out for c in g]
    assert len(set(lengths)) > 1, "the fake model ends rows at varied lengths"
    # each row's first token comes from its prefill; every later token costs one row-step, no more
    assert batch.row_steps == sum(lengths) - len(lengths)


def test_the_in_flight_cap_holds_and_refills():
    out, batch = _run(_requests(), max_in_flight=3)
    assert batch.most == 3
    unbounded, _ = _run(_requests())
    assert [[c.token_ids for c in g] for g in out] == [[c.token_ids for c in g] for g in unbounded]


def test_stop_queues_nothing_more_and_queued_rows_end_empty():
    out, _ = _run(_requests(), max_in_flight=4, controller=StopAtTarget(StopAtTarget.Config(groups=1)))
    reasons = [c.finish_reason for g in out for c in g]
    assert "aborted" in reasons and any(len(c.token_ids) == 0 and c.finish_reason == "aborted" for g in out for c in g)


class FakePolicy:
    """TEST/FAKE: the policy side the sample stage needs (tokenizing prompts)."""

    name, version = "fake", 0

    def __init__(self, engine: FakeEngine):
        self.engine = engine

    def encode(self, prompt: Prompt) -> list[int]:
        return list(self.engine.encode(prompt.text))


def _stage(**config):
    engine = FakeEngine()
    stage = Sample(Sample.Config(**config))
    stage.setup(Lent(FakePolicy(engine), engine))
    return stage


def _allocation(count=6, n=4):
    return Allocation(0, tuple(AllocationEntry(Prompt(f"p:{i}", text=f"{i}+{i}="), n) for i in range(count)))


def test_sample_maps_finish_reasons_and_records_entropy():
    groups = _stage(max_new_tokens=12, entropy=True).run(_allocation())
    for group in groups:
        assert group.verdict.included
        for r in group.rollouts:
            assert r.status == {"stop": RolloutStatus.COMPLETED, "length": RolloutStatus.TRUNCATED}[r.finish_reason]
            assert r.token_entropy is not None and r.token_entropy.shape == (len(r),) and np.all(r.token_entropy >= 0)


def test_sample_drops_groups_stopped_in_flight_and_keeps_their_partials():
    stage = _stage(max_new_tokens=40, max_in_flight=8)
    stage.attach_in_flight([StopAtTarget(StopAtTarget.Config(groups=2))])
    groups = stage.run(_allocation())
    dropped = [g for g in groups if not g.verdict.included]
    kept = [g for g in groups if g not in dropped]
    assert len(kept) >= 2 and dropped
    for g in dropped:
        assert "stopped in flight" in g.verdict.reason and "partial kept" in g.verdict.reason
        assert any(r.status == RolloutStatus.ABORTED_PARTIAL for r in g.rollouts)
    for g in kept:
        assert all(r.status in (RolloutStatus.COMPLETED, RolloutStatus.TRUNCATED) for r in g.rollouts)


def test_sample_is_the_same_whatever_the_in_flight_cap():
    a = _stage(max_new_tokens=20).run(_allocation())
    b = _stage(max_new_tokens=20, max_in_flight=2).run(_allocation())
    assert [[r.response_token_ids for r in g.rollouts] for g in a] == [[r.response_token_ids for r in g.rollouts]
                                                                       for g in b]


def test_score_requests_teacher_forces_each_response_through_the_loop():
    """Responses of different lengths (one empty, one holding the end-of-sequence token before
    its end, one with a stop string's text) are scored at the logits of their own contexts, as
    the fake engine's direct ``score`` computes them, with at most two rows in the batch; each
    row leaves once its response is fed, so the batch computes exactly one step per token."""
    engine = FakeEngine()
    prompt = engine.encode("12+30=")
    responses = [engine.encode("42"), (), engine.encode("4") + (0,) + engine.encode("2x"), engine.encode("abcdefg")]
    requests = [ScoreRequest(prompt, r, t) for r, t in zip(responses, [1.0, 0.7, 0.0, 0.5])]
    batch = CountingBatch(len(engine.ALPHABET))
    scored = score_requests(requests, batch, eos=0, decode=engine.decode, max_in_flight=2)
    for s, direct, r in zip(scored, engine.score(requests), responses):
        assert len(s.logprobs) == len(s.entropy) == len(r)
        np.testing.assert_array_equal(s.logprobs, direct.logprobs)
        np.testing.assert_allclose(s.entropy, direct.entropy, atol=1e-6)
    assert batch.most == 2
    assert batch.row_steps == sum(max(len(r) - 1, 0) for r in responses)  # the last token's logits are never needed


def test_the_decode_score_path_scores_a_batch_as_it_was_sampled():
    """On the fake engine's model, scoring the sampled rows through the loop returns their
    sampling log-probs and entropies exactly, refilled batch and stop strings included."""
    engine = FakeEngine()
    params = SamplingParams(temperature=0.9, max_new_tokens=20, seed=2, stop=("z",), entropy=True)
    requests = [GenerationRequest(f"r{i}", engine.encode(t), 3, params) for i, t in enumerate(["1+2=", "9-4=", "7+7="])]
    completions = [(r, c) for r, g in zip(requests, engine.generate(requests, max_in_flight=4)) for c in g]
    scored = score_requests([ScoreRequest(r.prompt_token_ids, c.token_ids, 0.9) for r, c in completions],
                            HashBatch(len(engine.ALPHABET)), eos=0, decode=engine.decode, max_in_flight=4)
    assert len({len(c.token_ids) for _, c in completions}) > 1
    for (_, c), s in zip(completions, scored):
        np.testing.assert_array_equal(s.logprobs, c.logprobs)
        np.testing.assert_array_equal(s.entropy, c.entropy)


def test_each_request_is_handed_over_once_as_soon_as_its_rows_have_ended():
    """``ready`` gets every request's completions once, equal to the call's own, while other rows are
    still decoding: with 3 rows at a time, the first request is handed over before the last one starts."""
    handed, steps = [], CountingBatch(len(FakeEngine.ALPHABET))
    requests = _requests(n=2, count=5)
    out = decode_requests(requests, steps, eos=0, decode=FakeEngine().decode, max_in_flight=3,
                          ready=lambda i, completions: handed.append((i, completions, steps.row_steps)))
    assert sorted(i for i, _, _ in handed) == list(range(5))
    for i, completions, _ in handed:
        assert [(c.token_ids, c.finish_reason, c.text) for c in completions] == \
               [(c.token_ids, c.finish_reason, c.text) for c in out[i]]
        assert all(np.array_equal(a.logprobs, b.logprobs) for a, b in zip(completions, out[i]))
    assert handed[0][2] < steps.row_steps  # handed over before the call's last decode step


def test_sample_hands_over_the_groups_it_returns():
    stage, handed = _stage(max_new_tokens=20, max_in_flight=4), []
    stage.hand_over(handed.append)
    groups = stage.run(_allocation())
    assert sorted(g.group_id for g in handed) == sorted(g.group_id for g in groups)
    assert all(any(h is g for h in handed) for g in groups)  # the same objects, not copies
    stage.hand_over(None)
    barrier = _stage(max_new_tokens=20, max_in_flight=4).run(_allocation())
    assert [[r.response_token_ids for r in g.rollouts] for g in groups] == \
           [[r.response_token_ids for r in g.rollouts] for g in barrier]
