"""control.beta_thompson (MoPPS) and the shared prompt statistics: the decayed Beta update by
hand, selection on fixed draws, seeded draws, checkpoints, and observe -> select in a pipeline."""

from __future__ import annotations

import json
import math
import textwrap

import numpy as np
import pytest
from pydantic import ValidationError

from gfcr.errors import GfcrError
from gfcr.graph import compile_pipeline, load_pipeline
from gfcr.records import Prompt, PromptPool, PromptStats, StepContext, StepReport
from gfcr.runtime import LocalRunner
from gfcr.spec import load_spec_text
from gfcr.stages.common.prompt_stats import (
    beta_mean, beta_update, observe_group, stats_from_state, stats_to_state,
)
from gfcr.stages.control.beta_thompson import BetaThompson, closest_to_target, thompson_draw
from gfcr.stages.testing import scored_group
from tests.conftest import REPO


def pool(n: int) -> PromptPool:
    return PromptPool([Prompt(f"p:{i}", text=str(i)) for i in range(n)])


def stage(**kw) -> BetaThompson:
    return BetaThompson(BetaThompson.Config(**{"batch_size": 2, "candidate_ratio": 2, "seed": 0, **kw}))


def report(step: int, results: list[tuple[str, list[float]]], group_step: int | None = None) -> StepReport:
    groups = tuple(scored_group(pid, rewards, step if group_step is None else group_step) for pid, rewards in results)
    return StepReport("run", step, step + 1, groups, None, {}, {})


# --- the Beta update, by hand ----------------------------------------------------------------

@pytest.mark.parametrize("decay, successes, n, expected", [
    # from Beta(3, 2) with prior Beta(1, 1)
    (1.0, 1, 1, (4.0, 2.0)),    # 3 + 1, 2 + 0: the plain conjugate update
    (1.0, 0, 1, (3.0, 3.0)),    # 3 + 0, 2 + 1
    (0.5, 1, 1, (3.0, 1.5)),    # 0.5*3 + 0.5*1 + 1 = 3,  0.5*2 + 0.5*1 + 0 = 1.5
    (0.5, 0, 1, (2.0, 2.5)),    # 1.5 + 0.5 + 0 = 2,      1 + 0.5 + 1 = 2.5
    (0.5, 3, 4, (5.0, 2.5)),    # 1.5 + 0.5 + 3 = 5,      1 + 0.5 + 1 = 2.5
    (0.0, 2, 4, (3.0, 3.0)),    # everything forgotten: the prior plus this group, 1 + 2, 1 + 2
])
def test_beta_update_by_hand(decay, successes, n, expected):
    stats = PromptStats("p:0", beta_alpha=3.0, beta_beta=2.0)
    beta_update(stats, successes, n, decay, prior_alpha=1.0, prior_beta=1.0)
    assert (stats.beta_alpha, stats.beta_beta) == pytest.approx(expected, abs=1e-12)


def test_beta_update_decays_toward_a_non_uniform_prior_and_refuses_bad_counts():
    stats = PromptStats("p:0", beta_alpha=6.0, beta_beta=1.0)
    beta_update(stats, 0, 0, decay=0.5, prior_alpha=2.0, prior_beta=4.0)  # no trials: only the decay
    assert (stats.beta_alpha, stats.beta_beta) == (4.0, 2.5)  # 0.5*6 + 0.5*2, 0.5*1 + 0.5*4
    assert beta_mean(stats) == pytest.approx(4.0 / 6.5)
    with pytest.raises(ValueError, match="p:0: 3 successes out of 2"):
        beta_update(stats, 3, 2, 1.0, 1.0, 1.0)
    with pytest.raises(ValueError, match="decay"):
        beta_update(stats, 0, 1, 1.5, 1.0, 1.0)


def test_observe_group_counts_judged_rollouts_only():
    group = scored_group("p:0", [1, 0, 1])
    group.rollouts[2].correct = None
    obs = observe_group(group, policy_version=7)
    assert (obs.n, obs.n_correct, obs.policy_version) == (2, 1, 7)
    for r in group.rollouts:
        r.correct = None
    assert observe_group(group, 7) is None


def test_prompt_stats_state_round_trips_with_nan_and_the_posterior():
    stats = PromptStats("p:0", history_size=2, beta_alpha=2.5, beta_beta=4.0)
    nan_group = scored_group("p:0", [1, 0])
    for r in nan_group.rollouts:
        r.reward = None  # judged but unscored: NaN mean reward
    stats.record(observe_group(nan_group, 0))
    state = json.loads(json.dumps(stats_to_state(stats), allow_nan=False))
    back = stats_from_state(state)
    assert (back.beta_alpha, back.beta_beta, back.history_size) == (2.5, 4.0, 2)
    assert math.isnan(back.last.mean_reward) and back.last.n_correct == 1


# --- selection ------------------------------------------------------------------------------

