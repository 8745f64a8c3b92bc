"""control.gps: the utility, cosine and greedy diverse batch by hand, a selection on hand
embeddings and evidence (with and without history anchors), loop rounds, the prediction error,
the Config bounds, a resume from state, and the shipped pipelines."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from pydantic import ValidationError

from gfcr.graph import load_pipeline
from gfcr.records import Prompt, PromptPool, StepContext, StepReport
from gfcr.stages.control.gps import Gps, cosine, greedy_diverse, utility
from gfcr.stages.testing import scored_group
from tests.conftest import REPO


def pool(n: int) -> PromptPool:
    return PromptPool([Prompt(f"p:{i}", text=str(i)) for i in range(n)])


def test_utility_and_cosine_by_hand():
    assert utility(np.array([0.5, 0.25, 0.0, 1.0])).tolist() == [1.0, 0.75, 0.0, 0.0]
    assert cosine(np.array([[1.0, 0.0], [1.0, 1.0], [0.0, 0.0]]), np.array([[2.0, 0.0]]))[:, 0].tolist() == \
        pytest.approx([1.0, 1 / math.sqrt(2), 0.0])  # a zero vector has cosine 0


def test_greedy_batch_trades_utility_against_similarity():
    util, x = np.array([1.0, 0.9, 0.8]), np.array([[1.0, 0.0], [1.0, 0.0], [0.0, 1.0]])  # 0 and 1 duplicates
    none = np.zeros((0, 2))
    # 0 first (1.0); then 1 scores 0.9 - 0.5 * 1 = 0.4 and 2 scores 0.8 - 0 = 0.8
    assert greedy_diverse(util, x, none, 2, 0.5) == ([0, 2], [1.0, 0.8], [0.0, 0.0])
    assert greedy_diverse(util, x, none, 2, 0.0)[0] == [0, 1]  # no diversity: utility order
    # an anchor like 2: scores [1.0, 0.9, 0.3]; then 1 has 0.4 and 2 still 0.3
    assert greedy_diverse(util, x, np.array([[0.0, 1.0]]), 2, 0.5) == ([0, 1], [1.0, 0.4], [0.0, 1.0])
    assert greedy_diverse(util, x, none, 5, 0.5)[0] == [0, 2, 1]  # k beyond the candidates: all of them
    assert greedy_diverse(np.array([0.5, 0.5]), x[:2], none, 1, 0.5)[0] == [0]  # ties: the first


def hand_stage(**kw) -> Gps:
    """Four prompts: p:0, p:1 alike and p:2, p:3 alike, opposite (features x / sqrt 2 after
    standardising); evidence by hand, the untrained model predicts 0.5 for all (kappa 4):
    p_hat = 0.5, (2 + 4) / 8 = 0.75, (2 + 0) / 8 = 0.25, 0.5; utility 1, 0.75, 0.75, 1."""
    s = Gps(Gps.Config(**{"batch_size": 2, "seed": 0, "diversity": 0.5, "anchor_steps": 1, "fit_steps": 0, **kw}))
    s.use_embeddings([f"p:{i}" for i in range(4)], np.array([[1.0, 1.0], [1.0, 1.0], [-1.0, -1.0], [-1.0, -1.0]]))
    s.estimator.set_evidence("p:0", 2.0, 4.0)
    s.estimator.set_evidence("p:1", 4.0, 4.0)
    s.estimator.set_evidence("p:2", 0.0, 4.0)
    return s


def test_selection_picks_the_intermediate_ones_of_different_kinds():
    s = hand_stage()
    s.before_step(StepContext("run", 0, 0, 0))
    alloc = s.run(pool(4))
    # p:0 and p:3 tie at utility 1; whichever comes first, the other is then unpenalised (cosine -1 -> 0)
    # and scores 1.0 against 0.75 - 0.5 = 0.25 for its look-alike
    assert sorted(e.prompt_id for e in alloc) == ["p:0", "p:3"] and [e.n_rollouts for e in alloc] == [1, 1]
    for e in alloc:
        q = e.why.quantities
        assert e.why.code == "diverse_intermediate" and e.why.name == "score" and e.why.value == pytest.approx(1.0)
        assert q["predicted_success"] == 0.5 and q["model_prediction"] == 0.5 and q["utility"] == 1.0
        assert q["similarity"] == 0.0 and q["cutoff_score"] == pytest.approx(1.0)
    assert [e.why.quantities["rank"] for e in alloc] == [1.0, 2.0]
    assert {e.prompt_id: e.why.quantities["evidence_trials"] for e in alloc} == {"p:0": 4.0, "p:3": 0.0}
    m = s.step_metrics()
    assert (m["candidates"], m["chosen"], m["anchors"], m["unseen"]) == (4, 2, 0, 1)
    assert m["predicted_success"] == 0.5 and m["utility"] == 1.0 and m["pool_intermediate"] == 4
    assert m["pool_predicted_mean"] == pytest.approx((0.5 + 0.75 + 0.25 + 0.5) / 4)


def test_the_last_steps_choices_anchor_the_diversity_penalty():
    s = hand_stage()
    s.recent.append((0, ["p:0"]))
    s.before_step(StepContext("run", 1, 0, 1))
    alloc = s.run(pool(4))
    # sim to p:0: [1, 1, 0, 0]: scores 0.5, 0.25, 0.75, 1.0: p:3; then p:2 gets sim 1 (0.25): p:0 at 0.5
    assert [e.prompt_id for e in alloc] == ["p:3", "p:0"]
    assert [e.why.value for e in alloc] == pytest.approx([1.0, 0.5]) and s.step_metrics()["anchors"] == 1
    s.before_step(StepContext("run", 3, 0, 3))  # two steps later, anchor_steps 1: step 1's choices have lapsed
    assert s.anchor_ids() == [] and sorted(e.prompt_id for e in s.run(pool(4))) == ["p:0", "p:3"]


def test_a_second_round_in_a_step_never_picks_a_prompt_again_and_they_anchor_it():
    s = hand_stage(anchor_steps=0)
    s.before_step(StepContext("run", 0, 0, 0))
    first, second = s.run(pool(4)), s.run(pool(4))
    assert sorted(e.prompt_id for e in second) == ["p:1", "p:2"]
    assert s.step_metrics()["candidates"] == 4 + 2 and s.step_metrics()["chosen"] == 4
    # both are like an earlier round's pick
    assert [e.why.quantities["similarity"] for e in second] == pytest.approx([1.0, 1.0])
    assert not {e.prompt_id for e in first} & {e.prompt_id for e in second}


def test_observe_learns_and_reports_the_error_of_the_predictions_it_chose_with():
    s = hand_stage(fit_steps=1, learning_rate=1.0)
    s.before_step(StepContext("run", 0, 0, 0))
    chosen = [e.prompt_id for e in s.run(pool(4))]
    groups = tuple(scored_group(pid, [1, 1, 1, 0], 0) for pid in chosen)  # 0.75 observed, 0.5 predicted
    s.observe(StepReport("run", 0, 1, groups, None, {}, {}))
    assert s.prediction_error == pytest.approx(0.25)
    assert s.estimator.model.weights.tolist() != [0.0, 0.0] or s.estimator.model.bias != 0.0
    s.before_step(StepContext("run", 1, 0, 1))
    s.run(pool(4))
    m = s.step_metrics()
    assert m["prediction_error"] == pytest.approx(0.25) and m["train_pairs"] == 2
    assert m["train_loss"] == pytest.approx(math.log(2))  # the window's loss before the first fit, at p = 0.5


def test_config_bounds():
    for bad in ({"diversity": -0.1}, {"anchor_steps": -1}, {"prior_strength": 0.0}, {"evidence_decay": 1.5},
                {"train_window": 0}, {"learning_rate": 0.0}, {"batch_size": 0}):
        with pytest.raises(ValidationError):
            Gps.Config(**{"batch_size": 2, **bad})


def test_a_run_without_a_policy_says_so():
    s = Gps(Gps.Config(batch_size=2))
    s.before_step(StepContext("run", 0, 0, 0))
    with pytest.raises(RuntimeError, match="control.gps was not set up with a policy"):
        s.run(pool(4))


def test_state_is_plain_json_and_resumes_to_the_same_allocations():
    rng = np.random.default_rng(0)
    vectors, data = rng.normal(size=(12, 3)), pool(12)

    def make() -> Gps:
        s = Gps(Gps.Config(batch_size=3, seed=0, fit_steps=5))
        s.use_embeddings([p.prompt_id for p in data], vectors)
        return s

    def step(s: Gps, number: int):
        s.before_step(StepContext("run", number, 0, number))
        alloc = s.run(data)
        s.observe(StepReport("run", number, number + 1, tuple(
            scored_group(e.prompt_id, [1, 1] if int(e.prompt_id[2:]) % 3 == 0 else [1, 0], number)
            for e in alloc), None, {}, {}))
        return alloc, s.step_metrics()

    a = make()
    for number in range(3):
        step(a, number)
    state = json.loads(json.dumps(a.state_dict(), allow_nan=False))
    b = Gps(Gps.Config(batch_size=3, seed=0, fit_steps=5))
    b.load_state_dict(state)
    b.estimator.embeddings.add([p.prompt_id for p in data], vectors)
    for number in range(3, 7):
        (first, m1), (second, m2) = step(a, number), step(b, number)
        assert [(e.prompt_id, e.reason) for e in first] == [(e.prompt_id, e.reason) for e in second] and m1 == m2
    assert a.state_dict() == b.state_dict()


@pytest.mark.parametrize("name", ["gps_arith.yaml", "examples/gps_dapo_arith.yaml"])
def test_the_shipped_gps_pipelines_validate(name):
    assert load_pipeline(REPO / "pipelines" / name).nodes["pick"].info.alias == "control.gps"
