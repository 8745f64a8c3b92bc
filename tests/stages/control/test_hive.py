"""control.hive (HIVE): both selection stages on hand-computed cases, the prompt entropy against
a forward pass of the real tiny-arith policy, its cost in tokens_scored, the group's response
entropy in the shared per-prompt statistics, state round-trips and loud misconfiguration."""

from __future__ import annotations

import json
import math
import textwrap

import numpy as np
import pytest
import torch
from pydantic import ValidationError

from gfcr.engines.decode import entropy_of
from gfcr.engines.fake import FakeEngine, fake_logits
from gfcr.errors import GraphError
from gfcr.graph import load_pipeline
from gfcr.records import (Observation, Prompt, PromptPool, PromptStats, Rollout, RolloutGroup, Segment,
                          StepContext, StepReport, group_id, rollout_id)
from gfcr.stages.common.prompt_stats import observe_group, stats_from_state, stats_to_state
from gfcr.stages.control.hive import Hive, coarse_keep, edge_score, prompt_entropy_request, stage_one, stage_two
from gfcr.stages.engine import Scored, ScoreRequest
from gfcr.stages.resources import Lent
from gfcr.stages.testing import scored_group
from tests.conftest import REPO

NAN = math.nan


def obs(n: int, correct: int, entropy: float = NAN, step: int = 0) -> Observation:
    return Observation(step=step, policy_version=0, n=n, n_correct=correct, mean_reward=correct / n,
                       reward_std=0.0, mean_entropy=entropy)


def stats_of(*observations: Observation, size: int = 4) -> PromptStats:
    stats = PromptStats("p", history_size=size)
    for o in observations:
        stats.record(o)
    return stats


# --- stage 1: the history --------------------------------------------------------------------

def test_edge_score_averages_the_window():
    stats = stats_of(obs(4, 0, 9.0), obs(4, 1, 0.6), obs(4, 3, 1.0))
    # window 2: (1 + 3) / (4 + 4) = 0.5 correct, entropy (0.6 + 1.0) / 2 = 0.8
    assert edge_score(stats, 2) == (0.5, pytest.approx(0.8))
    # window 1: the last group only
    assert edge_score(stats, 1) == (0.75, 1.0)
    # window 3: 4 of 12 correct, entropy (9 + 0.6 + 1) / 3
    assert edge_score(stats, 3) == (pytest.approx(1 / 3), pytest.approx(10.6 / 3))


def test_edge_score_of_unseen_and_of_groups_without_entropy():
    assert all(math.isnan(v) for v in edge_score(None, 4))
    p, h = edge_score(stats_of(obs(2, 1), obs(2, 2, 0.4)), 4)
    assert (p, h) == (0.75, 0.4)  # the group without entropy counts for p, not for H
    p, h = edge_score(stats_of(obs(2, 1)), 4)
    assert p == 0.5 and math.isnan(h)


SCORES = [
    (NAN, NAN),   # 0 unseen: first
    (0.5, 0.8),   # 1 u = 0.25 * 0.8 = 0.2
    (0.75, 1.0),  # 2 u = 0.1875 * 1.0 = 0.1875
    (1.0, 0.9),   # 3 all correct: off the edge
    (0.0, 2.0),   # 4 all wrong: off the edge
    (0.25, NAN),  # 5 no entropy: after every scored one, by p (1 - p) = 0.1875
    (0.5, 0.4),   # 6 u = 0.25 * 0.4 = 0.1
    (NAN, NAN),   # 7 unseen: first, after 0
]


def test_stage_one_ranks_unseen_then_the_edge_score_and_drops_the_band():
    kept, off = stage_one(SCORES, (0.0, 1.0), keep=5)
    assert off == {3, 4}
    assert kept == [0, 7, 1, 2, 6]  # unseen (candidate order), then u = 0.2, 0.1875, 0.1; 5 is cut
    assert stage_one(SCORES, (0.0, 1.0), keep=8)[0] == [0, 7, 1, 2, 6, 5]
    assert stage_one(SCORES, (0.0, 1.0), keep=1)[0] == [0]


def test_stage_one_band_is_open_at_both_ends():
    # band (0.25, 0.75): p = 0.75 and p = 0.25 are off too; only p = 0.5 and unseen pass
    kept, off = stage_one(SCORES, (0.25, 0.75), keep=8)
    assert off == {2, 3, 4, 5}
    assert kept == [0, 7, 1, 6]


