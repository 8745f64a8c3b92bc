"""control.coba: the capability-shifted value curve and the heap-greedy allocation on hand
cases, what ``observe`` learns, and real tiny-arith runs: the budget is spent exactly on every
step of ``metrics.jsonl``, and resume (from a checkpoint, and after a SIGKILL) gives the
metrics of an uninterrupted run."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from pydantic import ValidationError

from gfcr.graph import load_pipeline
from gfcr.records import Allocation, AllocationEntry, Prompt, StepContext, StepReport
from gfcr.stages.control.coba import Coba, greedy_allocation, marginal_gain, value_curve
from gfcr.stages.testing import scored_group
from tests.conftest import REPO
from tests.killing import sigkill_after_step


def test_value_curve_on_hand_values():
    # F = 0.5, kappa = 6: a = b = 3, B(3, 3) = 2! 2! / 5! = 1/30, so V(p) = 30 p^2 (1 - p)^2
    assert value_curve(0.5, 0.5, 6.0) == pytest.approx(30 / 16)  # 1.875
    assert value_curve(0.25, 0.5, 6.0) == pytest.approx(30 * (1 / 16) * (9 / 16))  # 1.0546875
    # F = 0.1: a = 1.4, b = 4.6, B(1.4, 4.6) = 0.88726 * 13.3813 / 120 = 0.098945
    # V(0.5) = 0.5^4 / B = 0.63167; V(0.25) = 0.25^0.4 0.75^3.6 / B = 0.57435 * 0.35517 / B = 2.0617
    assert value_curve(0.5, 0.1, 6.0) == pytest.approx(0.63167, abs=1e-4)
    assert value_curve(0.25, 0.1, 6.0) == pytest.approx(2.0608, abs=2e-3)


@pytest.mark.parametrize("failure_rate", [0.1, 0.3, 0.5, 0.8, 0.95])
def test_the_curve_peaks_at_the_failure_rate(failure_rate):
    grid = np.linspace(0.001, 0.999, 999)
    peak = grid[np.argmax([value_curve(p, failure_rate, 6.0) for p in grid])]
    assert peak == pytest.approx(failure_rate, abs=2e-3)


def test_a_weak_model_values_easy_prompts_a_strong_one_hard_ones():
    easy, hard = 0.75, 0.25
    # F = 0.9: a = 4.6, b = 1.4; V(0.75) / V(0.25) = 3^3.6 / 3^0.4 = 3^3.2 = 33.6
    assert value_curve(easy, 0.9, 6.0) / value_curve(hard, 0.9, 6.0) == pytest.approx(3 ** 3.2)
    assert value_curve(hard, 0.1, 6.0) / value_curve(easy, 0.1, 6.0) == pytest.approx(3 ** 3.2)


def test_marginal_gain_is_the_increase_of_the_informative_group_value():
    # U(n) = V (1 - p^n - (1 - p)^n); p = 0.25, V = 1: U(3) - U(2) = (1 - 1/64 - 27/64) - (1 - 1/16 - 9/16)
    u = lambda n: 1 - 0.25 ** n - 0.75 ** n  # noqa: E731
    assert marginal_gain(0.25, 2, 1.0) == pytest.approx(u(3) - u(2)) == pytest.approx(0.1875)
    assert marginal_gain(0.25, 3, 1.0) == pytest.approx(u(4) - u(3)) == pytest.approx(0.1875 * 0.625)
    assert marginal_gain(0.0, 2, 5.0) == marginal_gain(1.0, 2, 5.0) == 0.0
    gains = [marginal_gain(0.3, n, 1.0) for n in range(1, 12)]
    assert all(a >= b for a, b in zip(gains, gains[1:]))  # diminishing: the greedy is optimal


def test_greedy_allocation_on_a_hand_case():
    # F = 0.5: V(0.5) = 1.875, V(0.25) = 1.0546875; both start at n_min = 2.
    # gains: A (p 0.5): n=2 1.875 * 0.25 * 1 = 0.46875, n=3 0.234375, n=4 0.1171875
    #        B (p 0.25): n=2 1.0546875 * 0.1875 * 1 = 0.19775, n=3 0.19775 * 0.625 = 0.12360
    # extra 2: A, A -> [4, 2]; extra 3: then B (0.198 > 0.117) -> [4, 3]; extra 4: B (0.124 > 0.117) -> [4, 4]
    assert greedy_allocation([0.5, 0.25], 0.5, budget=6, n_min=2, n_max=16, kappa=6.0) == [4, 2]
    assert greedy_allocation([0.5, 0.25], 0.5, budget=7, n_min=2, n_max=16, kappa=6.0) == [4, 3]
    assert greedy_allocation([0.5, 0.25], 0.5, budget=8, n_min=2, n_max=16, kappa=6.0) == [4, 4]
    # the capability shift: F = 0.1 first gains A 0.63167 * 0.25 = 0.158 < B 2.0608 * 0.1875 = 0.386 -> B
    assert greedy_allocation([0.5, 0.25], 0.1, budget=5, n_min=2, n_max=16, kappa=6.0) == [2, 3]
    # n_max caps A at 3, so the rest goes to B even at a lower gain
    assert greedy_allocation([0.5, 0.25], 0.5, budget=8, n_min=2, n_max=3, kappa=6.0) == [3, 3]
    # ties go to the earlier prompt
    assert greedy_allocation([0.5, 0.5], 0.5, budget=5, n_min=2, n_max=16, kappa=6.0) == [3, 2]


def test_the_greedy_spends_exactly_the_budget_on_random_cases():
    rng = np.random.default_rng(0)
    for _ in range(200):
        k = int(rng.integers(1, 20))
        n_min, n_max = int(rng.integers(1, 4)), int(rng.integers(4, 20))
        mean = int(rng.integers(n_min, n_max + 1))
        rates = rng.choice([0.0, 1.0, *rng.random(5)], size=k).tolist()  # 0 and 1 have zero gain
        counts = greedy_allocation(rates, float(rng.random()), mean * k, n_min, n_max, 6.0)
        assert sum(counts) == mean * k and min(counts) >= n_min and max(counts) <= n_max


def _picked(*prompts: str) -> Allocation:
    return Allocation(0, tuple(AllocationEntry(Prompt(p, text=p), 1) for p in prompts))


def _ctx(step: int) -> StepContext:
    return StepContext("run", step, 0, step)


def test_the_stage_learns_pass_rates_and_the_failure_rate_and_sizes_groups_from_them():
    stage = Coba(Coba.Config(mean_rollouts=3, n_min=2, n_max=16))
    stage.before_step(_ctx(0))
    first = stage.run(_picked("p:0", "p:1"))
    # nothing seen: p = 0.5 for both, F = 0.5; equal gains: the tie to p:0, whose next gain halves,
    # then p:1 -> one each; the third rollout of each gained 1.875 * 0.25 * (0.5 + 0.5) = 0.46875
    assert [e.n_rollouts for e in first] == [3, 3]
    assert first.entries[0].why.code == "capability_value" and first.entries[0].why.value == pytest.approx(1.875)
    assert first.entries[1].why.quantities["last_gain"] == pytest.approx(0.46875)
    stage.observe(StepReport("run", 0, 1, (scored_group("p:0", [1, 0, 0, 0]), scored_group("p:1", [1, 1, 1, 1])),
                             None, {}, {}))
    # decay 0, prior Beta(1, 1): p:0 (1 + 1) / (4 + 2) = 1/3, p:1 (4 + 1) / (4 + 2) = 5/6;
    # F = 3 failures / 8 rollouts = 0.375 (the first observation, taken as is)
    assert (stage.pass_rate("p:0"), stage.pass_rate("p:1")) == (pytest.approx(1 / 3), pytest.approx(5 / 6))
    assert stage.failure_rate == pytest.approx(0.375)
    stage.before_step(_ctx(1))
    second = stage.run(_picked("p:0", "p:1", "p:2"))
    expected = greedy_allocation([1 / 3, 5 / 6, 0.5], 0.375, 9, 2, 16, 6.0)
    assert [e.n_rollouts for e in second] == expected and sum(expected) == 9
    assert stage.step_metrics() == {"prompts": 3, "budget": 9, "spent": 9, "failure_rate": 0.375, "mode": 0.375,
                                    "min_n": min(expected), "max_n": max(expected),
                                    "mean_p": pytest.approx((1 / 3 + 5 / 6 + 0.5) / 3)}
    # groups of other steps and prompts this stage did not size are not learnt from
    stage.observe(StepReport("run", 1, 2, (scored_group("p:0", [0, 0], step=1), scored_group("p:9", [1], step=1),
                                           scored_group("p:1", [1], step=0)), None, {}, {}))
    # F = 0.9 * 0.375 + 0.1 * (2 / 2) = 0.4375
    assert stage.failure_rate == pytest.approx(0.4375)
    assert "p:9" not in stage.stats and stage.pass_rate("p:1") == pytest.approx(5 / 6)
    clone = Coba(stage.config)
    clone.load_state_dict(json.loads(json.dumps(stage.state_dict())))
    assert clone.state_dict() == stage.state_dict()


def test_skipped_prompts_stay_skipped_and_misconfiguration_is_loud():
    stage = Coba(Coba.Config())
    alloc = Allocation(0, (AllocationEntry(Prompt("p:0", text="0"), 1, reason="picked"),
                           AllocationEntry(Prompt("p:1", text="1"), 0, reason="skip")))
    out = stage.run(alloc)
    assert [e.n_rollouts for e in out] == [8, 0] and out.entries[0].reason.startswith("picked; coba: p 0.5")
    with pytest.raises(ValidationError, match="n_min <= mean_rollouts <= n_max"):
        Coba.Config(mean_rollouts=20)
    with pytest.raises(ValidationError):
        Coba.Config(kappa=2.0)


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
    from gfcr.runtime.session import Run

    root = tmp_path_factory.mktemp("coba")
    Run.start(load_pipeline(write_spec(root)), root / "full").train()
    return root / "full"


def test_every_step_spends_exactly_the_budget(full_run):
    records = _metrics(full_run)
    assert [r["step"] for r in records] == [0, 1, 2, 3]
    for r in records:
        m = r["stages"]["budget"]
        assert m["spent"] == m["budget"] == 8 * 4 == r["rollouts_generated"]
    assert records[0]["stages"]["budget"]["failure_rate"] == 0.5  # nothing observed yet
    assert records[1]["stages"]["budget"]["failure_rate"] != 0.5
    assert any(r["stages"]["budget"]["max_n"] > r["stages"]["budget"]["min_n"] for r in records[2:])


def test_resume_from_a_checkpoint_gives_the_metrics_of_an_uninterrupted_run(full_run, tmp_path):
    from gfcr.runtime.session import Run

    part = tmp_path / "part"
    Run.start(load_pipeline(write_spec(tmp_path), ["run.steps=2"]), part).train()
    Run.resume(part, steps=4).train()
    assert _without_time(_metrics(part)) == _without_time(_metrics(full_run))


@pytest.mark.slow
def test_a_sigkilled_run_resumes_to_the_metrics_of_an_uninterrupted_run(full_run, tmp_path):
    from gfcr.runtime.session import Run

    run_dir = tmp_path / "killed"
    sigkill_after_step(write_spec(tmp_path), run_dir, 2, tmp_path)
    assert [r["step"] for r in _metrics(run_dir)] == [0, 1, 2]
    Run.resume(run_dir).train()
    assert _without_time(_metrics(run_dir)) == _without_time(_metrics(full_run))


def test_mlflow_records_the_budget_and_what_was_spent_per_step(tmp_path):
    """The allocator's budget accounting (``stages.budget.*``) and the step's generated and
    scored tokens reach MLflow per step, as in ``metrics.jsonl``."""
    from mlflow import MlflowClient

    from gfcr.runtime.session import Run
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
