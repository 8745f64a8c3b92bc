"""The estimators rloo, reinforce_pp, reinforce_pp_plain, dr_grpo, krpo and pvpo against hand-computed groups, and
the pairings ``gfcr validate`` checks for dr_grpo (its aggregation) and mc_grpo (G + 1 rollouts
from a Control stage)."""

from __future__ import annotations

import doctest
import importlib
import math
import re
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from gfcr.cli.main import app
from gfcr.records import Prompt, PromptPool, Rollout, RolloutGroup, RolloutGroups, Segment, group_id, rollout_id
from gfcr.stages.testing import scored_group
from gfcr.stages.components.advantage import AdvantageSpec, estimate_all
from gfcr.stages.components.advantage.mc_grpo import MCGRPO
from gfcr.stages.components.base import PairingContext
from tests.stages.update.test_tree_and_off_policy import stage_and_policy, tree_group

QUICKSTART = Path(__file__).resolve().parents[3] / "pipelines" / "quickstart.yaml"
NAN = float("nan")


def build(use, **config):
    return AdvantageSpec(use=use, **{"with": config}).build()


def adv(rewards, use, **config):
    return np.array(build(use, **config).estimate(scored_group("p:0", list(rewards))).values)


def sized_group(prompt, rewards, lengths, loss_masks=None):
    """A group whose rollout i has ``lengths[i]`` response tokens (and optional loss mask)."""
    gid = group_id(prompt, 0)
    rollouts = []
    for i, (r, n) in enumerate(zip(rewards, lengths)):
        ro = Rollout(rollout_id(gid, i), gid, prompt, [1] * n, [Segment(0, n, 0, np.zeros(n))], reward=float(r))
        ro.loss_mask = None if loss_masks is None or loss_masks[i] is None else np.array(loss_masks[i], dtype=bool)
        rollouts.append(ro)
    return RolloutGroup(gid, prompt, 0, len(rollouts), rollouts)


def values(advantages):
    return [np.array(a.values) for a in advantages]


@pytest.mark.parametrize("module", ["rloo", "reinforce_pp", "reinforce_pp_plain", "dr_grpo", "krpo",
                                    "pvpo", "mc_grpo"])
def test_module_examples_run(module):
    result = doctest.testmod(importlib.import_module(f"gfcr.stages.components.advantage.{module}"))
    assert result.attempted > 0 and result.failed == 0


# --- rloo ----------------------------------------------------------------------------------------

def test_rloo_subtracts_the_mean_of_the_other_rewards():
    # [1, 0, 0, 0]: rollout 0's baseline is (0 + 0 + 0) / 3 = 0, the others' (1 + 0 + 0) / 3
    np.testing.assert_allclose(adv([1, 0, 0, 0], "rloo"), [1.0, -1 / 3, -1 / 3, -1 / 3], atol=1e-12)
    # [0.2, 0.9, 0.5, 0.4], sum 2.0: baselines 1.8/3, 1.1/3, 1.5/3, 1.6/3
    expected = [0.2 - 0.6, 0.9 - 1.1 / 3, 0.5 - 0.5, 0.4 - 1.6 / 3]
    np.testing.assert_allclose(adv([0.2, 0.9, 0.5, 0.4], "rloo"), expected, atol=1e-12)
    # the same as G / (G - 1) * (r - mean): mean 0.5, 4/3 * [-0.3, 0.4, 0, -0.1]
    np.testing.assert_allclose(expected, [-0.4, 0.4 * 4 / 3, 0.0, -0.4 / 3], atol=1e-12)


def test_rloo_edge_cases():
    assert adv([0, 1], "rloo").tolist() == [-1.0, 1.0]  # each baseline is the other reward
    assert adv([0.7], "rloo").tolist() == [0.0]  # no other rollout: no baseline
    assert adv([0.1, 0.1, 0.1], "rloo").tolist() == [0.0, 0.0, 0.0]
    with pytest.raises(ValueError, match=r"group p:0@s0: 1 of 3 rewards are NaN"):
        adv([1, NAN, 0], "rloo")


