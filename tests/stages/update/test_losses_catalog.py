"""The registered losses (``gspo``, ``gspo_token``, ``cispo``, and ``ppo_clip`` with its dual
clip): the gradient they give a toy policy equals a hand-derived gradient, through the loss and
aggregation contract and through ``update.grpo``; misconfigurations fail ``gfcr validate``.

The toy policy: a ``torch.nn.Parameter`` of logits ``theta[b, t, :]`` over a 3-token vocabulary
for each of two responses of two tokens. ``log pi_bt = theta_bt[y_bt] - logsumexp(theta_bt)``, so
``d log pi_bt / d theta_bt = onehot(y_bt) - softmax(theta_bt)``, and the hand gradient of a loss
``L`` is ``c_bt * (onehot(y_bt) - softmax(theta_bt))`` with ``c_bt = dL / d log pi_bt`` written
out below for each method."""

from __future__ import annotations

import doctest
import importlib
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from gfcr.cli.main import app
from gfcr.records import RolloutGroups
from gfcr.registry.catalog import BUILTIN_LOSSES, LOSSES
from gfcr.stages.components.aggregation import Row
from gfcr.stages.components.aggregation.seq_mean_token_mean import SeqMeanTokenMean
from gfcr.stages.components.aggregation.token_mean import TokenMean
from tests.stages.update.test_tree_and_off_policy import (
    DELTAS,
    POOL,
    hand_gradients,
    stage_and_policy,
    stale_group,
    token_logprobs,
)

QUICKSTART = str(Path(__file__).resolve().parents[3] / "pipelines" / "quickstart.yaml")
TOKENS = torch.tensor([[0, 2], [1, 1]])  # y_bt of the two responses
ROWS = [Row("g", 2, np.array([1.0, 0.0]), 2, 2.0, 2), Row("g", 2, np.array([1.0, 0.0]), 2, 2.0, 2)]


def toy_theta() -> torch.nn.Parameter:
    generator = torch.Generator().manual_seed(0)
    return torch.nn.Parameter(torch.randn(2, 2, 3, generator=generator, dtype=torch.float64))


def score(theta: torch.Tensor) -> torch.Tensor:
    """``[B, T, V]``: d log pi_bt / d theta_bt = onehot(y_bt) - softmax(theta_bt)."""
    onehot = torch.nn.functional.one_hot(TOKENS, 3).to(theta.dtype)
    return onehot - torch.softmax(theta.detach(), -1)


def gfcr_gradient(theta, log_ratio_values, advantages, loss, aggregation, weight=None) -> torch.Tensor:
    """The gradient of ``aggregation.reduce(loss.terms(...))``, with behaviour log-probs set so
    that ``log_ratio`` has the given values and the gradient of ``log pi``."""
    logp = torch.log_softmax(theta, -1).gather(-1, TOKENS[..., None])[..., 0]  # [B, T]
    behaviour = logp.detach() - torch.tensor(log_ratio_values, dtype=theta.dtype)
    weight = torch.ones_like(logp) if weight is None else weight
    adv = torch.tensor(advantages, dtype=theta.dtype)[:, None].expand_as(logp)
    terms = loss.terms(logp - behaviour, adv, weight)
    theta.grad = None
    aggregation.reduce(terms.per_token, weight, ROWS, aggregation.plan(ROWS)).backward()
    return theta.grad.clone()


def unclipped_term_is_the_min(ratio: float, advantage: float, eps_low: float, eps_high: float) -> bool:
    """In ``min(r A, clip(r) A)`` the unclipped ``r A`` is (one of) the minimum, so it carries
    the gradient ``A dr``; otherwise the clipped constant is, and the gradient is 0."""
    if advantage > 0:
        return ratio <= 1 + eps_high
    if advantage < 0:
        return ratio >= 1 - eps_low
    return True


def assert_hand(theta, got, c) -> None:
    want = torch.tensor(c, dtype=theta.dtype)[..., None] * score(theta)
    torch.testing.assert_close(got, want, atol=1e-6, rtol=0)


# --- ppo_clip, incl. the dual clip ------------------------------------------------------------

