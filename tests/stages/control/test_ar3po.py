"""control.ar3po: the stages of the loop block on hand cases (who stays active, the cap, the
reasons, the budget), the misconfigurations gfcr validate refuses, a short real tiny-arith
run whose metrics.jsonl shows the spend bounded and the cache joining the unsolved groups, and
the composed pipeline (the stage keeps nothing across steps; its response cache does) resuming
after a SIGKILL to the metrics of an uninterrupted run."""

from __future__ import annotations

import json

import pytest
from pydantic import ValidationError

from gfcr.graph import load_pipeline
from gfcr.records import Allocation, AllocationEntry, Prompt, RolloutGroups, StepContext
from gfcr.runtime.loop.session import Run
from gfcr.stages.control.ar3po import Ar3po
from gfcr.stages.testing import scored_group
from tests.conftest import REPO
from tests.killing import sigkill_after_step


def ctx(round_, step=0):
    return StepContext("run", step=step, seed=0, policy_version=step, round=round_)


def picked(*ids, skipped=()):
    return Allocation(0, tuple(AllocationEntry(Prompt(p, text=p), 0 if p in skipped else 1) for p in ids))


def started(k=4, stages=3):
    stage = Ar3po(Ar3po.Config(k=k, stages=stages))
    stage.before_step(ctx(None))
    return stage


def test_stage_zero_gives_every_selected_prompt_k_and_keeps_skips():
    stage = started(k=3)
    out = stage.run(picked("a", "b", "c", skipped=("b",)), RolloutGroups(), ctx(0))
    assert [e.n_rollouts for e in out] == [3, 0, 3]
    assert [e.stage_index for e in out] == [0, 0, 0]
    assert out.entries[0].why.code == "first_stage" and out.entries[0].why.value == 3.0
    m = stage.step_metrics()
    # 2 prompts x k 3 x 3 stages = 18 at most; 6 spent
    assert (m["prompts"], m["budget"], m["spent"], m["unspent"]) == (2, 18, 6, 12)
    assert (m["stage0_prompts"], m["stage0_rollouts"], m["stage1_rollouts"]) == (2, 6, 0)


def test_a_prompt_stops_at_its_first_correct_response_and_the_rest_go_on_to_the_cap():
    # k = 2, 3 stages: cap 6 a prompt.
    stage = started(k=2, stages=3)
    alloc = picked("easy", "late", "never")
    stage.run(alloc, RolloutGroups(), ctx(0))
    # after stage 0: easy has 1/2 correct, late and never 0/2
    r1 = stage.run(alloc, RolloutGroups([scored_group("easy", [1, 0]), scored_group("late", [0, 0]),
                                         scored_group("never", [0, 0])]), ctx(1))
    assert [(e.n_rollouts, e.why.code) for e in r1] == [(0, "has_correct"), (2, "no_correct_yet"),
                                                        (2, "no_correct_yet")]
    assert r1.entries[0].why.quantities == {"correct": 1.0, "rollouts": 2.0}
    assert r1.entries[1].why.quantities == {"correct": 0.0, "rollouts": 2.0} and r1.entries[1].stage_index == 1
    # after stage 1 (merged groups of 4): late found one, never did not
    r2 = stage.run(alloc, RolloutGroups([scored_group("easy", [1, 0]), scored_group("late", [0, 0, 0, 1]),
                                         scored_group("never", [0, 0, 0, 0])]), ctx(2))
    assert [e.n_rollouts for e in r2] == [0, 0, 2]
    # round 3 = stages: reads the last stage, asks for nothing
    r3 = stage.run(alloc, RolloutGroups([scored_group("easy", [1, 0]), scored_group("late", [0, 0, 0, 1]),
                                         scored_group("never", [0] * 6)]), ctx(3))
    assert [(e.n_rollouts, e.why.code) for e in r3] == [(0, "has_correct"), (0, "has_correct"), (0, "stages_done")]
    m = stage.step_metrics()
    # spent: easy 2, late 2 + 2, never 2 + 2 + 2 = 12 of a cap of 3 x 6 = 18
    assert (m["budget"], m["spent"], m["unspent"], m["mean_rollouts"]) == (18, 12, 6, 4.0)
    assert [(m[f"stage{s}_prompts"], m[f"stage{s}_rollouts"]) for s in range(3)] == [(3, 6), (2, 4), (1, 2)]
    assert (m["solved_prompts"], m["unsolved_prompts"]) == (2, 1)


def test_an_all_correct_first_stage_also_stops_and_a_dropped_group_gets_nothing():
    stage = started(k=2, stages=2)
    alloc = picked("all", "gone", "missing")
    stage.run(alloc, RolloutGroups(), ctx(0))
    dropped = scored_group("gone", [0, 0])
    dropped.drop("a filter in the loop")
    out = stage.run(alloc, RolloutGroups([scored_group("all", [1, 1]), dropped]), ctx(1))
    assert [(e.n_rollouts, e.why.code) for e in out] == [(0, "has_correct"), (0, "no_group"), (0, "no_group")]
    assert stage.step_metrics()["spent"] == 6


