"""TIC-GRPO (the trajectory-ratio loss ``tic_grpo`` and the length-corrected estimator
``tic_grpo``) and TR-GRPO (the probability-shaped loss ``tr_grpo``) against hand computations:
gradients of the two-token toy policy of ``test_losses_catalog``, a real update step through
``update.grpo``, hand groups for the estimator, and misconfigurations that ``gfcr validate``
refuses. Every expected number is arithmetic written out here, never the implementation."""

from __future__ import annotations

import math

import pytest
import torch
from pydantic import ValidationError
from typer.testing import CliRunner

from gfcr.cli.main import app
from gfcr.registry.catalog import LOSSES
from gfcr.stages.components.advantage import AdvantageSpec
from gfcr.stages.components.aggregation.seq_mean_token_mean import SeqMeanTokenMean
from tests.stages.update.test_estimators_catalog_b import group
from tests.stages.update.test_losses_catalog import (
    QUICKSTART,
    TOKENS,
    assert_hand,
    gfcr_gradient,
    group_advantages,
    grpo_gradients,
    toy_theta,
)
from tests.stages.update.test_tree_and_off_policy import hand_gradients, stage_and_policy, stale_group, token_logprobs


def sigmoid(x: float) -> float:
    return 1 / (1 + math.exp(-x))


# --- tic_grpo loss ----------------------------------------------------------------------------

TIC_LOG_RATIOS = [[0.1, 0.2], [0.05, -0.01]]  # rho_0 = e^0.3 = 1.35 (above 1.28), rho_1 = e^0.04 = 1.04


@pytest.mark.parametrize("advantages", [(1.0, 0.5), (-1.0, -0.5)])
@pytest.mark.parametrize("eps_low", [None, 0.02])
def test_tic_grpo_gradient_is_the_trajectory_ratio_times_the_summed_score(advantages, eps_low):
    theta = toy_theta()
    cls = LOSSES.get("tic_grpo")
    loss = cls(cls.Config(eps_high=0.28, eps_low=eps_low))
    got = gfcr_gradient(theta, TIC_LOG_RATIOS, advantages, loss, SeqMeanTokenMean(SeqMeanTokenMean.Config()))
    # L = 1/2 sum_b -min(rho_b A_b, clip(rho_b) A_b), rho_b = exp(lr_b0 + lr_b1); d rho_b / d log pi_bt = rho_b:
    # dL/dlog pi_bt = -(1/2) A_b rho_b on both tokens when the unclipped term is the min, else 0
    c = []
    for b, a in enumerate(advantages):
        rho = math.exp(sum(TIC_LOG_RATIOS[b]))
        low = -math.inf if eps_low is None else 1 - eps_low
        unclipped_is_min = rho <= 1.28 if a > 0 else rho >= low
        c.append([-0.5 * a * rho if unclipped_is_min else 0.0] * 2)
    # A > 0: response 0's rho = 1.35 > 1.28 is clipped; A < 0: only a lower bound could clip, and
    # rho_1 = 1.04 >= 0.98, so both responses carry a gradient either way
    assert (c[0][0] == 0.0) == (advantages[0] > 0) and c[1][0] != 0.0
    assert_hand(theta, got, c)


def test_tic_grpo_ratio_is_a_product_not_a_geometric_mean_and_counts_only_weighted_tokens():
    cls = LOSSES.get("tic_grpo")
    log_ratio = torch.tensor([[0.1, 0.2, 5.0]], dtype=torch.float64)
    weight = torch.tensor([[1.0, 1.0, 0.0]], dtype=torch.float64)  # the third token is masked: not in y
    terms = cls(cls.Config(eps_high=0.5)).terms(log_ratio, torch.ones_like(log_ratio), weight)
    assert terms.ratio[0].tolist() == pytest.approx([math.exp(0.3)] * 3, abs=1e-12)  # e^(0.1+0.2), not e^0.15
    assert terms.clipped.tolist() == [[False, False, False]]  # 1.35 < 1.5
    tight = cls(cls.Config(eps_high=0.28)).terms(log_ratio, torch.ones_like(log_ratio), weight)
    assert tight.clipped.tolist() == [[True, True, True]]


def test_tic_grpo_needs_an_upper_bound_and_its_aggregation():
    with pytest.raises(ValidationError, match="eps_high"):
        LOSSES.get("tic_grpo").Config()
    assert not LOSSES.get("tic_grpo").token_corrections
    assert LOSSES.get("tic_grpo").requires[0].allowed == ("seq_mean_token_mean",)