def test_stage_one_ranks_re_admitted_prompts_with_the_unseen():
    # 3 (all correct) re-admitted: it joins the unseen 0 and 7 at the front, in candidate order
    kept, off = stage_one(SCORES, (0.0, 1.0), keep=4, readmit={3})
    assert off == {4} and kept == [0, 3, 7, 1]
    # naming a prompt that is on the edge changes its rank: 2 (u = 0.1875) moves up among the unseen
    assert stage_one(SCORES, (0.0, 1.0), keep=4, readmit={2})[0] == [0, 2, 7, 1]


def test_off_edge_prompts_are_re_admitted_by_seeded_draws():
    from gfcr.stages.common.prompt_stats import visit_draw

    pool = pool_of(list(range(2, 10)))  # 8 prompts, all seen and all correct: every one off the edge
    config = dict(batch_size=4, candidate_ratio=2, seed=0)
    for explore, expect in [(0.0, 0), (1.0, 8)]:
        stage = Hive(Hive.Config(**config, explore=explore))
        stage.setup(Lent(engine=FirstTokenEngine()))
        stage.stats = {f"p:{i}": stats_of(obs(4, 4, 1.0)) for i in range(8)}
        alloc = call(stage, 3, pool)
        assert stage.step_metrics()["readmitted"] == expect and stage.step_metrics()["off_edge"] == 8 - expect
        assert len(alloc.active()) == min(expect, 4)
    stage = Hive(Hive.Config(**config, explore=0.5))
    stage.setup(Lent(engine=FirstTokenEngine()))
    stage.stats = {f"p:{i}": stats_of(obs(4, 4, 1.0)) for i in range(8)}
    alloc = call(stage, 3, pool)
    drawn = {f"p:{i}" for i in range(8) if visit_draw(0, 0, 3, f"p:{i}") < 0.5}
    readmitted = {e.prompt_id for e in alloc if "re-admitted" in e.reason}
    assert readmitted == drawn and stage.step_metrics()["readmitted"] == len(drawn) == 3  # 3 of the 8 draws < 0.5


def test_stage_one_s_cap_is_a_ceiling_without_float_noise():
    assert coarse_keep(0.5, 64) == 32 and coarse_keep(0.5, 7) == 4 and coarse_keep(0.7, 10) == 7
    assert coarse_keep(0.07, 100) == 7  # 0.07 * 100 = 7.000000000000001 in floats: a plain ceil gives 8


def test_stage_one_ties_keep_candidate_order():
    kept, _ = stage_one([(0.5, 1.0), (0.5, 1.0), (0.5, 1.0)], (0.0, 1.0), keep=2)
    assert kept == [0, 1]


# --- stage 2: the prompt entropy -------------------------------------------------------------

def test_stage_two_keeps_the_highest_prompt_entropies():
    assert stage_two([0.3, 0.9, 0.3, 0.5], 2) == [1, 3]
    assert stage_two([0.3, 0.9, 0.3, 0.5], 3) == [1, 3, 0]  # 0 and 2 tie: candidate order
    assert stage_two([0.3], 4) == [0]
    assert stage_two([], 4) == []


def test_the_prompt_entropy_request_covers_every_prefix_of_the_prompt():
    r = prompt_entropy_request([5, 6, 7], 0.7)
    # positions predicting x_2, x_3 and the one after the whole prompt (placeholder x_1)
    assert (r.prompt_token_ids, r.response_token_ids, r.temperature) == ((5,), (6, 7, 5), 0.7)
    assert prompt_entropy_request([5], 1.0).response_token_ids == (5,)  # one token: the distribution after it
    with pytest.raises(ValueError, match="no tokens"):
        prompt_entropy_request([], 1.0)


class FirstTokenEngine:
    """TEST engine with hand-computable entropies: after any context the next token is uniform
    over ``context[0]`` tokens, so every position's entropy is ``ln(x_1)`` and so is PE(x)."""

    def __init__(self):
        self.calls: list[list[ScoreRequest]] = []

    def score(self, requests):
        self.calls.append(list(requests))
        return [Scored(np.zeros(len(r.response_token_ids), np.float32),
                       np.full(len(r.response_token_ids), math.log(r.prompt_token_ids[0]), np.float32))
                for r in requests]


