"""control.depo: the decision rule by hand, a candidate walk on hand embeddings and evidence
(skip easy and hard, explore, batch full, short batch), the after-rollout check of the
predictions, epochs, the group-size check of ``gfcr validate``, the Config bounds, a resume
from state, and the shipped pipelines."""

from __future__ import annotations

import json

import numpy as np
import pytest
from pydantic import ValidationError

from gfcr.errors import GfcrError
from gfcr.graph import load_pipeline
from gfcr.records import Prompt, PromptPool, StepContext, StepReport
from gfcr.stages.common.epochs import epoch_order
from gfcr.stages.common.prompt_stats import visit_draw
from gfcr.stages.control.depo import Depo, decide
from gfcr.stages.testing import scored_group
from tests.conftest import REPO


def pool(n: int) -> PromptPool:
    return PromptPool([Prompt(f"p:{i}", text=str(i)) for i in range(n)])


def test_the_decision_rule_by_hand():
    # (p_hat, z, draw, kept, batch_size, threshold, explore)
    assert decide(0.5, 0.01, 0.0, 3, 3, 0.5, 0.1) == "batch_full"          # full comes first
    assert decide(0.5, 0.49, 0.0, 0, 3, 0.5, 0.1) == "predicted_informative"
    assert decide(0.95, 0.5, 0.05, 0, 3, 0.5, 0.1) == "explore"            # z at the threshold, draw < explore
    assert decide(0.95, 0.5, 0.1, 0, 3, 0.5, 0.1) == "predicted_all_correct"
    assert decide(0.5, 0.9, 0.5, 0, 3, 0.5, 0.1) == "predicted_all_correct"  # p_hat 0.5 counts as easy
    assert decide(0.02, 0.85, 0.5, 0, 3, 0.5, 0.1) == "predicted_all_wrong"
    assert decide(0.02, 0.85, 0.5, 0, 3, 0.5, 0.0) == "predicted_all_wrong"  # explore 0: never kept


def hand_stage(**kw) -> Depo:
    """Eight prompts with one-hot embeddings; the untrained model predicts 0.5 for each. With
    kappa 4 and G 8: p:0 = (2 + 40) / 44 = 0.9545 (z = 0.6891), p:1 = 2 / 44 = 0.0455 (z the
    same), p:2 = (2 + 6) / 16 = 0.5 (z = 2 / 256), the others 0.5."""
    s = Depo(Depo.Config(**{"batch_size": 3, "candidate_ratio": 2, "seed": 0, "explore": 0.0, "fit_steps": 0, **kw}))
    s.use_embeddings([f"p:{i}" for i in range(8)], np.eye(8))
    s.estimator.set_evidence("p:0", 40.0, 40.0)
    s.estimator.set_evidence("p:1", 0.0, 40.0)
    s.estimator.set_evidence("p:2", 6.0, 12.0)
    return s


def walk(s: Depo, step: int = 0, n: int = 8):
    s.before_step(StepContext("run", step, 0, step))
    return s.run(pool(n))


def test_predicted_zero_variance_candidates_are_skipped_and_the_rest_fill_the_batch():
    s = hand_stage()
    alloc = walk(s)
    order = [f"p:{i}" for i in epoch_order(0, 0, 8)[:6]]
    assert [e.prompt_id for e in alloc] == order  # every candidate listed, in the epoch's order
    codes = {e.prompt_id: e.why.code for e in alloc}
    expected, kept = {}, 0
    for pid in order:  # the walk by hand
        if kept == 3:
            expected[pid] = "batch_full"
        elif pid == "p:0":
            expected[pid] = "predicted_all_correct"
        elif pid == "p:1":
            expected[pid] = "predicted_all_wrong"
        else:
            expected[pid], kept = "predicted_informative", kept + 1
    assert codes == expected
    for e in alloc:
        assert (e.n_rollouts > 0) == (e.why.code == "predicted_informative")
        assert e.why.name == "zero_variance_probability" and e.why.quantities["threshold"] == 0.5
    z = {e.prompt_id: e.why.value for e in alloc}
    p = {e.prompt_id: e.why.quantities["predicted_success"] for e in alloc}
    if "p:0" in z:
        assert p["p:0"] == pytest.approx(42 / 44) and z["p:0"] == pytest.approx((42 / 44) ** 8 + (2 / 44) ** 8)
    if "p:2" in z:
        assert p["p:2"] == 0.5 and z["p:2"] == pytest.approx(2 / 256)
    m = s.step_metrics()
    assert (m["candidates"], m["kept"], m["short"]) == (6, 3, 0)
    assert m["skipped_easy"] == ("p:0" in z and codes["p:0"] != "batch_full")
    assert m["skipped_hard"] == ("p:1" in z and codes["p:1"] != "batch_full")
    assert m["batch_full"] == sum(c == "batch_full" for c in codes.values())
    assert m["predicted_success"] == pytest.approx(0.5) and m["predicted_zero_variance"] == pytest.approx(2 / 256)


def test_a_batch_of_skips_trains_on_fewer_prompts():
    s = Depo(Depo.Config(batch_size=2, candidate_ratio=1, seed=0, explore=0.0, fit_steps=0))
    s.use_embeddings(["p:0", "p:1"], np.eye(2))
    s.estimator.set_evidence("p:0", 40.0, 40.0)
    alloc = walk(s, n=2)
    assert sorted((e.prompt_id, e.n_rollouts) for e in alloc) == [("p:0", 0), ("p:1", 1)]
    assert s.step_metrics()["short"] == 1 and s.step_metrics()["kept"] == 1


