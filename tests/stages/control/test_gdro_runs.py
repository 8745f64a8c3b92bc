"""Rollout-GDRO and Prompt-GDRO in real runs of the tiny-arith policy (``pipelines/gdro_arith.yaml``
on 12 prompts, so each comes back every 3 steps): the budget spent equals ``n_bar * |batch|``
on every step of ``metrics.jsonl``, and resume (from a checkpoint, and after a SIGKILL
mid-run) gives the metrics of an uninterrupted run."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gfcr.graph import load_pipeline
from gfcr.runtime.loop.session import Run
from tests.conftest import REPO
from tests.killing import sigkill_after_step

OVERRIDES = ["data.with.n=12", "stages.pick.with.batch_size=4", "run.steps=6", "run.checkpoint_every=2"]


def write_spec(tmp_path: Path) -> Path:
    """The shipped pipeline without its eval (a test needs no held-out accuracy)."""
    lines = (REPO / "pipelines" / "gdro_arith.yaml").read_text().splitlines()
    spec = tmp_path / "gdro.yaml"
    spec.write_text("\n".join(line for line in lines if not line.startswith("eval:")) + "\ntracking: {mlflow: null}\n")
    return spec


def _metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _without_time(records: list[dict]) -> list[dict]:
    return [{k: v for k, v in r.items() if k != "time"} for r in records]


@pytest.fixture(scope="module")
def full_run(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("gdro")
    run_dir = root / "full"
    Run.start(load_pipeline(write_spec(root), OVERRIDES), run_dir).train()
    return run_dir


def test_every_step_spends_exactly_n_bar_per_prompt(full_run):
    records = _metrics(full_run)
    assert [r["step"] for r in records] == list(range(6))
    for r in records:
        budget = r["stages"]["budget"]
        assert budget["spent"] == budget["budget"] == 4 * 4 == r["rollouts_generated"]
        assert sum(budget[f"prompts_bin{b}"] * budget[f"n_bin{b}"] for b in range(3)) == 16
        weights = r["stages"]["weights"]  # prompts at pass@k 0 or 1 are excluded from the bins
        assert sum(weights[f"groups_bin{b}"] for b in range(3)) + weights["groups_excluded"] == 4
    # from step 3 on every prompt has been seen once, so the bins and group sizes can move
    seen = [r["stages"]["budget"] for r in records[3:]]
    assert any(s["prompts_bin0"] < 4 for s in seen), "every prompt stayed in bin 0: the classifier learnt nothing"


def test_resume_from_a_checkpoint_gives_the_metrics_of_an_uninterrupted_run(full_run, tmp_path):
    part = tmp_path / "part"
    Run.start(load_pipeline(write_spec(tmp_path), [*OVERRIDES, "run.steps=3"]), part).train()
    Run.resume(part, steps=6).train()
    assert _without_time(_metrics(part)) == _without_time(_metrics(full_run))


@pytest.mark.slow
def test_a_sigkilled_run_resumes_to_the_metrics_of_an_uninterrupted_run(full_run, tmp_path):
    spec = write_spec(tmp_path)
    text = spec.read_text()
    for override in OVERRIDES:  # the killer script takes no overrides: write them into the spec
        key, value = override.split("=")
        text = {"data.with.n": text.replace("n: 400,", f"n: {value},"),
                "stages.pick.with.batch_size": text.replace("batch_size: 16", f"batch_size: {value}"),
                "run.steps": text.replace("steps: 100", f"steps: {value}"),
                "run.checkpoint_every": text.replace("checkpoint_every: 50", f"checkpoint_every: {value}")}[key]
    spec.write_text(text)
    run_dir = tmp_path / "killed"
    sigkill_after_step(spec, run_dir, 4, tmp_path)
    assert [r["step"] for r in _metrics(run_dir)] == [0, 1, 2, 3, 4]
    Run.resume(run_dir).train()
    assert _without_time(_metrics(run_dir)) == _without_time(_metrics(full_run))
