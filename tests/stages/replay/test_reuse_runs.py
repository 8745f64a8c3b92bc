"""replay.rollout_replay and replay.correct_cache in real runs of the tiny-arith policy: the step
counts, a resumed run equal to an uninterrupted one (buffers in checkpoint files, no pickle),
and the lineage chain of a replayed rollout back to the rollout it copies."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from typer.testing import CliRunner

from rich.console import Console

from gfcr.cli.lineage_cmd import chain_table
from gfcr.cli.main import app
from gfcr.graph import load_pipeline
from gfcr.runtime.store.lineage import read_lineage
from gfcr.runtime.loop.session import Run
from gfcr.tracking.lineage_chain import rollout_chain

cli = CliRunner()
pytestmark = pytest.mark.slow  # real runs: about 30 s a pipeline on 2 cores

HEAD = textwrap.dedent("""\
    policy: {model: tiny-arith}
    data: {source: arithmetic, with: {n: %d, seed: 0, digits: 2, operators: ["+", "-"]}}
    stages:
      pick:    {use: control.uniform, with: {batch_size: %d}}
      budget:  {use: control.fixed_n, from: pick, with: {n: %d}}
      rollout: {use: generate.sample, from: budget, with: {max_new_tokens: 8}}
      reward:  {use: filter.verify, from: rollout}
    """)
TAIL = textwrap.dedent("""\
    update: {use: update.grpo, from: %s, with: {lr: %s, correction: {use: decoupled_clip}}}
    run: {steps: 4, seed: 0, checkpoint_every: 2}
    tracking: {mlflow: null}
    """)
SPECS = {
    "replay": "name: dots-small\n" + HEAD % (60, 4, 4)
              + "  replay:  {use: replay.rollout_replay, from: reward, with: {buffer_size: 10}}\n"
              + TAIL % ("replay", "3.0e-4"),
    # 8 prompts, 4 a step, 2 rollouts each, a policy that barely moves: each prompt comes back every
    # 2 steps, and all-wrong groups of prompts answered right before keep coming (3 joins in 4 steps)
    "cache": "name: cache-small\n" + HEAD % (8, 4, 2)
             + "  cache:   {use: replay.correct_cache, from: reward, with: {max_staleness: 3}}\n"
             + TAIL % ("cache", "1.0e-8"),
}
GENERATED = {"replay": 16, "cache": 8}  # rollouts per step: 4 prompts x 4, 4 prompts x 2


def _metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _without_time(records: list[dict]) -> list[dict]:
    return [{k: v for k, v in r.items() if k != "time"} for r in records]


def _stage_files(run_dir: Path, sid: str, step: int) -> dict[str, object]:
    stage = run_dir / "checkpoints" / f"step-{step:06d}" / "stages" / sid
    return {"state.json": json.loads((stage / "state.json").read_text()),
            "entries": pq.read_table(stage / "files" / "entries.parquet").to_pylist()}


@pytest.fixture(scope="module", params=sorted(SPECS))
def full_run(request, tmp_path_factory) -> tuple[str, Path]:
    sid = request.param
    run_dir = tmp_path_factory.mktemp(sid) / "full"
    spec = run_dir.parent / "spec.yaml"
    spec.write_text(SPECS[sid])
    Run.start(load_pipeline(spec), run_dir).train()
    return sid, run_dir


def test_reused_rollouts_are_counted_apart_from_generated_ones(full_run):
    sid, run_dir = full_run
    records = _metrics(run_dir)
    table = read_lineage(run_dir / "lineage").to_pylist()
    for record in records:
        rows = [r for r in table if r["step"] == record["step"]]
        reused = [r for r in rows if r["origin"] in ("replayed", "cached_correct")]
        assert record["rollouts_generated"] == len(rows) - len(reused) == GENERATED[sid]  # reused ones apart
        assert record["tokens_generated"] == sum(r["n_tokens"] for r in rows if r not in reused)
        assert record["stages"][sid]["rollouts_replayed"] == len(reused)
    assert sum(r["stages"][sid]["rollouts_replayed"] for r in records) > 0, "nothing was reused: the test is empty"
    if sid == "replay":  # sigma 0.5: 4 groups replayed from step 1 on, 4 x 4 rollouts
        assert [r["stages"]["replay"]["groups_replayed"] for r in records] == [0, 4, 4, 4]
        assert all(r["update"]["batch_groups"] == 8 for r in records[1:])


def test_resume_gives_the_buffer_and_metrics_of_an_uninterrupted_run(full_run, tmp_path):
    sid, full = full_run
    spec = tmp_path / "spec.yaml"
    spec.write_text(SPECS[sid])
    part = tmp_path / "part"
    Run.start(load_pipeline(spec, ["run.steps=2"]), part).train()  # checkpoint at 2 (the end)
    Run.resume(part, steps=4).train()
    assert _without_time(_metrics(part)) == _without_time(_metrics(full))
    assert _stage_files(part, sid, 4) == _stage_files(full, sid, 4)
    assert _stage_files(full, sid, 2)["entries"], "the checkpoint holds the buffered rollouts"
    names = {p.name for p in (full / "checkpoints" / "step-000004" / "stages" / sid).rglob("*") if p.is_file()}
    assert names == {"state.json", "entries.parquet"}  # no pickle


def test_gfcr_lineage_follows_a_replayed_rollout_to_the_rollout_it_copies(full_run):
    sid, run_dir = full_run
    table = read_lineage(run_dir / "lineage").to_pylist()
    reused = next(r for r in table if r["origin"] in ("replayed", "cached_correct"))
    original = next(r for r in table if r["rollout_id"] == reused["replayed_from"])
    assert reused["created_step"] == original["step"] == original["created_step"] < reused["step"]
    assert reused["policy_version_min"] == original["policy_version_min"]
    chain = rollout_chain(run_dir, reused["rollout_id"])
    assert [r["rollout_id"] for r in chain.reused_from] == [original["rollout_id"]]
    assert chain.created_by.id == sid  # the stage that put it in the step: a new group, or appended (added_by)
    assert chain.reused_from[0]["created_by"] == "rollout"
    result = cli.invoke(app, ["lineage", str(run_dir), reused["rollout_id"], "--json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.output)["reused_from"][0]["rollout_id"] == original["rollout_id"]
    console = Console(width=400, record=True)
    console.print(chain_table(chain))  # what `gfcr lineage` prints, on a terminal wide enough for one line a link
    text = console.export_text()
    assert f"replayed from {original['rollout_id']} (generated at step {original['step']})" in text
    line = next(line for line in text.splitlines() if "reused from" in line)
    assert (f"{original['rollout_id']}: step {original['step']}, by rollout, origin fresh, "
            f"policy version {original['policy_version_min']}, reward") in line
    after = _metrics(run_dir)[reused["step"]]["policy_version"]
    assert f"policy version {after - 1} -> {after}" in text  # the update's versions, not the copy's
