"""control.vade: the two-scale decay by hand, the gain and selection on fixed draws, the
whole pool as arms (loop rounds never repeat a prompt in a step), the candidate-batch mode,
checkpoints, and one pipeline on the fake engine."""

from __future__ import annotations

import json
import textwrap

import numpy as np
import pytest
from pydantic import ValidationError

from gfcr.graph import compile_pipeline, load_pipeline
from gfcr.records import Prompt, PromptPool, PromptStats, StepContext, StepReport
from gfcr.runtime import LocalRunner
from gfcr.spec import load_spec_text
from gfcr.stages.control.beta_thompson import thompson_draw
from gfcr.stages.control.vade import Vade, idle_decayed, information_gain, largest_gain
from gfcr.stages.testing import scored_group
from tests.conftest import REPO


def pool(n: int) -> PromptPool:
    return PromptPool([Prompt(f"p:{i}", text=str(i)) for i in range(n)])


def stage(**kw) -> Vade:
    return Vade(Vade.Config(**{"batch_size": 2, "seed": 0, **kw}))


def report(step: int, results: list[tuple[str, list[float]]], group_step: int | None = None) -> StepReport:
    groups = tuple(scored_group(pid, rewards, step if group_step is None else group_step) for pid, rewards in results)
    return StepReport("run", step, step + 1, groups, None, {}, {})


# --- the two scales, by hand ----------------------------------------------------------------

def test_idle_decay_moves_the_posterior_toward_the_prior_per_step():
    # Beta(5, 3), prior Beta(1, 1), slow 0.5: keep 0.5 ** k of the evidence above the prior
    assert idle_decayed(5.0, 3.0, 0, 0.5, 1.0, 1.0) == (5.0, 3.0)
    assert idle_decayed(5.0, 3.0, 1, 0.5, 1.0, 1.0) == (3.0, 2.0)        # 1 + 4 * 0.5, 1 + 2 * 0.5
    assert idle_decayed(5.0, 3.0, 2, 0.5, 1.0, 1.0) == (2.0, 1.5)        # 1 + 4 * 0.25, 1 + 2 * 0.25
    assert idle_decayed(5.0, 3.0, 3, 1.0, 1.0, 1.0) == (5.0, 3.0)        # slow 1: no idle decay
    assert idle_decayed(5.0, 3.0, 2, 0.5, 2.0, 4.0) == (2.75, 3.75)      # 2 + 3 * 0.25, 4 + (-1) * 0.25


def test_observe_applies_the_idle_decay_then_the_fast_decay_then_the_counts():
    s = stage(fast_decay=0.5, slow_decay=0.5)
    s.observe(report(0, [("p:0", [1, 1, 1, 0])]))
    stats = s.stats["p:0"]
    # from the prior Beta(1, 1): 0.5 * 1 + 0.5 * 1 + 3 = 4, 0.5 * 1 + 0.5 * 1 + 1 = 2
    assert (stats.beta_alpha, stats.beta_beta, stats.last_selected_step, stats.times_selected) == (4.0, 2.0, 0, 1)
    assert s.posterior("p:0", 0) == (4.0, 2.0) and s.posterior("p:0", 3) == (1.375, 1.125)  # 1 + 3/8, 1 + 1/8
    s.observe(report(3, [("p:0", [0, 0])]))
    # idle 3 steps: Beta(1.375, 1.125); fast: 0.5 * 1.375 + 0.5 + 0 = 1.1875, 0.5 * 1.125 + 0.5 + 2 = 3.0625
    assert (stats.beta_alpha, stats.beta_beta, stats.last_selected_step, stats.times_selected) == \
           (1.1875, 3.0625, 3, 2)
    assert s.posterior("never:seen", 9) == (1.0, 1.0)