def pool_of(first_tokens: list[int]) -> PromptPool:
    return PromptPool([Prompt(f"p:{i}", text=str(i), prompt_token_ids=[t, 3, 3]) for i, t in enumerate(first_tokens)])


def call(stage: Hive, step: int, pool: PromptPool):
    stage.before_step(StepContext("run", step=step, seed=0, policy_version=step))
    return stage.run(pool)


def test_a_call_on_hand_values():
    # 4 candidates (the whole pool, one epoch), batch 2, stage 1 keeps ceil(0.75 * 4) = 3
    pool = pool_of([2, 8, 4, 16])
    stage = Hive(Hive.Config(batch_size=2, candidate_ratio=2, coarse_ratio=0.75, explore=0.0, seed=0))
    engine = FirstTokenEngine()
    resources = Lent(engine=engine)
    stage.setup(resources)
    stage.stats = {"p:0": stats_of(obs(4, 2, 1.0)),   # u = 0.25 * 1.0 = 0.25
                   "p:1": stats_of(obs(4, 1, 0.5)),   # u = 0.1875 * 0.5 = 0.09375
                   "p:2": stats_of(obs(4, 3, 0.9)),   # u = 0.1875 * 0.9 = 0.16875
                   "p:3": stats_of(obs(4, 4, 2.0))}   # all correct: off the edge
    alloc = call(stage, 0, pool)
    # stage 1: p:3 off; ranks p:0, p:2, p:1 (3 kept). Stage 2: PE = ln 2, ln 4, ln 8: keep p:1, p:2
    assert [(e.prompt_id, e.n_rollouts) for e in alloc] == [("p:1", 1), ("p:2", 1), ("p:0", 0), ("p:3", 0)]
    reasons = {e.prompt_id: e.reason for e in alloc}
    assert reasons["p:3"].startswith("hive: off the edge (success 1.000")
    assert reasons["p:0"].startswith("hive: pruned at stage 2 (stage-1 rank 1")
    assert reasons["p:0"].endswith(f"prompt entropy {math.log(2):.4f}, rank 3)")
    assert reasons["p:1"].startswith("hive: kept (stage-1 rank 3")
    why = {e.prompt_id: e.why for e in alloc}  # the same decisions, machine-readable (lineage)
    assert (why["p:3"].code, why["p:3"].name, why["p:3"].value) == ("off_edge", "success", 1.0)
    assert (why["p:0"].code, why["p:0"].name) == ("pruned_stage2", "prompt_entropy")
    assert why["p:0"].value == pytest.approx(math.log(2), abs=1e-6)
    assert (why["p:0"].quantities["stage1_rank"], why["p:0"].quantities["stage2_rank"]) == (1.0, 3.0)
    assert why["p:0"].quantities["success"] == 0.5
    assert (why["p:1"].code, why["p:2"].code) == ("kept", "kept")
    assert why["p:1"].value == pytest.approx(math.log(8), abs=1e-6)
    # one batched score call over the 3 survivors, 3 tokens each (x_2, x_3, placeholder)
    assert len(engine.calls) == 1 and len(engine.calls[0]) == 3
    assert resources.take_tokens_scored() == 9
    metrics = stage.step_metrics()
    assert {k: metrics[k] for k in ("candidates", "off_edge", "kept_stage1", "kept_stage2", "unseen",
                                    "tokens_scored")} == {"candidates": 4, "off_edge": 1, "kept_stage1": 3,
                                                          "kept_stage2": 2, "unseen": 0, "tokens_scored": 9}
    assert metrics["prompt_entropy_mean"] == pytest.approx((math.log(2) + math.log(8) + math.log(4)) / 3)
    assert metrics["prompt_entropy_kept"] == pytest.approx((math.log(8) + math.log(4)) / 2)


def test_metrics_sum_over_the_rounds_of_a_step_and_reset_at_the_next():
    pool = pool_of([2, 3, 4, 5, 6, 7, 8, 9])
    stage = Hive(Hive.Config(batch_size=1, candidate_ratio=2, seed=0))
    stage.setup(Lent(engine=FirstTokenEngine()))
    call(stage, 0, pool)
    stage.run(pool)  # a second loop round in the same step
    m = stage.step_metrics()
    assert (m["candidates"], m["kept_stage1"], m["kept_stage2"], m["unseen"], m["tokens_scored"]) == (4, 2, 2, 2, 6)
    call(stage, 1, pool)
    assert stage.step_metrics()["candidates"] == 2