def test_ppo_clip_gradient_with_a_dual_clip_matches_the_hand_derivation():
    # response 0 (A = +1): r = e^0.1 inside the clip, r = e^0.3 above 1.2 (clipped: no gradient)
    # response 1 (A = -2): r = e^1.5 = 4.48 > c = 3, the dual clip caps the loss at -c A (no
    # gradient); r = e^0.05 inside the clip
    log_ratio, advantages, c_dual = [[0.1, 0.3], [1.5, 0.05]], [1.0, -2.0], 3.0
    theta = toy_theta()
    loss = LOSSES.get("ppo_clip")(LOSSES.get("ppo_clip").Config(clip=(0.2, 0.2), dual_clip=c_dual))
    got = gfcr_gradient(theta, log_ratio, advantages, loss, TokenMean(TokenMean.Config()))
    c = [[0.0, 0.0], [0.0, 0.0]]
    for b in range(2):
        a = advantages[b]
        for t in range(2):
            r = math.exp(log_ratio[b][t])
            ppo_loss = -min(r * a, min(max(r, 0.8), 1.2) * a)
            dual_capped = a < 0 and -c_dual * a < ppo_loss  # l = min(ppo loss, -c A) picks the constant
            active = unclipped_term_is_the_min(r, a, 0.2, 0.2) and not dual_capped
            c[b][t] = -r * a / 4 if active else 0.0  # token_mean over 4 tokens; d(r)/d log pi = r
    assert c[0][1] == 0.0 and c[1][0] == 0.0 and c[0][0] != 0.0 and c[1][1] != 0.0
    assert_hand(theta, got, c)


def test_without_the_dual_clip_the_far_negative_token_keeps_its_gradient():
    theta = toy_theta()
    loss = LOSSES.get("ppo_clip")(LOSSES.get("ppo_clip").Config(clip=(0.2, 0.2)))
    got = gfcr_gradient(theta, [[0.1, 0.3], [1.5, 0.05]], [1.0, -2.0], loss, TokenMean(TokenMean.Config()))
    r10 = math.exp(1.5)
    assert_hand(theta, got, [[-math.exp(0.1) / 4, 0.0], [2.0 * r10 / 4, 2.0 * math.exp(0.05) / 4]])


# --- gspo and gspo_token ----------------------------------------------------------------------

GSPO_LOG_RATIOS = [[1e-4, 2e-4], [3e-4, 9e-4]]  # s_0 = e^1.5e-4 inside [1-3e-4, 1+4e-4]; s_1 = e^6e-4 above


@pytest.mark.parametrize("alias", ["gspo", "gspo_token"])
@pytest.mark.parametrize("advantages", [(1.5, 0.5), (-1.5, -0.5)])
def test_gspo_gradient_is_the_sequence_ratio_times_the_mean_score(alias, advantages):
    theta = toy_theta()
    cls = LOSSES.get(alias)
    got = gfcr_gradient(theta, GSPO_LOG_RATIOS, advantages, cls(cls.Config()), SeqMeanTokenMean(SeqMeanTokenMean.Config()))
    # L = 1/2 sum_b -min(s_b A_b, clip(s_b) A_b), s_b = exp((lr_b0 + lr_b1) / 2):
    # dL/dlog pi_bt = -(1/2) A_b s_b (1/2) when the unclipped term is the min, else 0
    c = []
    for b, a in enumerate(advantages):
        s = math.exp(sum(GSPO_LOG_RATIOS[b]) / 2)
        active = unclipped_term_is_the_min(s, a, 3e-4, 4e-4)
        c.append([-0.5 * a * s * 0.5 if active else 0.0] * 2)
    # A > 0: response 1's ratio is clipped; A < 0: both carry a gradient
    assert (c[1][0] == 0.0) == (advantages[0] > 0)
    assert_hand(theta, got, c)


@pytest.mark.parametrize("alias", ["gspo", "gspo_token"])
def test_gspo_reports_one_ratio_per_response_and_clips_it_as_a_whole(alias):
    cls = LOSSES.get(alias)
    log_ratio = torch.tensor(GSPO_LOG_RATIOS, dtype=torch.float64)
    terms = cls(cls.Config()).terms(log_ratio, torch.ones(2, 2, dtype=torch.float64), torch.ones(2, 2))
    want = torch.tensor([[math.exp(1.5e-4)] * 2, [math.exp(6e-4)] * 2], dtype=torch.float64)
    torch.testing.assert_close(terms.ratio, want, atol=1e-12, rtol=0)
    assert terms.clipped.tolist() == [[False, False], [True, True]]


