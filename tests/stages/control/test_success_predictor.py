"""The shared success predictor of control.gps and control.depo: gradient steps, the L2 pull,
standardised features, the history anchor and the zero-variance probability by hand, the
decayed per-prompt evidence, and a JSON round trip of the estimator."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from gfcr.stages.control.gps import Gps
from gfcr.stages.control.success_predictor import (LogisticSuccess, SuccessEstimator, features, with_history,
                                                   zero_variance_probability)
from gfcr.stages.testing import scored_group


def test_one_gradient_step_from_zero_weights():
    model = LogisticSuccess(2)
    # p = 0.5 for both; n p - s = [2 - 3, 2 - 0] = [-1, 2], over sum n = 8
    before = model.fit(np.eye(2), np.array([3.0, 0.0]), np.array([4.0, 4.0]), steps=1, lr=1.0, l2=0.0)
    assert before == pytest.approx(math.log(2))
    assert model.weights.tolist() == [0.125, -0.25] and model.bias == -0.125
    # prediction after the step: sigmoid(0.125 - 0.125) = 0.5 and sigmoid(-0.25 - 0.125)
    assert model.predict(np.eye(2)).tolist() == pytest.approx([0.5, 1 / (1 + math.exp(0.375))])


def test_the_l2_term_alone_shrinks_the_weights():
    model = LogisticSuccess(2)
    model.weights = np.array([2.0, -1.0])
    # x = 0: p = sigmoid(0) = 0.5 and s = n / 2, so the data gradient is 0; w <- w - 0.5 * 0.1 * w
    model.fit(np.zeros((2, 2)), np.array([1.0, 2.0]), np.array([2.0, 4.0]), steps=1, lr=0.5, l2=0.1)
    assert model.weights.tolist() == pytest.approx([1.9, -0.95]) and model.bias == 0.0


def test_fit_without_trials_changes_nothing():
    model = LogisticSuccess(2)
    assert math.isnan(model.fit(np.zeros((0, 2)), np.zeros(0), np.zeros(0), 5, 1.0, 0.0))
    assert model.weights.tolist() == [0.0, 0.0]


def test_features_are_standardised_per_coordinate_over_sqrt_d():
    v = np.array([[1.0, 2.0], [3.0, 2.0]])  # mean [2, 2], std [1, 0]: the second coordinate has no spread
    assert np.allclose(features(v, [0, 1]), [[-1 / math.sqrt(2), 0.0], [1 / math.sqrt(2), 0.0]])
    assert np.allclose(features(v, [1]), [[1 / math.sqrt(2), 0.0]])


def test_history_anchor_and_zero_variance_probability():
    assert with_history(0.5, 0.0, 0.0, 4.0) == 0.5                      # never observed: the model's prediction
    assert with_history(0.5, 6.0, 8.0, 4.0) == pytest.approx(8 / 12)    # (2 + 6) / (4 + 8)
    assert with_history(0.2, 8.0, 8.0, 2.0) == pytest.approx(8.4 / 10)  # (0.4 + 8) / 10
    assert zero_variance_probability(0.5, 8) == pytest.approx(2 / 256)
    assert zero_variance_probability(0.9, 2) == pytest.approx(0.82)     # 0.81 + 0.01
    assert zero_variance_probability(1.0, 8) == 1.0 and zero_variance_probability(0.0, 3) == 1.0


def estimator(**kw) -> SuccessEstimator:
    est = SuccessEstimator("test", Gps.Config(batch_size=1, **{"fit_steps": 0, **kw}))
    est.embeddings.add(["a", "b"], np.array([[1.0, 0.0], [0.0, 1.0]]))
    est.ensure([], None, None)
    return est


def test_evidence_is_decayed_per_group_and_anchors_the_prediction():
    est = estimator(evidence_decay=0.5, prior_strength=4.0)
    est.observe([scored_group("a", [1, 1, 1, 0], 0)], step=0, policy_version=0)
    assert est.evidence("a") == (3.0, 4.0)
    est.observe([scored_group("a", [0, 0, 0, 0], 1)], step=1, policy_version=1)
    # S = 0.5 * 3 + 0 = 1.5, F = 0.5 * 1 + 4 = 4.5: N = 6; fit_steps 0 keeps p_model = 0.5
    assert est.evidence("a") == (1.5, 6.0)
    p_hat, p_model, trials = est.predict(["a", "b"])
    assert p_hat.tolist() == pytest.approx([(2 + 1.5) / 10, 0.5]) and p_model.tolist() == [0.5, 0.5]
    assert trials.tolist() == [6.0, 0.0]
    assert list(est.window) == [("a", 3, 4), ("a", 0, 4)]


def test_groups_of_earlier_steps_and_unjudged_groups_are_ignored():
    est = estimator()
    unjudged = scored_group("b", [1, 0], 2)
    for rollout in unjudged.rollouts:
        rollout.correct = None  # no verifier judged them
    seen = est.observe([scored_group("a", [1, 0], 1), unjudged], step=2, policy_version=2)
    assert seen == [] and est.stats == {} and not est.window


def test_observe_fits_on_the_window_and_the_state_round_trips_through_json():
    est = estimator(fit_steps=3, learning_rate=0.5, train_window=2)
    for step, rewards in enumerate([[1, 1], [0, 0], [1, 0]]):
        est.observe([scored_group("a" if step != 1 else "b", rewards, step)], step=step, policy_version=step)
    assert list(est.window) == [("b", 0, 2), ("a", 1, 2)]  # the window keeps the last 2
    state = json.loads(json.dumps(est.state_dict(), allow_nan=False))
    other = SuccessEstimator("test", est.config)
    other.load_state_dict(state)
    other.embeddings.add(est.embeddings.ids, est.embeddings.vectors)
    assert other.predict(["a", "b"])[0].tolist() == est.predict(["a", "b"])[0].tolist()
    assert other.state_dict() == est.state_dict()
