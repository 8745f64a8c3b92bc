"""control.xrpo: the Student-t half-width reduction on hand data, the greedy phase on hand
cases, the rounds of the loop block, gfcr validate's refusals, and a short real tiny-arith
run whose ``metrics.jsonl`` shows the step's budget spent exactly."""

from __future__ import annotations

import json
import math
from dataclasses import replace
from pathlib import Path

import pytest
from pydantic import ValidationError

from gfcr.graph import load_pipeline
from gfcr.records import Allocation, AllocationEntry, Prompt, RolloutGroups, StepContext
from gfcr.stages.control.xrpo import Xrpo, greedy_phase, half_width, priority, reduction, reward_std
from gfcr.stages.testing import scored_group
from tests.conftest import REPO

# t_{0.975, k} from tables: k = 3: 3.18245, k = 4: 2.77645, k = 5: 2.57058
T3, T4, T5 = 3.1824463, 2.7764451, 2.5705818


def test_half_width_and_its_reduction_on_hand_data():
    # rewards [1, 0, 0, 0]: mean 1/4, s^2 = (9/16 + 3/16) / 3 = 1/4, s = 0.5
    s, n = reward_std(scored_group("p:0", [1, 0, 0, 0]))
    assert (s, n) == (0.5, 4)
    # h(4) = 3.18245 * 0.5 / 2 = 0.79561; h(5) = 2.77645 * 0.5 / sqrt(5) = 0.62083; reduction 0.17478
    assert half_width(0.5, 4) == pytest.approx(T3 * 0.25, abs=1e-6) == pytest.approx(0.795612, abs=1e-6)
    assert half_width(0.5, 5) == pytest.approx(T4 * 0.5 / math.sqrt(5), abs=1e-6) == pytest.approx(0.620832, abs=1e-6)
    assert reduction(0.5, 4) == pytest.approx(0.174780, abs=1e-6)
    # rewards [1, 1, 0, 0]: s^2 = 4 * 1/4 / 3 = 1/3; the reduction scales with s: 0.17478 * 2 / sqrt(3) = 0.20182
    s2, _ = reward_std(scored_group("p:1", [1, 1, 0, 0]))
    assert s2 == pytest.approx(1 / math.sqrt(3))
    assert reduction(s2, 4) == pytest.approx(0.201819, abs=1e-6)
    # h(5) - h(6) at s = 0.5: 0.62083 - 2.57058 * 0.5 / sqrt(6) = 0.62083 - 0.52472 = 0.09611
    assert reduction(0.5, 5) == pytest.approx(0.620832 - T5 * 0.5 / math.sqrt(6), abs=1e-6)
    # a wider interval (alpha 0.2: t_{0.9, 3} = 1.63774) is narrower: h(4) = 1.63774 * 0.25 = 0.40943
    assert half_width(0.5, 4, alpha=0.2) == pytest.approx(0.409435, abs=1e-5)


def test_zero_spread_has_no_reduction_and_one_rollout_no_interval():
    assert reduction(0.0, 4) == 0.0 and reward_std(scored_group("p:0", [1, 1, 1, 1]))[0] == 0.0
    with pytest.raises(ValueError, match="at least 2 rollouts"):
        half_width(0.5, 1)


def test_priority_adds_the_ucb_bonus():
    # 0.1 * sqrt(ln(9) / 4) = 0.1 * sqrt(2.19722 / 4) = 0.074115
    assert priority(0.5, 4, total=8, bonus=0.1) == pytest.approx(0.174780 + 0.074115, abs=1e-6)
    assert priority(0.0, 4, total=8, bonus=0.0) == 0.0


def test_greedy_phase_on_hand_cases():
    # A = [1,0,0,0] (s 0.5), B = [1,1,1,1] (s 0), both n = 4, T = 8, two rollouts to give.
    # bonus 0.1: 1st: A 0.17478 + 0.07412 = 0.2489 > B 0.07412 -> A (n_A 5, T 9);
    #            2nd: A 0.09611 + 0.1 sqrt(ln 10 / 5) = 0.09611 + 0.06786 = 0.1640 > B 0.1 sqrt(ln 10 / 4) = 0.07587 -> A
    assert greedy_phase([0.5, 0.0], [4, 4], units=2, total=8, bonus=0.1, n_max=16) == [2, 0]
    # bonus 2: 1st: A 0.1748 + 1.4823 > B 1.4823 -> A; 2nd: A 0.0961 + 1.3572 = 1.4533 < B 1.5174 -> B
    assert greedy_phase([0.5, 0.0], [4, 4], units=2, total=8, bonus=2.0, n_max=16) == [1, 1]
    # ties go to the earlier prompt
    assert greedy_phase([0.5, 0.5], [4, 4], units=1, total=8, bonus=0.1, n_max=16) == [1, 0]
    # n_max 5: A takes one and is full, B the next; a third has nowhere to go
    assert greedy_phase([0.5, 0.0], [4, 4], units=3, total=8, bonus=0.1, n_max=5) == [1, 1]


