"""Must-show 3 of issue 10: the update's gradient equals a hand computation (a) on a tree of
3 leaves sharing a prefix, where shared tokens count once, and (b) with truncated importance
sampling on stale segments, where each token's loss carries its capped weight. Also the
decoupled clip, the staleness limit, loss masks and per-token advantages, each correction chosen
as the update's ``correction`` component."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from gfcr.records import Prompt, PromptPool, Rollout, RolloutGroup, RolloutGroups, Segment, TreeIndex
from gfcr.stages.resources import Lent
from gfcr.stages.update.grpo import GRPOUpdate
from gfcr.stages.update.tree_weights import shared_prefix_weights

PROMPT = Prompt("p:0", text="unused", prompt_token_ids=[1, 2])
POOL = PromptPool([PROMPT])
VOCAB = 12


class TinyLM(torch.nn.Module):
    """A causal toy LM with the transformers call signature the update uses."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.tokens, self.positions = torch.nn.Embedding(VOCAB, 8), torch.nn.Embedding(32, 8)
        self.out = torch.nn.Linear(8, VOCAB)

    def forward(self, input_ids, attention_mask, position_ids, logits_to_keep):
        h = (self.tokens(input_ids) + self.positions(position_ids)) * attention_mask[..., None]
        logits = self.out(torch.tanh(h.cumsum(1)))  # position t sees tokens 0..t only
        return SimpleNamespace(logits=logits[:, -logits_to_keep:, :])


@dataclass
class ToyPolicy:
    model: TinyLM = field(default_factory=TinyLM)
    name: str = "toy"
    tokenizer: object = None
    version: int = 0

    def encode(self, prompt):
        return list(prompt.prompt_token_ids)

    def reference(self):
        raise NotImplementedError


def token_logprobs(model, response: list[int]) -> torch.Tensor:
    """log pi(y_t) of one response, computed on its own (no batching, no padding): the hand side."""
    ids = torch.tensor([PROMPT.prompt_token_ids + response])
    ones = torch.ones_like(ids)
    logits = model(ids, ones, torch.arange(ids.shape[1])[None], ids.shape[1]).logits[0, :-1]
    logp = torch.log_softmax(logits, -1).gather(-1, ids[0, 1:, None])[:, 0]
    return logp[len(PROMPT.prompt_token_ids) - 1:]


def stage_and_policy(version: int = 0, **config) -> tuple[GRPOUpdate, ToyPolicy]:
    policy = ToyPolicy(version=version)
    stage = GRPOUpdate(GRPOUpdate.Config(micro_batch_size=2, max_grad_norm=None, **config))
    stage.setup(Lent(policy))
    return stage, policy


def rollout(i: int, tokens: list[int], behaviour: list[float], versions: list[int] | None = None) -> Rollout:
    """``versions``: the policy version of each token; consecutive equal versions form a segment."""
    versions = versions or [0] * len(tokens)
    segments, start = [], 0
    for end in range(1, len(tokens) + 1):
        if end == len(tokens) or versions[end] != versions[start]:
            segments.append(Segment(start, end, versions[start], behaviour[start:end]))
            start = end
    return Rollout(f"p:0@s0/{i}", "p:0@s0", "p:0", tokens, segments)


def stage_gradients(stage: GRPOUpdate, groups: RolloutGroups) -> tuple[list[torch.Tensor], dict]:
    """The gradient ``update.grpo`` hands to its optimizer in one ``run`` (the step is skipped)."""
    model, captured = stage.policy.model, []
    model.zero_grad(set_to_none=True)
    stage.optimizer.step = lambda: captured.extend(p.grad.clone() for p in model.parameters())
    report = stage.run(groups, POOL)
    assert not report.skipped, report.skip_reason
    return captured, report.metrics


def hand_gradients(model, loss: torch.Tensor) -> list[torch.Tensor]:
    model.zero_grad(set_to_none=True)
    loss.backward()
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    return grads


def surrogate(ratio, advantage, eps=0.2):
    return torch.min(ratio * advantage, torch.clamp(ratio, 1 - eps, 1 + eps) * advantage)


# --- (a) a tree of 3 leaves sharing a prefix ---------------------------------------------------

LEAVES = [[3, 4, 5, 6], [3, 4, 5, 7], [3, 8, 9]]  # leaves 0 and 1 share 3 tokens, all three share 1
TREE = TreeIndex(children={"root": ["a", "n2"], "a": ["n0", "n1"]},
                 leaves={"root": ["p:0@s0/0", "p:0@s0/1", "p:0@s0/2"], "a": ["p:0@s0/0", "p:0@s0/1"],
                         "n0": ["p:0@s0/0"], "n1": ["p:0@s0/1"], "n2": ["p:0@s0/2"]})
