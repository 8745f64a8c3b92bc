"""control.greso: streaks, the skip rule, the self-tuning of p_easy / p_hard, deterministic
draws, checkpoints, and a pipeline that uses it."""

from __future__ import annotations

import json
import math
import textwrap

import pytest
from pydantic import ValidationError

from gfcr.errors import GfcrError
from gfcr.graph import compile_pipeline
from gfcr.records import Prompt, PromptPool, PromptStats, StepContext, StepReport
from gfcr.runtime import LocalRunner
from gfcr.spec import load_spec_text
from gfcr.stages.common.prompt_stats import visit_draw
from gfcr.stages.control.greso import Greso, skip_probability
from gfcr.stages.testing import scored_group

EASY, HARD, MIXED = [1, 1, 1, 1], [0, 0, 0, 0], [1, 0, 1, 0]


def pool(n: int) -> PromptPool:
    return PromptPool([Prompt(f"p:{i}", text=str(i)) for i in range(n)])


def greso(**kw) -> Greso:
    return Greso(Greso.Config(**{"batch_size": 2, "seed": 0, **kw}))


def observe(stage: Greso, step: int, results: list[tuple[str, list[float]]]) -> None:
    groups = tuple(scored_group(pid, rewards, step) for pid, rewards in results)
    stage.observe(StepReport("run", step, step + 1, groups, None, {}, {}))


def step(stage: Greso, data: PromptPool, number: int, outcome: dict[str, list[float]]):
    """One step: select, 'roll out' the kept prompts with the rewards in ``outcome``, observe."""
    stage.before_step(StepContext("run", number, 0, number))
    alloc = stage.run(data)
    observe(stage, number, [(e.prompt_id, outcome.get(e.prompt_id, MIXED)) for e in alloc.active()])
    return alloc


def after_epoch0(stage: Greso, data: PromptPool, outcome: dict[str, list[float]]) -> int:
    """Run epoch 0 (every prompt seen once); return the next step number."""
    number = 0
    while stage.epoch == 0 and stage.cursor + stage.config.batch_size <= len(data):
        step(stage, data, number, outcome)
        number += 1
    return number


# --- streaks and the skip rule ---------------------------------------------------------------

def test_streaks_count_consecutive_zero_variance_groups_and_reset_on_a_mixed_one():
    stage = greso()
    sequence = [EASY, EASY, MIXED, HARD, HARD, EASY]
    expected = [(1, 0), (2, 0), (0, 0), (0, 1), (0, 2), (1, 0)]
    for number, (rewards, streaks) in enumerate(zip(sequence, expected)):
        observe(stage, number, [("p:0", rewards)])
        stats = stage.stats["p:0"]
        assert (stats.easy_streak, stats.hard_streak) == streaks
    assert [(o.n, o.n_correct) for o in stats.history] == [(4, 2), (4, 0), (4, 0), (4, 4)]  # history_size 4


def test_unjudged_rollouts_are_left_out_of_the_observation():
    stage = greso()
    group = scored_group("p:0", [1, 1, 0])
    group.rollouts[2].correct = None  # e.g. an aborted rollout no verifier judged
    unjudged = scored_group("p:1", [0, 0])
    for r in unjudged.rollouts:
        r.correct = None
    stage.observe(StepReport("run", 0, 1, (group, unjudged), None, {}, {}))
    assert (stage.stats["p:0"].last.n, stage.stats["p:0"].easy_streak) == (2, 1)
    assert "p:1" not in stage.stats


