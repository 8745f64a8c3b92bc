"""control.coba: the value curve, its shape and tau, and the allocation on hand cases (the
reference's own cases are in tests/fidelity/test_coba.py), what ``observe`` learns, and real
tiny-arith runs: what the allocator spends is what was generated on every step of ``metrics.jsonl``, and resume (from a checkpoint, and after a SIGKILL) gives the
metrics of an uninterrupted run."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
from pydantic import ValidationError

from gfcr.graph import load_pipeline
from gfcr.records import Allocation, AllocationEntry, Prompt, StepContext, StepReport
from gfcr.stages.control.coba import Coba, allocate, beta_shape, temperature, value
from gfcr.stages.testing import scored_group
from tests.conftest import REPO
from tests.killing import sigkill_after_step


def test_the_value_curve_on_hand_values():
    # a = 9, b = 2: B(9, 2) = 1/90, BetaPDF(0.5) = 90 / 2^9; tau = 3, N = 4: 1 - exp(-4/3 * 1/4)
    assert value(0.5, 4, 3.0, 9.0, 2.0) == pytest.approx((1 - math.exp(-1 / 3)) * 90 / 2 ** 9)
    # p is clipped to [0.01, 0.99]: p = 0 is valued as 0.01, not 0
    assert value(0.0, 4, 3.0, 9.0, 2.0) == value(0.01, 4, 3.0, 9.0, 2.0) > 0
    gains = [value(0.3, n + 1, 5.0, 3.0, 4.0) - value(0.3, n, 5.0, 3.0, 4.0) for n in range(1, 30)]
    assert all(a > b > 0 for a, b in zip(gains, gains[1:]))  # diminishing: the greedy maximises the sum


def test_the_shape_follows_the_failure_rate_sharpened_below_one_half():
    assert beta_shape(0.8, 11.0) == pytest.approx((1 + 9 * 0.8, 10 - 9 * 0.8))  # mode 0.8
    assert beta_shape(1.0, 7.0) == (6.0, 1.0)  # clipped to [1, s - 1]
    # F = 0.3 <= 0.5: F' = 1 / (1 + e^2) = 0.1192, a = 1 + 5 F'
    assert beta_shape(0.3, 7.0)[0] == pytest.approx(1 + 5 / (1 + math.exp(2)))
    assert beta_shape(0.5, 7.0) == pytest.approx((3.5, 3.5))  # continuous at 0.5


def test_tau_grows_with_the_spread_of_the_explored_pass_rates():
    assert temperature([0.4, 0.4], 3.0, 12.0, 0.1667, 0.01) == 3.0
    # var([0.1, 0.9]) = 0.16: tau = 3 + 9 * 0.16 / 0.1667
    assert temperature([0.1, 0.9], 3.0, 12.0, 0.1667, 0.01) == pytest.approx(3 + 9 * 0.16 / 0.1667)
    assert temperature([0.0, 1.0], 3.0, 12.0, 0.1667, 0.01) == 12.0  # 0.2401 / 0.1667 clipped to 1


def test_allocation_on_a_hand_case():
    shape = (9.0, 2.0)  # the prior curve of beta_sum 11
    # first step: nothing seen, an even split with the remainder to the first
    assert allocate([None] * 3, 10, 2, 128, shape).counts == [4, 3, 3]
    # p 0.5 explored, 0 very hard, 1 very easy: 6 above n_min, the explored share is
    # 0.6 + 0.2 * (1/3 * 2) -> int(6 * 0.733) = 4 to the heap's only prompt, the 2 left to the very hard
    plan = allocate([0.5, 0.0, 1.0], 12, 2, 128, shape)
    assert (plan.counts, plan.kinds, plan.tau) == ([6, 4, 2], ["explored", "very_hard", "very_easy"], 3.0)
    # n_max caps the heap; what it cannot place goes to the very hard, then the others
    assert allocate([0.5, 0.0, 1.0], 12, 2, 5, shape).counts == [5, 5, 2]
    # a never-seen prompt next to seen ones counts as p = 0.5: equal rates tie to the earlier prompt
    assert allocate([0.5, None], 5, 2, 128, shape).counts == [3, 2]


def test_the_weighted_leftover_favours_earlier_prompts_as_the_reference_does():
    # four very easy prompts, 24 above n_min: int(24/4) = 6, then int(18/4) = 4, 3, 2, then 9 evenly
    assert allocate([1.0] * 4, 32, 2, 128, (9.0, 2.0)).counts == [11, 8, 7, 6]
    assert allocate([1.0] * 4, 32, 2, 128, (9.0, 2.0), leftover="uniform").counts == [8, 8, 8, 8]


def _picked(*prompts: str) -> Allocation:
    return Allocation(0, tuple(AllocationEntry(Prompt(p, text=p), 1) for p in prompts))


def _ctx(step: int) -> StepContext:
    return StepContext("run", step, 0, step)


def test_the_stage_learns_pass_rates_and_the_failure_rate_in_its_window():
    stage = Coba(Coba.Config(mean_rollouts=4, n_min=2, n_max=16, window=2, beta_sum=7.0))
    stage.before_step(_ctx(0))
    first = stage.run(_picked("p:0", "p:1"))
    assert [e.n_rollouts for e in first] == [4, 4] and first.entries[0].why.code == "first_step"
    assert stage.step_metrics()["alpha"] == 5.0 and "failure_rate" not in stage.step_metrics()
    stage.observe(StepReport("run", 0, 1, (scored_group("p:0", [1, 0, 0, 0]), scored_group("p:1", [1, 1, 1, 1])),
                             None, {}, {}))
    # p:0 1/4, p:1 4/4; F = 1 - mean(1/4, 1) = 0.375 -> F' = 1 / (1 + e^1.25), a = 1 + 5 F'
    assert (stage.pass_rate("p:0"), stage.pass_rate("p:1"), stage.pass_rate("p:2")) == (0.25, 1.0, None)
    assert stage.failure_rate == pytest.approx(0.375)
    assert stage.shape == pytest.approx(beta_shape(0.375, 7.0))
    # groups of other steps and prompts this stage did not size are not learnt from
    stage.before_step(_ctx(1))
    stage.run(_picked("p:0", "p:2"))
    stage.observe(StepReport("run", 1, 2, (scored_group("p:0", [0, 0], step=1), scored_group("p:9", [1], step=1),
                                           scored_group("p:1", [0], step=0)), None, {}, {}))
    assert stage.pass_rate("p:0") == pytest.approx(1 / 6) and stage.pass_rate("p:9") is None
    assert stage.failure_rate == pytest.approx((0.375 + 1.0) / 2)
    # window 2: a third observation pushes out p:0's first
    stage.before_step(_ctx(2))
    stage.run(_picked("p:0"))
    stage.observe(StepReport("run", 2, 3, (scored_group("p:0", [1, 1], step=2),), None, {}, {}))
    assert stage.pass_rate("p:0") == pytest.approx(2 / 4) and stage.failure_rate == pytest.approx(0.5)
    clone = Coba(stage.config)
    clone.load_state_dict(json.loads(json.dumps(stage.state_dict())))
    assert clone.state_dict() == stage.state_dict() and clone.pass_rate("p:0") == stage.pass_rate("p:0")


def test_skipped_prompts_stay_skipped_and_misconfiguration_is_loud():
    stage = Coba(Coba.Config())
    alloc = Allocation(0, (AllocationEntry(Prompt("p:0", text="0"), 1, reason="picked"),
                           AllocationEntry(Prompt("p:1", text="1"), 0, reason="skip")))
    out = stage.run(alloc)
    assert [e.n_rollouts for e in out] == [16, 0] and out.entries[0].reason.startswith("picked; coba: p 0.5")
    with pytest.raises(ValidationError, match="n_min <= mean_rollouts <= n_max"):
        Coba.Config(mean_rollouts=200)
    with pytest.raises(ValidationError):
        Coba.Config(beta_sum=2.0)
    with pytest.raises(ValidationError):
        Coba.Config(leftover="random")


def test_validate_refuses_a_fixed_n_after_coba(tmp_path):
    from gfcr.errors import GfcrError

    text = (REPO / "pipelines" / "coba_arith.yaml").read_text()
    old = "  rollout: {use: generate.sample, from: budget,"
    assert old in text
    spec = tmp_path / "bad.yaml"
    spec.write_text(text.replace(old, "  again:   {use: control.fixed_n, from: budget, with: {n: 8}}\n"
                                      "  rollout: {use: generate.sample, from: again,"))
    with pytest.raises(GfcrError, match=r"stages\.again\.with\.n: `budget` \(control\.coba\) upstream sets each"):
        load_pipeline(spec)


# --- real runs on tiny-arith: 8 prompts, 4 a step, so each comes back every 2 steps ------------

OVERRIDES = ["data.with.n=8", "stages.pick.with.batch_size=4", "run.steps=4", "run.checkpoint_every=2"]


def write_spec(tmp_path: Path) -> Path:
    """The shipped pipeline without its eval, the overrides written in (the killer takes none)."""
    text = (REPO / "pipelines" / "coba_arith.yaml").read_text()
    text = "\n".join(line for line in text.splitlines() if not line.startswith("eval:"))
    for old, new in [("n: 400,", "n: 8,"), ("batch_size: 16", "batch_size: 4"), ("steps: 100", "steps: 4"),
                     ("checkpoint_every: 50", "checkpoint_every: 2")]:
        assert old in text
        text = text.replace(old, new)
    spec = tmp_path / "coba.yaml"
    spec.write_text(text + "\ntracking: {mlflow: null}\n")
    return spec


def _metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _without_time(records: list[dict]) -> list[dict]:
    return [{k: v for k, v in r.items() if k != "time"} for r in records]


@pytest.fixture(scope="module")
def full_run(tmp_path_factory) -> Path:
    from gfcr.runtime.loop.session import Run

    root = tmp_path_factory.mktemp("coba")
    Run.start(load_pipeline(write_spec(root)), root / "full").train()
    return root / "full"


def test_every_step_spends_what_it_allocates(full_run):
    records = _metrics(full_run)
    assert [r["step"] for r in records] == [0, 1, 2, 3]
    for r in records:
        m = r["stages"]["budget"]
        assert m["spent"] == r["rollouts_generated"] and m["budget"] == 8 * 4
        assert m["spent"] <= m["budget"]  # only a prompt at n_max leaves some unspent
    assert "failure_rate" not in records[0]["stages"]["budget"]  # nothing observed yet: the prior curve
    assert records[0]["stages"]["budget"]["alpha"] == 9.0 and 0 <= records[1]["stages"]["budget"]["failure_rate"] <= 1
    assert any(r["stages"]["budget"]["max_n"] > r["stages"]["budget"]["min_n"] for r in records[2:])


def test_resume_from_a_checkpoint_gives_the_metrics_of_an_uninterrupted_run(full_run, tmp_path):
    from gfcr.runtime.loop.session import Run

    part = tmp_path / "part"
    Run.start(load_pipeline(write_spec(tmp_path), ["run.steps=2"]), part).train()
    Run.resume(part, steps=4).train()
    assert _without_time(_metrics(part)) == _without_time(_metrics(full_run))


@pytest.mark.slow
def test_a_sigkilled_run_resumes_to_the_metrics_of_an_uninterrupted_run(full_run, tmp_path):
    from gfcr.runtime.loop.session import Run

    run_dir = tmp_path / "killed"
    sigkill_after_step(write_spec(tmp_path), run_dir, 2, tmp_path)
    assert [r["step"] for r in _metrics(run_dir)] == [0, 1, 2]
    Run.resume(run_dir).train()
    assert _without_time(_metrics(run_dir)) == _without_time(_metrics(full_run))


def test_mlflow_records_the_budget_and_what_was_spent_per_step(tmp_path):
    """The allocator's budget accounting (``stages.budget.*``) and the step's generated and
    scored tokens reach MLflow per step, as in ``metrics.jsonl``."""
    from mlflow import MlflowClient

    from gfcr.runtime.loop.session import Run
    from gfcr.tracking.mlflow_tracker import start_tracking

    spec = write_spec(tmp_path)
    spec.write_text(spec.read_text().replace("tracking: {mlflow: null}", "tracking: {mlflow: {experiment: coba}}"))
    run = Run.start(load_pipeline(spec, ["run.steps=2"]), tmp_path / "run")
    trackers = start_tracking(run)
    run.hooks = trackers
    run.train()
    for tracker in trackers:
        tracker.close()
    run_id = json.loads((tmp_path / "run" / "tracking.json").read_text())["mlflow_run_id"]
    client = MlflowClient(trackers[0].uri)
    records = _metrics(tmp_path / "run")
    for key in ("budget", "spent"):
        got = sorted((m.step, m.value) for m in client.get_metric_history(run_id, f"stages.budget.{key}"))
        assert got == [(r["step"], float(r["stages"]["budget"][key])) for r in records] == [(0, 32.0), (1, 32.0)]
    for key in ("rollouts_generated", "tokens_generated", "tokens_scored"):
        got = sorted((m.step, m.value) for m in client.get_metric_history(run_id, key))
        assert got == [(r["step"], float(r[key])) for r in records], key
