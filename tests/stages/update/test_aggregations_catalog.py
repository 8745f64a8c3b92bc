"""The registered aggregations (``token_mean``, ``seq_mean_token_mean``, ``seq_mean_token_sum``,
``daro``, ``lambda_grpo``): the gradient they give a toy policy (and their learnable weights)
equals a hand-derived gradient; the learnable ones round-trip their state, and their parameters
get a gradient and move in one ``update.grpo`` step; misconfigurations fail ``gfcr validate``.

The toy policy is that of ``test_losses_catalog``: logits ``theta[b, t, :]`` over 3 tokens, two
response positions, ``d log pi_bt / d theta_bt = onehot(y_bt) - softmax(theta_bt)``. The loss is
``ppo_clip`` with a clip range no ratio here leaves, so every token's loss is ``l_bt = -r_bt A_b``
and ``dl_bt / d log pi_bt = -r_bt A_b``."""

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
from gfcr.registry.catalog import AGGREGATIONS, BUILTIN_AGGREGATIONS, LOSSES
from gfcr.stages.components.aggregation import Row
from tests.stages.update.test_tree_and_off_policy import POOL, stage_and_policy, token_logprobs, tree_group

QUICKSTART = str(Path(__file__).resolve().parents[3] / "pipelines" / "quickstart.yaml")
ALL_TOKENS = torch.tensor([[0, 2], [1, 1], [2, 0], [1, 0]])
LOG_RATIOS = [[0.1, -0.2], [0.05, 0.3], [-0.1, 0.2], [0.15, -0.05]]
ADVANTAGES = [1.0, -0.5, 0.8, 0.7]