def test_tic_grpo_through_the_update_matches_a_hand_loss():
    stage, policy = stage_and_policy(loss={"use": "tic_grpo", "with": {"eps_high": 0.28}},
                                     aggregation={"use": "seq_mean_token_mean"})
    group_ = stale_group(policy.model)  # log-ratios -DELTAS: rho_0 = e^0.39 (A > 0: clipped), rho_1 = e^0.75 (A < 0)
    got, metrics = grpo_gradients(stage, group_)
    total = 0.0
    for r, a in zip(group_.rollouts, group_advantages()):
        logp = token_logprobs(policy.model, r.response_token_ids)
        rho = torch.exp((logp - torch.tensor(r.behavior_logprobs)).sum())  # pi(y) / mu(y), the product
        total = total - torch.min(rho * a, torch.clamp(rho, max=1.28) * a)
    for g, w in zip(got, hand_gradients(policy.model, total / 2)):  # the mean over the 2 trajectories
        torch.testing.assert_close(g, w, atol=1e-6, rtol=0)
    assert metrics["clip_fraction"] == 1.0  # both trajectory ratios are above 1.28
    assert any(float(g.abs().max()) > 0 for g in got)  # response 1 (A < 0) has no lower clip: it pulls


# --- tic_grpo estimator -----------------------------------------------------------------------

def tic(**config):
    return AdvantageSpec(use="tic_grpo", **{"with": config}).build()


def test_tic_grpo_advantage_divides_rewards_by_length_before_normalising():
    # rewards 1, 1, 0, 0 with lengths 2, 4, 4, 1: u = 0.5, 0.25, 0, 0; mean 0.1875;
    # sum of squared deviations 0.3125^2 + 0.0625^2 + 2 * 0.1875^2 = 0.171875: sample std sqrt(0.171875 / 3)
    out = tic().estimate(group([1, 1, 0, 0], lengths=[2, 4, 4, 1])).values
    std = math.sqrt(0.171875 / 3)
    want = [(u - 0.1875) / (std + 1e-6) for u in (0.5, 0.25, 0.0, 0.0)]
    assert list(out) == pytest.approx(want, abs=1e-9)
    population = tic(std_ddof=0, eps=0.0).estimate(group([1, 1, 0, 0], lengths=[2, 4, 4, 1])).values
    assert list(population) == pytest.approx([(u - 0.1875) / math.sqrt(0.171875 / 4)
                                              for u in (0.5, 0.25, 0.0, 0.0)], abs=1e-9)


def test_tic_grpo_advantage_keeps_a_signal_in_an_all_correct_group_of_different_lengths():
    # rewards 1, 1 with lengths 1, 3: u = 1, 1/3; mean 2/3; sample std sqrt(2) / 3
    out = tic().estimate(group([1, 1], lengths=[1, 3])).values
    s = math.sqrt(2) / 3
    assert list(out) == pytest.approx([(1 / 3) / (s + 1e-6), -(1 / 3) / (s + 1e-6)], abs=1e-9)


def test_tic_grpo_advantage_edge_cases():
    assert tic().estimate(group([0, 0, 0], lengths=[1, 2, 3])).values == (0.0, 0.0, 0.0)  # u all 0
    assert tic().estimate(group([1, 1], lengths=[2, 2])).values == (0.0, 0.0)  # equal u
    assert tic().estimate(group([1], lengths=[2])).values == (0.0,)  # G = 1: no baseline
    with pytest.raises(ValueError, match="NaN"):
        tic().estimate(group([1.0, float("nan")], lengths=[1, 1]))
    with pytest.raises(ValueError, match="has no tokens"):
        tic().estimate(group([1.0, 0.0], lengths=[2, 0]))


# --- tr_grpo ----------------------------------------------------------------------------------

def test_tr_grpo_weights_on_hand_probabilities():
    cls = LOSSES.get("tr_grpo")
    loss = cls(cls.Config(tau=1 / 9))
    probs = [0.01, 0.1, 0.2, 0.3, 0.6]
    got = loss.weights(torch.log(torch.tensor([probs], dtype=torch.float64)))[0].tolist()
    # 2 (sigmoid(9 p) - 0.25) clipped to [1, 1.4]: p = 0.01, 0.1 fall below 1 (9p < ln 3), 0.6 above 1.4
    want = [min(max(2 * (sigmoid(9 * p) - 0.25), 1.0), 1.4) for p in probs]
    assert want[0] == want[1] == 1.0 and want[4] == 1.4 and 1.0 < want[2] < want[3] < 1.4
    assert got == pytest.approx(want, abs=1e-12)


