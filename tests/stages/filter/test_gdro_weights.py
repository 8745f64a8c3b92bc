"""Prompt-GDRO (``filter.gdro_weights``): the bin weights of a hand batch, the cap, the EMA
scores with normalisation by share, the weights reaching the advantages through
``update.grpo``'s sample-weight path, checkpoint state, and loud misconfiguration."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from pydantic import ValidationError

from gfcr.records import RolloutGroups, StepReport
from gfcr.stages.filter.gdro_weights import GdroWeights, bin_weights, sample_weights
from gfcr.stages.testing import scored_group


def _stage(**fields) -> GdroWeights:
    # extremes kept in the pass@k bins: these tests are about the bins' arithmetic
    stage = GdroWeights(GdroWeights.Config(**{"exclude_extremes": False, **fields}))
    stage.classifier.record("b", 1)  # b: pass@k 1.0 -> bin 2 at its first assignment; a unseen -> bin 0
    return stage


def _q(s0: float, s2: float) -> tuple[float, float]:
    """q of bins 0 and 2 by hand: (1 - 0.01) * omega / sum + 0.01 / 2, omega = exp(0.65 S)."""
    w0, w2 = math.exp(0.65 * s0), math.exp(0.65 * s2)
    return 0.99 * w0 / (w0 + w2) + 0.005, 0.99 * w2 / (w0 + w2) + 0.005


def test_prompt_gdro_weights_on_a_hand_batch():
    stage = _stage()
    stage.scores = {0: 1.0, 2: 0.0}
    groups = RolloutGroups([scored_group("a", [0, 1]), scored_group("b", [1, 1])])
    stage.run(groups)
    q0, q2 = _q(1.0, 0.0)  # 0.655440..., 0.344560...; they sum to 1
    # 4 samples, 2 per bin: mean q = (2 q0 + 2 q2) / 4 = 0.5, so w = q / 0.5
    assert [g.sample_weight for g in groups] == pytest.approx([2 * q0, 2 * q2])
    assert 2 * q0 == pytest.approx(1.310881, abs=1e-6)
    metrics = stage.step_metrics()
    assert metrics["groups_bin0"] == 1 and metrics["groups_bin1"] == 0 and metrics["groups_bin2"] == 1
    assert metrics["weight_bin0"] == pytest.approx(2 * q0) and metrics["score_bin0"] == 1.0


def test_an_uneven_batch_renormalises_over_samples_and_the_cap_binds():
    stage = _stage(max_weight=1.1)
    stage.scores = {0: 1.0, 2: 0.0}
    groups = RolloutGroups([scored_group("a", [0, 1, 0]), scored_group("b", [1])])
    stage.run(groups)
    q0, q2 = _q(1.0, 0.0)
    mean = (3 * q0 + q2) / 4  # per sample: 0.5777...
    assert q0 / mean == pytest.approx(1.1345, abs=1e-4)  # over the cap of 1.1
    assert [g.sample_weight for g in groups] == pytest.approx([1.1, q2 / mean])


def test_weights_multiply_an_upstream_sample_weight_and_skip_dropped_groups():
    stage = _stage()
    stage.scores = {0: 1.0, 2: 0.0}
    a, b, dropped = scored_group("a", [0, 1]), scored_group("b", [1, 1]), scored_group("c", [1, 1])
    a.sample_weight = 0.5
    dropped.drop("test")
    stage.run(RolloutGroups([a, b, dropped]))
    q0, _ = _q(1.0, 0.0)
    assert a.sample_weight == pytest.approx(0.5 * 2 * q0) and dropped.sample_weight == 1.0


def test_scores_are_ema_debiased_and_normalised_by_share():
    stage = _stage()
    groups = RolloutGroups([scored_group("a", [1, 0, 0]), scored_group("b", [1])])
    stage.run(groups)
    assert [g.sample_weight for g in groups] == [1.0, 1.0]  # no scores yet: equal weights
    stage.observe(StepReport("run", 0, 1, tuple(groups), None, {}, {}))
    # bin 0: losses 1 - r = [0, 1, 1], mean 2/3, share 3/4 -> 8/9 (first score: taken as is)
    # bin 2: loss [0], share 1/4 -> 0
    assert stage.scores == pytest.approx({0: 8 / 9, 2: 0.0})
    groups = RolloutGroups([scored_group("c", [0, 0], step=1), scored_group("d", [1, 1], step=1)])
    stage.run(groups)  # c, d unseen: both bin 0
    stage.observe(StepReport("run", 1, 2, tuple(groups), None, {}, {}))
    # bin 0: losses [1, 1, 0, 0], mean 1/2, share 1 -> S = 0.88 * 8/9 + 0.12 * 0.5
    assert stage.scores[0] == pytest.approx(0.88 * 8 / 9 + 0.12 * 0.5)


def test_the_helpers_by_hand():
    q = bin_weights({0: 10.0}, [0, 1], eta=1.0, gamma=0.0, clip=3.0)  # clipped to 3: e^3 / (e^3 + 1)
    assert q[0] == pytest.approx(math.exp(3) / (math.exp(3) + 1))
    assert sample_weights(np.array([1.0, 3.0]), cap=15.0).tolist() == [0.5, 1.5]


def test_state_round_trips_through_json():
    stage = _stage()
    groups = RolloutGroups([scored_group("a", [1, 0]), scored_group("b", [1, 1])])
    stage.run(groups)
    stage.observe(StepReport("run", 0, 1, tuple(groups), None, {}, {}))
    again = GdroWeights(GdroWeights.Config(exclude_extremes=False))
    again.load_state_dict(json.loads(json.dumps(stage.state_dict())))
    assert again.scores == stage.scores and again.classifier.state_dict() == stage.classifier.state_dict()


def test_unscored_rollouts_are_refused_with_the_fix():
    group = scored_group("a", [1, 0])
    group.rollouts[1].reward = None
    with pytest.raises(ValueError, match=r"rollouts a@s0/1 have no reward.*put it after the stage that scores them"):
        GdroWeights(GdroWeights.Config()).run(RolloutGroups([group]))


def test_misconfiguration_is_loud():
    with pytest.raises(ValidationError, match="strictly increasing"):
        GdroWeights.Config(edges=(0.5, 0.5))
    with pytest.raises(ValidationError, match="greater than 0"):
        GdroWeights.Config(max_weight=0.0)


def test_the_weights_scale_the_advantages_in_update_grpo():
    from gfcr.engines import TransformersEngine, load_policy
    from gfcr.records import Prompt, PromptPool
    from gfcr.spec import PolicySpec
    from gfcr.stages.resources import Lent
    from gfcr.stages.update.grpo import GRPOUpdate

    stage = _stage()
    stage.scores = {0: 1.0, 2: 0.0}
    groups = RolloutGroups([scored_group("a", [0, 1]), scored_group("b", [0, 1])])  # same rewards, bins 0 and 2
    stage.run(groups)
    policy = load_policy(PolicySpec(model="tiny-arith"))
    update = GRPOUpdate(GRPOUpdate.Config(lr=1e-3))
    update.setup(Lent(policy, TransformersEngine(policy)))
    update.run(groups, PromptPool([Prompt("a", text="1 + 1 ="), Prompt("b", text="2 + 2 =")]))
    a, b = ([r.advantage for r in g.rollouts] for g in groups)
    q0, q2 = _q(1.0, 0.0)
    assert a[1] > 0 and np.array(a) / np.array(b) == pytest.approx([q0 / q2, q0 / q2])
