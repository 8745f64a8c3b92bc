"""VCPO's learning-rate rule and OPOB baseline and PPO-EWMA's proximal policy under trainer ranks:
two ranks, each with its own copy of the policy and of ``update.grpo``, train contiguous shards of
one batch, their sums going through ``Ranks.all_reduce_sum`` (here two threads that add each
other's tensors, in rank order, as gloo's all-reduce does). The ESS is the whole batch's (VCPO
all-gathers its weights across data-parallel ranks), each group's OPOB baseline sees every
trajectory of the group whichever rank holds it, and the step equals one process's."""

from __future__ import annotations

import copy
import threading

import numpy as np
import pytest
import torch

from gfcr.stages.resources import Lent
from gfcr.stages.training import Ranks
from gfcr.stages.update.grpo import GRPOUpdate
from tests.stages.update.test_component_conformance import _batch
from tests.stages.update.test_tree_and_off_policy import ToyPolicy

CONFIG = {"lr": 1e-2, "micro_batch_size": 3, "advantage": {"use": "opob"}, "aggregation": {"use": "seq_mean_token_mean"},
          "lr_rule": {"use": "vcpo_ess"}, "correction": {"use": "ewma_proximal", "with": {"decay": 0.5}}}


class ThreadSum:
    """``all_reduce_sum`` for ``n`` ranks that are threads of this process."""

    def __init__(self, n: int):
        self.barrier, self.slots = threading.Barrier(n), [None] * n

    def for_rank(self, rank: int):
        def reduce(tensors):
            self.slots[rank] = [t.detach().clone() for t in tensors]
            self.barrier.wait()
            totals = [sum(parts[1:], parts[0].clone()) for parts in zip(*self.slots)]  # rank order on every rank
            self.barrier.wait()
            for t, total in zip(tensors, totals):
                t.copy_(total)
        return reduce


def _stale_batch():
    groups, pool = _batch()
    for g in groups:  # behaviour log-probs off the policy's: sequence weights spread, ratios leave 1
        for i, r in enumerate(g.rollouts):
            r.segments[0].behavior_logprobs = np.full(len(r), -0.5 - 1.5 * (i % 2), dtype=np.float32)
    return groups, pool


def _stage(model: torch.nn.Module) -> tuple[GRPOUpdate, ToyPolicy]:
    policy = ToyPolicy()
    policy.model.load_state_dict(model.state_dict())
    stage = GRPOUpdate(GRPOUpdate.Config.model_validate(CONFIG))
    stage.setup(Lent(policy))
    return stage, policy


def test_two_ranks_take_one_processs_step():
    start = ToyPolicy().model
    single, single_policy = _stage(start)
    groups, pool = _stale_batch()
    batch = single.prepare(groups, pool)
    one = single.train_shard(copy.deepcopy(batch.items), batch.plan, 0, Ranks())

    driver, _ = _stage(start)
    batch = driver.prepare(*_stale_batch())
    shards = [batch.items[:3], batch.items[3:]]  # contiguous, the first group straddling the two ranks
    assert shards[0][0].group is shards[1][0].group
    ranks, summer, answers = [_stage(start) for _ in range(2)], ThreadSum(2), [None, None]

    def run(r):
        answers[r] = ranks[r][0].train_shard(copy.deepcopy(shards[r]), batch.plan, 0, Ranks(r, 2, summer.for_rank(r)))

    threads = [threading.Thread(target=run, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert answers[0].skip_reason is None and answers[0].extra == answers[1].extra
    assert answers[0].extra["ess_ratio"] == pytest.approx(one.extra["ess_ratio"], rel=1e-9)
    assert one.extra["ess_ratio"] < 0.9 and one.extra["lr_factor"] < 1.0
    assert answers[0].advantages + answers[1].advantages == pytest.approx(one.advantages, rel=1e-6)
    for rank, _ in ranks:
        for p, q in zip(rank.policy.model.parameters(), single_policy.model.parameters()):
            assert torch.allclose(p, q, atol=1e-6)
        for p, q in zip(rank.correction.proximal_model().parameters(), single.correction.proximal_model().parameters()):
            assert torch.allclose(p, q, atol=1e-6)  # every rank's moving average followed the same step