def test_the_step_resets_the_accounting():
    stage = started(k=2, stages=2)
    stage.run(picked("a"), RolloutGroups(), ctx(0))
    stage.before_step(ctx(None, step=1))
    assert stage.step_metrics()["spent"] == 0 and stage.step_metrics()["prompts"] == 0


def test_loud_failures_outside_a_loop_and_without_a_verifier():
    stage = started()
    with pytest.raises(ValueError, match="runs outside a loop block"):
        stage.run(picked("a"), RolloutGroups(), ctx(None))
    stage.run(picked("a"), RolloutGroups(), ctx(0))
    unscored = scored_group("a", [0, 0])
    for r in unscored.rollouts:
        r.correct = None
    with pytest.raises(ValueError, match="put filter.verify in the loop block"):
        stage.run(picked("a"), RolloutGroups([unscored]), ctx(1))
    with pytest.raises(ValidationError):
        Ar3po.Config(k=0)
    with pytest.raises(ValidationError):
        Ar3po.Config(stages=0)


def test_validate_refuses_a_generate_stage_upstream(tmp_path):
    text = (REPO / "pipelines" / "ar3po_arith.yaml").read_text()
    text = text.replace("adapt:   {use: control.ar3po, from: {allocation: pick, groups: merged}",
                        "first:   {use: generate.sample, from: pick}\n"
                        "  adapt:   {use: control.ar3po, from: {allocation: pick, groups: first}")
    spec = tmp_path / "bad.yaml"
    spec.write_text(text)
    from gfcr.errors import GraphError
    with pytest.raises(GraphError) as err:
        load_pipeline(spec)
    assert "`first` (generate.sample) is upstream of control.ar3po" in str(err.value)
    assert "max_rounds: 3" in str(err.value)


def test_a_short_real_run_spends_within_the_cap_and_the_cache_joins_unsolved_groups(tmp_path):
    lines = (REPO / "pipelines" / "ar3po_arith.yaml").read_text().splitlines()
    spec = tmp_path / "ar3po.yaml"
    spec.write_text("\n".join(line for line in lines if not line.startswith("eval:")) + "\n")
    overrides = ["run.steps=4", "data.with.n=8", "stages.pick.with.batch_size=4", "tracking.mlflow=null",
                 "run.checkpoint_every=4"]
    Run.start(load_pipeline(spec, overrides), tmp_path / "run").train()
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    for r in records:
        m, reuse = r["stages"]["adapt"], r["stages"]["reuse"]
        assert 16 == m["stage0_rollouts"] <= m["spent"] == r["rollouts_generated"] <= m["budget"] == 32
        assert m["stage1_prompts"] * 4 == m["stage1_rollouts"]
        # the cache sees exactly the groups the loop left without a correct response
        assert reuse["groups_without_correct"] == m["unsolved_prompts"]
        assert r["loop_rounds"]["ar3po"] <= 3


def _small_spec(tmp_path, steps):
    """pipelines/ar3po_arith.yaml on 8 prompts, 4 a step (each seen every other step, so the cache
    is used), no eval, checkpoints every 2 steps; written out (the killer takes no overrides)."""
    text = (REPO / "pipelines" / "ar3po_arith.yaml").read_text()
    text = "\n".join(line for line in text.splitlines() if not line.startswith("eval:")) + "\n"
    for old, new in (("n: 4000,", "n: 8,"), ("batch_size: 16", "batch_size: 4"),
                     ("steps: 100", f"steps: {steps}"), ("checkpoint_every: 50", "checkpoint_every: 2")):
        assert old in text, old
        text = text.replace(old, new)
    spec = tmp_path / f"ar3po{steps}.yaml"
    spec.write_text(text + "tracking: {mlflow: null}\n")
    return spec


def _lines(run_dir):
    return [{k: v for k, v in json.loads(line).items() if k != "time"}
            for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_a_sigkilled_run_resumes_to_the_metrics_of_an_uninterrupted_run(tmp_path):
    Run.start(load_pipeline(_small_spec(tmp_path, 6)), tmp_path / "full").train()
    full = _lines(tmp_path / "full")
    assert any(r["stages"]["reuse"]["cache_prompts"] > 0 for r in full)
    killed = tmp_path / "killed"
    sigkill_after_step(_small_spec(tmp_path, 6), killed, 4, tmp_path)
    assert [r["step"] for r in _lines(killed)] == [0, 1, 2, 3, 4]
    Run.resume(killed).train()
    assert _lines(killed) == full