def toy(batch: int) -> tuple[torch.nn.Parameter, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    return torch.nn.Parameter(torch.randn(batch, 2, 3, generator=generator, dtype=torch.float64)), ALL_TOKENS[:batch]


def gfcr_loss(theta, tokens, weight, rows, aggregation) -> torch.Tensor:
    """``reduce`` of ``ppo_clip``'s token losses (plus ``batch_term``), with log-ratios LOG_RATIOS."""
    batch = len(rows)
    logp = torch.log_softmax(theta, -1).gather(-1, tokens[..., None])[..., 0]  # [B, 2]
    log_ratio = logp - (logp.detach() - torch.tensor(LOG_RATIOS[:batch], dtype=theta.dtype))
    adv = torch.tensor(ADVANTAGES[:batch], dtype=theta.dtype)[:, None].expand_as(logp)
    wide = LOSSES.get("ppo_clip")(LOSSES.get("ppo_clip").Config(clip=(0.99, 10.0)))
    terms = wide.terms(log_ratio, adv, weight)
    plan = aggregation.plan(rows)
    loss = aggregation.reduce(terms.per_token, weight, rows, plan)
    extra = getattr(aggregation, "batch_term", None)
    term = extra(plan) if extra is not None else None
    return loss if term is None else loss + term


def token_loss(b: int, t: int) -> float:
    return -math.exp(LOG_RATIOS[b][t]) * ADVANTAGES[b]  # l_bt = -r_bt A_b (never clipped here)


def hand_gradient(theta, tokens, c) -> torch.Tensor:
    onehot = torch.nn.functional.one_hot(tokens, 3).to(theta.dtype)
    return torch.tensor(c, dtype=theta.dtype)[..., None] * (onehot - torch.softmax(theta.detach(), -1))


def policy_gradient(theta, tokens, weight, rows, aggregation) -> torch.Tensor:
    theta.grad = None
    gfcr_loss(theta, tokens, weight, rows, aggregation).backward()
    return theta.grad.clone()


# --- the three fixed aggregations --------------------------------------------------------------

# response 0 has 1 token; response 1 has 2, the first shared with a sibling (weight 1/2)
WEIGHT = torch.tensor([[1.0, 0.0], [0.5, 1.0]], dtype=torch.float64)
ROWS = [Row("g", 2, np.array([1.0, 0.0]), 1, 1.0, 1), Row("g", 2, np.array([1.0, 0.0]), 2, 1.5, 2)]


@pytest.mark.parametrize("alias, config, denominator", [
    ("token_mean", {}, lambda b: 2.5),  # sum of all token weights: 1 + 0.5 + 1
    ("seq_mean_token_mean", {}, lambda b: [1, 2][b] * 2),  # n_b counted tokens, times N = 2 responses
    ("seq_mean_token_sum", {"constant": 4.0}, lambda b: 4.0 * 2),  # C, times N = 2 responses
])
def test_fixed_aggregation_gradients_match_the_hand_derivation(alias, config, denominator):
    theta, tokens = toy(2)
    cls = AGGREGATIONS.get(alias)
    got = policy_gradient(theta, tokens, WEIGHT, ROWS, cls(cls.Config(**config)))
    # dL/dlog pi_bt = w_bt * (-r_bt A_b) / denominator_b
    c = [[float(WEIGHT[b, t]) * -math.exp(LOG_RATIOS[b][t]) * ADVANTAGES[b] / denominator(b) for t in range(2)]
         for b in range(2)]
    torch.testing.assert_close(got, hand_gradient(theta, tokens, c), atol=1e-6, rtol=0)


# --- daro -------------------------------------------------------------------------------------

G4 = np.array
DARO_ROWS = [Row("a", 1, G4([1.0, 0.0, 0.0, 0.0]), 2, 2.0, 2),  # mu = 1/4
             Row("b", 2, G4([1.0, 1.0, 0.0, 0.0]), 2, 2.0, 2),  # mu = 2/4
             Row("b", 2, G4([1.0, 1.0, 0.0, 0.0]), 1, 1.0, 1),  # mu = 2/4, one token
             Row("c", 1, G4([0.0, 0.0, 0.0, 0.0]), 2, 2.0, 2)]  # mu = 0: not in M, contributes nothing
DARO_WEIGHT = torch.tensor([[1.0, 1.0], [1.0, 1.0], [1.0, 0.0], [1.0, 1.0]], dtype=torch.float64)
DARO_W = {1: 2.0, 2: 0.5, 3: 1.0}  # w_mu for mu = k / 4


def daro(**config):
    agg = AGGREGATIONS.get("daro")(AGGREGATIONS.get("daro").Config(rollouts_per_prompt=4, **config))
    agg.load_state_dict({"log_weights": [math.log(DARO_W[k]) for k in (1, 2, 3)]})
    return agg


def test_daro_policy_and_weight_gradients_match_the_hand_derivation():
    theta, tokens = toy(4)
    agg = daro()
    got = policy_gradient(theta, tokens, DARO_WEIGHT, DARO_ROWS, agg)
    mu_of, tokens_of = [1, 2, 2, None], {1: 2.0, 2: 3.0}  # difficulty of each row; token weight per mu
    # L = sum_mu w_mu L_mu - ln w_mu, L_mu = sum_{b in mu, t} w_bt l_bt / N_mu
    c = [[0.0, 0.0] for _ in range(4)]
    loss_of = {1: 0.0, 2: 0.0}
    for b, k in enumerate(mu_of):
        for t in range(2):
            if k is None:
                continue
            w_bt = float(DARO_WEIGHT[b, t])
            c[b][t] = DARO_W[k] * w_bt * -math.exp(LOG_RATIOS[b][t]) * ADVANTAGES[b] / tokens_of[k]
            loss_of[k] += w_bt * token_loss(b, t) / tokens_of[k]
    torch.testing.assert_close(got, hand_gradient(theta, tokens, c), atol=1e-6, rtol=0)
    # d/ds_mu (e^s L_mu - s) = w_mu L_mu - 1 for mu in the batch; mu = 3/4 is absent: no term
    want = torch.tensor([DARO_W[1] * loss_of[1] - 1, DARO_W[2] * loss_of[2] - 1, 0.0])
    torch.testing.assert_close(agg.log_w.grad, want.to(agg.log_w.dtype), atol=1e-6, rtol=0)


def test_daro_state_round_trips_and_reports_its_weights():
    agg = daro()
    again = AGGREGATIONS.get("daro")(AGGREGATIONS.get("daro").Config(rollouts_per_prompt=4))
    assert again.weights() == {"1/4": 1.0, "2/4": 1.0, "3/4": 1.0}
    again.load_state_dict(agg.state_dict())
    assert again.weights() == pytest.approx({"1/4": 2.0, "2/4": 0.5, "3/4": 1.0})
    assert again.metrics()["daro_weight_1_of_4"] == pytest.approx(2.0)
    with pytest.raises(ValueError, match="rollouts_per_prompt=8"):
        AGGREGATIONS.get("daro")(AGGREGATIONS.get("daro").Config(rollouts_per_prompt=8)).load_state_dict(
            agg.state_dict())


@pytest.mark.parametrize("rewards", [[1.0, 0.5, 0.0, 0.0], [1.0, 0.0, 0.0]])
def test_daro_refuses_groups_whose_pass_rate_is_not_k_over_g(rewards):
    with pytest.raises(ValueError, match="group odd: DARO needs 4 binary rewards"):
        daro().plan([Row("odd", 1, np.array(rewards), 2, 2.0, 2)])


# --- lambda_grpo --------------------------------------------------------------------------------

LAMBDA_ROWS = [Row("g", 2, np.zeros(2), 1, 1.0, 1), Row("g", 2, np.zeros(2), 2, 2.0, 2),
               Row("h", 1, np.zeros(1), 2, 2.0, 2)]  # h: a group of one, z = 0, f = 1
LAMBDA_WEIGHT = torch.tensor([[1.0, 0.0], [1.0, 1.0], [1.0, 1.0]], dtype=torch.float64)
LAM, R = 0.7, 0.5


def lambda_grpo():
    agg = AGGREGATIONS.get("lambda_grpo")(AGGREGATIONS.get("lambda_grpo").Config(r=R))
    agg.load_state_dict({"lambda": LAM})
    return agg


def test_lambda_grpo_policy_and_lambda_gradients_match_the_hand_derivation():
    theta, tokens = toy(3)
    agg = lambda_grpo()
    got = policy_gradient(theta, tokens, LAMBDA_WEIGHT, LAMBDA_ROWS, agg)
    # group g: lengths 1, 2; mean 1.5, std (ddof 1) = sqrt(0.5); z = -+0.5 / sqrt(0.5)
    z = [-0.5 / (math.sqrt(0.5) + 1e-8), 0.5 / (math.sqrt(0.5) + 1e-8)]
    h = [1 + R * zi for zi in z]
    g = [hi ** LAM for hi in h]
    p = [math.exp(gi) / sum(math.exp(gj) for gj in g) for gi in g]
    f = [2 * p[0], 2 * p[1], 1.0]  # f_i = G softmax(h ** lambda)_i; the lone response of h: 1
    n_tokens = 5.0  # 1 + 2 + 2
    c = [[f[b] * float(LAMBDA_WEIGHT[b, t]) * -math.exp(LOG_RATIOS[b][t]) * ADVANTAGES[b] / n_tokens
          for t in range(2)] for b in range(3)]
    torch.testing.assert_close(got, hand_gradient(theta, tokens, c), atol=1e-6, rtol=0)
    # dL/dlambda = (1/N) sum_{b in g} S_b f_b (g'_b - sum_j p_j g'_j), g'_j = h_j^lambda ln h_j
    s = [sum(float(LAMBDA_WEIGHT[b, t]) * token_loss(b, t) for t in range(2)) for b in range(2)]
    dg = [hi ** LAM * math.log(hi) for hi in h]
    mean_dg = sum(pj * dgj for pj, dgj in zip(p, dg))
    want = sum(s[b] * f[b] * (dg[b] - mean_dg) for b in range(2)) / n_tokens
    assert float(agg.lam.grad) == pytest.approx(want, abs=1e-6)


def test_lambda_zero_is_the_token_mean():
    theta, tokens = toy(3)
    agg = AGGREGATIONS.get("lambda_grpo")(AGGREGATIONS.get("lambda_grpo").Config(r=R))
    token_mean = AGGREGATIONS.get("token_mean")(AGGREGATIONS.get("token_mean").Config())
    a = policy_gradient(theta, tokens, LAMBDA_WEIGHT, LAMBDA_ROWS, agg)
    b = policy_gradient(theta, tokens, LAMBDA_WEIGHT, LAMBDA_ROWS, token_mean)
    torch.testing.assert_close(a, b, atol=1e-12, rtol=0)


def test_lambda_grpo_state_round_trips_and_refuses_a_non_positive_h():
    again = AGGREGATIONS.get("lambda_grpo")(AGGREGATIONS.get("lambda_grpo").Config(r=R))
    again.load_state_dict(lambda_grpo().state_dict())
    assert again.metrics() == {"lambda": pytest.approx(LAM)}
    steep = AGGREGATIONS.get("lambda_grpo")(AGGREGATIONS.get("lambda_grpo").Config(r=2.0))
    with pytest.raises(ValueError, match="group g: h = 1 \\+ r z is not positive"):
        steep.plan(LAMBDA_ROWS)  # z = -0.707: 1 - 1.41 < 0


# --- through update.grpo --------------------------------------------------------------------------

def one_step(stage, group, parameter):
    """Run one update; return (the parameter's gradient at the step, its value before)."""
    seen, step = {}, stage.optimizer.step
    stage.optimizer.step = lambda: (seen.setdefault("grad", parameter.grad.detach().clone()), step())
    before = parameter.detach().clone()
    report = stage.run(RolloutGroups([group]), POOL)
    assert not report.skipped, report.skip_reason
    return seen["grad"], before, report


def test_daro_weights_get_their_gradient_and_move_in_one_update():
    stage, policy = stage_and_policy(aggregation={"use": "daro", "with": {"rollouts_per_prompt": 3, "lr": 0.05}})
    group = tree_group(policy.model, rewards=(1.0, 0.0, 1.0))  # mu = 2/3
    group.tree = None
    hand = 0.0  # L_{2/3}: token mean of -r A over the group's 4 + 4 + 3 tokens
    rewards = np.array([1.0, 0.0, 1.0])
    for r, a in zip(group.rollouts, (rewards - rewards.mean()) / (rewards.std(ddof=1) + 1e-6)):
        logp = token_logprobs(policy.model, r.response_token_ids).detach()
        hand += float((-torch.exp(logp - torch.tensor(r.behavior_logprobs)) * float(a)).sum()) / 11
    agg = stage.aggregation
    grad, before, report = one_step(stage, group, agg.log_w)
    assert float(grad[0]) == 0.0  # mu = 1/3 is not in the batch
    assert float(grad[1]) == pytest.approx(1.0 * hand - 1.0, abs=1e-6)  # w L - 1 at w = 1
    after = agg.log_w.detach()
    assert float(after[0]) == float(before[0]) and float(after[1]) != float(before[1])
    assert report.metrics["daro_weight_2_of_3"] == pytest.approx(math.exp(float(before[1])))  # the w it used
    # the update's state carries the weights
    again, _ = stage_and_policy(aggregation={"use": "daro", "with": {"rollouts_per_prompt": 3}})
    again.load_state_dict(stage.state_dict())
    torch.testing.assert_close(again.aggregation.log_w.detach(), agg.log_w.detach())


def test_lambda_gets_its_gradient_and_moves_in_one_update():
    stage, policy = stage_and_policy(aggregation={"use": "lambda_grpo", "with": {"r": 0.3, "lr": 0.05}})
    group = tree_group(policy.model)  # lengths 4, 4, 3: z != 0
    group.tree = None
    grad, before, report = one_step(stage, group, stage.aggregation.lam)
    assert float(grad) != 0.0
    assert float(stage.aggregation.lam.detach()) != float(before)
    assert report.metrics["lambda"] == pytest.approx(float(before))  # the lambda the step used
    again, _ = stage_and_policy(aggregation={"use": "lambda_grpo", "with": {"r": 0.3}})
    again.load_state_dict(stage.state_dict())
    assert float(again.aggregation.lam.detach()) == float(stage.aggregation.lam.detach())


# --- gfcr validate ----------------------------------------------------------------------------

@pytest.mark.parametrize("overrides, path, message", [
    (["update.with.aggregation.use=daro"], "update.with.aggregation.with",
     "aggregation `daro`: `rollouts_per_prompt` is required"),
    (["update.with.aggregation={use: daro, with: {rollouts_per_prompt: 4}}"],
     "update.with.aggregation.with.rollouts_per_prompt",
     "DARO's difficulties are pass rates k/4, but stage `budget` allocates 8 rollouts per prompt"),
    (["update.with.aggregation.use=lambda_grpo"], "update.with.aggregation.with",
     "aggregation `lambda_grpo`: `r` is required"),
    (["update.with.aggregation.use=seq_mean_token_sum"], "update.with.aggregation.with",
     "aggregation `seq_mean_token_sum`: `constant` is required"),
])
def test_misconfigured_aggregations_fail_validation_with_the_key_path(overrides, path, message):
    result = CliRunner().invoke(app, ["validate", QUICKSTART] + [a for o in overrides for a in ("--set", o)])
    assert result.exit_code == 2, result.output
    assert f"{path}:" in result.output and message in result.output, result.output
    assert "quickstart.yaml:" in result.output and "Traceback" not in result.output


@pytest.mark.parametrize("override", ["update.with.aggregation={use: daro, with: {rollouts_per_prompt: 8}}",
                                      "update.with.aggregation={use: lambda_grpo, with: {r: 0.3}}"])
def test_well_configured_aggregations_validate(override):
    result = CliRunner().invoke(app, ["validate", QUICKSTART, "--set", override])
    assert result.exit_code == 0, result.output


@pytest.mark.parametrize("alias", sorted(BUILTIN_AGGREGATIONS))
def test_aggregation_docstring_examples_run(alias):
    module = importlib.import_module(BUILTIN_AGGREGATIONS[alias].partition(":")[0])
    result = doctest.testmod(module)
    assert result.attempted > 0 and result.failed == 0


def test_lambda_grpo_r_too_large_for_the_group_size_fails_validate():
    quickstart = str(Path(__file__).resolve().parents[3] / "pipelines" / "quickstart.yaml")
    bad = CliRunner().invoke(app, ["validate", quickstart, "--set",
                                   'update.with.aggregation={"use": "lambda_grpo", "with": {"r": 0.5}}'])
    assert bad.exit_code == 2 and "update.with.aggregation.with.r:" in bad.output
    assert "below sqrt(G) / (G - 1) = 0.4041" in bad.output  # sqrt(8) / 7, quickstart's groups of 8
    good = CliRunner().invoke(app, ["validate", quickstart, "--set",
                                    'update.with.aggregation={"use": "lambda_grpo", "with": {"r": 0.4}}'])
    assert good.exit_code == 0, good.output
