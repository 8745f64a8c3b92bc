"""control.dots: the attention prediction, the calibration and the sampling law on hand values,
selection rounds through the real tiny-arith policy (reference rollouts and the embedding pass
charged to the step, a round every mu calls), checkpoints, and loud misconfiguration."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
from pydantic import ValidationError

from gfcr.graph import load_pipeline
from gfcr.records import Prompt, PromptPool, StepContext, VerifierSpec
from gfcr.stages.control.dots import Dots, draw_selection, linear_calibration, selection_probabilities
from gfcr.stages.control.dots_predictor import DifficultyPredictor, predict, train_predictor
from tests.conftest import REPO

# --- the predictor ---------------------------------------------------------------------------------

def _toy(n: int, d: int = 8, seed: int = 0):
    """Embeddings whose first coordinate decides the success rate (a learnable difficulty)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, d, generator=g)
    return x, torch.sigmoid(3 * x[:, 0])


def test_training_lowers_the_loss_and_the_trained_predictor_ranks_unseen_prompts():
    queries, rates = _toy(256)
    refs, ref_rates = _toy(32, seed=1)
    held, held_rates = _toy(64, seed=2)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = DifficultyPredictor(8, hidden_size=32, num_layers=3)
        before = predict(model, held, refs, ref_rates)
        losses = train_predictor(model, queries, rates, [0] * 256, refs, ref_rates[None], epochs=30,
                                 batch_size=64, ref_size=32, warmup_steps=10)
    after = predict(model, held, refs, ref_rates)
    assert losses[-1] < losses[0]
    corr = lambda p: float(np.corrcoef(p.numpy(), held_rates.numpy())[0, 1])  # noqa: E731
    assert corr(after) > 0.8 and corr(after) > corr(before)  # measured: 0.1 untrained, above 0.9 trained
    assert bool(((after > 0) & (after < 1)).all()) and not model.training


def test_the_projections_and_calibration_have_the_reference_layout():
    model = DifficultyPredictor(6, hidden_size=5, num_layers=3)
    # LayerNorm(d), Linear, GELU, Dropout, Linear, GELU, Dropout, Linear, LayerNorm(h)
    assert [type(m).__name__ for m in model.query_proj] == ["LayerNorm", "Linear", "GELU", "Dropout", "Linear",
                                                            "GELU", "Dropout", "Linear", "LayerNorm"]
    assert [type(m).__name__ for m in DifficultyPredictor(6, 5, 1).ref_proj] == ["LayerNorm", "Linear", "LayerNorm"]
    assert [m.out_features for m in model.calibration if hasattr(m, "out_features")] == [10, 2]


def test_too_many_references_for_a_batch_is_an_error():
    x, r = _toy(4)
    with pytest.raises(ValueError, match="ref_size 8 exceeds the 4 reference embeddings"):
        train_predictor(DifficultyPredictor(8, 4, 1), x, r, [0] * 4, x, r[None], ref_size=8)


# --- calibration -------------------------------------------------------------------------------

def test_the_calibration_is_the_least_squares_line_of_acc_on_the_prediction():
    # x = [0.2, 0.4, 0.6], y = [0.1, 0.5, 0.6]: mean x 0.4, mean y 0.4;
    # slope = ((-0.2)(-0.3) + 0 + (0.2)(0.2)) / (0.04 + 0 + 0.04) = 0.10 / 0.08 = 1.25; intercept = 0.4 - 1.25 * 0.4 = -0.1
    assert linear_calibration(np.array([0.2, 0.4, 0.6]), np.array([0.1, 0.5, 0.6])) == (1.25, -0.1)
    # equal predictions: no slope; every prompt gets the reference mean
    assert linear_calibration(np.array([0.3, 0.3]), np.array([0.0, 1.0])) == (0.0, 0.5)


# --- the sampling law ----------------------------------------------------------------------------

def test_selection_probabilities_on_hand_values():
    # tau_s = 0.1: |p - 0.5| = [0, 0.1, 0.2]: exp(-[0, 1, 2]) = [1, 0.36788, 0.13534] / 1.50321
    np.testing.assert_allclose(selection_probabilities(np.array([0.5, 0.6, 0.3]), 0.5, 0.1),
                               [0.66524, 0.24473, 0.09003], atol=1e-5)
    # the default tau_s = 1e-3 does not overflow: exp(-[0, 1, 200]) normalised; the last underflows in float32
    w = selection_probabilities(np.array([0.5, 0.501, 0.7]), 0.5, 1e-3)
    np.testing.assert_allclose(w[:2], [1 / (1 + math.exp(-1)), math.exp(-1) / (1 + math.exp(-1))], rtol=1e-3)
    assert w[2] == 0.0 and w.sum() == pytest.approx(1.0)
    # another target: alpha = 0.25, tau_s = 0.05: |p - 0.25| = [0.25, 0.05]: exp(-[5, 1]) -> [0.01799, 0.98201]
    np.testing.assert_allclose(selection_probabilities(np.array([0.5, 0.3]), 0.25, 0.05), [0.01799, 0.98201],
                               atol=1e-5)