# --- dr_grpo -------------------------------------------------------------------------------------

def test_dr_grpo_centres_without_the_std():
    # mean 0.25
    assert adv([1, 0, 0, 0], "dr_grpo").tolist() == [0.75, -0.25, -0.25, -0.25]
    # mean 0.5: [-0.3, 0.4, 0.0, -0.1]
    np.testing.assert_allclose(adv([0.2, 0.9, 0.5, 0.4], "dr_grpo"), [-0.3, 0.4, 0.0, -0.1], atol=1e-12)
    assert adv([0, 1], "dr_grpo").tolist() == [-0.5, 0.5]
    assert adv([3.0], "dr_grpo").tolist() == [0.0]
    assert adv([1, 1, 1], "dr_grpo").tolist() == [0.0, 0.0, 0.0]
    with pytest.raises(ValueError, match=r"group p:0@s0: 1 of 3 rewards are NaN"):
        adv([1, NAN, 0], "dr_grpo")


# --- reinforce_pp --------------------------------------------------------------------------------

def test_reinforce_pp_on_one_group_of_equal_lengths():
    # c = r - 0.5 = [0.5, -0.5, -0.5, 0.5]; mu = 0; var = 0.25 -> A = c / 0.5
    assert adv([1, 0, 0, 1], "reinforce_pp").tolist() == [1.0, -1.0, -1.0, 1.0]
    # [1, 0, 0, 0]: c = [0.75, -0.25 x3], mu = 0, var = (0.5625 + 3 * 0.0625) / 4 = 0.1875
    s = math.sqrt(0.1875)
    np.testing.assert_allclose(adv([1, 0, 0, 0], "reinforce_pp"), [0.75 / s, -0.25 / s, -0.25 / s, -0.25 / s])
    assert adv([0, 1], "reinforce_pp").tolist() == [-1.0, 1.0]  # c = [-0.5, 0.5], var 0.25
    np.testing.assert_allclose(adv([1, 0, 0, 1], "reinforce_pp", std_norm=False), [0.5, -0.5, -0.5, 0.5])


def test_reinforce_pp_normalises_over_the_batch_tokens_and_subtracts_the_mean_again():
    # group a: rewards [1, 0], lengths [3, 1] -> c = [0.5, -0.5]
    # group b: rewards [1, 1], lengths [2, 2] -> c = [0, 0] (equal rewards)
    # tokens N = 8; mu = (3 * 0.5 + 1 * -0.5 + 0 + 0) / 8 = 0.125
    # c - mu = [0.375, -0.625, -0.125, -0.125]
    # var = (3 * 0.140625 + 0.390625 + 2 * 0.015625 + 2 * 0.015625) / 8 = 0.875 / 8 = 0.109375
    groups = [sized_group("a:0", [1, 0], [3, 1]), sized_group("b:0", [1, 1], [2, 2])]
    out = values(build("reinforce_pp").estimate_batch(groups, None))
    s = math.sqrt(0.109375)
    np.testing.assert_allclose(out[0], [0.375 / s, -0.625 / s], atol=1e-12)
    np.testing.assert_allclose(out[1], [-0.125 / s, -0.125 / s], atol=1e-12)  # an equal-reward group moves too
    plain = values(build("reinforce_pp", std_norm=False).estimate_batch(groups, None))
    np.testing.assert_allclose(np.concatenate(plain), [0.375, -0.625, -0.125, -0.125], atol=1e-12)
    # through the update's entry point: one Advantages per group
    assert len(estimate_all(build("reinforce_pp"), groups, None)) == 2