SHARED_ONCE = [[1 / 3, 1 / 2, 1 / 2, 1], [1 / 3, 1 / 2, 1 / 2, 1], [1 / 3, 1, 1]]  # 7 distinct tokens


def tree_group(model, rewards=(1.0, 0.0, 1.0)) -> RolloutGroup:
    rollouts = []
    for i, (tokens, reward) in enumerate(zip(LEAVES, rewards)):
        with torch.no_grad():  # behaviour a little off the policy, inside the clip range
            behaviour = (token_logprobs(model, tokens) + 0.05 * (i + 1)).tolist()
        r = rollout(i, tokens, behaviour)
        r.reward, r.tree_id, r.node_id = reward, "t0", f"n{i}"
        r.parent_node_id, r.branch_token_idx = ("a", 3) if i < 2 else ("root", 1)
        rollouts.append(r)
    return RolloutGroup("p:0@s0", "p:0", 0, 3, rollouts, tree=TREE)


def test_shared_prefix_weights_count_each_tree_position_once():
    stage, policy = stage_and_policy()
    group = tree_group(policy.model)
    weights = shared_prefix_weights(group)
    for r, expected in zip(group.rollouts, SHARED_ONCE):
        np.testing.assert_allclose(weights[r.rollout_id], expected)
    assert sum(w.sum() for w in weights.values()) == pytest.approx(7.0)  # 1 + 2 + 2 distinct + 2 own
    group.tree = None
    assert shared_prefix_weights(group) == {}


@pytest.mark.parametrize("use", ["mean_std", "mean"])
def test_a_tree_update_counts_shared_tokens_once(use):
    stage, policy = stage_and_policy(advantage={"use": use}, loss={"use": "ppo_clip", "with": {"clip": [0.2, 0.2]}})
    group = tree_group(policy.model)
    got, metrics = stage_gradients(stage, RolloutGroups([group]))
    # hand: token_mean over the 7 distinct tokens, each shared position weighted 1/k in each leaf
    rewards = np.array([1.0, 0.0, 1.0])
    centred = rewards - rewards.mean()
    advantages = centred / (rewards.std(ddof=1) + 1e-6) if use == "mean_std" else centred
    total = 0.0
    for r, a, w in zip(group.rollouts, advantages, SHARED_ONCE):
        logp = token_logprobs(policy.model, r.response_token_ids)
        ratio = torch.exp(logp - torch.tensor(r.behavior_logprobs))
        total = total - (torch.tensor(w, dtype=torch.float32) * surrogate(ratio, float(a))).sum()
    want = hand_gradients(policy.model, total / 7.0)
    assert metrics["batch_tokens"] == pytest.approx(7.0)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, atol=1e-6, rtol=0)
    # and it differs from counting every leaf's copy (the pre-tree update): the weights matter
    flat, _ = stage_gradients(stage, RolloutGroups([tree_group(policy.model)]))
    plain_stage, _ = stage_and_policy(advantage={"use": use})
    plain_stage.policy.model.load_state_dict(policy.model.state_dict())
    untreed = tree_group(plain_stage.policy.model)
    untreed.tree = None
    duplicated, _ = stage_gradients(plain_stage, RolloutGroups([untreed]))
    assert any(not torch.allclose(a, b, atol=1e-6) for a, b in zip(flat, duplicated))


# --- (b) truncated importance sampling with stale segments -------------------------------------

CAP = 1.5
# per token: behaviour log-prob = current log-prob + delta; tokens of version 0 are stale at version 2
DELTAS = [[-0.7, 0.3, 0.0, 0.01], [0.2, -1.0, 0.05]]
VERSIONS = [[0, 0, 2, 2], [0, 0, 0]]
TOKENS = [[3, 4, 5, 6], [7, 8, 9]]


def stale_group(model, rewards=(1.0, 0.0)) -> RolloutGroup:
    rollouts = []
    for i, (tokens, deltas, versions) in enumerate(zip(TOKENS, DELTAS, VERSIONS)):
        with torch.no_grad():
            behaviour = (token_logprobs(model, tokens) + torch.tensor(deltas)).tolist()
        r = rollout(i, tokens, behaviour, versions)
        r.reward = rewards[i]
        rollouts.append(r)
    return RolloutGroup("p:0@s0", "p:0", 0, 2, rollouts)


