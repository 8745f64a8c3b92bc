"""control.pilot_commit and replay.pilot_join: verdicts on boundary p values, the buffer's flush,
binary max-variance down-sampling by hand, loud misconfiguration, checkpoint state, and real
tiny-arith runs (budget accounting per step from metrics.jsonl; resume, after a SIGKILL too,
giving the metrics of an uninterrupted run)."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import numpy as np
import pytest
from pydantic import ValidationError

from gfcr.errors import GfcrError
from gfcr.graph import load_pipeline
from gfcr.records import (
    Allocation, AllocationEntry, Prompt, PromptPool, RolloutGroups, StepContext, StepReport,
)
from gfcr.runtime.store.lineage import read_lineage
from gfcr.runtime.loop.session import Run
from gfcr.stages.control.pilot_commit import PilotCommit, Verdict, maxvar_indices, verdict
from gfcr.stages.replay.pilot_join import PilotJoin
from gfcr.stages.testing import scored_group
from tests.conftest import REPO
from tests.killing import sigkill_after_step

POOL = PromptPool([Prompt(f"p{i}", text=str(i)) for i in range(40)])


def stage(**kw) -> PilotCommit:
    return PilotCommit(PilotCommit.Config(**{"batch_size": 2, "n_pilot": 8, "n_commit": 4, **kw}))


def candidates(step: int, ids: list[str]) -> Allocation:
    return Allocation(step, tuple(AllocationEntry(POOL.get(i), 1) for i in ids))


def ctx(step: int) -> StepContext:
    return StepContext("r", step, 0, step)


def report(step: int, groups) -> StepReport:
    return StepReport("r", step, step + 1, tuple(groups), None, {}, {})


def run(s: PilotCommit, step: int, ids: list[str]) -> Allocation:
    """One step's allocation, as the runtime calls it."""
    s.before_step(ctx(step))
    return s.run(candidates(step, ids), POOL, ctx(step))


def pilot_once(s: PilotCommit, step: int, outcomes: dict[str, list[int]]) -> Allocation:
    """Run a step that pilots ``outcomes``' prompts and observe their rewards."""
    alloc = run(s, step, list(outcomes))
    s.observe(report(step, [scored_group(p, r, step=step) for p, r in outcomes.items()]))
    return alloc


# --- verdicts ---------------------------------------------------------------------------------

@pytest.mark.parametrize("n, correct, expected, evicted", [
    # n_pilot = 8: p = k / 8; keep iff 0.125 <= p <= 0.75
    (8, 0, Verdict.TOO_INCORRECT, False),  # p = 0
    (8, 1, Verdict.KEEP, False),           # p = 0.125 exactly: the lower bound is inclusive
    (8, 6, Verdict.KEEP, False),           # p = 0.75 exactly: the upper bound is inclusive
    (8, 7, Verdict.TOO_CORRECT, False),    # p = 0.875 > 0.75
    (8, 8, Verdict.TOO_CORRECT, True),     # p = 1.0 >= exclude_threshold_upper: evicted for good
    # n_pilot = 16: p = k / 16
    (16, 1, Verdict.TOO_INCORRECT, False),  # p = 0.0625 < 0.125
    (16, 2, Verdict.KEEP, False),           # p = 0.125
    (16, 12, Verdict.KEEP, False),          # p = 0.75
    (16, 13, Verdict.TOO_CORRECT, False),   # p = 0.8125
    (16, 15, Verdict.TOO_CORRECT, False),   # p = 0.9375 < 1.0: skipped, not evicted
    (16, 16, Verdict.TOO_CORRECT, True),    # p = 1.0
])
def test_verdicts_on_boundary_p(n, correct, expected, evicted):
    assert verdict(correct / n, 0.125, 0.25) is expected
    s = stage(n_pilot=n)
    pilot_once(s, 0, {"p0": [1] * correct + [0] * (n - correct)})
    assert (s.buffered_prompts() == ["p0"]) is (expected is Verdict.KEEP)
    assert ("p0" in s.evicted) is evicted
    counts = s.step_metrics()
    assert (counts["judged"], counts[expected.value], counts["evicted"]) == (1, 1, int(evicted))


