"""Group advantage estimators against hand-computed numbers."""

from __future__ import annotations

import doctest
import math

import numpy as np
import pytest

from gfcr.records import RolloutGroups
from gfcr.stages.testing import scored_group
from gfcr.stages.update import advantages
from gfcr.stages.update.advantages import ESTIMATORS, assign_advantages, group_advantages, lower_median


def adv(rewards, estimator, **kw):
    return group_advantages(np.array(rewards, dtype=np.float64), estimator, **kw)


@pytest.mark.parametrize("estimator", ESTIMATORS)
@pytest.mark.parametrize("rewards", [[0, 0, 0, 0], [1, 1, 1, 1], [0.1, 0.1, 0.1], [7.0]])
def test_equal_rewards_and_singletons_give_exact_zeros(estimator, rewards):
    # [0.1]*3 has mean 0.10000000000000002: without the special case mean_std would give ~1e-11
    out = adv(rewards, estimator, mad_scale=True)
    assert out.dtype == np.float64 and out.shape == (len(rewards),)
    assert out.tolist() == [0.0] * len(rewards)


def test_mean_std_defaults_to_the_unbiased_std():
    # [1, 0, 0, 0]: mean 0.25, squared deviations sum to 0.5625 + 3 * 0.0625 = 0.75
    # ddof=1: std = sqrt(0.75 / 3) = 0.5   -> A = [0.75, -0.25 x3] / 0.5
    # ddof=0: std = sqrt(0.75 / 4) = sqrt(3) / 4 -> A = [sqrt(3), -1/sqrt(3) x3]
    assert adv([1, 0, 0, 0], "mean_std", eps=0.0).tolist() == [1.5, -0.5, -0.5, -0.5]
    s3 = math.sqrt(3)
    np.testing.assert_allclose(adv([1, 0, 0, 0], "mean_std", eps=0.0, std_ddof=0), [s3, -1 / s3, -1 / s3, -1 / s3])
    # the default eps 1e-6 is added to the std: 0.75 / (0.5 + 1e-6)
    assert adv([1, 0, 0, 0], "mean_std")[0] == pytest.approx(0.75 / 0.500001, rel=1e-12)


def test_group_of_two():
    # [0, 1]: deviations -0.5, 0.5; unbiased std sqrt(0.5); population std 0.5
    np.testing.assert_allclose(adv([0, 1], "mean_std", eps=0.0), [-1 / math.sqrt(2), 1 / math.sqrt(2)])
    assert adv([0, 1], "mean_std", eps=0.0, std_ddof=0).tolist() == [-1.0, 1.0]
    assert adv([0, 1], "mean").tolist() == [-0.5, 0.5]
    assert adv([0, 1], "median").tolist() == [0.0, 1.0]  # lower middle of [0, 1] is 0
    # gapo: k = ceil(0.5 * 2) = 1, windows [0] and [1] both span 0, leftmost -> Q = 0;
    # scale sqrt((0 + 1) / 1) = 1
    assert adv([0, 1], "gapo", eps=0.0).tolist() == [0.0, 1.0]


def test_mean_is_dr_grpo_without_std():
    assert adv([1, 0, 0, 0], "mean").tolist() == [0.75, -0.25, -0.25, -0.25]


def test_median_is_the_lower_middle_for_even_groups():
    assert lower_median(np.array([3.0, 1.0, 2.0, 4.0])) == 2.0  # numpy's median would be 2.5
    assert adv([3, 1, 2, 4], "median").tolist() == [1.0, -1.0, 0.0, 2.0]
    # ties: sorted [0, 0, 1, 1] -> lower middle 0, so the correct rollouts get +1, the others 0
    assert adv([0, 1, 1, 0], "median").tolist() == [0.0, 1.0, 1.0, 0.0]
    assert adv([1, 1, 0], "median").tolist() == [0.0, 0.0, -1.0]  # odd G: the middle, 1


def test_mad_scaling_is_optional_and_off_by_default():
    # [3, 1, 2, 4]: m = 2, |r - m| = [1, 1, 0, 2] -> sorted [0, 1, 1, 2], lower middle 1
    np.testing.assert_allclose(adv([3, 1, 2, 4], "median", mad_scale=True), np.array([1, -1, 0, 2]) / 1.001)
    # binary rewards: m = 0, |r - m| = [1, 0, 0] -> MAD 0, so A = 1 / 1e-3 = 1000 (the note's warning)
    assert adv([1, 0, 0], "median").tolist() == [1.0, 0.0, 0.0]
    np.testing.assert_allclose(adv([1, 0, 0], "median", mad_scale=True), [1000.0, 0.0, 0.0])