def test_explore_keeps_a_predicted_skip_when_its_draw_is_below_it():
    draw = visit_draw(0, 0, 0, "p:0")
    above = Depo(Depo.Config(batch_size=2, candidate_ratio=1, seed=0, explore=min(draw + 1e-9, 1.0), fit_steps=0))
    below = Depo(Depo.Config(batch_size=2, candidate_ratio=1, seed=0, explore=draw, fit_steps=0))
    for s in (above, below):
        s.use_embeddings(["p:0", "p:1"], np.eye(2))
        s.estimator.set_evidence("p:0", 40.0, 40.0)
    explored = {e.prompt_id: e for e in walk(above, n=2)}["p:0"]
    assert explored.why.code == "explore" and explored.n_rollouts == 1 and explored.why.quantities["draw"] == draw
    assert above.step_metrics()["explored"] == 1
    assert {e.prompt_id: e.why.code for e in walk(below, n=2)}["p:0"] == "predicted_all_correct"


def test_the_after_rollout_check_counts_zero_variance_groups_by_prediction():
    s = Depo(Depo.Config(batch_size=2, candidate_ratio=1, seed=0, explore=1.0, fit_steps=0))
    s.use_embeddings(["p:0", "p:1"], np.eye(2))
    s.estimator.set_evidence("p:0", 40.0, 40.0)
    alloc = walk(s, n=2)
    assert {e.prompt_id: e.why.code for e in alloc} == {"p:0": "explore", "p:1": "predicted_informative"}
    s.observe(StepReport("run", 0, 1, (scored_group("p:0", [1, 1, 1]), scored_group("p:1", [0, 0, 0])), None, {}, {}))
    assert s.checked == {"informative_zero_variance": 1.0, "explored_zero_variance": 1.0}
    walk(s, step=1, n=2)
    m = s.step_metrics()
    assert m["informative_zero_variance"] == 1.0 and m["train_pairs"] == 2
    # p:0's evidence: 0.5 * 40 + 3 successes of 0.5 * 40 + 3 trials
    assert s.estimator.evidence("p:0") == (23.0, 23.0)


def test_candidates_walk_the_epochs():
    s = hand_stage(candidate_ratio=1, batch_size=3)
    seen = [[e.prompt_id for e in walk(s, step)] for step in range(3)]
    assert seen[0] + seen[1] == [f"p:{i}" for i in epoch_order(0, 0, 8)[:6]]
    # 2 prompts left in epoch 0, fewer than 3 candidates: a new epoch starts (control.uniform's rule)
    assert s.epoch == 1 and seen[2] == [f"p:{i}" for i in epoch_order(0, 1, 8)[:3]]


def test_validate_refuses_another_group_size_downstream(tmp_path):
    text = (REPO / "pipelines" / "depo_arith.yaml").read_text()
    spec = tmp_path / "bad.yaml"
    spec.write_text(text.replace("with: {n: 8}", "with: {n: 4}"))
    with pytest.raises(GfcrError, match=r"stages\.pick\.with\.group_size: control\.depo predicts zero-variance groups "
                                        r"of group_size 8, and `budget` \(control\.fixed_n\) rolls out 4"):
        load_pipeline(spec)


def test_config_bounds():
    for bad in ({"threshold": 0.0}, {"threshold": 1.5}, {"explore": -0.1}, {"group_size": 0},
                {"candidate_ratio": 0}, {"prior_strength": -1.0}, {"fit_steps": -1}):
        with pytest.raises(ValidationError):
            Depo.Config(**{"batch_size": 2, **bad})


def test_state_is_plain_json_and_resumes_to_the_same_allocations():
    rng = np.random.default_rng(1)
    vectors, data = rng.normal(size=(12, 3)), pool(12)

    def make() -> Depo:
        s = Depo(Depo.Config(batch_size=3, seed=0, fit_steps=5, threshold=0.3))
        s.use_embeddings([p.prompt_id for p in data], vectors)
        return s

    def step(s: Depo, number: int):
        s.before_step(StepContext("run", number, 0, number))
        alloc = s.run(data)
        s.observe(StepReport("run", number, number + 1, tuple(
            scored_group(e.prompt_id, [1, 1, 1] if int(e.prompt_id[2:]) % 2 == 0 else [0, 0, 1], number)
            for e in alloc.active()), None, {}, {}))
        return alloc, s.step_metrics()

    a = make()
    for number in range(4):
        step(a, number)
    state = json.loads(json.dumps(a.state_dict(), allow_nan=False))
    b = Depo(Depo.Config(batch_size=3, seed=0, fit_steps=5, threshold=0.3))
    b.load_state_dict(state)
    b.estimator.embeddings.add([p.prompt_id for p in data], vectors)
    for number in range(4, 9):
        (first, m1), (second, m2) = step(a, number), step(b, number)
        assert [(e.prompt_id, e.reason) for e in first] == [(e.prompt_id, e.reason) for e in second] and m1 == m2
    assert a.state_dict() == b.state_dict()


@pytest.mark.parametrize("name", ["depo_arith.yaml", "examples/depo_dapo_arith.yaml"])
def test_the_shipped_depo_pipelines_validate(name):
    assert load_pipeline(REPO / "pipelines" / name).nodes["pick"].info.alias == "control.depo"