def test_skip_probability_formula_and_keep_floor():
    def stats(easy=0, hard=0):
        s = PromptStats("p:0")
        s.easy_streak, s.hard_streak = easy, hard
        return s

    assert skip_probability(stats(easy=3), p_easy=0.5, p_hard=0.9) == (0.875, "easy")  # 1 - 0.5^3
    p_skip, kind = skip_probability(stats(easy=5), p_easy=0.05, p_hard=0.5)
    assert kind == "easy" and p_skip == pytest.approx(0.99)  # 0.05^5 = 3.1e-7 is floored at 0.01
    assert skip_probability(stats(hard=2), p_easy=0.1, p_hard=0.6) == pytest.approx((0.64, "hard"))  # 1 - 0.36
    assert skip_probability(stats(easy=1, hard=4), p_easy=0.5, p_hard=0.1) == (0.5, "easy")  # easy first
    assert skip_probability(stats(), 0.05, 0.05) == (0.0, None)
    assert skip_probability(None, 0.05, 0.05) == (0.0, None)
    assert skip_probability(stats(easy=2), 0.0, 0.5, min_keep_probability=0.0) == (1.0, "easy")


def test_prompts_without_history_are_never_skipped():
    stage = greso(batch_size=8, initial_p_easy=0.0, initial_p_hard=0.0, min_keep_probability=0.0)
    alloc = stage.run(pool(8))
    assert [e.n_rollouts for e in alloc] == [1] * 8
    assert {e.reason for e in alloc} == {"greso: keep (no streak)"}


def test_skipped_candidates_stay_in_the_allocation_until_the_batch_is_full():
    # P_skip = 1 - max(0^z, 0) = 1 for the easy prompts: they are always skipped
    stage = greso(initial_p_easy=0.0, min_keep_probability=0.0)
    data = pool(8)
    number = after_epoch0(stage, data, {"p:1": EASY, "p:3": EASY, "p:7": EASY})
    assert number == 4
    alloc = step(stage, data, number, {})
    # epoch 1's order for seed 0 is [1, 3, 7, 6, 0, 4, 2, 5]: three skips, then two keeps
    assert [(e.prompt_id, e.n_rollouts) for e in alloc] == [("p:1", 0), ("p:3", 0), ("p:7", 0), ("p:6", 1), ("p:0", 1)]
    assert alloc.entries[0].reason == "greso: skip (easy streak 1, p_easy 0.00, P_skip 1.000)"
    assert alloc.controller_state == {
        "p_easy": 0.0, "p_hard": 0.5, "epoch": 1, "candidates": 5, "kept": 2,
        "skipped_easy": 3, "skipped_hard": 0, "stopped": "filled",
    }
    assert alloc.step == 4 and stage.cursor == 5


def test_the_search_stops_at_the_candidate_bound_or_the_end_of_the_epoch():
    everything_easy = {f"p:{i}": EASY for i in range(8)}
    stage = greso(initial_p_easy=0.0, min_keep_probability=0.0, max_candidates_factor=2)
    number = after_epoch0(stage, pool(8), everything_easy)
    alloc = step(stage, pool(8), number, {})
    assert (len(alloc), alloc.controller_state["kept"], alloc.controller_state["stopped"]) == (4, 0, "max_candidates")

    stage = greso(initial_p_easy=0.0, min_keep_probability=0.0)
    number = after_epoch0(stage, pool(8), everything_easy)
    alloc = step(stage, pool(8), number, {})
    assert (len(alloc), alloc.controller_state["kept"], alloc.controller_state["stopped"]) == (8, 0, "epoch_end")
    assert stage.run(pool(8)).controller_state["epoch"] == 2  # the next call starts a new epoch


def test_one_draw_per_visit_decides_against_p_skip():
    stage = greso(batch_size=8)
    data = pool(8)
    number = after_epoch0(stage, data, {f"p:{i}": EASY for i in range(8)})
    alloc = step(stage, data, number, {})
    # every prompt has easy streak 1, so P_skip = 1 - 0.5 = 0.5 and the epoch's 8 candidates are all seen
    expected = {f"p:{i}" for i in range(8) if visit_draw(0, 1, number, f"p:{i}") < 0.5}
    assert {e.prompt_id for e in alloc if e.n_rollouts == 0} == expected
    assert 0 < len(expected) < 8
    assert visit_draw(0, 1, 4, "p:0") == visit_draw(0, 1, 4, "p:0") != visit_draw(0, 1, 5, "p:0")


