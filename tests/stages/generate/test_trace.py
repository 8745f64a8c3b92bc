"""generate.trace: the budget goes to the anchor (prompt or turn prefix) predicted to give the most
mixed outcomes; every prompt gets exactly its budget as a turn-level tree; the shared predictor
learns from the outcomes below each prefix (a scripted environment, ``tests.stages.generate.doom``,
where only shallow prefixes can still succeed) and is the stage's checkpointed state."""

from __future__ import annotations

import numpy as np
import pytest

from gfcr.engines import TransformersEngine, load_policy
from gfcr.records import Allocation, AllocationEntry, Prompt, StepContext
from gfcr.spec import PolicySpec
from gfcr.stages.generate.trace import Trace, choose, mixedness
from gfcr.stages.resources import Lent


def test_mixed_evidence_wins_and_ties_go_to_the_first_anchor():
    # same prediction 0.5, kappa 2: all 4 failed, all 4 succeeded, 2 of 4, nothing seen yet
    scores = mixedness(np.full(4, 0.5), np.array([0.0, 4.0, 2.0, 0.0]), np.array([4.0, 4.0, 4.0, 0.0]), 2.0)
    assert choose(scores) == 2 and scores[0] == pytest.approx(scores[1]) and scores[1] < scores[3] == scores[2] == 0.25
    assert choose(np.array([0.1, 0.25, 0.25])) == 1
    # with no evidence the predictor decides: the anchor predicted nearest 0.5
    assert choose(mixedness(np.array([0.9, 0.45, 0.1]), np.zeros(3), np.zeros(3), 2.0)) == 1


@pytest.fixture(scope="module")
def policy():
    return load_policy(PolicySpec(model="tiny-arith"))


PROMPTS = tuple(AllocationEntry(Prompt(f"a:{i}", text=f"What is {i} + 30? Answer:"), 6) for i in range(3))


def _stage(policy, key: str) -> Trace:
    env = {"use": "tests.stages.generate.doom:Doom", "with": {"turns": 4, "at": 2, "key": key}}
    stage = Trace(Trace.Config(environment=env, max_turns=4, max_turn_tokens=3, max_tokens=80, temperature=3.0,
                               roots=2, branches=2, predictor_steps=200))
    stage.setup(Lent(policy, TransformersEngine(policy)))
    return stage


def test_every_prompt_gets_its_budget_as_a_tree_of_exact_prefixes(policy):
    stage = _stage(policy, "budget")
    groups = stage.run(Allocation(0, PROMPTS), StepContext("run", step=0, seed=0, policy_version=0))
    m = stage.step_metrics()
    assert m["trace_rounds"] == 2 and m["trace_root_branches"] + m["trace_prefix_branches"] == 6
    assert m["trace_prefix_branches"] > 0
    for g in groups.groups:
        assert len(g.rollouts) == 6 and not g.removed
        assert set(g.tree.leaves["root"]) == {r.rollout_id for r in g.rollouts}
        by_id = {r.rollout_id: r for r in g.rollouts}
        for r in g.rollouts:
            if r.branch_token_idx is None:
                continue
            source = next(s for s in g.rollouts if s.branch_token_idx is None and s.tree_id == r.tree_id)
            fork = r.branch_token_idx
            assert r.response_token_ids[:fork] == source.response_token_ids[:fork] and len(r) > fork
            assert fork in [t.start for t in source.turns if t.role == "model"][1:]
        assert len(by_id) == 6
    for anchor, score in stage.decisions:  # each chosen anchor had the best score of its round
        assert 0.0 <= score <= 0.25


def test_the_shared_predictor_learns_from_the_outcomes_below_prefixes_and_is_checkpointed(policy):
    """Under ``Parity`` (a turn earns 0.5 for even-length text, success at 1.0 of 3 turns) a prefix
    with more reward so far succeeds more often below it: the predictor learns that."""
    env = {"use": "tests.stages.generate.doom:Parity", "with": {"turns": 3}}
    stage = Trace(Trace.Config(environment=env, max_turns=3, max_turn_tokens=3, max_tokens=80, temperature=3.0,
                               roots=2, branches=2, predictor_steps=200))
    stage.setup(Lent(policy, TransformersEngine(policy)))
    for step in range(3):
        stage.run(Allocation(step, PROMPTS), StepContext("run", step=step, seed=0, policy_version=0))
    assert stage.step_metrics()["trace_prefix_branches"] > 0
    rows = np.array([[1 / 3, reward, -1.5, 0.0] for reward in (0.0, 0.5, 1.0)])
    p = stage.predictor.predict(rows)
    assert p[0] < p[1] < p[2] and len(stage.history) == 3
    again = Trace(stage.config)
    again.load_state_dict(stage.state_dict())
    assert np.allclose(again.predictor.predict(rows), p) and len(again.history) == 3
