"""Real runs on the tiny-arith policy: run directories, metrics, evaluation, resume equals
uninterrupted (with GRESO in the pipeline), a SIGKILL during a checkpoint write, and DAPO's
dynamic sampling loop."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pyarrow.parquet as pq

from gfcr.graph import load_pipeline
from gfcr.runtime.loop.session import Run

GRESO = textwrap.dedent("""\
    name: greso-small
    policy: {model: tiny-arith}
    data: {source: arithmetic, with: {n: 24, seed: 0}}
    eval: {source: arithmetic, with: {n: 16, seed: 1, split: eval}, every: 2, max_new_tokens: 8}
    stages:
      pick:    {use: control.greso, with: {batch_size: 6}}
      budget:  {use: control.fixed_n, from: pick, with: {n: 4}}
      rollout: {use: generate.sample, from: budget, with: {max_new_tokens: 8}}
      reward:  {use: filter.verify, from: rollout}
      keep:    {use: filter.nonzero_variance, from: reward}
    update: {use: update.grpo, from: keep, with: {lr: 1.0e-4, loss: {use: ppo_clip, with: {clip: [0.2, 0.28]}}}}
    run: {steps: 6, seed: 3, checkpoint_every: 3}
    tracking: {mlflow: null}
    """)

DAPO = textwrap.dedent("""\
    name: dapo-small
    policy: {model: tiny-arith}
    data: {source: arithmetic, with: {n: 200, seed: 0}}
    stages:
      pick:    {use: control.uniform, with: {batch_size: 6}}
      budget:  {use: control.fixed_n, from: pick, with: {n: 4}}
      rollout: {use: generate.sample, from: budget, with: {max_new_tokens: 8}}
      reward:  {use: filter.verify, from: rollout}
      keep:    {use: filter.nonzero_variance, from: reward}
      enough:  {use: filter.dynamic_sampling, from: keep, with: {target_groups: 6}}
    loops:
      collect: {stages: [pick, budget, rollout, reward, keep, enough], until: enough, max_rounds: 3}
    update: {use: update.grpo, from: collect, with: {lr: 1.0e-4, loss: {use: ppo_clip, with: {clip: [0.2, 0.28]}}}}
    run: {steps: 3, seed: 0}
    tracking: {mlflow: null}
    """)

REQUIRED = {"step", "policy_version", "prompts", "rollouts_generated", "tokens_generated", "groups_kept",
            "rollouts_in_update", "tokens_in_update", "reward_mean", "zero_variance_groups", "time"}


def _metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _without_time(records: list[dict]) -> list[dict]:
    return [{k: v for k, v in r.items() if k != "time"} for r in records]


def _start(write_spec, text: str, run_dir: Path, overrides: list[str] = ()) -> Run:
    return Run.start(load_pipeline(write_spec(text), list(overrides)), run_dir)


def test_a_run_writes_its_directory(write_spec, tmp_path):
    summary = _start(write_spec, GRESO, tmp_path / "run", ["run.steps=2"]).train()
    run_dir = tmp_path / "run"
    records = _metrics(run_dir)
    assert [r["step"] for r in records] == [0, 1] and all(REQUIRED <= r.keys() for r in records)
    assert "eval_accuracy" in records[0] and "eval_accuracy" not in records[1]  # every 2, step 0 included
    assert summary["eval_accuracy_before"] == records[0]["eval_accuracy"]
    assert summary["eval_accuracy_after"] is not None
    assert load_pipeline(run_dir / "spec.yaml").spec.run.steps == 2  # the resolved spec, overrides applied
    table = pq.read_table(run_dir / "lineage" / "step-000000.parquet").to_pylist()
    assert len(table) == records[0]["rollouts_generated"]
    assert {row["created_by"] for row in table} == {"rollout"}
    dropped = [row for row in table if row["dropped_by"] is not None]
    assert len({row["group_id"] for row in dropped}) == records[0]["groups"] - records[0]["groups_kept"]
    assert all(row["dropped_by"] == "keep" and "zero variance" in row["drop_reason"] for row in dropped)
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["step-000002"]


def test_resume_equals_uninterrupted_with_greso(write_spec, tmp_path):
    full = tmp_path / "full"
    _start(write_spec, GRESO, full).train()
    part = tmp_path / "part"
    _start(write_spec, GRESO, part, ["run.steps=3"]).train()
    Run.resume(part, steps=6).train()
    a, b = _metrics(full), _metrics(part)
    assert [r["step"] for r in b] == list(range(6))
    assert _without_time(a) == _without_time(b)
    skipped = sum(r["control"]["pick"]["skipped_easy"] + r["control"]["pick"]["skipped_hard"] for r in a)
    assert skipped > 0, "GRESO skipped prompts in this run, so its state mattered"


_KILLER = textwrap.dedent("""\
    import sys, time
    import gfcr.runtime.store.checkpoint as ckpt
    from gfcr.graph import load_pipeline
    from gfcr.runtime.loop.session import Run

    real_write_tree = ckpt.write_tree
    def slow_write_tree(tree, directory, where="state"):
        written = real_write_tree(tree, directory, where)
        if "step-000004" in str(directory):  # the policy and the first stage are written, the rest is not
            open(sys.argv[3], "w").close()  # tell the test we are inside the write
            time.sleep(60)
        return written
    ckpt.write_tree = slow_write_tree
    Run.start(load_pipeline(sys.argv[1], ["run.checkpoint_every=2"]), sys.argv[2]).train()
    """)


def test_a_sigkill_during_a_checkpoint_write_leaves_a_run_that_resumes(write_spec, tmp_path):
    spec = write_spec(GRESO)
    run_dir, marker = tmp_path / "killed", tmp_path / "inside-write"
    script = tmp_path / "killer.py"
    script.write_text(_KILLER)
    proc = subprocess.Popen([sys.executable, str(script), str(spec), str(run_dir), str(marker)],
                            env={**os.environ, "HF_HUB_OFFLINE": "1"}, start_new_session=True)
    deadline = time.monotonic() + 300  # a shared CI machine can be slow
    while not marker.exists():
        assert proc.poll() is None, "the run ended before reaching the checkpoint write"
        assert time.monotonic() < deadline
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGKILL)  # the run and its children (the embedded Prefect server): none outlives the test
    proc.wait()
    names = sorted(p.name for p in (run_dir / "checkpoints").iterdir())
    assert "step-000002" in names and "step-000004" not in names  # only a hidden temporary directory
    assert any(n.startswith(".step-000004.") and n.endswith(".tmp") for n in names), names
    Run.resume(run_dir).train()
    assert [r["step"] for r in _metrics(run_dir)] == list(range(6))
    left = sorted(p.name for p in (run_dir / "checkpoints").iterdir())
    assert left == ["step-000004", "step-000006"], left  # keep 2; the torn temporary is cleaned up


def test_dapo_regenerates_zero_variance_groups_and_trains_on_informative_ones(write_spec, tmp_path):
    _start(write_spec, DAPO, tmp_path / "dapo").train()
    records = _metrics(tmp_path / "dapo")
    assert all(1 <= r["loop_rounds"]["collect"] <= 3 for r in records)
    assert any(r["loop_rounds"]["collect"] > 1 for r in records), "some step needed a top-up round"
    for r in records:
        assert r["update"]["batch_zero_variance_groups"] == 0
        assert r["groups_kept"] <= 6 and r["update"]["batch_groups"] == r["groups_kept"]
        assert r["zero_variance_groups"] + r["groups_kept"] <= r["groups"]



def test_a_token_budget_stops_after_the_step_that_reaches_it_and_survives_a_resume(write_spec, tmp_path):
    """``run.max_tokens`` (on the labelled fake engine: this is runtime logic): the run stops
    after the first step at which its cumulative generated tokens reach the budget
    (``run.steps`` is only a cap); a resumed run counts the tokens of the steps before the
    resume too, so it stops at the same step as an uninterrupted one."""
    from tests.conftest import BASE

    _start(write_spec, BASE, tmp_path / "probe", ["run.steps=6", "executor.kind=local"]).train()
    tokens = [r["tokens_generated"] for r in _metrics(tmp_path / "probe")]
    budget = sum(tokens[:3]) - 1  # reached during the third step (step 2)
    overrides = [f"run.max_tokens={budget}", "run.checkpoint_every=1", "executor.kind=local"]
    summary = _start(write_spec, BASE, tmp_path / "full", [*overrides, "run.steps=50"]).train()
    assert summary["steps"] == 3 and summary["tokens_generated"] == sum(tokens[:3])

    _start(write_spec, BASE, tmp_path / "part", [*overrides, "run.steps=2"]).train()  # as if killed after step 1
    assert Run.resume(tmp_path / "part", steps=50).train()["steps"] == 3
    assert _without_time(_metrics(tmp_path / "part")) == _without_time(_metrics(tmp_path / "full"))


def test_a_rollout_budget_stops_the_run_and_every_kept_token_has_signal(write_spec, tmp_path):
    from tests.conftest import BASE

    run_dir = tmp_path / "run"
    _start(write_spec, BASE, run_dir, ["run.max_rollouts=30", "run.steps=50", "executor.kind=local"]).train()
    records = _metrics(run_dir)
    assert len(records) == 2  # 4 prompts x 4 rollouts a step
    assert sum(r["rollouts_generated"] for r in records[:-1]) < 30 <= sum(r["rollouts_generated"] for r in records)
    for r in records:  # the zero-variance filter drops groups with equal rewards: every kept token has signal
        assert r["tokens_with_signal"] == r["tokens_in_update"] and r["tokens_scored"] == 0
    assert sum(r["tokens_with_signal"] for r in records) > 0


def test_each_step_records_the_weight_sync_time(write_spec, tmp_path):
    """``time.sync_s``: the wall seconds of the weight mover after the optimizer step (vLLM's
    ``reload_weights``; the transformers engine shares the weights and its mover, ``none``, has
    nothing to do). The move is slowed by a known 50 ms here (labelled: a wrapper around the run's mover)."""
    run = _start(write_spec, DAPO, tmp_path / "run", ["run.steps=2", "executor.kind=local"])
    mover, real_move = run.services.mover, run.services.mover.move

    def slow_move(version: int) -> int:
        time.sleep(0.05)
        return real_move(version)

    mover.move = slow_move
    run.train()
    for record in _metrics(tmp_path / "run"):
        synced = not record["update_skipped"]
        assert (record["time"]["sync_s"] >= 0.05) == synced, record
        assert record["time"]["sync_s"] <= record["time"]["stages_s"]["update"]
        assert record["time"]["sync_bytes"] == 0  # the transformers engine shares the trained model