def _ctx(round_: int | None) -> StepContext:
    return StepContext("run", 0, 0, 0, round=round_)


def _picked(*prompts: str, skipped: tuple[str, ...] = ()) -> Allocation:
    return Allocation(0, tuple(AllocationEntry(Prompt(p, text=p), 0 if p in skipped else 1) for p in prompts))


def test_round_0_gives_the_base_the_phases_the_rest_of_the_budget():
    stage = Xrpo(Xrpo.Config(mean_rollouts=5, n_base=4, n_max=16, phases=1, bonus=0.1))
    stage.before_step(_ctx(None))
    picked = _picked("p:0", "p:1", "p:2", skipped=("p:2",))
    base = stage.run(picked, RolloutGroups(), _ctx(0))
    assert [(e.n_rollouts, e.stage_index) for e in base] == [(4, 0), (4, 0), (0, 0)]
    assert base.entries[0].why.code == "base"
    groups = RolloutGroups([scored_group("p:0", [1, 0, 0, 0]), scored_group("p:1", [1, 1, 1, 1])])
    # budget 5 * 2 = 10, base 8, one phase of 2: both to p:0 (test_greedy_phase_on_hand_cases)
    phase = stage.run(picked, groups, _ctx(1))
    assert [(e.prompt_id, e.n_rollouts, e.stage_index) for e in phase] == [("p:0", 2, 1), ("p:1", 0, 1), ("p:2", 0, 1)]
    a, b = phase.entries[0].why, phase.entries[1].why
    assert (a.code, b.code) == ("largest_priority", "lower_priority")
    assert a.value == pytest.approx(0.174780 + 0.074115, abs=1e-6)
    assert a.quantities["half_width"] == pytest.approx(0.795612, abs=1e-6) and a.quantities["given"] == 2
    assert b.quantities["reduction"] == 0.0
    assert stage.run(picked, groups, _ctx(2)).total_rollouts == 0  # past the last phase
    assert stage.step_metrics() == {"prompts": 2, "budget": 10, "base_rollouts": 8, "phase_rollouts": 2,
                                    "spent": 10, "unspent": 0, "max_n": 6, "min_n": 4}
    stage.before_step(_ctx(None))
    assert stage.step_metrics()["spent"] == 0


def test_phases_split_the_remainder_and_carry_what_a_capped_phase_could_not_place():
    stage = Xrpo(Xrpo.Config(mean_rollouts=5, n_base=4, n_max=5, phases=2))
    stage.before_step(_ctx(None))
    picked = _picked("p:0", "p:1")
    stage.run(picked, RolloutGroups(), _ctx(0))
    groups = RolloutGroups([scored_group("p:0", [1, 0, 0, 0]), scored_group("p:1", [1, 1, 0, 0])])
    # remainder 2: phase 1 may place ceil(2 * 1 / 2) = 1, phase 2 the rest; p:1 (s 0.577) first
    assert [e.n_rollouts for e in stage.run(picked, groups, _ctx(1))] == [0, 1]
    grown = RolloutGroups([scored_group("p:0", [1, 0, 0, 0]), scored_group("p:1", [1, 1, 0, 0, 1])])
    second = stage.run(picked, grown, _ctx(2))
    assert [e.n_rollouts for e in second] == [1, 0]
    assert second.entries[1].why.code == "at_cap"
    assert stage.step_metrics()["spent"] == stage.step_metrics()["budget"] == 10


def test_a_small_remainder_goes_out_in_the_first_phase():
    # one prompt, budget 5, base 4: remainder 1 over 2 phases. ceil(1 * 1 / 2) = 1 in phase 1 (a
    # floor would give 0, and the loop, which ends after a round that generated nothing, would
    # stop with the rollout unspent); phase 2 then has nothing left
    stage = Xrpo(Xrpo.Config(mean_rollouts=5, n_base=4, n_max=8, phases=2))
    stage.before_step(_ctx(None))
    picked = _picked("p:0")
    stage.run(picked, RolloutGroups(), _ctx(0))
    assert stage.run(picked, RolloutGroups([scored_group("p:0", [1, 0, 0, 0])]), _ctx(1)).total_rollouts == 1
    assert stage.run(picked, RolloutGroups([scored_group("p:0", [1, 0, 0, 0, 1])]), _ctx(2)).total_rollouts == 0
    assert stage.step_metrics()["spent"] == stage.step_metrics()["budget"] == 5