def test_the_run_seed_is_the_default_seed():
    def first(seed):
        stage = Greso(Greso.Config(batch_size=4))
        stage.before_step(StepContext("run", 0, seed, 0))
        return [e.prompt_id for e in stage.run(pool(50))]

    assert first(0) == first(0) != first(1)


def test_batch_larger_than_the_pool_and_bad_bounds_are_refused():
    with pytest.raises(GfcrError, match="a call draws 9 prompts, more than the pool's 8"):
        greso(batch_size=9).run(pool(8))
    with pytest.raises(ValidationError, match="min_p"):
        Greso.Config(batch_size=2, min_p=0.9, max_p=0.1)


# --- self-tuning ----------------------------------------------------------------------------

def in_epoch_1(**kw) -> Greso:
    stage = greso(**kw)
    stage.load_state_dict({"p_easy": stage.p_easy, "p_hard": stage.p_hard, "epoch": 1, "cursor": 0, "prompts": {}})
    return stage


def groups_with(easy: int, hard: int, mixed: int) -> list[tuple[str, list[float]]]:
    kinds = [EASY] * easy + [HARD] * hard + [MIXED] * mixed
    return [(f"p:{i}", rewards) for i, rewards in enumerate(kinds)]


def test_p_easy_and_p_hard_move_against_their_targets():
    # alpha = 0.25: target_easy = 0.0833, target_hard = 0.1667
    stage = in_epoch_1()
    observe(stage, 0, groups_with(easy=1, hard=1, mixed=8))  # easy 0.1 >= 0.083, hard 0.1 < 0.167
    assert (stage.p_easy, stage.p_hard) == (0.49, 0.51)
    observe(stage, 1, groups_with(easy=0, hard=2, mixed=8))  # easy 0 < 0.083, hard 0.2 >= 0.167
    assert (stage.p_easy, stage.p_hard) == (0.5, 0.5)


def test_a_ratio_equal_to_its_target_lowers_p():
    stage = in_epoch_1(target_zero_variance=0.75)  # targets 0.25 and 0.5, exact in binary
    observe(stage, 0, groups_with(easy=1, hard=2, mixed=1))  # ratios 0.25 and 0.5
    assert (stage.p_easy, stage.p_hard) == (0.49, 0.49)


def test_p_is_clipped_to_its_bounds():
    stage = in_epoch_1(initial_p_easy=0.05, initial_p_hard=0.95)
    observe(stage, 0, groups_with(easy=5, hard=0, mixed=5))  # p_easy down, p_hard up: both at a bound
    assert (stage.p_easy, stage.p_hard) == (0.05, 0.95)
    stage = in_epoch_1(initial_p_easy=0.3, min_p=0.295, step_size=0.1)
    observe(stage, 0, groups_with(easy=5, hard=0, mixed=5))
    assert stage.p_easy == 0.295


def test_no_tuning_in_the_first_epoch_or_without_groups():
    stage = greso()
    observe(stage, 0, groups_with(easy=5, hard=5, mixed=0))
    assert (stage.p_easy, stage.p_hard) == (0.5, 0.5)
    assert stage.stats["p:0"].easy_streak == 1  # streaks are recorded in epoch 0 all the same
    stage = in_epoch_1()
    observe(stage, 0, [])
    assert (stage.p_easy, stage.p_hard) == (0.5, 0.5)


def test_every_sampling_event_is_an_observation_and_old_groups_are_not():
    stage = in_epoch_1()
    # p:0 sampled in two loop rounds of step 3; p:1's group is a replayed one from step 1
    groups = (scored_group("p:0", EASY, 3), scored_group("p:0", EASY, 3), scored_group("p:1", HARD, 1),
              scored_group("p:2", MIXED, 3))
    stage.observe(StepReport("run", 3, 4, groups, None, {}, {}))
    assert stage.stats["p:0"].easy_streak == 2 and "p:1" not in stage.stats
    assert (stage.p_easy, stage.p_hard) == (0.49, 0.51)  # easy 2/3, hard 0/3


