"""control.dars: ΔN on hand-computed cases (ET and HW, with and without std, acc = 0, acc >= 0.5,
the cap), the two rounds of the loop block, loud misconfiguration, and short real tiny-arith
runs: the top-up merged into its prompt's group, the per-step budget in ``metrics.jsonl``
bounded by N_max per prompt, and resume giving the metrics of an uninterrupted run."""

from __future__ import annotations

import json
import math
import textwrap
from dataclasses import replace
from pathlib import Path

import pytest
from pydantic import ValidationError

from gfcr.graph import load_pipeline
from gfcr.records import Allocation, AllocationEntry, Prompt, RolloutGroups, StepContext
from gfcr.stages.control.dars import Dars, topup_size
from gfcr.stages.testing import scored_group
from tests.conftest import REPO

N = 8

# --- ΔN on hand cases (N = 8) ----------------------------------------------------------------
# Without std: S = 2a(1 - a), A_peak = 0.5 N = 4; acc = 0 becomes a = 0.5/8 = 1/16.
#   a = 1/16: S = 2 (1/16)(15/16) = 15/128, N S = 15/16
#     ET: (4 - 15/16) / (15/128) = (49/16)(128/15) = 392/15 = 26.13 -> 27
#     HW: target 2 (15/16) 4 = 15/2; (15/2 - 15/16) / (15/128) = (105/16)(128/15) = 56 exactly -> 56
#   a = 1/8: S = 7/32, N S = 7/4
#     ET: (4 - 7/4) / (7/32) = (9/4)(32/7) = 72/7 = 10.29 -> 11
#     HW: target 2 (7/8) 4 = 7; (7 - 7/4) / (7/32) = (21/4)(32/7) = 24 exactly -> 24
#   a = 2/8: S = 3/8, N S = 3
#     ET: (4 - 3) / (3/8) = 8/3 = 2.67 -> 3;  HW: target 6; (6 - 3) / (3/8) = 8 exactly -> 8
#   a = 3/8: S = 15/32, N S = 15/4
#     ET: (1/4) / (15/32) = 8/15 = 0.53 -> 1;  HW: target 5; (5/4)(32/15) = 8/3 = 2.67 -> 3
# With std: S = 2 sqrt(a(1 - a)), A_peak = N = 8.
#   a = 1/16: S = 2 sqrt(15)/16 = 0.48412, N S = 3.87298
#     ET: (8 - 3.87298) / 0.48412 = 8.525 -> 9;  HW: target 16 (15/16) = 15; 11.12702 / 0.48412 = 22.98 -> 23
#   a = 1/8: S = 2 sqrt(7)/8 = 0.66144, N S = 5.29150
#     ET: 2.70850 / 0.66144 = 4.095 -> 5;  HW: target 14; 8.70850 / 0.66144 = 13.17 -> 14
#   a = 2/8: S = sqrt(3)/2 = 0.86603, N S = 6.92820
#     ET: 1.07180 / 0.86603 = 1.238 -> 2;  HW: target 12; 5.07180 / 0.86603 = 5.856 -> 6
#   a = 3/8: S = 2 sqrt(15)/8 = 0.96825, N S = 7.74597
#     ET: 0.25403 / 0.96825 = 0.262 -> 1;  HW: target 10; 2.25403 / 0.96825 = 2.328 -> 3
HAND = {
    # (schedule, std): ΔN for 0, 1, 2, 3 correct of 8
    ("et", False): [27, 11, 3, 1],
    ("hw", False): [56, 24, 8, 3],
    ("et", True): [9, 5, 2, 1],
    ("hw", True): [23, 14, 6, 3],
}


@pytest.mark.parametrize("schedule, std", list(HAND))
def test_topup_on_hand_cases(schedule, std):
    assert [topup_size(k, N, 64, schedule, std) for k in range(4)] == HAND[(schedule, std)]


@pytest.mark.parametrize("schedule, std", list(HAND))
@pytest.mark.parametrize("correct", [4, 5, 7, 8])
def test_no_topup_at_or_above_half(schedule, std, correct):
    assert topup_size(correct, N, 64, schedule, std) == 0


