"""generate.elpo: the binary search finds a planted first irrecoverable turn in at most
ceil(log2 T) probes, on the pure search and on a real run with a scripted environment
(``tests.stages.generate.doom``); continuations are tree leaves that replay the prefix exactly."""

from __future__ import annotations

import math

import pytest

from gfcr.engines import TransformersEngine, load_policy
from gfcr.records import Allocation, AllocationEntry, Prompt, StepContext, TurnRole
from gfcr.spec import PolicySpec
from gfcr.stages.generate.elpo import ELPO, first_irrecoverable
from gfcr.stages.resources import Lent


@pytest.mark.parametrize("turns", range(1, 33))
def test_the_search_finds_every_planted_turn_in_at_most_log2_probes(turns):
    for planted in range(1, turns + 1):
        probed: list[int] = []
        found, order = first_irrecoverable(turns, lambda t: probed.append(t) or t < planted)
        assert found == planted and order == probed
        assert len(probed) <= math.ceil(math.log2(turns)) if turns > 1 else not probed
        assert len(set(probed)) == len(probed) and all(0 < t < turns for t in probed)


@pytest.fixture(scope="module")
def policy():
    return load_policy(PolicySpec(model="tiny-arith"))


def _run(policy, key: str, turns: int, at: int, n: int = 3, **config):
    env = {"use": "tests.stages.generate.doom:Doom", "with": {"turns": turns, "at": at, "key": key}}
    stage = ELPO(ELPO.Config(environment=env, max_turns=turns, max_turn_tokens=3, max_tokens=80, temperature=3.0,
                             **config))
    stage.setup(Lent(policy, TransformersEngine(policy)))
    prompts = (AllocationEntry(Prompt("a:0", text="What is 12 + 30? Answer:"), n),
               AllocationEntry(Prompt("a:1", text="What is 7 * 6? Answer:"), n))
    return stage, stage.run(Allocation(0, prompts), StepContext("run", step=0, seed=0, policy_version=0))


@pytest.mark.parametrize("turns,at", [(5, 3), (8, 1), (8, 6), (6, 6)])
def test_a_run_finds_the_planted_turn_of_every_failed_trajectory(policy, turns, at):
    stage, groups = _run(policy, f"planted-{turns}-{at}", turns, at, probes=3)
    _, expected = first_irrecoverable(turns, lambda t: t < at)
    for g in groups.groups:
        originals = [r for r in g.rollouts if r.branch_token_idx is None]
        assert len(originals) == 3 and all(r.reward == 0.0 for r in originals)
        for r in originals:
            assert r.reward_components["first_irrecoverable_turn"] == at
            model = [t for t in r.turns if t.role == TurnRole.MODEL]
            assert [t.info.get("elpo") for t in model].index("first irrecoverable") == at - 1
            continuations = [c for c in g.rollouts if c.tree_id == r.tree_id and c is not r]
            assert len(continuations) == 3 * len(expected) <= 3 * math.ceil(math.log2(turns))
            for c in continuations:  # a continuation holds the original's ids up to its fork, exactly
                fork = c.branch_token_idx
                assert c.response_token_ids[:fork] == r.response_token_ids[:fork]
                assert fork in [t.start for t in model] and c.generated_length > 0
                prefix = [t.start for t in model].index(fork)
                assert c.reward == float(prefix < at) or prefix < at  # past the planted turn nothing succeeds
        assert g.tree is not None and set(g.tree.leaves["root"]) == {r.rollout_id for r in g.rollouts}
    m = stage.step_metrics()
    assert m["elpo_searches"] == 6 and m["elpo_probes"] == 6 * len(expected)
    assert m["elpo_first_irrecoverable_mean"] == at


def test_an_environment_that_replays_differently_drops_the_continuation_only(policy):
    """An environment whose observations drift after its 4th step (the original's last): each
    continuation's replay sees another observation than recorded and is dropped with the reason."""
    from tests.stages.generate import doom

    class Drifting(doom.Doom):
        calls = 0

        def step(self, action):
            obs = super().step(action)
            Drifting.calls += 1
            return type(obs)(obs.text + ("" if Drifting.calls < 5 else " again"), obs.done, obs.reward, obs.metadata)

    doom.Drifting = Drifting
    try:
        env = {"use": "tests.stages.generate.doom:Drifting", "with": {"turns": 4, "at": 2, "key": "drifting"}}
        stage = ELPO(ELPO.Config(environment=env, max_turns=4, max_turn_tokens=3, max_tokens=80, probes=1))
        stage.setup(Lent(policy, TransformersEngine(policy)))
        out = stage.run(Allocation(0, (AllocationEntry(Prompt("a:0", text="What is 1 + 2? Answer:"), 1),)),
                        StepContext("run", step=0, seed=0, policy_version=0))
    finally:
        del doom.Drifting
    g = out.groups[0]
    assert [r.rollout_id for r in g.rollouts] == ["a:0@s0/0"]
    assert g.removed and all("gave another observation" in x.reason for x in g.removed)