def test_the_first_draw_follows_the_probabilities_and_draws_are_without_replacement():
    p_hat = np.array([0.5, 0.6, 0.3])
    firsts = [draw_selection(p_hat, 0.5, 0.1, 1, seed=i)[0] for i in range(6000)]
    freq = np.bincount(firsts, minlength=3) / len(firsts)
    np.testing.assert_allclose(freq, [0.66524, 0.24473, 0.09003], atol=0.02)  # 3 sigma of 6000 draws is ~0.018
    assert sorted(draw_selection(p_hat, 0.5, 0.1, 3, seed=0)) == [0, 1, 2]


def test_a_small_tau_s_selects_the_nearest_to_alpha_then_shuffles_them():
    p_hat = np.array([0.9, 0.52, 0.1, 0.49, 0.3, 0.55])  # distances 0.4, 0.02, 0.4, 0.01, 0.2, 0.05
    picks = [draw_selection(p_hat, 0.5, 1e-3, 3, seed=s) for s in range(20)]
    assert all(sorted(p) == [1, 3, 5] for p in picks)
    assert len({tuple(p) for p in picks}) > 1  # the order is shuffled, as the reference's dataloader serves it


# --- configuration -------------------------------------------------------------------------------

def test_a_fresh_batch_that_is_not_a_whole_number_of_prompts_is_refused():
    with pytest.raises(ValidationError, match=r"0.5 \* 15 = 7.5 is not a whole number of prompts per step"):
        Dots.Config(batch_size=15)
    assert Dots.Config(batch_size=16).fresh_per_call == 8
    assert Dots.Config(batch_size=10, fresh_fraction=0.3).fresh_per_call == 3  # 0.3 as written, not the float


@pytest.mark.parametrize("bad", [{"interval": 0}, {"reference_prompts": 1}, {"reference_samples": 0},
                                 {"selection_temperature": 0.0}, {"target": 1.5}, {"fresh_fraction": 0.0},
                                 {"refrence_prompts": 8}])
def test_out_of_range_and_unknown_keys_are_refused(bad):
    with pytest.raises(ValidationError):
        Dots.Config(batch_size=16, **bad)


def test_a_pool_too_small_for_a_round_is_an_error_that_says_what_to_change():
    s = Dots(Dots.Config(batch_size=8, reference_prompts=4, train_prompts=4))
    small = PromptPool([Prompt(f"p:{i}", text=str(i)) for i in range(12)])
    with pytest.raises(ValueError, match=r"pool holds 12 prompts; a round needs 16 to select .* lower batch_size"):
        s.run_round(small)  # the first round selects mu * B = 16
    with pytest.raises(ValueError, match=r"pool holds 12 prompts; .* and 20 reference prompts \(\+ 4 train_prompts"):
        Dots(Dots.Config(batch_size=2, reference_prompts=20, train_prompts=4)).run_round(small)
    with pytest.raises(ValueError, match=r"and 8 reference prompts \(\+ 8 train_prompts in the first round\)"):
        Dots(Dots.Config(batch_size=2, reference_prompts=8, train_prompts=8)).run_round(small)


def _pipeline(tmp_path, old: str, new: str):
    text = (REPO / "pipelines" / "examples" / "dots_rr_select_arith.yaml").read_text()
    assert old in text
    spec = tmp_path / "bad.yaml"
    spec.write_text(text.replace(old, new))
    return spec


def test_validate_refuses_a_rollout_replay_at_another_sigma(tmp_path):
    from gfcr.errors import GfcrError

    spec = _pipeline(tmp_path, "replay.rollout_replay, from: reward, with: {fresh_fraction: 0.5",
                     "replay.rollout_replay, from: reward, with: {fresh_fraction: 0.25")
    with pytest.raises(GfcrError, match=r"stages\.pick\.with\.fresh_fraction: control\.dots selects sigma \* B fresh "
                                        r"prompts with fresh_fraction 0.5, and `replay`"):
        load_pipeline(spec)


@pytest.mark.parametrize("name", ["dots_arith.yaml", "examples/dots_rr_select_arith.yaml"])
def test_the_shipped_dots_pipelines_validate(name):
    compiled = load_pipeline(REPO / "pipelines" / name)
    assert compiled.nodes["pick"].info.alias == "control.dots"


# --- rounds through the real policy ----------------------------------------------------------------

@pytest.fixture(scope="module")
def resources():
    from gfcr.engines import TransformersEngine, load_policy
    from gfcr.spec import PolicySpec
    from gfcr.stages.resources import Lent

    policy = load_policy(PolicySpec(model="tiny-arith"))
    return Lent(policy, TransformersEngine(policy))


def arithmetic_pool(n: int) -> PromptPool:
    pairs = [(12 + 7 * i, 30 + 5 * i) for i in range(n)]
    return PromptPool([Prompt(f"a:{i}", text=f"What is {a} + {b}? Answer:", verifier=VerifierSpec("arithmetic", str(a + b)))
                       for i, (a, b) in enumerate(pairs)])


def make(resources) -> Dots:
    s = Dots(Dots.Config(batch_size=4, interval=2, fresh_fraction=0.5, reference_prompts=6, reference_samples=4,
                         train_prompts=12, hidden_size=16, max_new_tokens=8, seed=0))
    s.setup(resources)
    return s