@pytest.mark.parametrize("schedule, std", list(HAND))
def test_topup_is_capped_at_n_max_minus_n(schedule, std):
    # N_max = 12: room for 4 more; every uncapped value above 4 is cut to 4, the rest kept
    assert [topup_size(k, N, 12, schedule, std) for k in range(4)] == [min(v, 4) for v in HAND[(schedule, std)]]
    assert [topup_size(k, N, N, schedule, std) for k in range(4)] == [0, 0, 0, 0]  # N_max = N: no top-up


def test_exact_boundaries_are_not_pushed_up_by_float_error():
    # HW without std lands exactly on 56, 24 and 8 (above): float arithmetic would give 56.000...01 -> 57
    assert topup_size(0, N, 100, "hw", False) == 56
    # ET just below 0.5: a = 7/16 of 16 -> S = 2 (7/16)(9/16) = 63/128, N S = 63/8, A_peak = 8:
    # (8 - 63/8) / (63/128) = (1/8)(128/63) = 16/63 = 0.25 -> 1
    assert topup_size(7, 16, 64, "et", False) == 1


def test_accuracy_measured_on_other_group_sizes():
    # 1 of 4 measured, N = 8 configured: a = 1/4, S = 3/8, N S = 3, ET -> ceil((4 - 3) / (3/8)) = 3
    assert topup_size(1, N, 64, "et", False, measured=4) == 3
    with pytest.raises(ValueError, match="5 correct out of 4"):
        topup_size(5, N, 64, "et", False, measured=4)


def test_config_defaults_are_the_reference_s_and_the_cap_must_cover_n():
    cfg = Dars.Config()
    assert (cfg.n, cfg.n_max, cfg.schedule, cfg.std) == (8, 64, "hw", False)
    with pytest.raises(ValidationError, match=r"n_max \(4\) must be at least n \(8\)"):
        Dars.Config(n=8, n_max=4)
    with pytest.raises(ValidationError):
        Dars.Config(schedule="equal")


# --- the rounds ------------------------------------------------------------------------------------

def _ctx(round_: int | None) -> StepContext:
    return StepContext("run", 0, 0, 0, round=round_)


def _picked(*prompts: str, skipped: tuple[str, ...] = ()) -> Allocation:
    return Allocation(0, tuple(AllocationEntry(Prompt(p, text=p), 0 if p in skipped else 1) for p in prompts))


def test_round_0_gives_n_round_1_the_top_up_round_2_nothing():
    stage = Dars(Dars.Config(n=8, n_max=64, schedule="et"))
    stage.before_step(_ctx(None))
    picked = _picked("p:0", "p:1", "p:2", "p:3", skipped=("p:3",))
    first = stage.run(picked, RolloutGroups(), _ctx(0))
    assert [(e.n_rollouts, e.stage_index) for e in first] == [(8, 0), (8, 0), (8, 0), (0, 0)]
    groups = RolloutGroups([scored_group("p:0", [0] * 8), scored_group("p:1", [1, 1, 0, 0, 0, 0, 0, 0]),
                            scored_group("p:2", [1] * 8)])
    top = stage.run(picked, groups, _ctx(1))
    assert [(e.prompt_id, e.n_rollouts, e.stage_index) for e in top] == [
        ("p:0", 27, 1), ("p:1", 3, 1), ("p:2", 0, 1), ("p:3", 0, 1)]
    assert [e.reason for e in top][:3] == ["dars et: acc 0/8, ΔN 27", "dars et: acc 2/8, ΔN 3",
                                           "dars et: acc 8/8 >= 0.5, no top-up"]
    assert stage.run(picked, groups, _ctx(2)).total_rollouts == 0
    m = stage.step_metrics()
    # 3 prompts x 8 first-stage; 27 + 3 top-up; the bound 3 x 64
    assert (m["prompts"], m["first_rollouts"], m["topup_rollouts"], m["total_rollouts"], m["max_rollouts"]) == \
           (3, 24, 30, 54, 192)
    assert (m["topup_prompts"], m["at_cap_prompts"], m["zero_acc_prompts"], m["easy_prompts"]) == (2, 0, 1, 1)
    assert m["first_acc_mean"] == pytest.approx((0 + 0.25 + 1) / 3)
    stage.before_step(_ctx(None))  # a new step starts from nothing
    assert stage.step_metrics()["total_rollouts"] == 0