def test_gspo_averages_only_the_counted_tokens():
    # a masked (weight 0) token is not part of y_i: s = e^(first log-ratio) alone
    cls = LOSSES.get("gspo")
    log_ratio = torch.tensor([[2e-4, 5.0]], dtype=torch.float64)
    terms = cls(cls.Config()).terms(log_ratio, torch.ones_like(log_ratio), torch.tensor([[1.0, 0.0]]))
    assert float(terms.ratio[0, 0]) == pytest.approx(math.exp(2e-4), abs=1e-9)


def test_gspo_defaults_are_the_papers():
    assert LOSSES.get("gspo").Config().clip == (3e-4, 4e-4)
    assert LOSSES.get("gspo_token").Config().clip == (3e-4, 4e-4)
    assert not LOSSES.get("gspo").token_corrections and not LOSSES.get("gspo_token").token_corrections


# --- cispo ------------------------------------------------------------------------------------

@pytest.mark.parametrize("eps_low", [None, 0.1])
def test_cispo_gradient_is_the_clipped_detached_weight_times_the_score(eps_low):
    log_ratio, advantages, eps_high = [[0.3, -0.3], [0.05, -0.02]], [1.0, -0.5], 0.2
    theta = toy_theta()
    cls = LOSSES.get("cispo")
    got = gfcr_gradient(theta, log_ratio, advantages, cls(cls.Config(eps_high=eps_high, eps_low=eps_low)),
                        TokenMean(TokenMean.Config()))
    # L = (1/4) sum_bt -sg(r_hat_bt) A_b log pi_bt: dL/dlog pi_bt = -(1/4) r_hat_bt A_b
    c = []
    for b, a in enumerate(advantages):
        row = []
        for lr in log_ratio[b]:
            r = math.exp(lr)
            r_hat = min(r, 1 + eps_high) if eps_low is None else min(max(r, 1 - eps_low), 1 + eps_high)
            row.append(-r_hat * a / 4)
        c.append(row)
    assert_hand(theta, got, c)


def test_cispo_marks_the_tokens_whose_weight_was_clipped():
    cls = LOSSES.get("cispo")
    log_ratio = torch.tensor([[0.3, -0.3, 0.0]])
    no_floor = cls(cls.Config(eps_high=0.2)).terms(log_ratio, torch.ones(1, 3), torch.ones(1, 3))
    floor = cls(cls.Config(eps_high=0.2, eps_low=0.1)).terms(log_ratio, torch.ones(1, 3), torch.ones(1, 3))
    assert no_floor.clipped.tolist() == [[True, False, False]]  # e^-0.3 = 0.74: no lower bound by default
    assert floor.clipped.tolist() == [[True, True, False]]


def test_cispo_has_no_default_upper_bound():
    with pytest.raises(ValueError, match="eps_high"):
        LOSSES.get("cispo").Config()


# --- through update.grpo ----------------------------------------------------------------------

def grpo_gradients(stage, group) -> list[torch.Tensor]:
    model, captured = stage.policy.model, []
    model.zero_grad(set_to_none=True)
    stage.optimizer.step = lambda: captured.extend(p.grad.clone() for p in model.parameters())
    report = stage.run(RolloutGroups([group]), POOL)
    assert not report.skipped, report.skip_reason
    return captured, report.metrics


def group_advantages() -> list[float]:
    rewards = np.array([1.0, 0.0])  # stale_group's rewards; mean_std (the default estimator)
    return list((rewards - rewards.mean()) / (rewards.std(ddof=1) + 1e-6))


def test_gspo_through_the_update_matches_a_hand_loss():
    stage, policy = stage_and_policy(loss={"use": "gspo"}, aggregation={"use": "seq_mean_token_mean"})
    group = stale_group(policy.model)  # log-ratios -DELTAS: s_0 = e^0.0975 (A > 0, clipped), s_1 = e^0.25 (A < 0)
    got, metrics = grpo_gradients(stage, group)
    total = 0.0
    for r, a in zip(group.rollouts, group_advantages()):
        logp = token_logprobs(policy.model, r.response_token_ids)
        s = torch.exp((logp - torch.tensor(r.behavior_logprobs)).mean())  # (pi / mu) ** (1 / |y|)
        total = total - torch.min(s * a, torch.clamp(s, 1 - 3e-4, 1 + 4e-4) * a)
    for g, w in zip(got, hand_gradients(policy.model, total / 2)):  # mean over the 2 responses
        torch.testing.assert_close(g, w, atol=1e-6, rtol=0)
    assert metrics["clip_fraction"] == 1.0  # both sequence ratios lie outside the tiny range
    assert any(float(g.abs().max()) > 0 for g in got)  # response 1 (A < 0, s > 1 + eps) still pulls


