"""replay.store in real runs of the tiny-arith policy: the store's size per step in
``metrics.jsonl`` and MLflow, its files in every checkpoint, resume (after a SIGKILL mid-run)
giving the same store and metrics as an uninterrupted run, and ``gfcr replay inspect``."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from mlflow import MlflowClient
from typer.testing import CliRunner

from gfcr.cli.main import app
from gfcr.graph import load_pipeline
from gfcr.runtime.loop.session import Run
from gfcr.tracking.mlflow_tracker import start_tracking
from tests.conftest import REPO
from tests.killing import sigkill_after_step

cli = CliRunner()
FILES = ("entries.parquet", "prompts.parquet", "responses.faiss", "prompts.faiss")

SPEC = textwrap.dedent("""\
    name: store-small
    policy: {model: tiny-arith}
    data: {source: arithmetic, with: {n: 60, seed: 0, digits: 2, operators: ["+", "-"]}}
    stages:
      pick:    {use: control.uniform, with: {batch_size: 6}}
      budget:  {use: control.fixed_n, from: pick, with: {n: 4}}
      rollout: {use: generate.sample, from: budget, with: {max_new_tokens: 8}}
      reward:  {use: filter.verify, from: rollout}
      store:   {use: replay.store, from: reward, with: {max_entries: 40, evict: priority}}
    update: {use: update.grpo, from: store, with: {lr: 3.0e-4, loss: {use: ppo_clip, with: {clip: [0.2, 0.28]}}}}
    run: {steps: 6, seed: 0, checkpoint_every: 2}
    tracking: {mlflow: null}
    """)


def _metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _without_time(records: list[dict]) -> list[dict]:
    return [{k: v for k, v in r.items() if k != "time"} for r in records]


def _store_files(run_dir: Path, step: int) -> dict[str, object]:
    """The store of a checkpoint: its state, its parquet tables and its index files' bytes."""
    stage = run_dir / "checkpoints" / f"step-{step:06d}" / "stages" / "store"
    found: dict[str, object] = {"state.json": json.loads((stage / "state.json").read_text())}
    for name in FILES:
        path = stage / "files" / name
        found[name] = pq.read_table(path).to_pylist() if name.endswith(".parquet") else path.read_bytes()
    return found


@pytest.fixture(scope="module")
def full_run(tmp_path_factory) -> Path:
    """The uninterrupted 6-step run: the reference of the resume tests."""
    run_dir = tmp_path_factory.mktemp("store") / "full"
    spec = run_dir.parent / "spec.yaml"
    spec.write_text(SPEC)
    Run.start(load_pipeline(spec), run_dir).train()
    return run_dir


def test_the_store_s_size_is_in_every_metrics_line_and_its_files_in_every_checkpoint(full_run):
    records = _metrics(full_run)
    sizes = [r["stages"]["store"] for r in records]
    assert [s["entries"] for s in sizes] == sorted(s["entries"] for s in sizes) and sizes[-1]["entries"] == 40
    for before, now in zip([{"entries": 0}] + sizes, sizes):
        assert now["entries"] == before["entries"] + now["added"] - now["evicted"]
        assert now["added"] + now["exact_duplicates"] + now["near_duplicates"] == 24  # 6 prompts x 4, all finished
    assert sum(s["evicted"] for s in sizes) > 0  # the cap of 40 was reached
    for step in (4, 6):
        files = _store_files(full_run, step)
        assert len(files["entries.parquet"]) == records[step - 1]["stages"]["store"]["entries"]
    entries = _store_files(full_run, 6)["entries.parquet"]
    assert min(r["reward"] for r in entries) >= 0.0 and all(r["response_token_ids"] for r in entries)
    assert {r["added_step"] for r in entries} <= set(range(6))


def test_resume_gives_the_store_and_metrics_of_an_uninterrupted_run(full_run, tmp_path):
    spec = tmp_path / "spec.yaml"
    spec.write_text(SPEC)
    part = tmp_path / "part"
    Run.start(load_pipeline(spec, ["run.steps=3"]), part).train()  # checkpoints at 2 and 3 (the end)
    Run.resume(part, steps=6).train()
    assert _without_time(_metrics(part)) == _without_time(_metrics(full_run))
    assert _store_files(part, 6) == _store_files(full_run, 6)


@pytest.mark.slow
def test_a_sigkilled_run_resumes_to_the_store_and_metrics_of_an_uninterrupted_run(full_run, tmp_path):
    spec = tmp_path / "spec.yaml"
    spec.write_text(SPEC)
    run_dir = tmp_path / "killed"
    sigkill_after_step(spec, run_dir, 4, tmp_path)
    assert [r["step"] for r in _metrics(run_dir)] == [0, 1, 2, 3, 4]
    Run.resume(run_dir).train()
    assert _without_time(_metrics(run_dir)) == _without_time(_metrics(full_run))
    assert _store_files(run_dir, 6) == _store_files(full_run, 6)


def test_mlflow_records_the_store_size_per_step(tmp_path):
    spec = tmp_path / "spec.yaml"
    spec.write_text(SPEC.replace("tracking: {mlflow: null}", "tracking: {mlflow: {experiment: replay-store}}"))
    run = Run.start(load_pipeline(spec, ["run.steps=2"]), tmp_path / "run")
    trackers = start_tracking(run)
    run.hooks = trackers
    run.train()
    run_id = json.loads((tmp_path / "run" / "tracking.json").read_text())["mlflow_run_id"]
    client = MlflowClient(trackers[0].uri)
    expected = [(r["step"], float(r["stages"]["store"]["entries"])) for r in _metrics(tmp_path / "run")]
    got = sorted((m.step, m.value) for m in client.get_metric_history(run_id, "stages.store.entries"))
    assert got == expected and expected[1][1] > 0
    assert [m.step for m in client.get_metric_history(run_id, "stages.store.bytes")] == [0, 1]


def test_replay_inspect_shows_counts_and_the_nearest_neighbours_of_a_query(full_run):
    result = cli.invoke(app, ["replay", "inspect", str(full_run), "--query", "What is 12 + 7? Answer:", "-k", "3"])
    assert result.exit_code == 0, result.output
    last = _metrics(full_run)[-1]["stages"]["store"]
    assert f"{last['entries']} rollouts of {last['prompts']} prompts, {last['bytes']:,} bytes" in result.output
    assert "(step 6, policy version 6)" in result.output
    assert "prompts with the most rollouts" in result.output and "staleness:" in result.output
    assert "nearest prompts to 'What is 12 + 7? Answer:'" in result.output
    assert "nearest responses to" in result.output and result.output.count("arithmetic:train-") >= 6


def test_replay_inspect_of_a_run_without_a_store_exits_2(tmp_path):
    spec = tmp_path / "spec.yaml"
    spec.write_text(SPEC.replace("from: store", "from: reward").replace(
        "  store:   {use: replay.store, from: reward, with: {max_entries: 40, evict: priority}}\n", ""))
    Run.start(load_pipeline(spec, ["run.steps=1"]), tmp_path / "run").train()
    result = cli.invoke(app, ["replay", "inspect", str(tmp_path / "run")])
    assert result.exit_code == 2 and "has no replay.store stage" in result.output and "fix:" in result.output