def hand_off_policy_loss(model, group, weight_of, proximal_is_old) -> torch.Tensor:
    """token_mean of -w_t * min(r_t A, clip(r_t) A); r_t against pi_old or mu per token."""
    rewards = np.array([r.reward for r in group.rollouts])
    advantages = (rewards - rewards.mean()) / (rewards.std(ddof=1) + 1e-6)
    total, count = 0.0, 0
    for r, a in zip(group.rollouts, advantages):
        logp = token_logprobs(model, r.response_token_ids)
        mu = torch.tensor(r.behavior_logprobs)
        old = logp.detach()
        stale = torch.tensor(r.staleness(2) > 0)
        decoupled = proximal_is_old(stale)
        ratio = torch.exp(logp - torch.where(decoupled, old, mu))
        weights = torch.where(decoupled, weight_of(torch.exp(old - mu)), torch.ones_like(mu))
        total = total - (weights * surrogate(ratio, float(a))).sum()
        count += len(r)
    return total / count


def test_tis_weights_every_token_by_its_capped_ratio_to_the_behaviour_policy():
    stage, policy = stage_and_policy(version=2, correction={"use": "tis", "with": {"cap": CAP}})
    group = stale_group(policy.model)
    got, metrics = stage_gradients(stage, RolloutGroups([group]))
    loss = hand_off_policy_loss(policy.model, group, lambda raw: raw.clamp(max=CAP), lambda s: torch.ones_like(s))
    for g, w in zip(got, hand_gradients(policy.model, loss)):
        torch.testing.assert_close(g, w, atol=1e-6, rtol=0)
    raw = np.exp(-np.concatenate(DELTAS))  # pi_old / mu
    assert metrics["is_weight_max"] == pytest.approx(raw.max(), rel=1e-5)
    assert metrics["is_weight_mean"] == pytest.approx(raw.mean(), rel=1e-5)
    assert metrics["is_clipped_fraction"] == pytest.approx((raw > CAP).mean())  # 2 of 7 above the cap
    assert metrics["off_policy_token_fraction"] == pytest.approx(5 / 7)
    assert all(r.old_logprobs is not None and r.old_logprobs.shape == (len(r),) for r in group.rollouts)


def test_decoupled_clip_corrects_only_the_stale_tokens_without_a_cap():
    stage, policy = stage_and_policy(version=2, correction={"use": "decoupled_clip"})
    group = stale_group(policy.model)
    got, metrics = stage_gradients(stage, RolloutGroups([group]))
    loss = hand_off_policy_loss(policy.model, group, lambda raw: raw, lambda stale: stale)
    for g, w in zip(got, hand_gradients(policy.model, loss)):
        torch.testing.assert_close(g, w, atol=1e-6, rtol=0)
    stale_raw = np.exp(-np.array([-0.7, 0.3, 0.2, -1.0, 0.05]))
    assert metrics["is_weight_max"] == pytest.approx(stale_raw.max(), rel=1e-5)
    assert metrics["is_clipped_fraction"] == 0.0


def test_the_staleness_limit_masks_old_tokens_out_of_the_loss_and_its_denominator():
    stage, policy = stage_and_policy(version=2, correction={"use": "staleness", "with": {"max_staleness": 1}})
    group = stale_group(policy.model)
    got, metrics = stage_gradients(stage, RolloutGroups([group]))
    assert metrics["batch_tokens"] == 2.0  # only the 2 fresh tokens of rollout 0 count
    rewards = np.array([1.0, 0.0])
    a0 = ((rewards - rewards.mean()) / (rewards.std(ddof=1) + 1e-6))[0]
    r = group.rollouts[0]
    logp = token_logprobs(policy.model, r.response_token_ids)[2:]
    ratio = torch.exp(logp - torch.tensor(r.behavior_logprobs[2:]))
    want = hand_gradients(policy.model, -surrogate(ratio, float(a0)).sum() / 2)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, atol=1e-6, rtol=0)


