"""Advantage estimators (their own registry) against hand-computed groups, and the
``advantage: {use, with}`` spec checked at compile time."""

from __future__ import annotations

import doctest
import importlib
import math

import numpy as np
import pytest
from pydantic import ValidationError

from gfcr.registry.catalog import ADVANTAGE_ESTIMATORS, BUILTIN_ADVANTAGE_ESTIMATORS
from gfcr.stages.testing import scored_group
from gfcr.stages.components.advantage import AdvantageSpec, lower_median

NAMES = sorted(BUILTIN_ADVANTAGE_ESTIMATORS)
# krpo's Kalman filter starts at 0, so equal non-zero rewards get non-zero advantages (the method,
# not rounding); pvpo's baseline is the prompt's reference reward, not the group, and it needs the
# prompt pool (estimate_batch): both are tested in test_estimators_catalog_a.py
# tree reads the group's tree (RolloutGroup.tree), which a plain group has not: its equal-reward
# zeros are tested on hand trees in test_tree_advantage.py
NOT_GROUP_CENTRED = {"krpo", "pvpo", "tree", "reinforce_pp_plain"}  # reinforce_pp_plain: no group baseline, by design
NEEDS_POOL = {"pvpo"}
# Config fields with no default get their smallest valid value here: stratified has no default
# stratum key or alpha (the paper's alpha could not be verified).
REQUIRED_CONFIG = {"stratified": {"stratum_by": "finish_reason", "alpha": 0.5}}


def adv(rewards, use, **config):
    estimator = AdvantageSpec(use=use, **{"with": {**REQUIRED_CONFIG.get(use, {}), **config}}).build()
    group = scored_group("p:0", list(rewards))
    for rollout in group.rollouts:  # gdpo reads the reward components, not the scalar reward; the others ignore them
        rollout.reward_components = {"reward": rollout.reward}
    return np.array(estimator.estimate(group).values, dtype=np.float64)


@pytest.mark.parametrize("use", sorted(set(NAMES) - NOT_GROUP_CENTRED))
@pytest.mark.parametrize("rewards", [[0, 0, 0, 0], [1, 1, 1, 1], [0.1, 0.1, 0.1], [7.0]])
def test_equal_rewards_and_singletons_give_exact_zeros(use, rewards):
    # [0.1]*3 has mean 0.10000000000000002: without the special case mean_std would give ~1e-11
    out = adv(rewards, use)  # a per-token estimator (hgpo) gives each rollout a row of its tokens' values
    assert len(out) == len(rewards) and np.ravel(out).tolist() == [0.0] * np.ravel(out).size


@pytest.mark.parametrize("use", sorted(set(NAMES) - NEEDS_POOL))
def test_unscored_rollouts_are_refused_naming_the_group(use):
    with pytest.raises(ValueError, match=r"group p:0@s0: 1 of 3 rewards are NaN"):
        adv([1, float("nan"), 0], use)


def test_mean_std_defaults_to_the_unbiased_std():
    # [1, 0, 0, 0]: mean 0.25, squared deviations sum to 0.5625 + 3 * 0.0625 = 0.75
    # ddof=1: std = sqrt(0.75 / 3) = 0.5   -> A = [0.75, -0.25 x3] / 0.5
    # ddof=0: std = sqrt(0.75 / 4) = sqrt(3) / 4 -> A = [sqrt(3), -1/sqrt(3) x3]
    assert adv([1, 0, 0, 0], "mean_std", eps=0.0).tolist() == [1.5, -0.5, -0.5, -0.5]
    s3 = math.sqrt(3)
    np.testing.assert_allclose(adv([1, 0, 0, 0], "mean_std", eps=0.0, std_ddof=0), [s3, -1 / s3, -1 / s3, -1 / s3])
    assert adv([1, 0, 0, 0], "mean_std")[0] == pytest.approx(0.75 / 0.500001, rel=1e-12)


def test_group_of_two():
    np.testing.assert_allclose(adv([0, 1], "mean_std", eps=0.0), [-1 / math.sqrt(2), 1 / math.sqrt(2)])
    assert adv([0, 1], "mean_std", eps=0.0, std_ddof=0).tolist() == [-1.0, 1.0]
    assert adv([0, 1], "mean").tolist() == [-0.5, 0.5]
    assert adv([0, 1], "median").tolist() == [0.0, 1.0]  # lower middle of [0, 1] is 0
    # gapo: k = ceil(0.5 * 2) = 1, windows [0] and [1] both span 0, leftmost -> Q = 0; scale 1
    assert adv([0, 1], "gapo", eps=0.0).tolist() == [0.0, 1.0]
    # mc_grpo: m = 0, the pivot is rollout 0 (masked), MAD 0 -> A = [0, 1/1e-3], rescale 2/1
    assert adv([0, 1], "mc_grpo").tolist() == [0.0, 2000.0]


def test_mean_is_dr_grpo_without_std():
    assert adv([1, 0, 0, 0], "mean").tolist() == [0.75, -0.25, -0.25, -0.25]


def test_median_is_the_lower_middle_for_even_groups():
    assert lower_median(np.array([3.0, 1.0, 2.0, 4.0])) == 2.0  # numpy's median would be 2.5
    assert adv([3, 1, 2, 4], "median").tolist() == [1.0, -1.0, 0.0, 2.0]
    assert adv([0, 1, 1, 0], "median").tolist() == [0.0, 1.0, 1.0, 0.0]
    assert adv([1, 1, 0], "median").tolist() == [0.0, 0.0, -1.0]