def test_a_capped_prompt_is_counted_and_a_dropped_or_missing_group_gets_nothing():
    stage = Dars(Dars.Config(n=4, n_max=6))
    stage.before_step(_ctx(None))
    picked = _picked("p:0", "p:1", "p:2")
    stage.run(picked, RolloutGroups(), _ctx(0))
    dropped = scored_group("p:1", [0, 0, 0, 1])
    dropped.drop("some filter")
    top = stage.run(picked, RolloutGroups([scored_group("p:0", [0, 0, 0, 0]), dropped]), _ctx(1))
    # p:0: acc 0 -> a = 1/8 of N = 4: HW target 2 (7/8) 2 = 7/2, S = 7/32, N S = 7/8 -> 12, capped at 6 - 4 = 2
    assert [e.n_rollouts for e in top] == [2, 0, 0]
    assert top.entries[1].reason == "dars hw: first-stage group dropped, no top-up"
    assert top.entries[2].reason == "dars hw: no first-stage group, no top-up"
    m = stage.step_metrics()
    assert (m["at_cap_prompts"], m["total_rollouts"], m["max_rollouts"]) == (1, 14, 18)


def test_unscored_groups_and_runs_outside_a_loop_are_refused():
    stage = Dars(Dars.Config())
    stage.before_step(_ctx(None))
    picked = _picked("p:0")
    stage.run(picked, RolloutGroups(), _ctx(0))
    group = scored_group("p:0", [0, 1])
    group.rollouts[0].correct = None
    with pytest.raises(ValueError, match=r"p:0@s0: rollouts \['p:0@s0/0'\] have no `correct`.*filter.verify"):
        stage.run(picked, RolloutGroups([group]), _ctx(1))
    with pytest.raises(ValueError, match="outside a loop block"):
        stage.run(picked, RolloutGroups(), _ctx(None))


# --- gfcr validate ------------------------------------------------------------------------------

def _bad_spec(tmp_path: Path, old: str, new: str) -> Path:
    text = (REPO / "pipelines" / "dars_arith.yaml").read_text()
    assert old in text
    spec = tmp_path / "bad.yaml"
    spec.write_text(text.replace(old, new))
    return spec


def test_the_shipped_pipeline_validates():
    compiled = load_pipeline(REPO / "pipelines" / "dars_arith.yaml")
    assert compiled.nodes["topup"].info.alias == "control.dars"
    assert compiled.nodes["merged"].info.alias == "filter.merge_rounds"


def test_validate_refuses_a_fixed_n_after_dars(tmp_path):
    from gfcr.errors import GfcrError

    spec = _bad_spec(tmp_path, "  rollout: {use: generate.sample, from: topup,",
                     "  budget:  {use: control.fixed_n, from: topup, with: {n: 8}}\n"
                     "  rollout: {use: generate.sample, from: budget,")
    spec.write_text(spec.read_text().replace("stages: [topup, rollout", "stages: [topup, budget, rollout"))
    with pytest.raises(GfcrError, match=r"stages\.budget\.with\.n: `topup` \(control\.dars\) upstream sets each"):
        load_pipeline(spec)


def test_validate_refuses_a_std_that_disagrees_with_the_update_s_advantage(tmp_path):
    from gfcr.errors import GfcrError

    with pytest.raises(GfcrError, match=r"stages\.topup\.with\.std: std: false .* advantage is `mean_std`"):
        load_pipeline(_bad_spec(tmp_path, "advantage: {use: mean}", "advantage: {use: mean_std}"))
    with pytest.raises(GfcrError, match=r"std: true .* advantage is `mean`.*\n    fix: set `std: false` here"):
        load_pipeline(_bad_spec(tmp_path, "schedule: hw}", "schedule: hw, std: true}"))
    ok = _bad_spec(tmp_path, "advantage: {use: mean}", "advantage: {use: rloo}")  # other estimators: not checked
    assert load_pipeline(ok).nodes["topup"].config.std is False