# --- state ----------------------------------------------------------------------------------

def test_state_is_plain_json_and_resumes_to_the_same_allocations():
    data = pool(12)
    outcome = {"p:1": EASY, "p:2": EASY, "p:5": HARD, "p:9": EASY}
    a = greso(batch_size=3)
    number = after_epoch0(a, data, outcome)
    step(a, data, number, outcome)
    nan_group = scored_group("p:3", [1, 0], number)
    for r in nan_group.rollouts:
        r.reward = None  # judged but unscored: the mean reward is NaN, stored as null
    a.observe(StepReport("run", number, number, (nan_group,), None, {}, {}))
    state = json.loads(json.dumps(a.state_dict(), allow_nan=False))
    assert state == a.state_dict() and state["prompts"]["p:3"]["history"][-1]["mean_reward"] is None

    b = greso(batch_size=3)
    b.load_state_dict(state)
    assert math.isnan(b.stats["p:3"].last.mean_reward) and b.stats["p:1"].easy_streak == a.stats["p:1"].easy_streak
    skipped = 0
    for n in range(number + 1, number + 6):
        first, second = step(a, data, n, outcome), step(b, data, n, outcome)
        decisions = [[(e.prompt_id, e.n_rollouts, e.reason) for e in alloc] for alloc in (first, second)]
        assert decisions[0] == decisions[1]
        assert first.controller_state == second.controller_state
        skipped += len(first) - len(first.active())
    assert skipped > 0 and a.state_dict() == b.state_dict()


# --- in a pipeline --------------------------------------------------------------------------

SPEC = textwrap.dedent("""\
    name: greso
    data: {source: arithmetic, with: {n: 12}}
    stages:
      pick:    {use: control.greso, with: {batch_size: 4}}
      budget:  {use: control.fixed_n, from: pick, with: {n: 4}}
      rollout: {use: generate.fake, from: budget}
      keep:    {use: filter.nonzero_variance, from: rollout}
    update: {use: update.fake, from: keep}
    run: {steps: 12}
    tracking: {mlflow: null}
    """)


def test_a_greso_pipeline_runs_and_skips_prompts_after_zero_variance_groups():
    class Allocations:
        def __init__(self):
            self.seen = []

        def after_stage(self, event):
            if event.stage_id == "pick":
                self.seen.append(event.output)

    hook = Allocations()
    runner = LocalRunner(compile_pipeline(load_spec_text(SPEC)), hooks=(hook,))
    assert runner.pipeline.describe_plan() == "pick -> budget -> rollout -> keep -> update"
    reports = runner.run()
    last: dict[str, tuple[int, int]] = {}  # prompt -> (n_correct, n) of its latest group
    skips = []
    for alloc, report in zip(hook.seen, reports):
        assert alloc.controller_state["kept"] == 4 == len({g.prompt_id for g in report.groups})
        for entry in alloc:
            if entry.n_rollouts == 0:
                skips.append(entry.reason)
                assert entry.prompt_id not in {g.prompt_id for g in report.groups}
                n_correct, n = last[entry.prompt_id]  # skipped only with a zero-variance latest group
                assert n_correct == (n if "easy streak" in entry.reason else 0)
        for g in report.groups:
            last[g.prompt_id] = (g.stats.n_correct, g.stats.n)
    assert any("easy streak" in s for s in skips) and any("hard streak" in s for s in skips)
    assert [a.controller_state["epoch"] for a in hook.seen[:4]] == [0, 0, 0, 1]
    assert all(a.controller_state["candidates"] == 4 for a in hook.seen[:3])  # nothing skipped in epoch 0
    json.dumps(runner.state_dict())