def test_median_mad_scaling_is_optional_and_off_by_default():
    # [3, 1, 2, 4]: m = 2, |r - m| = [1, 1, 0, 2] -> sorted [0, 1, 1, 2], lower middle 1
    np.testing.assert_allclose(adv([3, 1, 2, 4], "median", mad_scale=True), np.array([1, -1, 0, 2]) / 1.001)
    assert adv([1, 0, 0], "median").tolist() == [1.0, 0.0, 0.0]
    np.testing.assert_allclose(adv([1, 0, 0], "median", mad_scale=True), [1000.0, 0.0, 0.0])


def test_mc_grpo_as_the_reference_code_computes_it():
    # G + 1 = 5 rewards [0.2, 0.9, 0.5, 0.4, 0.7]: sorted [0.2, 0.4, 0.5, 0.7, 0.9], m = 0.5 (rollout 2: pivot)
    # r - m = [-0.3, 0.4, 0, -0.1, 0.2]; |.| sorted [0, 0.1, 0.2, 0.3, 0.4] -> MAD 0.2, + 1e-3 = 0.201
    # 4 non-zero of 5 -> rescale 5/4
    group = scored_group("p:0", [0.2, 0.9, 0.5, 0.4, 0.7])
    out = AdvantageSpec(use="mc_grpo").build().estimate(group)
    expected = np.array([-0.3, 0.4, 0.0, -0.1, 0.2]) / 0.201 * 1.25
    expected[2] = 0.0
    np.testing.assert_allclose(out.values, expected, atol=1e-12)
    assert [bool(m.any()) for m in out.loss_masks] == [True, True, False, True, True]
    assert all(m.shape == (len(r),) for m, r in zip(out.loss_masks, group.rollouts))
    # without MAD and rescale it is the median baseline, the pivot still masked
    plain = AdvantageSpec(use="mc_grpo", **{"with": {"mad_scale": False, "rescale_nonzero": False}}).build()
    np.testing.assert_allclose(plain.estimate(group).values, [-0.3, 0.4, 0.0, -0.1, 0.2], atol=1e-12)


def test_mc_grpo_pivot_is_the_first_of_tied_medians_and_g1_is_masked():
    out = AdvantageSpec(use="mc_grpo").build().estimate(scored_group("p:0", [1, 0, 0, 1, 1]))
    assert [bool(m.any()) for m in out.loss_masks] == [False, True, True, True, True]
    single = AdvantageSpec(use="mc_grpo").build().estimate(scored_group("p:0", [1.0]))
    assert single.values == (0.0,) and not single.loss_masks[0].any()


def test_gapo_on_a_hand_worked_group():
    # sorted [0.1, 0.5, 0.55, 0.6, 0.9, 1.0], k = 3: the densest window [0.5, 0.55, 0.6], Q = 0.55
    # r - Q = [0.35, -0.45, -0.05, 0, 0.45, 0.05]; squares sum 0.5325; / (G - 1) = 0.1065
    rewards = [0.9, 0.1, 0.5, 0.55, 1.0, 0.6]
    expected = np.array([0.35, -0.45, -0.05, 0.0, 0.45, 0.05]) / math.sqrt(0.1065)
    np.testing.assert_allclose(adv(rewards, "gapo", eps=0.0), expected, atol=1e-12)


def test_gapo_takes_the_leftmost_shortest_window_and_averages_even_windows():
    np.testing.assert_allclose(adv([0, 0, 1, 1], "gapo", eps=0.0), np.array([0, 0, 1, 1]) / math.sqrt(2 / 3))
    np.testing.assert_allclose(adv([0, 0.2, 0.3, 1], "gapo", eps=0.0),
                               np.array([-0.25, -0.05, 0.05, 0.75]) / math.sqrt(0.21), atol=1e-12)


def test_gapo_window_size_is_robust_to_float_rounding():
    out = adv([0, 0, 0, 5, 5, 5, 5, 9, 9, 9], "gapo", fraction=0.3)
    assert out[:3].tolist() == [0.0, 0.0, 0.0] and (out[3:] > 0).all()


def test_the_spec_is_checked_against_the_registry_and_the_estimator_config():
    with pytest.raises(ValidationError, match="unknown advantage estimator `medain`; did you mean `median`"):
        AdvantageSpec(use="medain")
    with pytest.raises(ValidationError, match="unknown key `fracton`; did you mean `fraction`"):
        AdvantageSpec(use="gapo", **{"with": {"fracton": 0.5}})
    with pytest.raises(ValidationError, match="`fraction`: Input should be less than or equal to 1"):
        AdvantageSpec(use="gapo", **{"with": {"fraction": 2.0}})
    with pytest.raises(ValidationError, match=r"write `advantage: \{use: median\}`"):
        AdvantageSpec.model_validate("median")


def test_every_estimator_is_registered_with_a_strict_frozen_config_and_a_cited_docstring():
    for name in NAMES:
        cls = ADVANTAGE_ESTIMATORS.get(name)
        assert cls.Config.model_config["extra"] == "forbid" and cls.Config.model_config["frozen"]
        doc = importlib.import_module(cls.__module__).__doc__
        assert "arXiv" in doc and "Deviations:" in doc and ".. code-block:: yaml" in doc


@pytest.mark.parametrize("module", ["base", "mean_std", "mean", "median", "gapo", "mc_grpo", "group_stats", "gdpo",
                                    "stratified", "grpo_lead", "xrpo"])
def test_module_examples_run(module):
    result = doctest.testmod(importlib.import_module(f"gfcr.stages.components.advantage.{module}"))
    assert result.attempted > 0 and result.failed == 0