def test_a_missing_group_gets_nothing_and_the_shortfall_is_reported():
    stage = Xrpo(Xrpo.Config(mean_rollouts=8, n_base=4, n_max=8, phases=1))
    stage.before_step(_ctx(None))
    picked = _picked("p:0", "p:1")
    stage.run(picked, RolloutGroups(), _ctx(0))
    out = stage.run(picked, RolloutGroups([scored_group("p:0", [1, 0, 0, 0])]), _ctx(1))
    assert [e.n_rollouts for e in out] == [4, 0]  # p:0 up to n_max 8; p:1 has no group
    assert out.entries[1].why.code == "no_group"
    m = stage.step_metrics()
    assert (m["budget"], m["spent"], m["unspent"]) == (16, 12, 4)


def test_misconfiguration_is_loud():
    with pytest.raises(ValidationError, match="n_base <= mean_rollouts <= n_max"):
        Xrpo.Config(mean_rollouts=4, n_base=6)
    with pytest.raises(ValidationError):
        Xrpo.Config(n_base=1)
    stage = Xrpo(Xrpo.Config())
    with pytest.raises(ValueError, match="outside a loop block"):
        stage.run(_picked("p:0"), RolloutGroups(), _ctx(None))
    unscored = scored_group("p:0", [1, 0])
    bad = RolloutGroups([replace(unscored, rollouts=[replace(unscored.rollouts[0], reward=None), unscored.rollouts[1]])])
    stage.run(_picked("p:0"), RolloutGroups(), _ctx(0))
    with pytest.raises(ValueError, match="put filter.verify in the loop block"):
        stage.run(_picked("p:0"), bad, _ctx(1))


# --- gfcr validate ------------------------------------------------------------------------------

def _bad_spec(tmp_path: Path, old: str, new: str) -> Path:
    text = (REPO / "pipelines" / "xrpo_arith.yaml").read_text()
    assert old in text
    spec = tmp_path / "bad.yaml"
    spec.write_text(text.replace(old, new))
    return spec


def test_the_shipped_pipeline_validates():
    compiled = load_pipeline(REPO / "pipelines" / "xrpo_arith.yaml")
    assert compiled.nodes["plan"].info.alias == "control.xrpo"


def test_validate_refuses_a_fixed_n_after_xrpo(tmp_path):
    from gfcr.errors import GfcrError

    spec = _bad_spec(tmp_path, "  rollout: {use: generate.sample, from: plan,",
                     "  budget:  {use: control.fixed_n, from: plan, with: {n: 8}}\n"
                     "  rollout: {use: generate.sample, from: budget,")
    spec.write_text(spec.read_text().replace("stages: [plan, rollout", "stages: [plan, budget, rollout"))
    with pytest.raises(GfcrError, match=r"stages\.budget\.with\.n: `plan` \(control\.xrpo\) upstream sets each"):
        load_pipeline(spec)


def test_validate_refuses_xrpo_reading_groups_from_a_generate_stage_upstream(tmp_path):
    from gfcr.errors import GfcrError

    spec = tmp_path / "noloop.yaml"
    spec.write_text("""\
name: xrpo-no-loop
policy: {model: tiny-arith}
data: {source: arithmetic, with: {n: 40, seed: 0}}
stages:
  pick:    {use: control.uniform, with: {batch_size: 4}}
  budget:  {use: control.fixed_n, from: pick, with: {n: 4}}
  rollout: {use: generate.sample, from: budget}
  reward:  {use: filter.verify, from: rollout}
  plan:    {use: control.xrpo, from: {allocation: pick, groups: reward}}
  again:   {use: generate.sample, from: plan}
update: {use: update.grpo, from: again}
""")
    with pytest.raises(GfcrError, match=r"(?s)stages\.plan\.with: `rollout` \(generate\.sample\) is upstream of "
                                        r"control\.xrpo.*put the stage in a loop block"):
        load_pipeline(spec)


# --- a short real run on tiny-arith -------------------------------------------------------------

def test_every_step_of_a_real_run_spends_its_budget_exactly(tmp_path):
    from gfcr.runtime.loop.session import Run

    overrides = ["data.with.n=40", "stages.pick.with.batch_size=4", "eval.every=100", "eval.with.n=20",
                 "run.steps=3", "tracking.mlflow=null"]
    Run.start(load_pipeline(REPO / "pipelines" / "xrpo_arith.yaml", overrides), tmp_path / "run").train()
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [0, 1, 2]
    uneven = 0
    for r in records:
        m = r["stages"]["plan"]
        assert m["spent"] == m["budget"] == 8 * 4 == r["rollouts_generated"]
        assert (m["base_rollouts"], m["phase_rollouts"], m["unspent"]) == (16, 16, 0)
        assert r["loop_rounds"] == {"xrpo": 3}
        uneven += m["max_n"] > m["min_n"]
    assert uneven > 0, "every prompt got the same number of rollouts: the allocator allocated nothing"
