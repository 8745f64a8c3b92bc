"""control.gps and control.depo in real runs of the tiny-arith policy: their per-step decisions
in ``metrics.jsonl``, the embedding pass charged to step 0's scored tokens, and resume (from a
checkpoint, and after a SIGKILL mid-run) giving the metrics of an uninterrupted run."""

from __future__ import annotations

from pathlib import Path

import pytest

from gfcr.graph import load_pipeline
from gfcr.runtime.loop.session import Run
from tests.killing import sigkill_after_step
from tests.stages.control.test_selector_runs import BASE, FIXED, _metrics, _without_time

SELECTORS = {
    "gps": "{use: control.gps, with: {batch_size: 4, fit_steps: 10}}",
    "depo": "{use: control.depo, with: {batch_size: 4, group_size: 4, threshold: 0.3, explore: 0.2, fit_steps: 10}}",
}
DECISIONS = {"gps": ("candidates", "chosen", "predicted_success", "model_prediction", "utility", "similarity",
                     "pool_predicted_mean", "train_pairs"),
             "depo": ("candidates", "kept", "skipped_easy", "skipped_hard", "explored", "predicted_success",
                      "predicted_zero_variance", "candidate_zero_variance", "train_pairs")}


def write_spec(tmp_path: Path, name: str) -> Path:
    spec = tmp_path / f"{name}.yaml"
    spec.write_text(BASE.format(name=f"{name}-small", pick=SELECTORS[name], budget=FIXED, rollout_from="budget",
                                entropy=""))
    return spec


@pytest.fixture(scope="module")
def full_runs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("gps-depo")
    runs = {}
    for name in SELECTORS:
        runs[name] = root / f"{name}-full"
        Run.start(load_pipeline(write_spec(root, name)), runs[name]).train()
    return runs


@pytest.mark.parametrize("name", list(SELECTORS))
def test_every_step_reports_what_the_selector_decided_on_and_pays_for_its_embeddings(full_runs, name):
    records = _metrics(full_runs[name])
    assert [r["step"] for r in records] == list(range(6))
    for r in records:
        decided = r["stages"]["pick"]
        assert all(isinstance(decided[key], (int, float)) for key in DECISIONS[name])
        # the embedding pass (all 40 prompts, once, at step 0) is the only scoring
        assert r["tokens_scored"] == decided["embedding_tokens"]
        assert decided["embedded_prompts"] == (40 if r["step"] == 0 else 0)
        assert decided["train_pairs"] == 4 * r["step"] if name == "gps" else decided["train_pairs"] >= 0
    assert records[0]["tokens_scored"] > 0
    assert all("train_loss" in r["stages"]["pick"] for r in records[1:])


@pytest.mark.parametrize("name", list(SELECTORS))
def test_resume_from_a_checkpoint_gives_the_metrics_of_an_uninterrupted_run(full_runs, tmp_path, name):
    part = tmp_path / "part"
    Run.start(load_pipeline(write_spec(tmp_path, name), ["run.steps=3"]), part).train()
    Run.resume(part, steps=6).train()
    assert _without_time(_metrics(part)) == _without_time(_metrics(full_runs[name]))


@pytest.mark.slow
@pytest.mark.parametrize("name", list(SELECTORS))
def test_a_sigkilled_run_resumes_to_the_metrics_of_an_uninterrupted_run(full_runs, tmp_path, name):
    run_dir = tmp_path / "killed"
    sigkill_after_step(write_spec(tmp_path, name), run_dir, 4, tmp_path)
    assert [r["step"] for r in _metrics(run_dir)] == [0, 1, 2, 3, 4]
    Run.resume(run_dir).train()
    assert _without_time(_metrics(run_dir)) == _without_time(_metrics(full_runs[name]))