def test_tr_grpo_gradient_is_the_weighted_ppo_gradient():
    theta = toy_theta()
    cls = LOSSES.get("tr_grpo")
    loss = cls(cls.Config(tau=0.5, mu=0.3, bounds=(0.5, 1.5), clip=(0.2, 0.2)))
    log_ratio, advantages = [[0.1, 0.3], [0.5, 0.05]], [1.0, -2.0]
    probs = torch.softmax(theta.detach(), -1).gather(-1, TOKENS[..., None])[..., 0]  # p_bt under the toy policy
    logp = torch.log_softmax(theta, -1).gather(-1, TOKENS[..., None])[..., 0]
    behaviour = logp.detach() - torch.tensor(log_ratio, dtype=theta.dtype)
    weight = torch.ones_like(logp)
    adv = torch.tensor(advantages, dtype=theta.dtype)[:, None].expand_as(logp)
    terms = loss.terms(logp - behaviour, adv, weight, logprobs=logp.detach())
    theta.grad = None
    terms.per_token.mean().backward()  # the token mean over 4 tokens of weight 1
    # L = (1/4) sum_bt -w_bt min(r A, clip(r) A): dL/dlog pi_bt = -(1/4) w_bt r_bt A_b where the unclipped term
    # is the min, else 0 (w_bt is detached); w_bt = clip(2 (sigmoid(p_bt / 0.5) - 0.3), 0.5, 1.5)
    c = []
    for b, a in enumerate(advantages):
        row = []
        for t in range(2):
            r = math.exp(log_ratio[b][t])
            w = min(max(2 * (sigmoid(float(probs[b, t]) / 0.5) - 0.3), 0.5), 1.5)
            active = r <= 1.2 if a > 0 else r >= 0.8
            row.append(-w * r * a / 4 if active else 0.0)
        c.append(row)
    assert c[0][1] == 0.0 and c[1][0] != 0.0  # e^0.3 > 1.2 with A > 0 is clipped; e^0.5 with A < 0 is not
    assert_hand(theta, theta.grad, c)


def test_tr_grpo_through_the_update_matches_a_hand_loss():
    stage, policy = stage_and_policy(loss={"use": "tr_grpo", "with": {"tau": 0.25, "bounds": [0.6, 1.3]}})
    group_ = stale_group(policy.model)
    got, _ = grpo_gradients(stage, group_)
    total = 0.0
    for r, a in zip(group_.rollouts, group_advantages()):
        logp = token_logprobs(policy.model, r.response_token_ids)
        ratio = torch.exp(logp - torch.tensor(r.behavior_logprobs))
        w = torch.clamp(2 * (torch.sigmoid(torch.exp(logp.detach()) / 0.25) - 0.25), 0.6, 1.3)
        total = total - (w * torch.min(ratio * a, torch.clamp(ratio, 0.8, 1.2) * a)).sum()
    for g, want in zip(got, hand_gradients(policy.model, total / 7)):  # token_mean over 4 + 3 tokens
        torch.testing.assert_close(g, want, atol=1e-6, rtol=0)


def test_tr_grpo_refuses_a_setting_whose_weights_are_all_equal():
    cls = LOSSES.get("tr_grpo")
    with pytest.raises(ValidationError, match="tau"):
        cls.Config()  # tau is required
    with pytest.raises(ValidationError, match="plain GRPO"):
        cls.Config(tau=9.0)  # the transcribed tau: 2 (sigmoid(p / 9) - 0.25) <= 0.56 < L = 1 for every p
    with pytest.raises(ValidationError, match="L <= U"):
        cls.Config(tau=0.1, bounds=(1.4, 1.0))
    with pytest.raises(ValueError, match="needs the current policy's token log-probabilities"):
        cls(cls.Config(tau=0.1)).terms(torch.zeros(1, 1), torch.ones(1, 1), torch.ones(1, 1))


# --- gfcr validate ----------------------------------------------------------------------------

@pytest.mark.parametrize("overrides, path, message", [
    (["update.with.loss={use: tic_grpo, with: {eps_high: 0.28}}"], "update.with.aggregation.use",
     "TIC-GRPO's objective is a mean over trajectories of one ratio each, so it needs aggregation "
     "`seq_mean_token_mean`"),
    (["update.with.loss={use: tic_grpo}", "update.with.aggregation.use=seq_mean_token_mean"],
     "update.with.loss.with", "`eps_high`"),
    (["update.with.loss={use: tic_grpo, with: {eps_high: 0.28}}", "update.with.aggregation.use=seq_mean_token_mean",
      "update.with.correction.use=tis"], "update.with.correction.use", "loss `tic_grpo` has no per-token ratio"),
    (["update.with.loss={use: tr_grpo, with: {tau: 9.0}}"], "update.with.loss.with", "this is plain GRPO"),
    (["update.with.loss={use: tr_grpo}"], "update.with.loss.with", "`tau`"),
])
def test_misconfigured_tic_and_tr_grpo_fail_validation_with_the_key_path(overrides, path, message):
    result = CliRunner().invoke(app, ["validate", QUICKSTART] + [a for o in overrides for a in ("--set", o)])
    assert result.exit_code == 2, result.output
    assert f"{path}:" in result.output and message in result.output, result.output
    assert "quickstart.yaml:" in result.output and "Traceback" not in result.output


@pytest.mark.parametrize("overrides", [
    ["update.with.advantage.use=tic_grpo"],
    ["update.with.loss={use: tic_grpo, with: {eps_high: 0.28}}", "update.with.aggregation.use=seq_mean_token_mean",
     "update.with.advantage.use=tic_grpo"],
    ["update.with.loss={use: tr_grpo, with: {tau: 0.1111}}"],
])
def test_tic_and_tr_grpo_validate_in_the_quickstart(overrides):
    result = CliRunner().invoke(app, ["validate", QUICKSTART] + [a for o in overrides for a in ("--set", o)])
    assert result.exit_code == 0, result.output