def test_validate_refuses_dars_reading_groups_from_a_generate_stage_upstream(tmp_path):
    from gfcr.errors import GfcrError

    text = textwrap.dedent("""\
        name: dars-no-loop
        policy: {model: tiny-arith}
        data: {source: arithmetic, with: {n: 40, seed: 0}}
        stages:
          pick:    {use: control.uniform, with: {batch_size: 4}}
          budget:  {use: control.fixed_n, from: pick, with: {n: 8}}
          rollout: {use: generate.sample, from: budget}
          reward:  {use: filter.verify, from: rollout}
          topup:   {use: control.dars, from: {allocation: pick, groups: reward}}
          again:   {use: generate.sample, from: topup}
        update: {use: update.grpo, from: again}
        """)
    spec = tmp_path / "noloop.yaml"
    spec.write_text(text)
    with pytest.raises(GfcrError, match=r"(?s)stages\.topup\.with: `rollout` \(generate\.sample\) is upstream of "
                                        r"control\.dars.*put the stage in a loop block"):
        load_pipeline(spec)


# --- short real runs on tiny-arith ----------------------------------------------------------------

SMALL = ["data.with.n=40", "stages.pick.with.batch_size=4", "eval.every=100", "eval.with.n=20",
         "run.checkpoint_every=2", "tracking.mlflow=null"]


def _metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _without_time(records: list[dict]) -> list[dict]:
    return [{k: v for k, v in r.items() if k != "time"} for r in records]


@pytest.fixture(scope="module")
def full_run(tmp_path_factory) -> Path:
    from gfcr.runtime.loop.session import Run

    run_dir = tmp_path_factory.mktemp("dars") / "full"
    Run.start(load_pipeline(REPO / "pipelines" / "dars_arith.yaml", SMALL + ["run.steps=4"]), run_dir).train()
    return run_dir


def test_spending_per_step_is_bounded_by_n_max_per_prompt(full_run):
    records = _metrics(full_run)
    assert [r["step"] for r in records] == [0, 1, 2, 3]
    topped = 0
    for r in records:
        m = r["stages"]["topup"]
        assert m["prompts"] == r["prompts"] == 4
        assert m["first_rollouts"] == 8 * 4
        assert r["rollouts_generated"] == m["total_rollouts"] == m["first_rollouts"] + m["topup_rollouts"]
        assert r["rollouts_generated"] <= m["max_rollouts"] == 64 * r["prompts"]
        assert r["loop_rounds"] == {"dars": 2}
        topped += m["topup_rollouts"]
    assert topped > 0  # the untrained policy misses often enough for some top-up


def test_the_top_up_joins_its_prompt_s_group_as_fresh_samples():
    from gfcr.runtime import LocalRunner, RuntimeServices
    from gfcr.stages.resources import Lent
    from gfcr.engines import TransformersEngine, load_policy

    compiled = load_pipeline(REPO / "pipelines" / "dars_arith.yaml", SMALL)
    policy = load_policy(compiled.spec.policy)
    report = LocalRunner(compiled, services=RuntimeServices(Lent(policy, TransformersEngine(policy)))).run_step()
    merged = [g for g in report.groups if g.verdict.reason and g.verdict.reason.startswith("merged into")]
    bases = {g.group_id: g for g in report.groups if g not in merged}
    assert merged and len(bases) == 4
    fresh_rows, first_rows = [], []
    for topup in merged:
        assert topup.rollouts == [] and report.dropped_by[topup.group_id] == "merged"
        base = bases[topup.verdict.reason.removeprefix("merged into ")]
        fresh = [r for r in base.rollouts if r.rollout_id.startswith(topup.group_id + "/")]
        assert len(fresh) == base.target_size - 8 == len(base.rollouts) - 8 > 0
        assert all(r.group_id == base.group_id for r in base.rollouts)
        assert "merged" in report.changed_by[base.group_id]
        fresh_rows += [r.behavior_logprobs.tolist() for r in fresh[:8]]
        first_rows += [r.behavior_logprobs.tolist() for r in base.rollouts[:len(fresh[:8])]]
    # sampled in their own round (seed and request id of round 1): not row-by-row copies of the first rows
    assert fresh_rows != first_rows
    assert report.rollouts_generated == report.metrics["topup"]["total_rollouts"]
    assert report.rollouts_generated == sum(len(g.rollouts) for g in bases.values())


def test_resume_from_a_checkpoint_gives_the_metrics_of_an_uninterrupted_run(full_run, tmp_path):
    from gfcr.runtime.loop.session import Run

    part = tmp_path / "part"
    Run.start(load_pipeline(REPO / "pipelines" / "dars_arith.yaml", SMALL + ["run.steps=2"]), part).train()
    Run.resume(part, steps=4).train()
    assert _without_time(_metrics(part)) == _without_time(_metrics(full_run))
