"""The catalog-b advantage estimators (gdpo, stratified, grpo_lead, xrpo) against groups worked
out by hand: every expected number below is explicit arithmetic, never the implementation."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
from pydantic import ValidationError
from typer.testing import CliRunner

from gfcr.cli.main import app
from gfcr.records import Rollout, RolloutGroup, Segment, group_id, rollout_id
from gfcr.stages.components.advantage import AdvantageSpec, estimate_all

QUICKSTART = str(Path(__file__).resolve().parents[3] / "pipelines" / "quickstart.yaml")
S2, S3 = math.sqrt(2), math.sqrt(3)


def group(rewards, *, prompt="p:0", components=None, correct=None, lengths=None, finish=None, logprobs=None):
    """A scored group: rollout i has reward ``rewards[i]`` and, where given, its components,
    ``correct`` flag (default: reward == 1), response length, finish reason and per-token
    behaviour log-probs (default: zeros)."""
    gid = group_id(prompt, 0)
    rollouts = []
    for i, reward in enumerate(rewards):
        lp = np.asarray(logprobs[i] if logprobs else np.zeros(lengths[i] if lengths else 1), dtype=np.float32)
        rollouts.append(Rollout(
            rollout_id(gid, i), gid, prompt, list(range(len(lp))), [Segment(0, len(lp), 0, lp)],
            finish_reason=finish[i] if finish else "stop", reward=float(reward),
            reward_components=dict(components[i]) if components else {},
            correct=correct[i] if correct is not None else reward == 1))
    return RolloutGroup(gid, prompt, 0, len(rewards), rollouts)


def estimator(use, **config):
    return AdvantageSpec(use=use, **{"with": config}).build()


def values(out) -> np.ndarray:
    return np.array(out.values, dtype=np.float64)


def cc(*pairs):
    """Components ``{correct, format}`` of each rollout."""
    return [{"correct": float(c), "format": float(f)} for c, f in pairs]


# --- gdpo ---------------------------------------------------------------------------------

def test_gdpo_separates_what_grpo_collapses_across_two_groups():
    # a: (c, f) = (0,0), (0,1): correct all equal -> 0; format [0, 1] -> mean .5, std sqrt(.5) -> -+1/sqrt2
    # b: (0,0), (1,1): each component gives -+1/sqrt2, summed -+sqrt2
    # batch [-1/s2, 1/s2, -s2, s2]: mean 0, squares sum .5 + .5 + 2 + 2 = 5, std = sqrt(5 / 3)
    a, b = group([0, 1], components=cc((0, 0), (0, 1))), group([0, 2], prompt="p:1", components=cc((0, 0), (1, 1)))
    out = estimator("gdpo", eps=0.0).estimate_batch([a, b], None)
    std = math.sqrt(5 / 3)
    np.testing.assert_allclose(values(out[0]), [-1 / S2 / std, 1 / S2 / std], atol=1e-6)
    np.testing.assert_allclose(values(out[1]), [-S2 / std, S2 / std], atol=1e-6)
    # GRPO on the summed rewards [0, 1] and [0, 2] gives both groups -+1/sqrt2: the collapse
    grpo = estimator("mean_std", eps=0.0)
    assert np.allclose(values(grpo.estimate(a)), values(grpo.estimate(b)))


def test_gdpo_weights_the_normalised_components():
    # correct [1, 1, 0]: mean 2/3, std sqrt((1/9 + 1/9 + 4/9) / 2) = 1/sqrt3 -> z = [1, 1, -2] / sqrt3
    # format  [1, 0, 0]: z = [2, -1, -1] / sqrt3
    # A_sum = z_c + 0.5 z_f = [2, 0.5, -2.5] / sqrt3; batch mean 0, std sqrt((4 + .25 + 6.25) / 3 / 2) = sqrt(1.75)
    g = group([2, 1, 0], components=cc((1, 1), (1, 0), (0, 0)))
    out = estimator("gdpo", eps=0.0, weights={"correct": 1.0, "format": 0.5}).estimate(g)
    np.testing.assert_allclose(values(out), np.array([2, 0.5, -2.5]) / S3 / math.sqrt(1.75), atol=1e-6)
    # weight 0 leaves a component out: only correct -> z_c, whose sample std is 1 -> z_c itself
    out = estimator("gdpo", eps=0.0, weights={"correct": 1.0, "format": 0.0}).estimate(g)
    np.testing.assert_allclose(values(out), np.array([1, 1, -2]) / S3, atol=1e-6)


def test_gdpo_with_one_component_is_mean_std_restandardised_over_the_batch():
    # one group [1, 0, 0, 0]: z = [1.5, -.5, -.5, -.5] (std .5), whose own sample std is 1: unchanged
    one = group([1, 0, 0, 0], components=[{"correct": r} for r in (1.0, 0.0, 0.0, 0.0)])
    np.testing.assert_allclose(values(estimator("gdpo", eps=0.0).estimate(one)), [1.5, -0.5, -0.5, -0.5], atol=1e-6)
    # two groups [1, 0] and [1, 1]: z = [1/s2, -1/s2] and [0, 0]; batch std sqrt((.5 + .5) / 3) = 1/sqrt3
    a = group([1, 0], components=[{"correct": 1.0}, {"correct": 0.0}])
    b = group([1, 1], prompt="p:1", components=[{"correct": 1.0}, {"correct": 1.0}])
    out = estimator("gdpo", eps=0.0).estimate_batch([a, b], None)
    np.testing.assert_allclose(values(out[0]), [S3 / S2, -S3 / S2], atol=1e-6)
    assert values(out[1]).tolist() == [0.0, 0.0]  # nothing to compare: exactly zero


def test_gdpo_equal_components_singletons_and_the_update_path():
    equal = group([1, 1, 1], components=cc((1, 0), (1, 0), (1, 0)))
    assert values(estimator("gdpo").estimate(equal)).tolist() == [0.0, 0.0, 0.0]
    single = group([1], prompt="p:1", components=cc((1, 1)))
    pair = group([0, 1], prompt="p:2", components=cc((0, 1), (1, 1)))
    gdpo = estimator("gdpo")
    batch = estimate_all(gdpo, [equal, single, pair], pool=None)  # the update calls estimate_batch
    assert [values(a).tolist() for a in batch[:2]] == [[0.0, 0.0, 0.0], [0.0]]
    # pair: z_correct = -+1/sqrt2 (eps 1e-4), format equal; batch of 6 values, two non-zero: std = sqrt(z^2 * 2 / 5)
    z = 0.5 / (math.sqrt(0.5) + 1e-4)
    np.testing.assert_allclose(values(batch[2]), np.array([-z, z]) / (math.sqrt(2 * z * z / 5) + 1e-4), atol=1e-6)


def test_gdpo_refuses_missing_unweighted_and_nan_components_naming_the_group():
    gdpo = estimator("gdpo")
    with pytest.raises(ValueError, match=r"group p:0@s0: rollout p:0@s0/1 has no reward component `format`"):
        gdpo.estimate(group([1, 0], components=[{"correct": 1.0, "format": 1.0}, {"correct": 0.0}]))
    with pytest.raises(ValueError, match=r"group p:0@s0: no rollout has reward_components"):
        gdpo.estimate(group([1, 0]))
    with pytest.raises(ValueError, match=r"group p:0@s0: reward component `format` has no weight"):
        estimator("gdpo", weights={"correct": 1.0}).estimate(group([1, 0], components=cc((1, 1), (0, 0))))
    with pytest.raises(ValueError, match=r"has no reward component `length`, which `weights` names"):
        estimator("gdpo", weights={"correct": 1.0, "format": 1.0, "length": 1.0}).estimate(
            group([1, 0], components=cc((1, 1), (0, 0))))
    with pytest.raises(ValueError, match=r"group p:0@s0: 1 rollouts have NaN reward components"):
        gdpo.estimate(group([1, 0], components=[{"correct": 1.0}, {"correct": float("nan")}]))
    with pytest.raises(ValueError, match=r"group p:0@s0: 1 of 2 rewards are NaN"):
        gdpo.estimate(group([1, float("nan")], components=cc((1, 1), (0, 0))))


# --- stratified ---------------------------------------------------------------------------

def test_stratified_blends_san_with_the_group_normalisation():
    # strata by search calls [0, 0, 1, 1], rewards [0, 1, 1, 1]
    # SAN: stratum 0 = [0, 1] -> -+1/sqrt2; stratum 1 = [1, 1] -> 0
    # GN: mean .75, squares .5625 + 3 * .0625 = .75, std sqrt(.75 / 3) = .5 -> [-1.5, .5, .5, .5]
    g = group([0, 1, 1, 1], components=[{"search_calls": c} for c in (0.0, 0.0, 1.0, 1.0)])
    san, gn = np.array([-1 / S2, 1 / S2, 0, 0]), np.array([-1.5, 0.5, 0.5, 0.5])
    for alpha in (0.0, 0.3, 1.0):
        out = estimator("stratified", stratum_by="reward_component", component="search_calls", alpha=alpha, eps=0.0)
        np.testing.assert_allclose(values(out.estimate(g)), alpha * san + (1 - alpha) * gn, atol=1e-6)


def test_stratified_by_finish_reason_and_by_length_bucket():
    # finish [stop, stop, length, length], rewards [1, 0, 1, 0]: each stratum -> +-1/sqrt2
    # GN: mean .5, std sqrt(1 / 3) -> +-sqrt3/2; alpha .5
    g = group([1, 0, 1, 0], finish=["stop", "stop", "length", "length"])
    out = estimator("stratified", stratum_by="finish_reason", alpha=0.5, eps=0.0).estimate(g)
    signs = np.array([1, -1, 1, -1])
    np.testing.assert_allclose(values(out), 0.5 * signs / S2 + 0.5 * signs * S3 / 2, atol=1e-6)
    # lengths [2, 3, 5, 7] in buckets of 4 tokens: [0, 0, 1, 1]; rewards [1, 0, 0, 1]; pure SAN
    g = group([1, 0, 0, 1], lengths=[2, 3, 5, 7])
    out = estimator("stratified", stratum_by="length_bucket", bucket_tokens=4, alpha=1.0, eps=0.0).estimate(g)
    np.testing.assert_allclose(values(out), np.array([1, -1, -1, 1]) / S2, atol=1e-6)


def test_stratified_singleton_strata_and_groups_of_one_and_two():
    # G = 2 in two strata of one: SAN is 0, only (1 - alpha) * GN = .25 * -+1/sqrt2 remains
    g = group([0, 1], finish=["stop", "length"])
    out = estimator("stratified", stratum_by="finish_reason", alpha=0.75, eps=0.0).estimate(g)
    np.testing.assert_allclose(values(out), [-0.25 / S2, 0.25 / S2], atol=1e-6)
    one = estimator("stratified", stratum_by="finish_reason", alpha=0.75).estimate(group([1]))
    assert values(one).tolist() == [0.0]


def test_stratified_config_needs_its_key_fields_and_alpha():
    def build(**config):
        return AdvantageSpec(use="stratified", **{"with": config})

    with pytest.raises(ValidationError, match="stratum_by: reward_component needs `component`"):
        build(stratum_by="reward_component", alpha=0.5)
    with pytest.raises(ValidationError, match="stratum_by: length_bucket needs `bucket_tokens`"):
        build(stratum_by="length_bucket", alpha=0.5)
    with pytest.raises(ValidationError, match="`component` is read only with stratum_by: reward_component"):
        build(stratum_by="finish_reason", component="search_calls", alpha=0.5)
    with pytest.raises(ValidationError, match="`alpha` is required"):
        build(stratum_by="finish_reason")
    with pytest.raises(ValidationError, match="`alpha`: Input should be less than or equal to 1"):
        build(stratum_by="finish_reason", alpha=1.5)


def test_stratified_refuses_a_missing_stratum_component_naming_the_group():
    est = estimator("stratified", stratum_by="reward_component", component="search_calls", alpha=0.5)
    with pytest.raises(ValueError, match=r"group p:0@s0: rollout p:0@s0/1 has no reward component `search_calls`"):
        est.estimate(group([1, 1], components=[{"search_calls": 1.0}, {}]))  # even when rewards are equal
    with pytest.raises(ValueError, match=r"group p:0@s0: 1 of 2 rewards are NaN"):
        est.estimate(group([1, float("nan")], components=[{"search_calls": 1.0}] * 2))


# --- grpo_lead ----------------------------------------------------------------------------

def logistic(x, a=0.4, b=1.5, x0=0.75, k=10.0):
    return a + (b - a) / (1 + math.exp(k * (x - x0)))


def test_grpo_lead_weights_hard_prompts_up_for_correct_answers():
    # [1, 0, 0, 0]: A = [1.5, -.5, -.5, -.5] (std .5); rho = .25
    # w(.25) = .4 + 1.1 / (1 + e^-5) = 1.49264; w(1 - .25) = .4 + 1.1 / 2 = .95
    out = values(estimator("grpo_lead", eps=0.0).estimate(group([1, 0, 0, 0])))
    w_hard = 0.4 + 1.1 / (1 + math.exp(-5))
    np.testing.assert_allclose(out, [1.5 * w_hard, -0.5 * 0.95, -0.5 * 0.95, -0.5 * 0.95], atol=1e-6)


def test_grpo_lead_weights_easy_prompts_up_for_wrong_answers():
    # [1, 1, 1, 0]: A = [.5, .5, .5, -1.5]; rho = .75: positives w(.75) = .95, the negative w(.25) = 1.49264
    out = values(estimator("grpo_lead", eps=0.0).estimate(group([1, 1, 1, 0])))
    np.testing.assert_allclose(out, [0.5 * 0.95] * 3 + [-1.5 * (0.4 + 1.1 / (1 + math.exp(-5)))], atol=1e-6)


def test_grpo_lead_reads_accuracy_from_correct_and_handles_g2():
    # graded rewards [.9, .2, .5], only the first correct: rho = 1/3
    r = np.array([0.9, 0.2, 0.5])
    mean = (0.9 + 0.2 + 0.5) / 3
    a = (r - mean) / math.sqrt(((0.9 - mean) ** 2 + (0.2 - mean) ** 2 + (0.5 - mean) ** 2) / 2)
    expected = np.where(a > 0, a * logistic(1 / 3), a * logistic(2 / 3))
    out = estimator("grpo_lead", eps=0.0).estimate(group(list(r), correct=[True, False, False]))
    np.testing.assert_allclose(values(out), expected, atol=1e-6)
    # G = 2, [0, 1]: A = -+1/sqrt2, rho = .5 -> both signs weighted by w(.5) = .4 + 1.1 / (1 + e^-2.5)
    out = estimator("grpo_lead", eps=0.0).estimate(group([0, 1]))
    np.testing.assert_allclose(values(out), np.array([-1, 1]) / S2 * logistic(0.5), atol=1e-6)


def test_grpo_lead_custom_logistic_and_missing_correct():
    # weight_min 1, weight_max 2, midpoint .5, steepness 0: w = 1 + 1 / 2 = 1.5 everywhere
    out = estimator("grpo_lead", eps=0.0, weight_min=1.0, weight_max=2.0, midpoint=0.5, steepness=0.0)
    np.testing.assert_allclose(values(out.estimate(group([1, 0, 0, 0]))), np.array([1.5, -0.5, -0.5, -0.5]) * 1.5)
    with pytest.raises(ValueError, match=r"group p:0@s0: 1 of 2 rollouts have no `correct`"):
        estimator("grpo_lead").estimate(group([1, 0], correct=[True, None]))


# --- xrpo ---------------------------------------------------------------------------------

def test_xrpo_sharpens_the_less_likely_correct_response():
    # rewards [1, 1, 0, 0]: A = -+sqrt3/2 (std sqrt(1/3)); s = [-.1, -1, -.5, -.5], s_bar = -.525
    # eta = [e^.425, e^-.475, ...]: rollout 0 is more likely than the group (no bonus),
    # rollout 1 gets 1 - e^-.475 = .37811 < kappa * A = .866
    g = group([1, 1, 0, 0], logprobs=[[-0.1], [-1.0], [-0.5], [-0.5]])
    out = values(estimator("xrpo", eps=0.0).estimate(g))
    a = S3 / 2
    np.testing.assert_allclose(out, [a, a + 1 - math.exp(-1.0 + 0.525), -a, -a], atol=1e-6)


def test_xrpo_bonus_is_clipped_at_kappa_times_a_and_wrong_answers_are_untouched():
    # s = [-.1, -5, -.1, -8] (rollout 3 wrong and very unlikely): s_bar = -3.3
    # rollout 1: 1 - e^(-5 + 3.3) = .8173 > kappa * A = .5 * sqrt3/2 = .433 -> bonus .433
    g = group([1, 1, 0, 0], logprobs=[[-0.1], [-5.0], [-0.1], [-8.0]])
    out = values(estimator("xrpo", eps=0.0, kappa_clip=0.5).estimate(g))
    a = S3 / 2
    np.testing.assert_allclose(out, [a, a * 1.5, -a, -a], atol=1e-6)
    # lambda .2: bonus .2 * .8173 = .16346 < .433
    out = values(estimator("xrpo", eps=0.0, kappa_clip=0.5, lambda_novelty=0.2).estimate(g))
    np.testing.assert_allclose(out, [a, a + 0.2 * (1 - math.exp(-5.0 + 3.3)), -a, -a], atol=1e-6)


def test_xrpo_uses_the_mean_token_logprob_and_skips_empty_responses():
    # rollout 1 has tokens [-1, -3]: s = -2; rollout 2 is empty: no s, no bonus, not in s_bar
    # rewards [1, 1, 0]: mean 2/3, std 1/sqrt3 -> A = [1, 1, -2] / sqrt3; s_bar = (-.5 - 2) / 2 = -1.25
    g = group([1, 1, 0], logprobs=[[-0.5], [-1.0, -3.0], []])
    out = values(estimator("xrpo", eps=0.0).estimate(g))
    a = 1 / S3
    np.testing.assert_allclose(out, [a, a + min(1 - math.exp(-2.0 + 1.25), a), -2 * a], atol=1e-6)


def test_xrpo_group_of_two_and_missing_correct():
    # G = 2 [1, 0]: A = -+1/sqrt2 reversed; the correct one is less likely: s = [-2, 0], s_bar = -1
    out = values(estimator("xrpo", eps=0.0).estimate(group([1, 0], logprobs=[[-2.0], [0.0]])))
    np.testing.assert_allclose(out, [1 / S2 + min(1 - math.exp(-1.0), 1 / S2), -1 / S2], atol=1e-6)
    with pytest.raises(ValueError, match=r"group p:0@s0: 1 of 2 rollouts have no `correct`"):
        estimator("xrpo").estimate(group([1, 0], correct=[None, False]))


# --- gfcr validate ------------------------------------------------------------------------

@pytest.mark.parametrize("overrides, message", [
    (["update.with.advantage.use=stratified", "update.with.advantage.with.stratum_by=reward_component",
      "update.with.advantage.with.alpha=0.5"], "stratum_by: reward_component needs `component`"),
    (["update.with.advantage.use=stratified", "update.with.advantage.with.stratum_by=finish_reason"],
     "`alpha` is required"),
    (["update.with.advantage.use=grpo_lead", "update.with.advantage.with.midpont=0.5"],
     "advantage estimator `grpo_lead`: unknown key `midpont`\n    fix: did you mean `midpoint`?"),
])
def test_bad_catalog_b_specs_fail_validation_with_the_key_path(overrides, message):
    result = CliRunner().invoke(app, ["validate", QUICKSTART] + [a for o in overrides for a in ("--set", o)])
    assert result.exit_code == 2, result.output
    assert "update.with.advantage.with:" in result.output and message in result.output
    assert "Traceback" not in result.output


@pytest.mark.parametrize("use", ["gdpo", "grpo_lead", "xrpo"])
def test_the_catalog_b_estimators_validate_in_the_quickstart(use):
    result = CliRunner().invoke(app, ["validate", QUICKSTART, "--set", f"update.with.advantage.use={use}"])
    assert result.exit_code == 0, result.output
