"""Must-show 3 of issue 11: TreeRL's tree advantages on hand-built trees equal a hand computation
(node values, per-node advantages, per-token advantages), with the spans read from the tokens and
recorded on the tree; the update's gradient with them equals a hand-written loss; and the pairing
``gfcr validate`` checks (the estimator needs a tree generator upstream)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from gfcr.cli.main import app
from gfcr.records import Rollout, RolloutGroup, RolloutGroups, Segment, TreeIndex
from gfcr.stages.generate.tree_topology import segment_tree
from gfcr.stages.components.advantage.tree import TreeAdvantage
from gfcr.stages.components.base import PairingContext
from tests.conftest import REPO
from tests.stages.update.test_tree_and_off_policy import (
    SHARED_ONCE, hand_gradients, stage_and_policy, stage_gradients, surrogate, token_logprobs, tree_group,
)

R2 = math.sqrt(2.0)
R3 = math.sqrt(3.0)


def leaf(i: int, tokens: list[int], reward: float) -> Rollout:
    return Rollout(f"g/{i}", "g", "p", tokens, [Segment(0, len(tokens), 0, [0.0] * len(tokens))], reward=reward)


def estimator(**config) -> TreeAdvantage:
    return TreeAdvantage(TreeAdvantage.Config(**config))


# --- tree A: 3 leaves, spans read from the tokens (the update test's tree) ----------------------
# root {0,1,2} shares token 0; a {0,1} shares tokens 0-2; leaves 0, 1 then own token 3; leaf 2 own 1-2.
TREE_A = TreeIndex(children={"root": ["a", "n2"], "a": ["n0", "n1"]},
                   leaves={"root": ["g/0", "g/1", "g/2"], "a": ["g/0", "g/1"],
                           "n0": ["g/0"], "n1": ["g/1"], "n2": ["g/2"]})


def group_a(rewards=(1.0, 1.0, 0.0)) -> RolloutGroup:
    leaves = [leaf(i, t, r) for i, (t, r) in enumerate(zip([[3, 4, 5, 6], [3, 4, 5, 7], [3, 8, 9]], rewards))]
    return RolloutGroup("g", "p", 0, 3, leaves, tree=TREE_A)


def test_node_values_and_advantages_of_a_hand_tree():
    values, root = estimator().node_values(group_a())
    # rewards (1, 1, 0): V(root) = 2/3, V(a) = 1, V(n0) = V(n1) = 1, V(n2) = 0
    assert root == pytest.approx(2 / 3)
    assert values == pytest.approx({"root": 2 / 3, "a": 1.0, "n0": 1.0, "n1": 1.0, "n2": 0.0})
    adv = estimator().node_advantages(group_a())
    assert adv["root"] == pytest.approx(0.0)
    assert adv["a"] == pytest.approx(((1 - 2 / 3) + (1 - 2 / 3)) / R2)  # global + local, over sqrt(2 leaves)
    assert adv["n0"] == pytest.approx((1 - 2 / 3) + (1 - 1))  # local 0: a and n0 agree
    assert adv["n2"] == pytest.approx((0 - 2 / 3) + (0 - 2 / 3))  # its parent is the root


def test_per_token_advantages_of_a_hand_tree_from_the_tokens():
    out = estimator().estimate(group_a())
    a, n0, n2 = 2 / 3 / R2, 1 / 3, -4 / 3
    expected = [[0.0, a, a, n0], [0.0, a, a, n0], [0.0, n2, n2]]  # position 0 is the root's: 0
    for got, want in zip(out.values, expected):
        np.testing.assert_allclose(got, want)
    assert out.loss_masks == ()


def test_without_the_sqrt_scaling():
    out = estimator(leaf_scaling=False).estimate(group_a())
    np.testing.assert_allclose(out.values[0], [0.0, 2 / 3, 2 / 3, 1 / 3])


# --- tree B: two trees, spans recorded (as generate.tree writes them) ---------------------------
# t0: q0 sampled 5 tokens; q1 branched from q0 at 2 (4 tokens); q2 from q1 at 3 (6 tokens). t1: q3 alone.
TOKENS_B = [[1, 2, 3, 4, 5], [1, 2, 7, 8], [1, 2, 7, 9, 9, 9], [4, 4, 4]]
TREE_B = TreeIndex(
    children={"root": ["n0@0", "n3@0"], "n0@0": ["n0@2", "n1@2"], "n1@2": ["n1@3", "n2@3"]},
    leaves={"root": ["g/0", "g/1", "g/2", "g/3"], "n0@0": ["g/0", "g/1", "g/2"], "n0@2": ["g/0"],
            "n1@2": ["g/1", "g/2"], "n1@3": ["g/1"], "n2@3": ["g/2"], "n3@0": ["g/3"]},
    spans={"root": (0, 0), "n0@0": (0, 2), "n0@2": (2, 5), "n1@2": (2, 3), "n1@3": (3, 4), "n2@3": (3, 6),
           "n3@0": (0, 3)})


def group_b(rewards=(0.0, 1.0, 1.0, 0.0)) -> RolloutGroup:
    return RolloutGroup("g", "p", 0, 4, [leaf(i, t, r) for i, (t, r) in enumerate(zip(TOKENS_B, rewards))],
                        tree=TREE_B)


def test_the_generator_s_topology_of_tree_b():
    tree = segment_tree([None, 0, 1, None], [0, 2, 3, 0], [5, 4, 6, 3], ["g/0", "g/1", "g/2", "g/3"])
    assert tree.children == TREE_B.children and tree.leaves == TREE_B.leaves and tree.spans == TREE_B.spans


def test_per_token_advantages_of_a_two_tree_group_with_spans():
    out = estimator().estimate(group_b())
    # V(root) = 1/2; V(n0@0) = 2/3; V(n0@2) = 0; V(n1@2) = 1; V(n1@3) = V(n2@3) = 1; V(n3@0) = 0
    top = ((2 / 3 - 0.5) + (2 / 3 - 0.5)) / R3
    q0_own = (0 - 0.5) + (0 - 2 / 3)
    mid = ((1 - 0.5) + (1 - 2 / 3)) / R2
    tip = (1 - 0.5) + (1 - 1)
    expected = [[top, top, q0_own, q0_own, q0_own], [top, top, mid, tip], [top, top, mid, tip, tip, tip],
                [-1.0, -1.0, -1.0]]
    for got, want in zip(out.values, expected):
        np.testing.assert_allclose(got, want)


def test_equal_rewards_give_zero_and_a_missing_tree_or_reward_is_loud():
    assert all(np.all(v == 0.0) for v in estimator().estimate(group_b((1.0, 1.0, 1.0, 1.0))).values)
    flat = group_b()
    flat.tree = None
    with pytest.raises(ValueError, match="has no tree.*generate.tree"):
        estimator().estimate(flat)
    unscored = group_b()
    unscored.rollouts[1].reward = None
    with pytest.raises(ValueError, match="NaN"):
        estimator().estimate(unscored)


def test_a_removed_leaf_leaves_the_node_values():
    g = group_b()
    g.remove("g/2", "test")  # n1@2 keeps only g/1; V(root) = 1/3 over g/0, g/1, g/3
    adv = estimator().node_advantages(g)
    assert adv["n0@0"] == pytest.approx(((0.5 - 1 / 3) * 2) / R2)
    assert adv["n1@2"] == pytest.approx((1 - 1 / 3) + (1 - 0.5))
    assert "n2@3" not in adv


# --- through the update: the gradient with per-token tree advantages ----------------------------

def test_the_update_gradient_with_tree_advantages_equals_a_hand_loss():
    stage, policy = stage_and_policy(advantage={"use": "tree"}, loss={"use": "ppo_clip", "with": {"clip": [0.2, 0.2]}})
    group = tree_group(policy.model, rewards=(1.0, 1.0, 0.0))  # tree A's shape, tokens [3..]
    got, metrics = stage_gradients(stage, RolloutGroups([group]))
    a, n0, n2 = 2 / 3 / R2, 1 / 3, -4 / 3
    advantages = [[0.0, a, a, n0], [0.0, a, a, n0], [0.0, n2, n2]]
    total = 0.0
    for r, adv, w in zip(group.rollouts, advantages, SHARED_ONCE):
        logp = token_logprobs(policy.model, r.response_token_ids)
        ratio = torch.exp(logp - torch.tensor(r.behavior_logprobs))
        total = total - (torch.tensor(w) * surrogate(ratio, torch.tensor(adv, dtype=torch.float32))).sum()
    want = hand_gradients(policy.model, total / 7.0)  # token_mean over the 7 distinct tokens
    assert metrics["batch_tokens"] == pytest.approx(7.0)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, atol=1e-6, rtol=0)


# --- gfcr validate -------------------------------------------------------------------------------

def test_pairing_needs_a_tree_generator_upstream():
    config = TreeAdvantage.Config()
    ctx = PairingContext("tree", "ppo_clip", "token_mean", upstream=(("reward", "filter.verify"),
                                                                     ("rollout", "generate.sample")))
    (problem,) = TreeAdvantage.pairing_problems(config, ctx)
    assert problem.key == ("advantage", "use") and "generate.tree" in problem.fix
    ok = PairingContext("tree", "ppo_clip", "token_mean", upstream=(("rollout", "generate.tree"),), trees_upstream=True)
    assert TreeAdvantage.pairing_problems(config, ok) == []


def test_gfcr_validate_refuses_tree_advantages_on_independent_samples():
    result = CliRunner().invoke(app, ["validate", str(REPO / "pipelines" / "quickstart.yaml"),
                                      "--set", "update.with.advantage.use=tree"])
    assert result.exit_code == 2, result.output
    assert "update.with.advantage.use:" in result.output and "no stage upstream of the update generates trees" \
        in result.output and "fix: generate with `generate.tree`" in result.output
    for name in ("tree_arith", "tree_dapo_arith"):
        assert CliRunner().invoke(app, ["validate", str(REPO / "pipelines" / f"{name}.yaml")]).exit_code == 0
    # a tree group reaching a scalar estimator is allowed (a group of its leaves; shared tokens once)
    assert CliRunner().invoke(app, ["validate", str(REPO / "pipelines" / "tree_arith.yaml"),
                                    "--set", "update.with.advantage.use=mean_std"]).exit_code == 0


def test_shared_prefix_weights_from_recorded_spans():
    from gfcr.stages.update.tree_weights import shared_prefix_weights

    weights = shared_prefix_weights(group_b())
    third = 1 / 3
    expected = [[third, third, 1, 1, 1], [third, third, 0.5, 1], [third, third, 0.5, 1, 1, 1], [1, 1, 1]]
    for i, want in enumerate(expected):
        np.testing.assert_allclose(weights[f"g/{i}"], want)
    assert sum(w.sum() for w in weights.values()) == pytest.approx(13.0)  # 2 + 3 + 1 + 1 + 3 + 3 distinct