def test_gapo_on_a_hand_worked_group():
    # G = 6, fraction 0.5 -> windows of k = 3 sorted rewards:
    #   sorted [0.1, 0.5, 0.55, 0.6, 0.9, 1.0]
    #   spans: [0.1..0.55] 0.45, [0.5..0.6] 0.1, [0.55..0.9] 0.35, [0.6..1.0] 0.4 -> [0.5, 0.55, 0.6]
    #   Q = median = 0.55
    #   r - Q = [0.35, -0.45, -0.05, 0, 0.45, 0.05]; squares sum to
    #   0.1225 + 0.2025 + 0.0025 + 0 + 0.2025 + 0.0025 = 0.5325; / (G - 1) = 0.1065
    #   A = (r - Q) / sqrt(0.1065)
    rewards = [0.9, 0.1, 0.5, 0.55, 1.0, 0.6]
    expected = np.array([0.35, -0.45, -0.05, 0.0, 0.45, 0.05]) / math.sqrt(0.1065)
    np.testing.assert_allclose(adv(rewards, "gapo", eps=0.0), expected, atol=1e-12)
    np.testing.assert_allclose(adv(rewards, "gapo"), expected * math.sqrt(0.1065) / (math.sqrt(0.1065) + 1e-6))


def test_gapo_takes_the_leftmost_shortest_window_and_averages_even_windows():
    # [0, 0, 1, 1], k = 2: windows [0, 0] and [1, 1] both span 0 -> the leftmost, Q = 0;
    # sum of squares 2, / 3 -> scale sqrt(2/3). (The rightmost would give Q = 1 and negative advantages.)
    np.testing.assert_allclose(adv([0, 0, 1, 1], "gapo", eps=0.0), np.array([0, 0, 1, 1]) / math.sqrt(2 / 3))
    # [0, 0.2, 0.3, 1], k = 2: spans 0.2, 0.1, 0.7 -> [0.2, 0.3], Q = 0.25 (average median, not 0.2)
    # r - Q = [-0.25, -0.05, 0.05, 0.75]; squares 0.0625 + 0.0025 + 0.0025 + 0.5625 = 0.63; / 3 = 0.21
    np.testing.assert_allclose(adv([0, 0.2, 0.3, 1], "gapo", eps=0.0),
                               np.array([-0.25, -0.05, 0.05, 0.75]) / math.sqrt(0.21), atol=1e-12)


def test_gapo_window_size_is_robust_to_float_rounding():
    # 0.3 * 10 = 3.0000000000000004: k must be 3 (window [0, 0, 0], Q = 0), not 4 ([5, 5, 5, 5], Q = 5)
    out = adv([0, 0, 0, 5, 5, 5, 5, 9, 9, 9], "gapo", gapo_fraction=0.3)
    assert out[:3].tolist() == [0.0, 0.0, 0.0] and (out[3:] > 0).all()


def test_bad_inputs_raise_clear_errors():
    with pytest.raises(ValueError, match="1 of 3 rewards are NaN"):
        adv([1, float("nan"), 0], "mean_std")
    with pytest.raises(ValueError, match="unknown advantage estimator 'rloo'"):
        adv([1, 0], "rloo")
    with pytest.raises(ValueError, match="gapo_fraction must be in"):
        adv([1, 0], "gapo", gapo_fraction=0.0)
    with pytest.raises(ValueError, match="shape"):
        group_advantages(np.zeros((2, 2)), "mean")


def test_assign_advantages_writes_included_groups_and_counts_nonzero():
    mixed, easy, dropped = scored_group("p:0", [1, 0, 0, 0]), scored_group("p:1", [1, 1]), scored_group("p:2", [0, 1])
    dropped.drop("not wanted")
    nonzero = assign_advantages(RolloutGroups([mixed, easy, dropped]), "mean")
    assert nonzero == 4
    assert [r.advantage for r in mixed.rollouts] == [0.75, -0.25, -0.25, -0.25]
    assert all(type(r.advantage) is float for r in mixed.rollouts)
    assert [r.advantage for r in easy.rollouts] == [0.0, 0.0]
    assert [r.advantage for r in dropped.rollouts] == [None, None]
    assert assign_advantages(RolloutGroups([scored_group("p:3", [1, 0, 0])]), "median") == 1


def test_assign_advantages_names_the_unscored_group():
    g = scored_group("p:0", [1, 0])
    g.rollouts[1].reward = None
    with pytest.raises(ValueError, match=r"group p:0@s0: 1 of 2 rewards are NaN"):
        assign_advantages(RolloutGroups([g]), "mean_std")


def test_module_example_runs():
    result = doctest.testmod(advantages)
    assert result.attempted > 0 and result.failed == 0