def test_two_groups_of_one_prompt_in_a_step_update_twice_and_old_groups_are_ignored():
    s = stage(fast_decay=0.5, slow_decay=0.9)
    groups = (scored_group("p:0", [1, 1], 2), scored_group("p:0", [0, 1], 2), scored_group("p:1", [1, 1], 0))
    s.observe(StepReport("run", 2, 3, groups, None, {}, {}))
    # first: 1 + 2 = 3, 1 + 0 = 1; second (idle 0): 0.5 * 3 + 0.5 + 1 = 3, 0.5 * 1 + 0.5 + 1 = 2
    assert (s.stats["p:0"].beta_alpha, s.stats["p:0"].beta_beta) == (3.0, 2.0)
    assert "p:1" not in s.stats and s.stats["p:0"].times_selected == 2


# --- selection ------------------------------------------------------------------------------

def test_gain_is_the_reward_variance_and_the_largest_are_kept_in_order():
    draws = np.array([0.9, 0.45, 0.2, 0.55, 0.5])
    assert information_gain(draws).tolist() == pytest.approx([0.09, 0.2475, 0.16, 0.2475, 0.25])
    assert largest_gain(information_gain(draws), 3).tolist() == [4, 1, 3]  # the tie 1, 3 keeps its order
    assert largest_gain(information_gain(draws), 5).tolist() == [4, 1, 3, 2, 0]


def test_every_prompt_is_a_candidate_drawn_from_its_idle_decayed_posterior():
    s = stage(batch_size=3, slow_decay=0.5)
    s.stats["p:4"] = PromptStats("p:4", beta_alpha=9.0, beta_beta=1.0, last_selected_step=1)  # known easy
    s.before_step(StepContext("run", 3, 0, 3))
    alloc = s.run(pool(10))
    posterior = {f"p:{i}": (1.0, 1.0) for i in range(10)}
    posterior["p:4"] = (1.0 + 8.0 * 0.25, 1.0)  # idle 2 steps at 0.5: Beta(3, 1)
    draws = {pid: thompson_draw(0, 0, 3, pid, *ab) for pid, ab in posterior.items()}
    gain = {pid: d * (1 - d) for pid, d in draws.items()}
    ids = [f"p:{i}" for i in range(10)]
    best = sorted(ids, key=lambda pid: (-gain[pid], ids.index(pid)))[:3]
    assert [e.prompt_id for e in alloc] == best and [e.n_rollouts for e in alloc] == [1, 1, 1]
    assert alloc.entries[0].reason == (f"vade: rank 1 (draw {draws[best[0]]:.4f}, gain {gain[best[0]]:.4f}, "
                                       f"Beta({posterior[best[0]][0]:.4g}, {posterior[best[0]][1]:.4g}))")
    state = alloc.controller_state
    assert state["candidates"] == 10 and state["chosen"] == 3 and state["tracked"] == 1
    assert state["gain_mean"] == pytest.approx(np.mean([gain[p] for p in best]))
    assert state["gain_min"] == pytest.approx(min(gain[p] for p in best))
    assert state["draw_mean"] == pytest.approx(np.mean([draws[p] for p in best]))
    means = [posterior[p][0] / sum(posterior[p]) for p in best]
    assert state["posterior_mean"] == pytest.approx(np.mean(means))
    assert state["unseen"] == 3 - ("p:4" in best) and state["idle_steps"] == (2.0 if "p:4" in best else 0.0)


def test_a_second_round_in_a_step_never_picks_a_prompt_again():
    s = stage(batch_size=4)
    s.before_step(StepContext("run", 0, 0, 0))
    first, second = s.run(pool(10)), s.run(pool(10))
    assert second.controller_state["candidates"] == 6
    assert not {e.prompt_id for e in first} & {e.prompt_id for e in second}
    s.before_step(StepContext("run", 1, 0, 1))
    assert s.run(pool(10)).controller_state["candidates"] == 10  # a new step: every prompt again


def test_candidate_ratio_draws_from_the_epoch_permutation_and_lists_every_candidate():
    s = stage(batch_size=2, candidate_ratio=2)
    s.before_step(StepContext("run", 0, 0, 0))
    alloc = s.run(pool(10))
    order = np.random.default_rng([0, 0]).permutation(10)[:4]
    assert sorted(e.prompt_id for e in alloc) == sorted(f"p:{i}" for i in order)
    assert [e.n_rollouts for e in alloc] == [1, 1, 0, 0] and alloc.entries[2].reason.startswith("vade: not chosen")
    epochs = [s.run(pool(10)).controller_state["epoch"] for _ in range(2)]
    assert epochs == [0, 1] and s.cursor == 4