def test_a_kept_prompt_is_buffered_with_its_pilots_and_candidates_in_the_buffer_or_evicted_get_none():
    s = stage()
    pilot_once(s, 0, {"p0": [1, 0, 0, 0, 0, 0, 0, 0], "p1": [1] * 8, "p2": [0] * 8})
    assert s.buffered_prompts() == ["p0"] and s.evicted == {"p1"}
    assert [e.reward for e in s.buffer["p0"].pilots] == [1.0] + [0.0] * 7
    alloc = run(s, 1, ["p0", "p1", "p2", "p3"])
    got = [(e.prompt_id, e.n_rollouts, e.reason, e.stage_index) for e in alloc]
    # p2 (too_incorrect) is deferred, not evicted: piloted again when drawn
    assert got == [("p2", 8, "pilot", 0), ("p3", 8, "pilot", 0), ("p0", 0, "buffered", 0),
                   ("p1", 0, "evicted", 0), ("p0", 4, "commit", 1)]
    commit = alloc.entries[-1]
    assert [r.replayed_from for r in commit.joins] == [f"p0@s0/{i}" for i in range(8)]
    assert {r.created_step for r in commit.joins} == {0}
    assert s.buffered_prompts() == []  # a committed prompt leaves the buffer
    m = s.step_metrics()
    assert (m["pilot_rollouts"], m["commit_rollouts"], m["pilot_rollouts_joined"]) == (16, 4, 8)
    assert (m["skipped_buffered"], m["skipped_evicted"], m["commit_staleness_mean"]) == (1, 1, 1.0)


def test_at_most_batch_size_prompts_are_committed_drawn_seeded():
    kept = {f"p{i}": [1, 0, 1, 0, 0, 0, 0, 0] for i in range(5)}  # p = 0.25: all kept

    def draw() -> list[str]:
        s = stage(batch_size=2)
        pilot_once(s, 0, kept)
        alloc = run(s, 1, [])
        assert len(s.buffered_prompts()) == 3
        return [e.prompt_id for e in alloc if e.stage_index == 1]

    first = draw()
    assert len(first) == 2 and set(first) <= set(kept) and draw() == first


def test_in_a_loop_block_the_rounds_of_a_step_share_its_commit_budget_and_counts():
    s = stage(batch_size=3)
    pilot_once(s, 0, {f"p{i}": [1, 1, 0, 0, 0, 0, 0, 0] for i in range(5)})  # 5 kept
    s.before_step(ctx(1))
    first = s.run(candidates(1, ["p5", "p6"]), POOL, StepContext("r", 1, 0, 1, round=0))
    second = s.run(candidates(1, ["p6", "p7"]), POOL, StepContext("r", 1, 0, 1, round=1))
    commits = [e.prompt_id for a in (first, second) for e in a if e.stage_index == 1]
    assert len(commits) == 3 and len(set(commits)) == 3  # B = 3 over both rounds
    assert [(e.prompt_id, e.reason) for e in second if e.stage_index == 0] == [("p7", "pilot"), ("p6", "piloted")]
    m = s.step_metrics()
    assert (m["pilot_prompts"], m["pilot_rollouts"], m["commit_prompts"], m["skipped_piloted"]) == (3, 24, 3, 1)


# --- flush ---------------------------------------------------------------------------------------

def test_the_buffer_flushes_a_prompt_once_it_is_more_than_max_off_steps_old():
    s = stage(max_off_steps=4)
    pilot_once(s, 0, {"p0": [1, 1, 0, 0, 0, 0, 0, 0]})  # kept at step 0
    for step in range(1, 5):  # 1..4: step - 0 <= 4, stays
        s.observe(report(step, []))
        assert s.buffered_prompts() == ["p0"] and s.step_metrics()["flushed"] == 0
    # the draw of step 5 still sees it (committed 5 steps after its pilots, the reference's order) ...
    alloc = run(s, 5, [])
    assert [(e.prompt_id, e.reason) for e in alloc] == [("p0", "commit")]
    assert s.step_metrics()["commit_staleness_mean"] == 5.0
    # ... but had it not been drawn, step 5's flush (5 - 0 > 4) removes it
    s = stage(max_off_steps=4)
    pilot_once(s, 0, {"p0": [1, 1, 0, 0, 0, 0, 0, 0]})
    for step in range(1, 6):
        s.observe(report(step, []))
    assert s.buffered_prompts() == [] and s.step_metrics()["flushed"] == 1


def test_max_off_steps_zero_flushes_at_the_next_step():
    s = stage(max_off_steps=0)
    pilot_once(s, 0, {"p0": [1, 1, 0, 0, 0, 0, 0, 0]})
    assert s.buffered_prompts() == ["p0"]  # 0 - 0 > 0 is false
    s.observe(report(1, []))
    assert s.buffered_prompts() == []


# --- max-variance down-sampling -------------------------------------------------------------------

@pytest.mark.parametrize("correct, m, ones", [
    ([1, 1, 1, 0, 0, 0, 0, 0], 4, 2),  # half and half: 2 correct, 2 wrong (variance 0.25, the most)
    ([1, 0, 0, 0, 0, 0, 0, 0], 4, 1),  # one correct only: it and 3 wrong
    ([1, 1, 1, 1, 1, 1, 1, 0], 4, 3),  # one wrong only: it and 3 correct
    ([1, 1, 1, 1], 2, 2),              # no wrong: all correct
    ([1, 1, 1, 0, 0, 0, 0, 0], 5, 2),  # odd m: floor(5/2) = 2 correct, 3 wrong
    ([1, 1, 0, 0], 4, 2),              # m = n: everything
])
def test_maxvar_down_sampling_by_hand(correct, m, ones):
    picked = maxvar_indices([bool(c) for c in correct], m, np.random.default_rng(0))
    assert len(picked) == len(set(picked)) == m and picked == sorted(picked)
    assert sum(correct[i] for i in picked) == ones