def test_reinforce_pp_counts_only_the_tokens_the_loss_mask_keeps():
    # rollout a0 keeps 1 of its 3 tokens: n = [1, 1, 2, 2], N = 6, mu = (0.5 - 0.5) / 6 = 0
    # var = (0.25 + 0.25) / 6 = 1/12 -> A = c * sqrt(12)
    groups = [sized_group("a:0", [1, 0], [3, 1], [[True, False, False], None]), sized_group("b:0", [1, 1], [2, 2])]
    out = values(build("reinforce_pp").estimate_batch(groups, None))
    np.testing.assert_allclose(np.concatenate(out), [0.5 * math.sqrt(12), -0.5 * math.sqrt(12), 0.0, 0.0],
                               atol=1e-12)


def test_reinforce_pp_edge_cases():
    assert adv([1, 1, 1, 1], "reinforce_pp").tolist() == [0.0] * 4  # var floored at 1e-8, 0 * 1e4
    assert adv([0.1, 0.1, 0.1], "reinforce_pp").tolist() == [0.0] * 3
    assert adv([5.0], "reinforce_pp").tolist() == [0.0]
    empty = sized_group("e:0", [1, 0], [0, 0])  # no token counts anywhere: nothing to normalise over
    assert build("reinforce_pp").estimate(empty).values == (0.0, 0.0)
    good, bad = scored_group("a:0", [1, 0]), scored_group("b:0", [1, NAN])
    with pytest.raises(ValueError, match=r"group b:0@s0: 1 of 2 rewards are NaN"):
        build("reinforce_pp").estimate_batch([good, bad], None)



# --- reinforce_pp_plain ---------------------------------------------------------------------

def test_reinforce_pp_plain_whitens_the_raw_rewards_over_the_batch_tokens():
    # no group centring: c = r = [1, 0 | 1, 1], n = [3, 1 | 2, 2], N = 8, mu = (3 + 0 + 2 + 2) / 8 = 0.875
    # r - mu = [0.125, -0.875, 0.125, 0.125]; var = (3 * 0.015625 + 0.765625 + 4 * 0.015625) / 8 = 0.109375
    groups = [sized_group("a:0", [1, 0], [3, 1]), sized_group("b:0", [1, 1], [2, 2])]
    s = math.sqrt(0.109375)
    out = np.concatenate(values(build("reinforce_pp_plain").estimate_batch(groups, None)))
    np.testing.assert_allclose(out, [0.125 / s, -0.875 / s, 0.125 / s, 0.125 / s], atol=1e-12)
    plain = np.concatenate(values(build("reinforce_pp_plain", std_norm=False).estimate_batch(groups, None)))
    np.testing.assert_allclose(plain, [0.125, -0.875, 0.125, 0.125], atol=1e-12)


def test_reinforce_pp_plain_edge_cases():
    # a lone rollout has no group baseline to lose: across a batch it is compared with the others
    singles = [scored_group("a:0", [1.0]), scored_group("b:0", [0.0])]
    assert np.concatenate(values(build("reinforce_pp_plain").estimate_batch(singles, None))).tolist() == [1, -1]
    assert adv([1, 1, 1], "reinforce_pp_plain").tolist() == [0.0] * 3  # nothing to compare in the batch
    with pytest.raises(ValueError, match=r"group b:0@s0: 1 of 2 rewards are NaN"):
        build("reinforce_pp_plain").estimate_batch([scored_group("a:0", [1, 0]), scored_group("b:0", [1, NAN])],
                                                         None)

# --- krpo ----------------------------------------------------------------------------------------