def test_closest_to_target_on_fixed_draws():
    draws = [0.9, 0.45, 0.2, 0.55, 0.5]
    # squared distances to 0.5: 0.16, 0.0025, 0.09, 0.0025, 0 -> 4, then the tie 1, 3 in order, then 2, 0
    assert closest_to_target(draws, 0.5, 3).tolist() == [4, 1, 3]
    assert closest_to_target(draws, 0.5, 5).tolist() == [4, 1, 3, 2, 0]
    # target 0.8: distances 0.01, 0.1225, 0.36, 0.0625, 0.09 -> 0, 3
    assert closest_to_target(draws, 0.8, 2).tolist() == [0, 3]


def test_a_call_draws_candidate_ratio_times_batch_and_keeps_the_draws_nearest_the_target():
    s = stage(batch_size=2, candidate_ratio=3)
    s.stats["p:5"] = PromptStats("p:5", beta_alpha=9.0, beta_beta=1.0)  # a known-easy prompt
    s.before_step(StepContext("run", 3, 0, 3))
    alloc = s.run(pool(12))
    order = np.random.default_rng([0, 0]).permutation(12)[:6]  # epoch 0 of seed 0, the first 6
    candidates = [f"p:{i}" for i in order]
    assert sorted(e.prompt_id for e in alloc) == sorted(candidates) and len(alloc) == 6
    draws = {pid: thompson_draw(0, 0, 3, pid, *((9.0, 1.0) if pid == "p:5" else (1.0, 1.0))) for pid in candidates}
    nearest = sorted(candidates, key=lambda pid: ((draws[pid] - 0.5) ** 2, candidates.index(pid)))[:2]
    assert [e.prompt_id for e in alloc.active()] == nearest
    assert [e.n_rollouts for e in alloc] == [1, 1, 0, 0, 0, 0]
    first = alloc.entries[0]
    assert first.reason == f"beta_thompson: rank 1 (draw {draws[first.prompt_id]:.4f}, Beta(1, 1))"
    assert alloc.controller_state == {
        "epoch": 0, "candidates": 6, "chosen": 2,
        "draw_mean": pytest.approx(np.mean([draws[p] for p in nearest])),
        "draw_min": min(draws[p] for p in nearest), "draw_max": max(draws[p] for p in nearest),
        "posterior_mean": pytest.approx(np.mean([0.9 if p == "p:5" else 0.5 for p in nearest])),
    }
    assert alloc.step == 3 and s.cursor == 6


def test_draws_are_seeded_per_prompt_and_visit_and_follow_the_posterior():
    assert thompson_draw(0, 1, 4, "p:0", 2.0, 3.0) == thompson_draw(0, 1, 4, "p:0", 2.0, 3.0)
    assert thompson_draw(0, 1, 4, "p:0", 2.0, 3.0) != thompson_draw(0, 1, 5, "p:0", 2.0, 3.0)
    assert thompson_draw(0, 1, 4, "p:0", 2.0, 3.0) != thompson_draw(1, 1, 4, "p:0", 2.0, 3.0)
    draws = [thompson_draw(0, 0, t, "p:0", 30.0, 10.0) for t in range(400)]
    assert np.mean(draws) == pytest.approx(0.75, abs=0.02)  # Beta(30, 10) has mean 0.75


def test_epochs_drop_the_last_short_batch_and_the_run_seed_is_the_default():
    s = stage(batch_size=2, candidate_ratio=2)  # 4 candidates per call from 10 prompts: 2 calls per epoch
    epochs = [s.run(pool(10)).controller_state["epoch"] for _ in range(3)]
    assert epochs == [0, 0, 1]
    with pytest.raises(GfcrError, match="a call draws 12 prompts, more than the pool's 10"):
        stage(batch_size=3, candidate_ratio=4).run(pool(10))

    def first(seed):
        t = BetaThompson(BetaThompson.Config(batch_size=2))
        t.before_step(StepContext("run", 0, seed, 0))
        return [e.prompt_id for e in t.run(pool(50))]

    assert first(0) == first(0) != first(1)


def test_config_bounds():
    for bad in ({"decay": 1.5}, {"target": -0.1}, {"prior_alpha": 0.0}, {"candidate_ratio": 0}):
        with pytest.raises(ValidationError):
            BetaThompson.Config(batch_size=2, **bad)


# --- observe --------------------------------------------------------------------------------

def test_observe_updates_each_group_of_the_step_with_decay_and_ignores_old_groups():
    s = stage(decay=0.5, prior_alpha=2.0, prior_beta=2.0)
    s.observe(report(0, [("p:0", [1, 1, 1, 0]), ("p:1", [0, 0])]))
    # p:0 from the prior Beta(2, 2): 0.5*2 + 0.5*2 + 3 = 5, 0.5*2 + 0.5*2 + 1 = 3
    assert (s.stats["p:0"].beta_alpha, s.stats["p:0"].beta_beta) == (5.0, 3.0)
    assert (s.stats["p:1"].beta_alpha, s.stats["p:1"].beta_beta) == (2.0, 4.0)
    # p:0 twice in step 1 (two loop rounds), p:2's group is a replayed one from step 0
    groups = (scored_group("p:0", [0, 0], 1), scored_group("p:0", [1, 0], 1), scored_group("p:2", [1, 1], 0))
    s.observe(StepReport("run", 1, 2, groups, None, {}, {}))
    # first: 0.5*5 + 1 + 0 = 3.5, 0.5*3 + 1 + 2 = 4.5; second: 0.5*3.5 + 1 + 1 = 3.75, 0.5*4.5 + 1 + 1 = 4.25
    assert (s.stats["p:0"].beta_alpha, s.stats["p:0"].beta_beta) == (3.75, 4.25)
    assert "p:2" not in s.stats and len(s.stats["p:0"].history) == 3


