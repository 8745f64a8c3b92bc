"""The stale lifecycles (gfcr.runtime.loop.lifecycle). Pipelined (``lifecycle: {mode: pipelined, lag: K}``):
generation for step t samples with the weights of the start of step t - K, every fresh token of
step t's batch is exactly K versions old when it is trained (no update skipped), the stages observe
a step before its update, and a resumed run equals the uninterrupted one (the weights of the last
K + 2 steps travel in the checkpoint), and an overlapped run (a producer thread) equals its
sequential twin. Async (``{mode: async, max_staleness: K}``): no rollout starts more than K
versions ahead of the update that trains it."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from typer.testing import CliRunner

from gfcr.cli.main import app

from gfcr.graph import load_pipeline
from gfcr.runtime.loop.session import Run

PIPELINED = textwrap.dedent("""\
    name: pipelined-small
    policy: {model: tiny-arith}
    data: {source: arithmetic, with: {n: 200, seed: 0}}
    eval: {source: arithmetic, with: {n: 16, seed: 1, split: eval}, every: 2, max_new_tokens: 8}
    stages:
      pick:    {use: control.greso, with: {batch_size: 6}}
      budget:  {use: control.fixed_n, from: pick, with: {n: 4}}
      rollout: {use: generate.sample, from: budget, with: {max_new_tokens: 8}}
      reward:  {use: filter.verify, from: rollout}
    update: {use: update.grpo, from: reward, with: {lr: 1.0e-3, correction: {use: tis}}}
    lifecycle: {mode: pipelined, lag: 2}
    run: {steps: 5, seed: 3}
    executor: {kind: local}
    tracking: {mlflow: null}
    """)


def _metrics(run_dir: Path) -> list[dict]:
    return [{k: v for k, v in json.loads(line).items() if k != "time"}
            for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _start(write_spec, run_dir: Path, overrides: list[str] = ()) -> Run:
    return Run.start(load_pipeline(write_spec(PIPELINED), list(overrides)), run_dir)


@pytest.mark.parametrize("lag", [1, 2])
def test_generation_lags_the_trainer_by_exactly_lag_steps(write_spec, tmp_path, lag):
    run_dir = tmp_path / f"lag{lag}"
    _start(write_spec, run_dir, [f"lifecycle.lag={lag}", "run.steps=4"]).train()
    records = _metrics(run_dir)
    assert [r["update_skipped"] for r in records] == [False] * 4  # so versions count steps
    for r in records:
        step = r["step"]
        expected = min(step, lag)  # the first steps sample with the initial weights
        assert list(r["staleness"]) == [str(expected)] and r["staleness"][str(expected)] >= r["tokens_in_update"], r
        rows = pq.read_table(run_dir / "lineage" / f"step-{step:06d}.parquet").to_pylist()
        assert {(row["policy_version_min"], row["policy_version_max"]) for row in rows} == \
            {(max(0, step - lag), max(0, step - lag))}


def test_the_stages_observe_a_step_before_its_update(write_spec, tmp_path):
    run = _start(write_spec, tmp_path / "run", ["run.steps=2"])
    seen = []
    greso = run.runner.stages["pick"]
    real = greso.observe
    greso.observe = lambda report: (seen.append((report.step, report.update, report.policy_version)),
                                    real(report))[1]
    run.train()
    assert seen == [(0, None, 0), (1, None, 0)]  # lag 2: step 1 still samples with version 0


def test_a_resumed_pipelined_run_equals_the_uninterrupted_one(write_spec, tmp_path):
    full = tmp_path / "full"
    _start(write_spec, full).train()
    part = tmp_path / "part"
    _start(write_spec, part, ["run.steps=3"]).train()
    assert (part / "checkpoints" / "step-000003" / "lifecycle" / "tensors.safetensors").is_file()
    Run.resume(part, steps=5).train()
    assert _metrics(full) == _metrics(part)
    assert any(list(r["staleness"]) == ["2"] for r in _metrics(full))


def test_sync_runs_keep_their_metric_keys(write_spec, tmp_path):
    text = PIPELINED.replace("lifecycle: {mode: pipelined, lag: 2}\n", "")
    Run.start(load_pipeline(write_spec(text), ["run.steps=1"]), tmp_path / "sync").train()
    assert "staleness" not in _metrics(tmp_path / "sync")[0]


def _lineage(run_dir: Path) -> list[list[dict]]:
    return [[{k: v for k, v in row.items() if k != "run_id"} for row in pq.read_table(path).to_pylist()]
            for path in sorted((run_dir / "lineage").glob("step-*.parquet"))]


@pytest.mark.parametrize("lag", [1, 2])
def test_an_overlapped_run_equals_its_sequential_twin(write_spec, tmp_path, lag):
    """Generation of later steps in a producer thread while the update trains (each on its own
    copy of the policy) gives the metrics and lineage of the same schedule run step after step."""
    runs = {}
    for overlap in (True, False):
        runs[overlap] = tmp_path / f"overlap-{overlap}"
        _start(write_spec, runs[overlap], [f"lifecycle.lag={lag}", f"lifecycle.overlap={str(overlap).lower()}",
                                           "run.steps=6", "run.checkpoint_every=4"]).train()
    assert _metrics(runs[True]) == _metrics(runs[False])
    assert _lineage(runs[True]) == _lineage(runs[False])
    assert [r["step"] for r in _metrics(runs[True])] == list(range(6))


def test_an_overlapped_run_resumes_as_if_uninterrupted(write_spec, tmp_path):
    full = tmp_path / "full"
    _start(write_spec, full, ["run.steps=6", "run.checkpoint_every=2"]).train()
    part = tmp_path / "part"
    _start(write_spec, part, ["run.steps=3", "run.checkpoint_every=2"]).train()
    Run.resume(part, steps=6).train()
    assert _metrics(full) == _metrics(part)


ASYNC_FAKE = textwrap.dedent("""\
    name: async-fake
    data: {source: arithmetic, with: {n: 200}}
    stages:
      pick:    {use: control.uniform, with: {batch_size: 4}}
      budget:  {use: control.fixed_n, from: pick, with: {n: 4}}
      rollout: {use: generate.fake, from: budget, with: {latency_s: 0.0}}
    update: {use: update.fake, from: rollout, with: {latency_s: 0.0}}
    lifecycle: {mode: async, max_staleness: 2}
    run: {steps: 10}
    executor: {kind: local}
    tracking: {mlflow: null}
    """)


@pytest.mark.parametrize(("generation_s", "update_s"), [(0.0, 0.1), (0.1, 0.0)], ids=["fast engine", "slow engine"])
def test_async_never_starts_a_rollout_more_than_max_staleness_ahead(write_spec, tmp_path, generation_s, update_s):
    """The labelled fake engine and fake update, one made slow: every rollout was sampled at most
    K = 2 versions before the update that trained it (read from the lineage); with a fast engine
    generation runs ahead until the bound holds it back, with a slow one it never gets there."""
    text = ASYNC_FAKE.replace("from: budget, with: {latency_s: 0.0}", f"from: budget, with: {{latency_s: {generation_s}}}")
    text = text.replace("from: rollout, with: {latency_s: 0.0}", f"from: rollout, with: {{latency_s: {update_s}}}")
    assert text.count("latency_s: 0.1") == 1
    run_dir = tmp_path / "run"
    Run.start(load_pipeline(write_spec(text)), run_dir).train()
    ages = []
    for r in _metrics(run_dir):
        trained_on = r["policy_version"] - (0 if r["update_skipped"] else 1)
        rows = pq.read_table(run_dir / "lineage" / f"step-{r['step']:06d}.parquet").to_pylist()
        ages += [trained_on - row["policy_version_min"] for row in rows]
        assert all(int(age) <= 2 for age in r["staleness"]), r
    assert max(ages) <= 2
    waits = [(r["time"]["producer_wait_s"], r["time"]["trainer_wait_s"])
             for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())]
    if generation_s == 0.0:
        assert max(ages) == 2  # the bound, not the engine's speed, held generation back
        assert sum(p for p, _ in waits) > sum(t for _, t in waits)  # generation waited for the trainer
    else:
        assert sum(t for _, t in waits) > sum(p for p, _ in waits)  # the trainer waited for generation


@pytest.mark.parametrize(("correction", "says"), [
    ("{use: tis}", "trained 2 version(s) stale, corrected by `tis`"),
    ("{use: staleness, with: {max_staleness: 1}}", "tokens past max_staleness=1 masked by `staleness`"),
])
def test_lineage_lists_the_stale_rollouts_and_what_the_correction_did(write_spec, tmp_path, correction, says):
    run_dir = tmp_path / "run"
    text = PIPELINED.replace("correction: {use: tis}", f"correction: {correction}")
    Run.start(load_pipeline(write_spec(text), ["run.steps=3"]), run_dir).train()
    rows = [r for step in _lineage(run_dir) for r in step]
    assert {r["staleness"] for r in rows if r["in_update"]} == {0, 1, 2}  # steps 0, 1, 2 at lag 2
    result = CliRunner().invoke(app, ["lineage", str(run_dir), "--stale", "--step", "2"])
    stale = sum(1 for r in rows if r["step"] == 2 and r["in_update"])
    assert result.exit_code == 0 and f"{stale} rollouts matching --stale --step 2" in result.output, result.output
    listed = json.loads(CliRunner().invoke(app, ["lineage", str(run_dir), "--stale", "--step", "2", "--json"]).output)
    assert len(listed["rollouts"]) == stale and all(says in r["stale_fate"] for r in listed["rollouts"])
    result = CliRunner().invoke(app, ["lineage", str(run_dir), "--stale", "--step", "0"])
    assert result.exit_code == 0 and "no rollout" in result.output, result.output