def test_nothing_on_the_edge_scores_nothing_and_keeps_nothing():
    pool = pool_of([2, 3])
    stage = Hive(Hive.Config(batch_size=1, candidate_ratio=2, explore=0.0, seed=0))
    engine = FirstTokenEngine()
    stage.setup(Lent(engine=engine))
    stage.stats = {"p:0": stats_of(obs(4, 0, 1.0)), "p:1": stats_of(obs(4, 4, 1.0))}
    alloc = call(stage, 0, pool)
    assert alloc.active() == () and len(alloc) == 2 and engine.calls == []
    m = stage.step_metrics()
    assert m["off_edge"] == 2 and m["kept_stage2"] == 0 and "prompt_entropy_mean" not in m


def test_the_prompt_entropy_is_the_mean_next_token_entropy_over_the_prompt():
    engine = FakeEngine()
    tokens = list(engine.encode("12+34="))
    stage = Hive(Hive.Config(batch_size=1, candidate_ratio=1, coarse_ratio=1.0, temperature=0.5))
    stage.setup(Lent(engine=engine))
    (pe,) = stage.prompt_entropies([Prompt("p", text="x", prompt_token_ids=tokens)])
    # independently: the entropy of the tempered next-token distribution after x_1..x_t, t = 1..L
    want = [entropy_of(torch.log_softmax(fake_logits(tokens[:t], len(engine.ALPHABET)) / 0.5, -1)).item()
            for t in range(1, len(tokens) + 1)]
    assert pe == pytest.approx(float(np.mean(want)), rel=1e-5)


def test_the_prompt_entropy_under_the_real_policy_is_one_forward_pass_over_the_prompt():
    from gfcr.engines import TransformersEngine, load_policy
    from gfcr.spec import PolicySpec

    policy = load_policy(PolicySpec(model="tiny-arith"))
    resources = Lent(policy, TransformersEngine(policy))
    prompts = [Prompt("a", text="What is 12 + 7? Answer:"), Prompt("b", text="What is 3 - 45? Answer:")]
    stage = Hive(Hive.Config(batch_size=1, candidate_ratio=2))
    stage.setup(resources)
    got = stage.prompt_entropies(prompts)
    assert all(p.prompt_token_ids for p in prompts)  # tokenized once, kept on the prompt
    assert resources.take_tokens_scored() == sum(len(p.prompt_token_ids) for p in prompts)
    with torch.no_grad():
        for prompt, pe in zip(prompts, got):
            logits = policy.model(torch.tensor([prompt.prompt_token_ids])).logits[0]  # [L, V]
            want = entropy_of(torch.log_softmax(logits.float(), -1)).mean().item()
            assert pe == pytest.approx(want, rel=1e-4, abs=1e-6)


# --- learning: the observation's response entropy ---------------------------------------------

def group_with_entropies(prompt: str, rows: list[tuple[float, list[float] | None]], step: int = 0) -> RolloutGroup:
    gid = group_id(prompt, step)
    rollouts = [Rollout(rollout_id(gid, i), gid, prompt, [1] * 2, [Segment(0, 2, 0, np.zeros(2))], reward=r,
                        correct=None if r is None else r == 1,
                        token_entropy=None if h is None else np.array(h, np.float32))
                for i, (r, h) in enumerate(rows)]
    return RolloutGroup(gid, prompt, step, len(rows), rollouts)


def test_an_observation_keeps_the_mean_token_entropy_of_the_judged_responses():
    group = group_with_entropies("p", [(1, [0.5, 1.5]), (0, [1.0, NAN]), (0, None), (None, [9.0, 9.0])])
    o = observe_group(group, 3)
    # judged: the first three; tokens with an entropy: 0.5, 1.5, 1.0 -> 1.0 (the unjudged 9s are left out)
    assert (o.n, o.n_correct, o.policy_version) == (3, 1, 3)
    assert o.mean_entropy == pytest.approx(1.0)
    assert math.isnan(observe_group(group_with_entropies("p", [(1, None)]), 0).mean_entropy)