def test_krpo_runs_the_reference_filter_at_its_defaults():
    # rewards [1, 0], Q = 1e-5, R = 1e-2, x0 = 0, P0 = 1, eps = 1e-8
    p_pred = 1.0 + 1e-5
    k1 = p_pred / (p_pred + 1e-2)
    x1, p1 = 0.0 + k1 * (1.0 - 0.0), (1 - k1) * p_pred
    a1 = (1.0 - x1) / (math.sqrt(p1) + 1e-8)
    p_pred = p1 + 1e-5
    k2 = p_pred / (p_pred + 1e-2)
    x2, p2 = x1 + k2 * (0.0 - x1), (1 - k2) * p_pred
    a2 = (0.0 - x2) / (math.sqrt(p2) + 1e-8)
    assert (round(a1, 6), round(a2, 6)) == (0.099503, -7.048125)
    np.testing.assert_allclose(adv([1, 0], "krpo"), [a1, a2], atol=1e-9)
    assert adv([1], "krpo")[0] == pytest.approx(a1, abs=1e-9)  # G = 1: the first step alone


def test_krpo_on_a_hand_worked_filter():
    # Q = 0, R = 1, x0 = 0, P0 = 1, eps = 0, rewards [2, 2]:
    # step 1: K = 1/2, x = 1, P = 1/2, A = (2 - 1) / sqrt(1/2) = sqrt(2)
    # step 2: K = (1/2) / (3/2) = 1/3, x = 1 + 1/3 = 4/3, P = (2/3)(1/2) = 1/3, A = (2/3) / sqrt(1/3)
    out = adv([2, 2], "krpo", process_var=0.0, meas_var=1.0, eps=0.0)
    np.testing.assert_allclose(out, [math.sqrt(2), (2 / 3) * math.sqrt(3)], atol=1e-12)
    # equal rewards are not zeroed: the filter starts at x0 = 0 (the method, not rounding) ...
    assert (adv([1, 1, 1, 1], "krpo") > 0).all()
    # ... and rewards equal to x0 leave it there
    assert adv([0, 0, 0, 0], "krpo").tolist() == [0.0] * 4
    # the filter is sequential: the order of the rollouts matters
    assert adv([1, 0], "krpo").tolist() != adv([0, 1], "krpo")[::-1].tolist()


def test_krpo_refuses_unscored_rollouts():
    with pytest.raises(ValueError, match=r"group p:0@s0: 1 of 3 rewards are NaN"):
        adv([1, NAN, 0], "krpo")


# --- pvpo ----------------------------------------------------------------------------------------

def test_pvpo_subtracts_each_prompts_reference_reward():
    prompts = PromptPool([Prompt("p:0", text="q", metadata={"reference_reward": 0.25}),
                          Prompt("p:1", text="q", metadata={"reference_reward": 0})])
    groups = [scored_group("p:0", [1, 0, 1]), scored_group("p:1", [0.5, 1.0])]
    out = values(build("pvpo").estimate_batch(groups, prompts))
    np.testing.assert_allclose(out[0], [1 - 0.25, 0 - 0.25, 1 - 0.25])
    np.testing.assert_allclose(out[1], [0.5, 1.0])
    assert values(estimate_all(build("pvpo"), groups, prompts))[0].tolist() == out[0].tolist()


def test_pvpo_keeps_its_baseline_for_equal_rewards_and_single_rollouts():
    prompts = PromptPool([Prompt("p:0", text="q", metadata={"ref": 0.5})])
    est = build("pvpo", key="ref")
    assert est.estimate_batch([scored_group("p:0", [1, 1])], prompts)[0].values == (0.5, 0.5)
    assert est.estimate_batch([scored_group("p:0", [0.0])], prompts)[0].values == (-0.5,)
    assert est.estimate_batch([scored_group("p:0", [0, 1])], prompts)[0].values == (-0.5, 0.5)