def test_one_rollout_per_prompt_updates_by_one_trial():
    # the reference sets alpha = beta = 8 when n == 1 (a precedence slip); here s of 1
    s = stage()
    s.observe(report(0, [("p:0", [1])]))
    assert (s.stats["p:0"].beta_alpha, s.stats["p:0"].beta_beta) == (2.0, 1.0)


# --- state ----------------------------------------------------------------------------------

def test_state_is_plain_json_and_resumes_to_the_same_allocations():
    data = pool(16)
    a = stage(batch_size=2, candidate_ratio=4, decay=0.5)

    def step(s: BetaThompson, number: int):
        s.before_step(StepContext("run", number, 0, number))
        alloc = s.run(data)
        # prompts with an even index always succeed, odd ones half the time
        s.observe(report(number, [(e.prompt_id, [1, 1] if int(e.prompt_id[2:]) % 2 == 0 else [1, 0])
                                  for e in alloc.active()]))
        return alloc

    for number in range(3):
        step(a, number)
    state = json.loads(json.dumps(a.state_dict(), allow_nan=False))
    assert state == a.state_dict() and state["prompts"]
    b = stage(batch_size=2, candidate_ratio=4, decay=0.5)
    b.load_state_dict(state)
    for number in range(3, 8):
        first, second = step(a, number), step(b, number)
        assert [(e.prompt_id, e.n_rollouts, e.reason) for e in first] == \
               [(e.prompt_id, e.n_rollouts, e.reason) for e in second]
        assert first.controller_state == second.controller_state
    assert a.state_dict() == b.state_dict()


# --- in a pipeline --------------------------------------------------------------------------

SPEC = textwrap.dedent("""\
    name: mopps
    data: {source: arithmetic, with: {n: 16}}
    stages:
      pick:    {use: control.beta_thompson, with: {batch_size: 2, candidate_ratio: 8}}
      budget:  {use: control.fixed_n, from: pick, with: {n: 4}}
      rollout: {use: generate.fake, from: budget}
    update: {use: update.fake, from: rollout}
    run: {steps: 2, seed: 0}
    tracking: {mlflow: null}
    """)


def test_two_steps_on_the_fake_engine_select_from_the_posterior_observed_in_step_0():
    class Allocations:
        def __init__(self):
            self.seen = []

        def after_stage(self, event):
            if event.stage_id == "pick":
                self.seen.append(event.output)

    hook = Allocations()
    runner = LocalRunner(compile_pipeline(load_spec_text(SPEC)), hooks=(hook,))
    reports = runner.run()
    assert len(hook.seen) == 2 and [r.controller_state["pick"]["chosen"] for r in reports] == [2, 2]

    # step 0: each chosen prompt's 4 rollouts update Beta(1, 1) to Beta(1 + s, 1 + 4 - s)
    posterior = {}
    for g in reports[0].groups:
        s = sum(bool(r.correct) for r in g.rollouts)
        posterior[g.prompt_id] = (1.0 + s, 1.0 + len(g.rollouts) - s)
    assert set(posterior) == {e.prompt_id for e in hook.seen[0].active()}

    # step 1: epoch 0 held one call (8 * 2 = 16 candidates, the whole pool), so epoch 1 starts
    # and every prompt is a candidate, drawn from its posterior after step 0
    second = hook.seen[1]
    assert second.controller_state["epoch"] == 1 and len(second) == 16
    ids = [e.prompt_id for e in second]
    draws = {pid: thompson_draw(0, 1, 1, pid, *posterior.get(pid, (1.0, 1.0))) for pid in ids}
    nearest = sorted(ids, key=lambda pid: (draws[pid] - 0.5) ** 2)[:2]
    assert [e.prompt_id for e in second.active()] == nearest
    for e in second:
        a, b = posterior.get(e.prompt_id, (1.0, 1.0))
        assert f"draw {draws[e.prompt_id]:.4f}, Beta({a:g}, {b:g})" in e.reason
    assert sum("Beta(1, 1)" not in e.reason for e in second) == 2  # step 0's two observed posteriors
    assert json.loads(json.dumps(runner.state_dict()))


def test_the_shipped_mopps_pipeline_validates():
    compiled = load_pipeline(REPO / "pipelines" / "mopps_arith.yaml")
    assert "pick" in compiled.nodes