def test_a_commit_keeps_n_pilot_effective_pilots_of_maximal_variance():
    s = stage(n_pilot_effective=4)
    pilot_once(s, 0, {"p0": [1, 0, 0, 0, 0, 0, 1, 0]})  # p = 0.25, kept
    commit = [e for e in run(s, 1, []) if e.stage_index == 1][0]
    assert len(commit.joins) == 4 and sum(r.reward for r in commit.joins) == 2.0  # both correct, 2 wrong


# --- the join stage ------------------------------------------------------------------------------

def test_the_update_group_is_pilot_union_commit_and_pilot_groups_are_dropped():
    s = stage()
    pilot_once(s, 0, {"p0": [1, 1, 0, 0, 0, 0, 0, 0]})
    alloc = run(s, 1, ["p1"])
    groups = RolloutGroups([scored_group("p1", [1] * 8, step=1), scored_group("p0", [1, 0, 1, 1], step=1)])
    join = PilotJoin(PilotJoin.Config())
    out = join.run(groups, alloc, StepContext("r", 1, 0, 1))
    assert [g.group_id for g in out] == ["p0@s1"]
    (group,) = out.groups
    assert len(group.rollouts) == 4 + 8 and [r.reused for r in group.rollouts] == [False] * 4 + [True] * 8
    assert [r.rollout_id for r in group.rollouts][-1] == "p0@s1/11"
    # one baseline over pilot and commit: 3 + 2 correct of 12
    assert group.stats.n_correct == 5 and group.stats.reward_mean == pytest.approx(5 / 12)
    assert not groups.groups[0].verdict.included and "pilot" in groups.groups[0].verdict.reason
    m = join.step_metrics()
    assert (m["pilot_groups_dropped"], m["commit_groups"], m["pilots_joined"], m["update_rollouts"]) == (1, 1, 8, 12)


# --- misconfiguration ----------------------------------------------------------------------------

def test_config_errors_say_how_to_fix_them():
    with pytest.raises(ValidationError, match="n_pilot_effective: 9.*at most n_pilot"):
        PilotCommit.Config(n_pilot=8, n_pilot_effective=9)
    with pytest.raises(ValidationError, match="no p can be kept"):
        PilotCommit.Config(thr_lo=0.5, thr_up=0.6)


PIPELINE = REPO / "pipelines" / "pilot_commit_arith.yaml"


@pytest.mark.parametrize("edit, expected", [
    (("correction: {use: decoupled_clip}", "correction: {use: none}"), "the update's correction is `none`"),
    (("from: join", "from: reward"), "no `replay.pilot_join` stage"),
    (("n_commit: 4,", "n_commit: 4, n_pilot_effective: 5,"), "n_pilot_effective: 5"),
])
def test_validate_refuses_a_broken_pipeline_with_file_and_line(tmp_path, edit, expected):
    text = PIPELINE.read_text().replace(*edit)
    if edit[1] == "from: reward":
        text = text.replace("  join:    {use: replay.pilot_join, from: {groups: reward, allocation: plan}}\n", "")
    spec = tmp_path / "bad.yaml"
    spec.write_text(text)
    with pytest.raises(GfcrError) as err:
        load_pipeline(spec)
    assert expected in str(err.value) and "bad.yaml:" in str(err.value)


# --- checkpoint ----------------------------------------------------------------------------------

def test_state_and_files_round_trip(tmp_path):
    s = stage()
    pilot_once(s, 0, {"p0": [1, 1, 0, 0, 0, 0, 0, 0], "p1": [1] * 8, "p2": [0, 1, 0, 0, 0, 0, 0, 0]})
    s.save_files(tmp_path)
    back = stage()
    back.load_state_dict(json.loads(json.dumps(s.state_dict())))
    back.load_files(tmp_path)
    assert back.buffered_prompts() == s.buffered_prompts() == ["p0", "p2"] and back.evicted == {"p1"}
    a, b = run(s, 1, ["p3"]), run(back, 1, ["p3"])
    assert [(e.prompt_id, e.n_rollouts, [r.response_token_ids for r in e.joins]) for e in a] == \
           [(e.prompt_id, e.n_rollouts, [r.response_token_ids for r in e.joins]) for e in b]


# --- real runs -----------------------------------------------------------------------------------