def test_pvpo_errors_name_the_prompt_and_the_fix():
    est = build("pvpo")
    with pytest.raises(ValueError, match=r"prompt p:0: no `reference_reward` in its metadata.*data source"):
        est.estimate_batch([scored_group("p:0", [1, 0])], PromptPool([Prompt("p:0", text="q")]))
    for bad in ("high", float("nan"), True):
        with pytest.raises(ValueError, match=r"prompt p:0: `metadata\['reference_reward'\]` is .* finite number"):
            est.estimate_batch([scored_group("p:0", [1, 0])],
                               PromptPool([Prompt("p:0", text="q", metadata={"reference_reward": bad})]))
    with pytest.raises(ValueError, match=r"prompt p:9 is not in the prompt pool"):
        est.estimate_batch([scored_group("p:9", [1, 0])], PromptPool([Prompt("p:0", text="q")]))
    with pytest.raises(ValueError, match=r"call estimate_batch\(groups, pool\)"):
        est.estimate(scored_group("p:0", [1, 0]))
    prompts = PromptPool([Prompt("p:0", text="q", metadata={"reference_reward": 0.5})])
    with pytest.raises(ValueError, match=r"group p:0@s0: 1 of 3 rewards are NaN"):
        est.estimate_batch([scored_group("p:0", [1, NAN, 0])], prompts)


# --- mc_grpo: G + 1 rollouts from a Control stage ------------------------------------------------

SETTINGS = {"control.fixed_n": lambda n: f"n={n}", "control.mc_grpo": lambda n: f"g={n - 1}"}


def ctx(n, sid="budget", alias="control.fixed_n"):
    """What update.grpo hands the estimator: the group size fixed upstream, and the ``key=value``
    of the fixing stage's capability (``group_size_setting``; none for a stage without it)."""
    upstream = () if n is None else ((sid, alias),)
    return PairingContext("mc_grpo", "ppo_clip", "token_mean", n, None if n is None else sid, upstream,
                          rollouts_setting=SETTINGS.get(alias))


def test_mc_grpo_needs_a_fixed_allocation():
    (p,) = MCGRPO.pairing_problems(MCGRPO.Config(), ctx(None))
    assert p.key == ("advantage", "use") and "G + 1 rollouts per prompt from a fixed allocation" in p.message
    assert p.fix == "add `control.mc_grpo` with `g: 8` (or `control.fixed_n` with `n: 9`) upstream of the update"
    (p,) = MCGRPO.pairing_problems(MCGRPO.Config(g=4), ctx(None))
    assert "`g: 4` (or `control.fixed_n` with `n: 5`)" in p.fix


def test_mc_grpo_checks_g_against_the_allocation():
    assert MCGRPO.pairing_problems(MCGRPO.Config(g=8), ctx(9)) == []
    assert MCGRPO.pairing_problems(MCGRPO.Config(), ctx(8)) == []  # G = 7, inferred
    (p,) = MCGRPO.pairing_problems(MCGRPO.Config(g=8), ctx(8))
    assert p.key == ("advantage", "with", "g")
    assert p.message == "MC-GRPO with `g: 8` needs G + 1 = 9 rollouts per prompt, but stage `budget` allocates 8"
    assert p.fix == "set `n: 9` on `budget` (--set stages.budget.with.n=9), or set `g: 7`"
    (p,) = MCGRPO.pairing_problems(MCGRPO.Config(g=8), ctx(8, "alloc", "control.mine"))
    assert p.fix == "make `alloc` allocate 9 rollouts per prompt, or set `g: 7`"
    # the paired allocator control.mc_grpo (its Config's rollouts_per_prompt is its g + 1)
    (p,) = MCGRPO.pairing_problems(MCGRPO.Config(g=8), ctx(5, "budget", "control.mc_grpo"))
    assert p.message == "MC-GRPO with `g: 8` needs G + 1 = 9 rollouts per prompt, but stage `budget` allocates 5"
    assert p.fix == "set `g: 8` on `budget` (--set stages.budget.with.g=8), or set `g: 4`"
    (p,) = MCGRPO.pairing_problems(MCGRPO.Config(), ctx(1))
    assert "its only rollout is the pivot" in p.message


# --- gfcr validate ------------------------------------------------------------------------------

def validate(path, *overrides):
    result = CliRunner().invoke(app, ["validate", str(path)] + [a for o in overrides for a in ("--set", o)])
    assert "Traceback" not in result.output
    return result


