"""``ControlReason``: the machine-readable why of a Control stage's per-prompt decision, its
checks, and how the runtime finds which stage decided an entry (``gfcr.runtime.loop.local.decided``)
and writes it to the control lineage table."""

from __future__ import annotations

from dataclasses import replace

import pytest

from gfcr.records import Allocation, AllocationEntry, ControlDecision, ControlReason, Prompt, StepReport
from gfcr.runtime.store.lineage import CONTROL_SCHEMA, control_rows, read_control_lineage, write_control_lineage
from gfcr.runtime.loop.local import decided
from gfcr.stages.control.fixed_n import FixedN

P0, P1 = Prompt("p:0", text="0"), Prompt("p:1", text="1")


def test_the_decision_is_the_entry_s_count_and_the_reason_renders_its_numbers():
    why = ControlReason("easy_streak", "p_skip", 0.75, {"streak": 2, "p_easy": 0.5, "draw": 0.31})
    assert AllocationEntry(P0, 0, why=why).decision == "skipped"
    assert AllocationEntry(P0, 8, why=why).decision == "picked"
    # 1 - 0.5 ** 2 = 0.75: the decisive number first, then the others in the stage's order
    assert str(why) == "easy_streak, p_skip=0.75 (streak=2, p_easy=0.5, draw=0.31)"
    assert str(ControlReason("next_in_epoch")) == "next_in_epoch"
    assert why.quantities["streak"] == 2.0 and isinstance(why.quantities["streak"], float)
    assert AllocationEntry(P0, 1).why is None  # optional: a stage may give only the sentence


@pytest.mark.parametrize("kwargs, message", [
    ({"code": "Easy streak"}, "snake_case"),
    ({"code": "easy_streak", "name": "p_skip"}, "both a name and a value"),
    ({"code": "easy_streak", "value": 0.5}, "both a name and a value"),
    ({"code": "easy_streak", "name": "p_skip", "value": float("nan")}, "finite"),
    ({"code": "closest_to_target", "quantities": {"draw": float("inf")}}, "finite"),
    ({"code": "closest_to_target", "quantities": {"Draw value": 0.5}}, "snake_case name"),
])
def test_a_malformed_reason_is_refused_with_what_to_fix(kwargs, message):
    with pytest.raises(ValueError, match=message):
        ControlReason(**kwargs)


def test_a_stage_decided_the_entries_it_set_not_those_it_passed_on():
    picked = AllocationEntry(P0, 1, reason="greso: keep (no streak)", why=ControlReason("no_streak", "p_skip", 0.0))
    skipped = AllocationEntry(P1, 0, reason="greso: skip", why=ControlReason("easy_streak", "p_skip", 0.5))
    upstream = Allocation(3, (picked, skipped))
    assert [(d.stage_id, d.entry.prompt_id, d.round) for d in decided("pick", 2, [], upstream)] == \
        [("pick", "p:0", 2), ("pick", "p:1", 2)]
    sized = FixedN(FixedN.Config(n=8)).run(upstream)  # 1 -> 8 rollouts: still picked, same reason
    assert decided("budget", None, [upstream], sized) == []
    vetoed = upstream.with_entries([replace(picked, n_rollouts=0, reason="budget: out of tokens", why=None), skipped])
    assert [d.entry.prompt_id for d in decided("budget", None, [upstream], vetoed)] == ["p:0"]


def test_the_control_table_round_trips_through_parquet(tmp_path):
    why = ControlReason("farther_from_target", "draw", 0.9, {"distance": 0.4, "cutoff_distance": 0.1})
    decisions = (ControlDecision("pick", AllocationEntry(P0, 0, reason="beta_thompson: not chosen", why=why)),
                 ControlDecision("pick", AllocationEntry(P1, 1), round=1))
    report = StepReport("run", 4, 5, (), None, {}, {}, control_decisions=decisions)
    write_control_lineage(tmp_path / "control-000004.parquet", report)
    rows = read_control_lineage(tmp_path)
    assert rows == control_rows(report)
    assert rows[0] == {"run_id": "run", "step": 4, "round": None, "stage_id": "pick", "prompt_id": "p:0",
                       "decision": "skipped", "n_rollouts": 0, "code": "farther_from_target", "value_name": "draw",
                       "value": 0.9, "quantities": {"distance": 0.4, "cutoff_distance": 0.1},
                       "reason": "beta_thompson: not chosen"}
    assert rows[1]["decision"] == "picked" and rows[1]["round"] == 1 and rows[1]["code"] is None
    assert read_control_lineage(tmp_path / "nothing") == []  # a run written before decisions were recorded
    assert set(CONTROL_SCHEMA.names) == set(rows[0])