SMALL = textwrap.dedent("""\
    name: pilot-commit-small
    policy: {model: tiny-arith}
    data: {source: arithmetic, with: {n: 40, seed: 0, digits: 2, operators: ["+", "-"]}}
    stages:
      pick:    {use: control.uniform, with: {batch_size: 6}}
      plan:    {use: control.pilot_commit, from: pick, with: {batch_size: 2, n_pilot: 4, n_commit: 4, max_off_steps: 1}}
      rollout: {use: generate.sample, from: plan, with: {max_new_tokens: 8}}
      reward:  {use: filter.verify, from: rollout}
      join:    {use: replay.pilot_join, from: {groups: reward, allocation: plan}}
    update: {use: update.grpo, from: join, with: {lr: 3.0e-4, correction: {use: decoupled_clip}}}
    run: {steps: 6, seed: 0, checkpoint_every: 2}
    tracking: {mlflow: null}
    """)


def _metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _without_time(records: list[dict]) -> list[dict]:
    return [{k: v for k, v in r.items() if k != "time"} for r in records]


@pytest.fixture(scope="module")
def small(tmp_path_factory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("pilot_commit")
    spec = root / "small.yaml"
    spec.write_text(SMALL)
    Run.start(load_pipeline(spec), root / "full").train()
    return spec, root / "full"


def test_budget_accounting_per_step(small):
    records = _metrics(small[1])
    assert [r["step"] for r in records] == list(range(6))
    for r in records:
        plan, join = r["stages"]["plan"], r["stages"]["join"]
        # every generated rollout is a pilot or a commit, from one generation call
        assert r["rollouts_generated"] == plan["pilot_rollouts"] + plan["commit_rollouts"]
        assert plan["pilot_rollouts"] == 4 * plan["pilot_prompts"]
        assert plan["commit_rollouts"] == 4 * plan["commit_prompts"] and plan["commit_prompts"] <= 2
        assert plan["pilot_prompts"] + plan["skipped_buffered"] + plan["skipped_evicted"] == 6  # the candidates
        # the update trains on pilot ∪ commit of the committed prompts only
        assert r["update"]["batch_rollouts"] == join["update_rollouts"]
        # a kept prompt has a correct and a wrong pilot (0.125 <= p <= 0.75), so no update group is zero-variance
        assert r["update"]["batch_zero_variance_groups"] == 0
        assert join["update_rollouts"] == plan["commit_rollouts"] + plan["pilot_rollouts_joined"]
        assert plan["pilot_rollouts_joined"] == join["pilots_joined"] == 4 * join["commit_groups"]
        assert 1.0 <= plan["commit_staleness_mean"] <= 2.0 or plan["commit_prompts"] == 0  # max_off_steps + 1
        assert plan["judged"] == plan["keep"] + plan["too_correct"] + plan["too_incorrect"]
    assert records[0]["rollouts_in_update"] == 0 and records[0]["update_skipped"]  # nothing buffered yet
    assert sum(r["stages"]["plan"]["commit_prompts"] for r in records) > 0
    # the verdicts on step t's line judge step t - 1's pilots
    assert [r["stages"]["plan"]["judged"] for r in records[1:]] == [r["stages"]["plan"]["pilot_prompts"]
                                                                   for r in records[:-1]]


def test_lineage_follows_a_joined_pilot_back_to_its_pilot_group(small):
    rows = read_lineage(small[1] / "lineage").to_pylist()
    by_id = {r["rollout_id"]: r for r in rows}
    joined = [r for r in rows if r["origin"] == "replayed"]
    assert joined and all(r["created_by"] == "join" and r["in_update"] for r in joined)
    for r in joined:
        pilot = by_id[r["replayed_from"]]
        assert pilot["step"] == r["created_step"] < r["step"]  # generated on an earlier step
        assert pilot["dropped_by"] == "join" and not pilot["in_update"]  # not trained on its own step
        assert (pilot["reward"], pilot["prompt_id"]) == (r["reward"], r["prompt_id"])


def test_resume_from_a_checkpoint_gives_the_metrics_of_an_uninterrupted_run(small, tmp_path):
    spec, full = small
    part = tmp_path / "part"
    Run.start(load_pipeline(spec, ["run.steps=3"]), part).train()
    Run.resume(part, steps=6).train()
    assert _without_time(_metrics(part)) == _without_time(_metrics(full))


@pytest.mark.slow
def test_a_sigkilled_run_resumes_to_the_metrics_of_an_uninterrupted_run(small, tmp_path):
    spec, full = small
    run_dir = tmp_path / "killed"
    sigkill_after_step(spec, run_dir, 4, tmp_path)
    assert [r["step"] for r in _metrics(run_dir)] == [0, 1, 2, 3, 4]
    Run.resume(run_dir).train()
    assert _without_time(_metrics(run_dir)) == _without_time(_metrics(full))