def test_config_bounds():
    for bad in ({"slow_decay": 1.5}, {"fast_decay": -0.1}, {"prior_alpha": 0.0}, {"candidate_ratio": 0}):
        with pytest.raises(ValidationError):
            Vade.Config(batch_size=2, **bad)


# --- state ----------------------------------------------------------------------------------

def test_state_is_plain_json_and_resumes_to_the_same_allocations():
    data = pool(16)

    def step(s: Vade, number: int):
        s.before_step(StepContext("run", number, 0, number))
        alloc = s.run(data)
        s.observe(report(number, [(e.prompt_id, [1, 1] if int(e.prompt_id[2:]) % 2 == 0 else [1, 0])
                                  for e in alloc.active()]))
        return alloc

    a = stage(batch_size=3, slow_decay=0.9)
    for number in range(3):
        step(a, number)
    state = json.loads(json.dumps(a.state_dict(), allow_nan=False))
    assert state == a.state_dict() and state["prompts"]
    b = stage(batch_size=3, slow_decay=0.9)
    b.load_state_dict(state)
    for number in range(3, 8):
        first, second = step(a, number), step(b, number)
        assert [(e.prompt_id, e.reason) for e in first] == [(e.prompt_id, e.reason) for e in second]
        assert first.controller_state == second.controller_state
    assert a.state_dict() == b.state_dict()


# --- in a pipeline --------------------------------------------------------------------------

SPEC = textwrap.dedent("""\
    name: vade
    data: {source: arithmetic, with: {n: 16}}
    stages:
      pick:    {use: control.vade, with: {batch_size: 4}}
      budget:  {use: control.fixed_n, from: pick, with: {n: 4}}
      rollout: {use: generate.fake, from: budget}
    update: {use: update.fake, from: rollout}
    run: {steps: 3, seed: 0}
    tracking: {mlflow: null}
    """)


def test_steps_on_the_fake_engine_learn_posteriors_from_every_group():
    runner = LocalRunner(compile_pipeline(load_spec_text(SPEC)))
    reports = runner.run()
    stage_ = runner.stages["pick"]
    observed = {g.prompt_id for r in reports for g in r.groups}
    assert set(stage_.stats) == observed and all(r.controller_state["pick"]["chosen"] == 4 for r in reports)
    assert sum(s.times_selected for s in stage_.stats.values()) == 12
    assert json.loads(json.dumps(runner.state_dict()))


@pytest.mark.parametrize("name", ["vade_arith.yaml", "examples/vade_dapo_arith.yaml"])
def test_the_shipped_vade_pipelines_validate(name):
    assert load_pipeline(REPO / "pipelines" / name).nodes["pick"].info.alias == "control.vade"


def test_each_entry_says_why_by_its_gain_against_the_smallest_chosen_one():
    s = stage(candidate_ratio=2)  # 4 candidates, 2 chosen: every candidate listed
    s.before_step(StepContext("run", step=0, seed=0, policy_version=0))
    alloc = s.run(pool(8))
    chosen = [e for e in alloc if e.n_rollouts > 0]
    cutoff = min(e.why.value for e in chosen)
    for e in alloc:
        q = e.why.quantities
        assert e.why.name == "gain" and e.why.value == pytest.approx(q["draw"] * (1 - q["draw"]))
        assert q["cutoff_gain"] == pytest.approx(cutoff) and (q["alpha"], q["beta"]) == (1.0, 1.0)  # the prior
    assert [e.why.code for e in alloc] == ["largest_gain"] * 2 + ["smaller_gain"] * 2
    assert [e.why.quantities["rank"] for e in chosen] == [1.0, 2.0]
    assert all(e.why.value <= cutoff for e in alloc if e.n_rollouts == 0)
