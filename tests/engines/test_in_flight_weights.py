"""In-flight weight updates, the runtime logic without vLLM (docs/async.md, "In-flight updates on
vLLM"): ``splice`` cuts one segment per version a completion records, and the steered driver
(``gfcr.engines.vllm_steps.generate_steered``) aborts the running rows at a publish, reloads, and
adds each row again as a continuation of its tokens so far, recording where each version starts.

The request-level engine here is a labelled fake (``FakeLLMEngine``): each step gives every running
request one token, ``100 * version + position``, with log-prob ``-version``, so a token says which
weights sampled it. On vLLM itself: tests/engines/test_vllm_lifecycle.py (slow)."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from gfcr.engines.vllm_steps import continuation_seed, generate_steered
from gfcr.records import Segment
from gfcr.stages.engine import Completion, GenerationRequest, ResponsePrefix, SamplingParams, splice


class FakeLLMEngine:
    """A labelled fake of vLLM's ``LLMEngine``: ``add_request``, ``step``, ``abort_request``."""

    def __init__(self):
        self.version = 0
        self.running: dict[str, dict] = {}
        self.added: list[tuple[str, list[int], int, int]] = []  # (id, prompt ids, seed, max_tokens)
        self.aborted: list[str] = []

    def add_request(self, request_id, prompt, params, lora_request=None):
        assert request_id not in self.running and all(request_id != a[0] for a in self.added), request_id
        ids = list(prompt["prompt_token_ids"])
        self.added.append((request_id, list(ids), params.seed, params.max_tokens))
        self.running[request_id] = {"ids": ids, "left": params.max_tokens}

    def abort_request(self, request_ids):
        self.aborted += list(request_ids)
        for request_id in request_ids:
            del self.running[request_id]

    def step(self):
        outputs = []
        for request_id, r in list(self.running.items()):
            token = 100 * self.version + len(r["ids"])
            r["ids"].append(token)
            r["left"] -= 1
            logprob = {token: SimpleNamespace(logprob=-float(self.version))}
            sample = SimpleNamespace(token_ids=[token], logprobs=[logprob], finish_reason="length")
            outputs.append(SimpleNamespace(request_id=request_id, outputs=[sample], finished=r["left"] == 0))
            if r["left"] == 0:
                del self.running[request_id]
        return outputs


class PublishAt:
    """``InFlightWeights`` that offers version ``to`` once, after ``after`` engine steps."""

    def __init__(self, engine: FakeLLMEngine, after: int, to: int):
        self.engine, self.after, self.to, self.published = engine, after, to, []

    def newer(self, decoded):
        return self.to if decoded == self.after else None

    def publish(self, version):
        assert not self.engine.running  # every row aborted before the reload
        self.engine.version = version
        self.published.append(version)


def _params(row):
    """The engine's ``_row_params``, in short: the continuation's budget and seed."""
    p = row.request.params
    return SimpleNamespace(seed=continuation_seed(p.seed + row.index, row),
                           max_tokens=p.max_new_tokens - len(row.prefix) - len(row.tokens))


def _call(engine, weights, max_in_flight=None, n=2, max_new=6):
    requests = [GenerationRequest("q", (1, 2, 3), n, SamplingParams(max_new_tokens=max_new, seed=7))]
    return generate_steered(engine, requests, _params, lambda ids: " ".join(map(str, ids)), "fake",
                            max_in_flight=max_in_flight, weights=weights, version=0)[0]