def test_dr_grpo_without_its_aggregation_fails_validation():
    result = validate(QUICKSTART, "update.with.advantage.use=dr_grpo")
    assert result.exit_code == 2, result.output
    assert re.search(r"quickstart\.yaml:\d+:\d+: update\.with\.aggregation\.use: `dr_grpo` is half of Dr\.GRPO",
                     result.output), result.output
    assert "so it needs aggregation `seq_mean_token_sum`, not `token_mean`" in result.output
    assert "--set update.with.aggregation.use=seq_mean_token_sum" in result.output
    paired = validate(QUICKSTART, "update.with.advantage.use=dr_grpo", "update.with.aggregation.use=seq_mean_token_sum",
                      "update.with.aggregation.with.constant=8")
    assert paired.exit_code == 0, paired.output


def test_mc_grpo_without_a_fixed_allocation_fails_validation(tmp_path):
    text = QUICKSTART.read_text()
    budget = next(line for line in text.splitlines() if line.strip().startswith("budget:"))
    text = text.replace(budget + "\n", "").replace("from: budget", "from: pick")
    text = text.replace("with: {lr: 3.0e-4,", "with: {lr: 3.0e-4, advantage: {use: mc_grpo},")
    spec = tmp_path / "no_fixed_n.yaml"
    spec.write_text(text)
    result = validate(spec)
    assert result.exit_code == 2, result.output
    assert re.search(r"no_fixed_n\.yaml:\d+:\d+: update\.with\.advantage\.use: MC-GRPO needs G \+ 1 rollouts per "
                     r"prompt from a fixed allocation", result.output), result.output
    assert "add `control.mc_grpo` with `g: 8` (or `control.fixed_n` with `n: 9`) upstream of the update" \
        in result.output


def test_mc_grpo_with_the_wrong_fixed_n_fails_validation():
    result = validate(QUICKSTART, "update.with.advantage.use=mc_grpo", "update.with.advantage.with.g=8")
    assert result.exit_code == 2, result.output
    assert "update.with.advantage.with.g: MC-GRPO with `g: 8` needs G + 1 = 9 rollouts per prompt, but stage " \
           "`budget` allocates 8" in result.output
    assert "--set stages.budget.with.n=9" in result.output
    fixed = validate(QUICKSTART, "update.with.advantage.use=mc_grpo", "update.with.advantage.with.g=8",
                     "stages.budget.with.n=9")
    assert fixed.exit_code == 0, fixed.output
    assert validate(QUICKSTART, "update.with.advantage.use=mc_grpo").exit_code == 0  # n: 8 is G = 7


# --- through update.grpo: estimate_batch gets the batch and the prompt pool ----------------------

def test_the_update_hands_batch_estimators_the_batch_and_the_pool():
    prompts = PromptPool([Prompt("p:0", text="unused", prompt_token_ids=[1, 2], metadata={"reference_reward": 0.5})])
    stage, policy = stage_and_policy(advantage={"use": "pvpo"})
    group = tree_group(policy.model, rewards=(1.0, 0.0, 1.0))
    group.tree = None
    items, _, _ = stage._batch(RolloutGroups([group]), prompts)
    assert [i.advantage for i in items] == [0.5, -0.5, 0.5]
    # reinforce_pp: lengths [4, 4, 3], c = [1/3, -2/3, 1/3], mu = (4/3 - 8/3 + 1) / 11 = -1/33
    stage, _ = stage_and_policy(advantage={"use": "reinforce_pp", "with": {"std_norm": False}})
    items, _, _ = stage._batch(RolloutGroups([group]), prompts)
    np.testing.assert_allclose([i.advantage for i in items], [1 / 3 + 1 / 33, -2 / 3 + 1 / 33, 1 / 3 + 1 / 33],
                               atol=1e-12)