def test_cispo_through_the_update_matches_a_hand_loss():
    stage, policy = stage_and_policy(loss={"use": "cispo", "with": {"eps_high": 0.5}})
    group = stale_group(policy.model)
    got, metrics = grpo_gradients(stage, group)
    total = 0.0
    for r, a in zip(group.rollouts, group_advantages()):
        logp = token_logprobs(policy.model, r.response_token_ids)
        mu = torch.tensor(r.behavior_logprobs)
        weight = torch.exp(logp - mu).detach().clamp(max=1.5)  # sg(clip(r, -, 1 + eps_high))
        total = total - (weight * a * logp).sum()
    for g, w in zip(got, hand_gradients(policy.model, total / 7)):  # token_mean over 4 + 3 tokens
        torch.testing.assert_close(g, w, atol=1e-6, rtol=0)
    clipped = sum(math.exp(-d) > 1.5 for ds in DELTAS for d in ds)  # e^0.7 and e^1.0
    assert clipped == 2 and metrics["clip_fraction"] == pytest.approx(clipped / 7)


# --- gfcr validate ----------------------------------------------------------------------------

@pytest.mark.parametrize("overrides, path, message", [
    (["update.with.loss.use=gspo"], "update.with.aggregation.use",
     "GSPO's objective is a mean over responses, so it needs aggregation `seq_mean_token_mean`, not `token_mean`"),
    (["update.with.loss.use=gspo_token"], "update.with.aggregation.use", "needs aggregation `seq_mean_token_mean`"),
    (["update.with.loss={use: gspo}", "update.with.aggregation.use=seq_mean_token_mean",
      "update.with.correction.use=tis"],
     "update.with.correction.use", "loss `gspo` has no per-token ratio for correction `tis` to correct"),
    (["update.with.loss={use: gspo_token}", "update.with.aggregation.use=seq_mean_token_mean",
      "update.with.correction.use=decoupled_clip"], "update.with.correction.use",
     "no per-token ratio for correction `decoupled_clip`"),
    (["update.with.loss={use: gspo}", "update.with.aggregation.use=seq_mean_token_mean",
      "update.with.correction.use=recompute_old"], "update.with.correction.use",
     "no per-token ratio for correction `recompute_old`"),
    (["update.with.loss={use: cispo}"], "update.with.loss.with", "loss `cispo`: `eps_high` is required"),
    (["update.with.loss={use: gspo, with: {clip: [0.2]}}", "update.with.aggregation.use=seq_mean_token_mean"],
     "update.with.loss.with", "loss `gspo`: `clip"),
])
def test_misconfigured_losses_fail_validation_with_the_key_path(overrides, path, message):
    result = CliRunner().invoke(app, ["validate", QUICKSTART] + [a for o in overrides for a in ("--set", o)])
    assert result.exit_code == 2, result.output
    assert f"{path}:" in result.output and message in result.output, result.output
    assert "quickstart.yaml:" in result.output and "Traceback" not in result.output


@pytest.mark.parametrize("overrides", [
    ["update.with.loss={use: gspo}", "update.with.aggregation.use=seq_mean_token_mean"],
    ["update.with.loss={use: gspo_token}", "update.with.aggregation.use=seq_mean_token_mean"],
    ["update.with.loss={use: cispo, with: {eps_high: 4.0}}", "update.with.correction.use=tis"],
    ["update.with.loss={use: gspo}", "update.with.aggregation.use=seq_mean_token_mean",  # a mask, no reweighting
     "update.with.correction={use: staleness, with: {max_staleness: 2}}"],
])
def test_well_paired_losses_validate(overrides):
    result = CliRunner().invoke(app, ["validate", QUICKSTART] + [a for o in overrides for a in ("--set", o)])
    assert result.exit_code == 0, result.output


@pytest.mark.parametrize("alias", sorted(BUILTIN_LOSSES))
def test_loss_docstring_examples_run(alias):
    module = importlib.import_module(BUILTIN_LOSSES[alias].partition(":")[0])
    result = doctest.testmod(module)
    assert result.attempted > 0 and result.failed == 0