def call(s: Dots, step: int, data: PromptPool):
    s.before_step(StepContext("run", step, 0, step))
    return s.run(data)


def test_rounds_charge_the_reference_rollouts_and_the_embedding_pass_to_their_step(resources):
    data = arithmetic_pool(24)
    resources.take_generation_charge(), resources.take_tokens_scored()
    s = make(resources)
    first = call(s, 0, data)
    rollouts, tokens = resources.take_generation_charge()
    m = s.step_metrics()
    # round 0: K = 6 reference prompts and 12 training prompts, 4 samples each
    assert rollouts == (6 + 12) * 4 == m["reference_rollouts"] and tokens == m["reference_tokens"]
    assert 72 <= tokens <= 72 * 8
    assert m["train_prompts"] == 12 and 0.0 < m["train_loss"] < 5.0 and 0.0 <= m["train_accuracy_mean"] <= 1.0
    prompt_tokens = sum(len(p.prompt_token_ids) for p in data)
    assert resources.take_tokens_scored() == prompt_tokens == m["embedding_tokens"] and m["embedded_prompts"] == 24
    assert (m["round"], m["rounds_run"], m["dispatched"], m["selection_left"]) == (1, 1, 4, 4)  # round 0: mu * B = 8
    assert s.embeddings.shape == (24, 128) and s.embedded == [p.prompt_id for p in data]
    assert m["predicted_mean"] == pytest.approx(np.mean([e.why.value for e in first]))

    second = call(s, 1, data)  # the rest of the round's selection: nothing charged
    assert resources.take_generation_charge() == (0, 0) and resources.take_tokens_scored() == 0
    assert s.step_metrics()["reference_rollouts"] == 0 and s.step_metrics()["selection_left"] == 0
    ids = [e.prompt_id for e in [*first, *second]]
    assert len(set(ids)) == 8  # without replacement

    trained = {k: v.clone() for k, v in s.predictor.state_dict().items()}
    third = call(s, 2, data)  # round 1: mu * sigma * B = 4, 2 a call; embeddings cached, the predictor frozen
    assert resources.take_generation_charge()[0] == 6 * 4 and resources.take_tokens_scored() == 0
    m = s.step_metrics()
    assert "train_loss" not in m
    assert all(torch.equal(v, s.predictor.state_dict()[k]) for k, v in trained.items())
    assert (m["round"], m["rounds_run"], m["dispatched"], m["selection_left"], m["embedded_prompts"]) == (2, 1, 2, 2, 0)
    for rank, e in enumerate(third.entries):
        assert e.n_rollouts == 1 and e.why.code == "difficulty_targeted" and e.why.name == "predicted_success"
        q = e.why.quantities
        assert q["distance"] == pytest.approx(abs(e.why.value - 0.5)) and q["round"] == 1 and q["position"] == rank + 1
        assert q["reference_accuracy_mean"] == m["reference_accuracy_mean"]
        assert e.reason.startswith(f"dots: round 1, selection {rank + 1}, predicted success")


def test_the_calibrated_prediction_is_the_line_fitted_on_the_reference_set(resources):
    data = arithmetic_pool(24)
    s = make(resources)
    call(s, 0, data)
    a, b = s.last_round["calibration_slope"], s.last_round["calibration_intercept"]
    for pid, p_hat, p_raw in s.selection:
        assert p_hat == pytest.approx(a * p_raw + b)
        assert 0.0 < p_raw < 1.0  # the predictor's output, a rate, before the line


def test_state_is_plain_json_and_a_restored_stage_continues_the_same_way(resources, tmp_path):
    data = arithmetic_pool(24)
    a = make(resources)
    for step in range(3):
        call(a, step, data)
    state = json.loads(json.dumps(a.state_dict(), allow_nan=False))
    assert state == a.state_dict() and state["round"] == 2 and state["cursor"] == 2
    a.save_files(tmp_path)
    b = make(resources)
    b.load_state_dict(state)
    b.load_files(tmp_path)
    np.testing.assert_array_equal(b.embeddings, a.embeddings)
    assert all(torch.equal(v, b.predictor.state_dict()[k]) for k, v in a.predictor.state_dict().items())
    for step in range(3, 6):
        first, second = call(a, step, data), call(b, step, data)
        assert [(e.prompt_id, e.reason, e.why) for e in first] == [(e.prompt_id, e.reason, e.why) for e in second]
        assert a.step_metrics() == b.step_metrics()
    assert b.step_metrics()["embedded_prompts"] == 0  # the cache came back: nothing re-embedded
    broken = make(resources)
    broken.load_state_dict({**state, "embedded": state["embedded"][:3]})
    with pytest.raises(ValueError, match="holds 24 embeddings and the stage state names 3 prompts"):
        broken.load_files(tmp_path)
    (tmp_path / "predictor.safetensors").unlink()
    missing = make(resources)
    missing.load_state_dict(state)
    with pytest.raises(ValueError, match="the predictor was trained and .*predictor.safetensors is missing"):
        missing.load_files(tmp_path)