def test_observe_records_the_step_s_groups_only():
    stage = Hive(Hive.Config(batch_size=1, history_size=2))
    stage.before_step(StepContext("run", step=1, seed=0, policy_version=1))
    stage.observe(StepReport("run", 1, 2, (group_with_entropies("p:0", [(1, [0.2, 0.4]), (0, [0.6, 0.8])], 1),
                                           scored_group("p:1", [1, 0], step=0)), None, {}, {}))
    assert set(stage.stats) == {"p:0"}  # p:1's group is from step 0 (replayed)
    assert edge_score(stage.stats["p:0"], 2) == (0.5, pytest.approx(0.5))


def test_stats_round_trip_keeps_the_entropy_and_reads_old_checkpoints():
    stats = stats_of(obs(4, 1, 0.25), obs(4, 2))
    state = json.loads(json.dumps(stats_to_state(stats)))
    again = stats_from_state(state)
    assert [o.mean_entropy for o in again.history][0] == 0.25 and math.isnan(again.history[1].mean_entropy)
    for o in state["history"]:
        del o["mean_entropy"]  # a checkpoint written before the field existed
    assert all(math.isnan(o.mean_entropy) for o in stats_from_state(state).history)


def test_state_round_trip_gives_the_same_next_call():
    pool = pool_of(list(range(2, 14)))

    def fresh() -> Hive:
        stage = Hive(Hive.Config(batch_size=2, candidate_ratio=2, seed=0))
        stage.setup(Lent(engine=FirstTokenEngine()))
        return stage

    stage = fresh()
    chosen = call(stage, 0, pool).active()
    groups = tuple(group_with_entropies(e.prompt_id, [(1, [0.3, 0.3]), (0, [0.7, 0.7])]) for e in chosen)
    stage.observe(StepReport("run", 0, 1, groups, None, {}, {}))
    restored = fresh()
    restored.load_state_dict(json.loads(json.dumps(stage.state_dict())))
    a, b = call(stage, 1, pool), call(restored, 1, pool)
    assert [(e.prompt_id, e.n_rollouts, e.reason) for e in a] == [(e.prompt_id, e.n_rollouts, e.reason) for e in b]


# --- misconfiguration -------------------------------------------------------------------------

def test_a_closed_band_is_refused():
    with pytest.raises(ValidationError,
                       match=r"min_success \(0.6\) must be below max_success \(0.4\).*defaults are 0 and 1"):
        Hive.Config(batch_size=4, min_success=0.6, max_success=0.4)


def test_a_stage_one_smaller_than_the_batch_is_refused():
    # ceil(0.2 * 2 * 4) = 2 < 4: the batch could never fill
    with pytest.raises(ValidationError,
                       match="= 2 prompts, fewer than batch_size .4.; raise `coarse_ratio` to at least 0.5"):
        Hive.Config(batch_size=4, candidate_ratio=2, coarse_ratio=0.2)
    assert Hive.Config(batch_size=4, candidate_ratio=2, coarse_ratio=0.5).coarse_ratio == 0.5


def test_a_pipeline_without_response_entropy_fails_validation(tmp_path):
    text = textwrap.dedent("""\
        name: hive-no-entropy
        policy: {model: tiny-arith}
        data: {source: arithmetic, with: {n: 40}}
        stages:
          pick:    {use: control.hive, with: {batch_size: 4}}
          budget:  {use: control.fixed_n, from: pick, with: {n: 4}}
          rollout: {use: generate.sample, from: budget, with: {max_new_tokens: 8}}
          reward:  {use: filter.verify, from: rollout}
        update: {use: update.grpo, from: reward}
        run: {steps: 2}
        tracking: {mlflow: null}
        """)
    spec = tmp_path / "hive.yaml"
    spec.write_text(text)
    with pytest.raises(GraphError) as info:
        load_pipeline(spec)
    (problem,) = info.value.problems
    assert "no generate stage records per-token entropy" in problem.message
    assert "--set stages.rollout.with.entropy=true" in problem.fix
    assert load_pipeline(spec, ["stages.rollout.with.entropy=true"])  # the fix works


def test_without_an_engine_the_stage_says_how_to_add_one():
    from gfcr.errors import ModelError
    with pytest.raises(ModelError, match="needs an engine"):
        Hive(Hive.Config(batch_size=1)).setup(Lent())


@pytest.mark.parametrize("path", ["pipelines/hive_arith.yaml", "pipelines/examples/hive_dapo_arith.yaml"])
def test_the_shipped_hive_pipelines_validate(path):
    compiled = load_pipeline(REPO / path)
    assert compiled.spec.stages["pick"].use == "control.hive"

