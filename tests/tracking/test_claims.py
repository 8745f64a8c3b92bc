"""The claims table (issue 42): the shipped claims file, each row's figure and test against its own
baseline, Holm's correction across rows, the verdicts, and (slow) a row run twice with the same
seeds giving the same numbers (Must show 4, on a 2-seed miniature)."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from gfcr.errors import GfcrError
from gfcr.tracking.claims import Claim, holm, load_claims, measure, render, run_claim, run_claims, verdict
from gfcr.tracking.compare_figures import compare
from gfcr.tracking.report_series import RunSeries, StepCounts
from tests.conftest import REPO

CLAIMS = REPO / "benchmarks" / "claims.yaml"


def test_holm_matches_the_step_down_rule_worked_by_hand():
    # sorted 0.005, 0.01, 0.03, 0.04 times 4, 3, 2, 1 = 0.02, 0.03, 0.06, 0.04 -> non-decreasing 0.02, 0.03, 0.06, 0.06
    assert holm([0.01, 0.04, 0.03, 0.005]) == pytest.approx([0.03, 0.06, 0.06, 0.02])
    assert holm([0.5, 0.9]) == [1.0, 1.0] and holm([0.2]) == [0.2] and holm([]) == []


def test_the_shipped_claims_cover_twelve_methods_each_with_its_own_baseline_and_every_row_compiles(tmp_path):
    from gfcr.tracking.compare import plan_comparison

    claims = load_claims(CLAIMS, REPO)
    assert len({c.method for c in claims}) >= 12
    assert {c.baseline_pipeline for c in claims} >= {"pipelines/quickstart.yaml", "pipelines/dapo_arith.yaml"}
    assert {c.task for c in claims} == {"arith-mix", "rg-arith"}
    assert all(any(ch.isdigit() for ch in c.claim) or "no single number" in c.claim for c in claims)
    for c in claims:  # each row's two pipelines compile on its task, under its budget
        plan_comparison([REPO / c.baseline_pipeline, REPO / c.method_pipeline], task=c.task, seeds=[0],
                        overrides=c.overrides, runs_dir=tmp_path)


def test_a_bad_claims_file_names_the_row(tmp_path):
    bad = tmp_path / "claims.yaml"
    bad.write_text(CLAIMS.read_text().replace("pipelines/greso_arith.yaml", "pipelines/gresso_arith.yaml", 1))
    with pytest.raises(GfcrError, match="greso: pipelines/gresso_arith.yaml"):
        load_claims(bad, REPO)
    bad.write_text(CLAIMS.read_text().replace("metric: tokens_to_target", "metric: tokens", 1))
    with pytest.raises(GfcrError, match=r"claims\.0\.metric"):
        load_claims(bad, REPO)


def _run(variant: str, seed: int, accuracies: tuple[float, float, float], seconds: float = 1.0) -> RunSeries:
    """Four steps of 40 tokens (16 rollouts), evaluations before steps 0 and 2 and after step 3."""
    steps = tuple(StepCounts(i, 16, 40, 12, 32, 4, 1, seconds, seconds, 32, 0) for i in range(4))
    return RunSeries(name=f"{variant}-{seed}", params={"name": variant}, steps=steps,
                     evals=tuple(zip((0, 2, 4), accuracies)), seed=seed, variant=variant, source=f"{variant}{seed}")


def claim(metric: str) -> Claim:
    return Claim(id="x", method="M", paper="p", claim="2x", paper_baseline="B", paper_scale="s", metric=metric,
                 metric_note="n", method_pipeline="m.yaml", baseline_pipeline="b.yaml")


def test_each_metric_is_measured_against_the_rows_own_baseline():
    finals = [0.50, 0.55, 0.60, 0.52]
    base = [_run("base", s, (0.3, 0.45, f), seconds=2.0) for s, f in enumerate(finals)]
    above = (0.06, 0.05, 0.07, 0.06)
    fast = [_run("fast", s, (0.3, 0.52 + 0.01 * s, f + d)) for s, (f, d) in enumerate(zip(finals, above))]
    comparison = compare(base + fast, baseline="base")  # target: the baseline's lowest final, 0.50
    tokens = measure(comparison, "fast", "tokens_to_target")  # 160 tokens (after step 3) against 80 (step 2)
    assert tokens.value.mean == pytest.approx(2.0) and tokens.test.test == "paired t" and tokens.test.p == 0.0
    assert measure(comparison, "fast", "rollouts_to_target").value.mean == pytest.approx(2.0)  # 64 against 32
    wall = measure(comparison, "fast", "wall_to_target")  # steps 1-3 at 2 s against step 1 at 1 s
    assert wall.value.mean == pytest.approx(6.0)
    assert measure(comparison, "fast", "wall_per_step").value.mean == pytest.approx(2.0)
    accuracy = measure(comparison, "fast", "final_accuracy")
    assert accuracy.value.mean == pytest.approx(0.06) and accuracy.test.p < 0.001
    assert [verdict(m, m.test.p) for m in (tokens, accuracy)] == ["reproduced", "reproduced"]
    backwards = measure(compare(fast + base, baseline="fast"), "base", "tokens_to_target")  # target 0.56
    assert backwards.value is None and (backwards.test.better, backwards.test.worse) == (0, 3)  # sign test
    assert verdict(backwards, 0.0) == "contradicted"
    assert verdict(tokens, 0.2) == "inconclusive"  # after correction


def test_a_seed_that_never_reaches_the_target_leaves_the_ratio_to_the_sign_test():
    base = [_run("base", s, (0.3, 0.45, 0.5)) for s in range(3)]
    slow = [_run("slow", s, (0.3, 0.45, 0.4)) for s in range(3)]
    m = measure(compare(base + slow, baseline="base"), "slow", "tokens_to_target")
    assert m.value is None and m.test.test == "sign" and (m.test.better, m.test.worse) == (0, 3)


def test_a_target_met_before_any_rollout_is_said_so_not_called_unreached():
    # the baseline ends no better than it starts, so every run is at the target at its first evaluation
    base = [_run("base", s, (0.5, 0.45, 0.45)) for s in range(3)]
    flat = [_run("flat", s, (0.5, 0.46, 0.44)) for s in range(3)]
    m = measure(compare(base + flat, baseline="base"), "flat", "tokens_to_target")
    assert m.value is None and m.test.test == "paired t"
    rows = [claim("tokens_to_target")]
    assert "n/a (target met at the first evaluation, before any rollout)" in render(rows, {"x": m}, "0,1,2")


def test_the_table_corrects_across_rows_with_holm():
    finals = [0.50, 0.55, 0.60, 0.52]
    base = [_run("base", s, (0.3, 0.45, f)) for s, f in enumerate(finals)]
    fast = [_run("fast", s, (0.3, 0.52 + 0.01 * s, f + d)) for s, (f, d) in enumerate(zip(finals, (.06, .05, .07, .05)))]
    comparison = compare(base + fast, baseline="base")
    rows = [claim("final_accuracy").model_copy(update={"id": i}) for i in ("a", "b")]
    m = measure(comparison, "fast", "final_accuracy")
    table = render(rows, {"a": m, "b": m}, "0,1,2,3")
    assert f"| {m.test.p:.3g} ({2 * m.test.p:.3g}) | reproduced |" in table  # two rows: Holm doubles the smaller p
    assert "+0.058 [" in table and "| 4 |" in table
    alone = render(rows, {"a": m}, "0,1,2,3")
    assert f"| {m.test.p:.3g} ({m.test.p:.3g}) |" in alone and "| not run | 0 | n/a | not run |" in alone


MINI_TASK = textwrap.dedent("""\
    name: rg-mini
    description: a small reasoning-gym task for tests
    policy: {model: tiny-arith-mix, engine: hf}
    data:
      source: reasoning_gym
      with:
        n: 64
        seed: 0
        template: "What is {expression}? Answer:"
        tasks: [{task: products, levels: [{name: 1d, config: {min_terms: 2, max_terms: 2, min_digits: 1, max_digits: 1}}]}]
    eval:
      source: reasoning_gym
      with:
        n: 16
        seed: 1
        template: "What is {expression}? Answer:"
        tasks: [{task: products, levels: [{name: 1d, config: {min_terms: 2, max_terms: 2, min_digits: 1, max_digits: 1}}]}]
      every: 1
      max_new_tokens: 8
    """)


@pytest.mark.slow  # four two-step runs, twice; then two rows grouped, and the second alone
def test_a_row_run_twice_with_the_same_seeds_gives_the_same_numbers(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "task.yaml").write_text(MINI_TASK)
    row = Claim(id="vade-mini", method="VADE", paper="p", claim="over 30% compute reduction", paper_baseline="uniform",
                paper_scale="s", metric="final_accuracy", metric_note="n", method_pipeline="pipelines/vade_arith.yaml",
                baseline_pipeline="pipelines/quickstart.yaml", task=str(tmp_path / "task.yaml"), budget="steps=2",
                overrides=["stages.pick.with.batch_size=4", "stages.budget.with.n=4", "run.checkpoint_every=2"])
    first = run_claim(row, [0, 1], tmp_path / "first", REPO, executor="local")
    second = run_claim(row, [0, 1], tmp_path / "second", REPO, executor="local")
    assert first.seeds == 2 and first.test is not None
    assert first == second
    # two rows on one baseline run as one comparison (the baseline's cells once): each row's figures
    # are its own two-pipeline comparison's
    other = row.model_copy(update={"id": "mopps-mini", "method_pipeline": "pipelines/mopps_arith.yaml"})
    grouped = run_claims([row, other], [0, 1], tmp_path / "grouped", REPO, executor="local")
    assert grouped["vade-mini"] == first
    assert grouped["mopps-mini"] == run_claim(other, [0, 1], tmp_path / "alone", REPO, executor="local")


def test_the_claims_page_is_current():
    import importlib.util

    spec = importlib.util.spec_from_file_location("claims_script", REPO / "benchmarks" / "claims.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    store = script.MEASURED
    expected = script.page(load_claims(CLAIMS, REPO), script.read_measured(store), "0,1,2,3,4,5,6,7,8,9", store)
    assert (REPO / "docs" / "claims.md").read_text() == expected, (
        "docs/claims.md is stale: run `python benchmarks/claims.py --render-only`")