def test_a_publish_mid_call_continues_each_row_from_its_tokens_under_the_new_weights():
    engine = FakeLLMEngine()
    weights = PublishAt(engine, after=2, to=1)
    completions = _call(engine, weights)
    assert weights.published == [1]
    assert engine.aborted == ["gfcr-" + engine.added[0][0].split("-")[1] + f"-q#{i}" for i in range(2)]
    for i, c in enumerate(completions):
        assert c.versions == ((0, 0), (2, 1))
        assert c.token_ids == (3, 4, 105, 106, 107, 108)  # the prefix recomputed: positions go on
        assert list(c.logprobs) == [0, 0, -1, -1, -1, -1]
        tokens, segments = splice(None, c, policy_version=1)  # the stage's version after the call: ignored
        assert [(s.start, s.end, s.policy_version) for s in segments] == [(0, 2, 0), (2, 6, 1)]
        assert [list(s.behavior_logprobs) for s in segments] == [[0, 0], [-1, -1, -1, -1]]
    first, again = engine.added[0], engine.added[2]
    assert again[1] == [1, 2, 3, 3, 4] and again[3] == 4  # the row's tokens so far; the budget it has left
    assert again[0].endswith("q#0.1") and again[2] != first[2]  # a request id and a seed of its own


def test_without_a_publish_a_call_records_one_version_and_draws_as_before():
    engine = FakeLLMEngine()
    completions = _call(engine, PublishAt(engine, after=99, to=1))
    assert [c.versions for c in completions] == [((0, 0),)] * 2
    assert [a[2] for a in engine.added] == [7, 8]  # each row's own seed: the call's draws are unchanged
    plain = _call(FakeLLMEngine(), None)
    assert [c.versions for c in plain] == [(), ()]  # no in-flight weights: the completion says nothing
    assert [c.token_ids for c in plain] == [c.token_ids for c in completions]


def test_a_row_still_queued_at_the_publish_starts_with_the_new_version():
    engine = FakeLLMEngine()
    completions = _call(engine, PublishAt(engine, after=2, to=1), max_in_flight=1, n=2, max_new=4)
    assert completions[0].versions == ((0, 0), (2, 1))
    assert completions[1].versions == ((0, 1),)  # added after the publish
    _, segments = splice(None, completions[1], policy_version=0)
    assert [(s.start, s.end, s.policy_version) for s in segments] == [(0, 4, 1)]


def test_splice_cuts_one_segment_per_version_after_a_prefix_and_clips_at_a_stop():
    prefix = ResponsePrefix((9, 9), (Segment(0, 2, 3, np.zeros(2, np.float32)),))
    c = Completion((1, 2, 3), np.array([-1, -2, -3], np.float32), "stop", "", versions=((0, 4), (1, 5), (3, 6)))
    tokens, segments = splice(prefix, c, policy_version=4)
    assert tokens == [9, 9, 1, 2, 3]
    assert [(s.start, s.end, s.policy_version) for s in segments] == [(0, 2, 3), (2, 3, 4), (3, 5, 5)]
    same_token = Completion((1, 2), np.zeros(2, np.float32), "length", "", versions=((0, 4), (0, 5)))
    assert [(s.start, s.end, s.policy_version) for s in splice(None, same_token, 4)[1]] == [(0, 2, 5)]
    with pytest.raises(ValueError, match="must start at token 0"):
        splice(None, Completion((1,), np.zeros(1, np.float32), "stop", "", versions=((1, 4),)), 4)


def test_a_schedule_with_in_flight_updates_is_refused_off_vllm_from_python_too():
    """``gfcr validate`` and ``gfcr run`` refuse it first (tests/graph/test_lifecycle.py); a run built
    from Python, past them, gets the same refusal from the runtime, not a silent one-version step."""
    from gfcr.errors import GfcrError
    from gfcr.graph import load_pipeline
    from gfcr.runtime.loop.session import build_schedule
    from gfcr.stages.resources import Lent
    from tests.conftest import REPO

    spec = load_pipeline(REPO / "pipelines" / "quickstart.yaml",
                         ["lifecycle.mode=async", "lifecycle.max_staleness=1", "lifecycle.in_flight=true",
                          "update.with.correction.use=tis"]).spec
    with pytest.raises(GfcrError, match="only the vLLM engine does so far"):
        build_schedule(spec, Lent())