def test_recompute_old_takes_every_ratio_against_pi_old_with_no_weight():
    """APRIL's and SPEC-RL's rule: stale tokens treated as on-policy (ratio 1 at the update's start)."""
    stage, policy = stage_and_policy(version=2, correction={"use": "recompute_old"})
    group = stale_group(policy.model)
    got, metrics = stage_gradients(stage, RolloutGroups([group]))
    loss = hand_off_policy_loss(policy.model, group, lambda raw: torch.ones_like(raw), lambda s: torch.ones_like(s))
    for g, w in zip(got, hand_gradients(policy.model, loss)):
        torch.testing.assert_close(g, w, atol=1e-6, rtol=0)
    raw = np.exp(-np.concatenate(DELTAS))  # pi_old / mu: reported, not applied
    assert metrics["is_weight_max"] == pytest.approx(raw.max(), rel=1e-5)
    assert metrics["off_policy_token_fraction"] == pytest.approx(5 / 7)


def test_a_weighting_correction_takes_a_staleness_limit_too():
    """``tis`` with ``max_staleness``: the old tokens leave the loss, the fresh ones keep their weight."""
    stage, policy = stage_and_policy(version=2, correction={"use": "tis", "with": {"cap": CAP, "max_staleness": 1}})
    group = stale_group(policy.model)
    got, metrics = stage_gradients(stage, RolloutGroups([group]))
    assert metrics["batch_tokens"] == 2.0  # only the 2 fresh tokens of rollout 0 count
    assert metrics["off_policy_token_fraction"] == pytest.approx(5 / 7)  # counted before the limit
    rewards = np.array([1.0, 0.0])
    a0 = ((rewards - rewards.mean()) / (rewards.std(ddof=1) + 1e-6))[0]
    r = group.rollouts[0]
    logp = token_logprobs(policy.model, r.response_token_ids)[2:]
    old, mu = logp.detach(), torch.tensor(r.behavior_logprobs[2:])
    weights = torch.exp(old - mu).clamp(max=CAP)
    want = hand_gradients(policy.model, -(weights * surrogate(torch.exp(logp - old), float(a0))).sum() / 2)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, atol=1e-6, rtol=0)


def test_off_policy_metrics_appear_only_with_a_correction():
    stage, policy = stage_and_policy(version=2)
    _, metrics = stage_gradients(stage, RolloutGroups([stale_group(policy.model)]))
    assert not {"off_policy_token_fraction", "is_weight_mean"} & set(metrics)


# --- loss masks and per-token advantages -------------------------------------------------------

def test_an_mc_grpo_pivot_is_masked_out_of_the_loss():
    stage, policy = stage_and_policy(advantage={"use": "mc_grpo", "with": {"mad_scale": False}})
    group = tree_group(policy.model, rewards=(1.0, 0.0, 0.0))
    group.tree = None
    got, metrics = stage_gradients(stage, RolloutGroups([group]))
    # m = 0, the pivot is rollout 1 (first zero); A = [1, 0, 0] rescaled by 3/1 -> [3, 0, 0]
    assert [r.advantage for r in group.rollouts] == [3.0, 0.0, 0.0]
    assert metrics["batch_tokens"] == 4 + 3  # rollout 1's 4 tokens are not in the denominator
    r = group.rollouts[0]
    logp = token_logprobs(policy.model, r.response_token_ids)
    ratio = torch.exp(logp - torch.tensor(r.behavior_logprobs))
    want = hand_gradients(policy.model, -surrogate(ratio, 3.0).sum() / 7)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, atol=1e-6, rtol=0)


def test_a_filter_loss_mask_and_a_per_token_advantage_are_honoured():
    stage, policy = stage_and_policy(advantage={"use": "mean"})
    group = tree_group(policy.model)
    group.tree = None
    group.rollouts[2].loss_mask = np.array([True, False, True])
    items, _, _ = stage._batch(RolloutGroups([group]), POOL)
    items[0].advantage = np.array([1.0, 0.5, 0.0, -1.0])  # a per-token advantage replaces the scalar
    policy.model.zero_grad(set_to_none=True)
    stage.backward(items, stage.aggregation.plan([i.row() for i in items]), batch_term=True)  # 10 token weights
    got = [p.grad.clone() for p in policy.model.parameters()]
    total = 0.0
    for item, mask in zip(items, [[1, 1, 1, 1], [1, 1, 1, 1], [1, 0, 1]]):
        r = item.rollout
        logp = token_logprobs(policy.model, r.response_token_ids)
        ratio = torch.exp(logp - torch.tensor(r.behavior_logprobs))
        a = torch.as_tensor(item.advantage, dtype=torch.float32)
        total = total - (torch.tensor(mask, dtype=torch.float32) * surrogate(ratio, a)).sum()
    for g, w in zip(got, hand_gradients(policy.model, total / 10.0)):
        torch.testing.assert_close(g, w, atol=1e-6, rtol=0)
