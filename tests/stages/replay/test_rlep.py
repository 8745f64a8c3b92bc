"""replay.rlep on the real tiny-arith policy: advantages over a mixed group computed by hand, the
two corrections, the lineage of a replayed rollout (``gfcr lineage`` shows the chain), the
step's generated counts leaving replayed rollouts out, the pool's seeds, MLflow per step, and
resume (after a SIGKILL mid-run) giving the store, the pool and the metrics of an uninterrupted run."""

from __future__ import annotations

import json
import math
import textwrap
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
from mlflow import MlflowClient
from typer.testing import CliRunner

from gfcr.cli.main import app
from gfcr.engines import TransformersEngine, load_policy
from gfcr.errors import DataError, GfcrError
from gfcr.graph import load_pipeline
from gfcr.records import (
    Prompt, PromptPool, Rollout, RolloutGroup, RolloutGroups, Segment, SegmentOrigin, StepContext, VerifierSpec,
)
from gfcr.runtime.store.lineage import read_lineage
from gfcr.runtime.loop.session import Run
from gfcr.spec import PolicySpec
from gfcr.stages.replay.rlep import RLEP
from gfcr.stages.resources import Lent, ScoreRequest
from gfcr.stages.update.grpo import GRPOUpdate
from gfcr.tracking.mlflow_tracker import start_tracking
from tests.conftest import REPO
from tests.killing import sigkill_after_step

cli = CliRunner()

SPEC = textwrap.dedent("""\
    name: rlep-small
    policy: {model: tiny-arith}
    data: {source: arithmetic, with: {n: 12, seed: 0, digits: 2, operators: ["+", "-"]}}
    stages:
      pick:    {use: control.uniform, with: {batch_size: 6}}
      budget:  {use: control.fixed_n, from: pick, with: {n: 4}}
      rollout: {use: generate.sample, from: budget, with: {max_new_tokens: 8}}
      reward:  {use: filter.verify, from: rollout}
      store:   {use: replay.store, from: reward, with: {max_entries: 40, correct_only: true}}
      rlep:    {use: replay.rlep, from: store, with: {replayed_per_group: 2, store: store}}
    update: {use: update.grpo, from: rlep, with: {lr: 3.0e-4, loss: {use: ppo_clip, with: {clip: [0.2, 0.28]}}}}
    run: {steps: 6, seed: 0, checkpoint_every: 2}
    tracking: {mlflow: null}
    """)


# --- one group, by hand ------------------------------------------------------------------------

@pytest.fixture(scope="module")
def policy():
    return load_policy(PolicySpec(model="tiny-arith"))


def _rollout(policy, gid: str, index: int, text: str, reward: float, version: int) -> Rollout:
    ids = list(policy.tokenizer.encode(text, add_special_tokens=False)) + [policy.tokenizer.eos_token_id]
    logprobs = np.full(len(ids), -0.5 - index, dtype=np.float32)  # made-up behaviour log-probs
    return Rollout(f"{gid}/{index}", gid, "a:0", ids, [Segment(0, len(ids), version, logprobs)], text=text,
                   reward=reward, correct=reward == 1.0)


def _mixed_group(policy, correction: str):
    """A group of 4 fresh rollouts (one correct) at step 3, and RLEP with two successes of step 1
    (policy version 1) in its own pool."""
    prompt = Prompt("a:0", text="What is 12 + 30? Answer:", verifier=VerifierSpec("arithmetic", "42"))
    engine = TransformersEngine(policy)
    stage = RLEP(RLEP.Config(replayed_per_group=2, correction=correction))
    stage.setup(Lent(policy, engine))
    for i, text in enumerate([" 42", "42"]):
        stage.pool.add_rollout(_rollout(policy, "a:0@s1", i, text, 1.0, version=1), step=1)
    fresh = [_rollout(policy, "a:0@s3", i, t, r, version=3) for i, (t, r) in
             enumerate([(" 41", 0.0), (" 40", 0.0), (" 4", 0.0), (" 42", 1.0)])]
    group = RolloutGroup("a:0@s3", "a:0", 3, 4, fresh)
    stage.run(RolloutGroups([group]), PromptPool([prompt]), StepContext("r", 3, 0, 3))
    return prompt, engine, stage, group


def test_advantages_are_computed_over_the_mixed_group_by_hand(policy):
    prompt, engine, stage, group = _mixed_group(policy, "none")
    assert [r.origin.value for r in group.rollouts] == ["fresh"] * 4 + ["replayed"] * 2
    assert sorted(r.replayed_from for r in group.rollouts[4:]) == ["a:0@s1/0", "a:0@s1/1"]
    assert [r.rollout_id for r in group.rollouts[4:]] == ["a:0@s3/4", "a:0@s3/5"]
    update = GRPOUpdate(GRPOUpdate.Config(lr=1e-3))  # mean_std: sample std (ddof 1), eps 1e-6
    update.setup(Lent(policy, engine))
    report = update.run(RolloutGroups([group]), PromptPool([prompt]))
    # rewards [0, 0, 0, 1, 1, 1]: mean 0.5, sample std sqrt(6 * 0.25 / 5) = sqrt(0.3)
    a = 0.5 / (math.sqrt(0.3) + 1e-6)
    assert [r.advantage for r in group.rollouts] == pytest.approx([-a, -a, -a, a, a, a], rel=1e-9)
    assert report.rollouts_in_update == 6


def test_correction_none_rescores_under_the_current_policy_and_tis_keeps_the_stored_log_probs(policy):
    prompt, engine, _, group = _mixed_group(policy, "none")
    for r in group.rollouts[4:]:
        expected = engine.score([ScoreRequest(tuple(policy.encode(prompt)), tuple(r.response_token_ids))])[0]
        (segment,) = r.segments
        assert (segment.policy_version, segment.origin) == (3, SegmentOrigin.REPLAYED_TEXT)
        assert np.allclose(segment.behavior_logprobs, expected.logprobs, atol=1e-6)
        assert (r.created_step, r.replayed_policy_version) == (1, 1)  # the original's, for lineage
    _, _, _, group = _mixed_group(policy, "tis")
    by_source = {r.replayed_from: r for r in group.rollouts[4:]}
    for index, source in enumerate(["a:0@s1/0", "a:0@s1/1"]):
        (segment,) = by_source[source].segments
        assert segment.policy_version == 1 and np.all(segment.behavior_logprobs == np.float32(-0.5 - index))


def test_a_prompt_with_fewer_candidates_gets_what_there_is_and_is_counted_short(policy):
    _, _, stage, group = _mixed_group(policy, "tis")
    stage.pool = type(stage.pool)(None)
    stage.pool.add_rollout(_rollout(policy, "a:0@s1", 0, " 42", 1.0, version=1), step=1)
    stage.before_step(StepContext("r", 4, 0, 4))
    other = RolloutGroup("a:0@s4", "a:0", 4, 1, [_rollout(policy, "a:0@s4", 0, " 3", 0.0, version=4)])
    stage.run(RolloutGroups([other]), PromptPool([]), StepContext("r", 4, 0, 4))
    assert [r.origin.value for r in other.rollouts] == ["fresh", "replayed"]
    assert stage.step_metrics() == {"rollouts_replayed": 1, "tokens_replayed": len(other.rollouts[1]),
                                    "groups_short": 1, "pool_entries": 1, "pool_prompts": 1}


# --- runs --------------------------------------------------------------------------------------

def _metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _without_time(records: list[dict]) -> list[dict]:
    return [{k: v for k, v in r.items() if k != "time"} for r in records]


def _checkpoint_files(run_dir: Path, step: int) -> dict[str, object]:
    """The store's and RLEP's state and files in a checkpoint (parquet as rows, indexes as bytes)."""
    found: dict[str, object] = {}
    for stage in ("store", "rlep"):
        root = run_dir / "checkpoints" / f"step-{step:06d}" / "stages" / stage
        for path in sorted(root.rglob("*")):
            if path.is_file():
                key = f"{stage}/{path.relative_to(root)}"
                found[key] = pq.read_table(path).to_pylist() if path.suffix == ".parquet" else path.read_bytes()
    return found


@pytest.fixture(scope="module")
def full_run(tmp_path_factory) -> Path:
    run_dir = tmp_path_factory.mktemp("rlep") / "full"
    spec = run_dir.parent / "spec.yaml"
    spec.write_text(SPEC)
    Run.start(load_pipeline(spec), run_dir).train()
    return run_dir


def test_replayed_rollouts_are_in_the_lineage_with_their_origin_and_not_counted_as_generated(full_run):
    rows = read_lineage(full_run / "lineage").to_pylist()
    by_id = {r["rollout_id"]: r for r in rows}
    replayed = [r for r in rows if r["origin"] == "replayed"]
    assert replayed, "prompts come back every other step: something was replayed"
    for row in replayed:
        source = by_id[row["replayed_from"]]
        assert source["origin"] == "fresh" and source["correct"] and source["step"] < row["step"]
        assert row["created_step"] == source["step"] == source["created_step"]
        assert row["replayed_policy_version"] == source["policy_version_min"]
        assert row["created_by"] == "rlep" and row["correct"] and row["in_update"]
        assert row["group_id"] == f"{row['prompt_id']}@s{row['step']}"  # appended to the step's own group
        assert row["policy_version_min"] == row["step"]  # correction none: rescored at the step's version
    for record in _metrics(full_run):
        step_rows = [r for r in rows if r["step"] == record["step"]]
        fresh = [r for r in step_rows if r["origin"] == "fresh"]
        assert record["rollouts_generated"] == len(fresh) == 24
        assert record["tokens_generated"] == sum(r["n_tokens"] for r in fresh)
        ours = [r for r in step_rows if r["origin"] == "replayed"]
        assert record["stages"]["rlep"]["rollouts_replayed"] == len(ours)
        assert record["stages"]["rlep"]["tokens_replayed"] == sum(r["n_tokens"] for r in ours)
        assert record["tokens_scored"] == sum(r["n_tokens"] for r in ours)  # the rescoring pass
        # correction none: replayed tokens were rescored by the current policy, so the ratio starts at 1
        assert record["update"]["ratio_mean"] == pytest.approx(1.0, abs=1e-4)
        assert record["correct_fraction"] == sum(bool(r["correct"]) for r in fresh) / len(fresh)
        # the store keeps only correct rollouts, so all of it is the pool
        assert record["stages"]["rlep"]["pool_entries"] == record["stages"]["store"]["entries"] > 0


def test_gfcr_lineage_shows_the_chain_of_a_replayed_rollout(full_run):
    rows = read_lineage(full_run / "lineage").to_pylist()
    row = next(r for r in rows if r["origin"] == "replayed")
    result = cli.invoke(app, ["lineage", str(full_run), row["rollout_id"]])
    assert result.exit_code == 0, result.output
    text = " ".join(result.output.split())
    assert "by rlep (replay.rlep), origin replayed" in text
    assert (f"replayed from {row['replayed_from']} (generated at step {row['created_step']}, "
            f"policy version {row['replayed_policy_version']})") in text
    assert f"reused from │ {row['replayed_from']}: step {row['created_step']}, by rollout" in text
    result = cli.invoke(app, ["lineage", str(full_run), row["rollout_id"], "--json"])
    (source,) = json.loads(result.output)["reused_from"]
    assert (source["rollout_id"], source["step"], source["created_by"], source["origin"]) == (
        row["replayed_from"], row["created_step"], "rollout", "fresh")
    assert source["policy_version_min"] == row["replayed_policy_version"]


def test_resume_gives_the_store_pool_and_metrics_of_an_uninterrupted_run(full_run, tmp_path):
    spec = tmp_path / "spec.yaml"
    spec.write_text(SPEC)
    part = tmp_path / "part"
    Run.start(load_pipeline(spec, ["run.steps=3"]), part).train()
    Run.resume(part, steps=6).train()
    assert _without_time(_metrics(part)) == _without_time(_metrics(full_run))
    assert _checkpoint_files(part, 6) == _checkpoint_files(full_run, 6)


@pytest.mark.slow
def test_a_sigkilled_run_with_store_and_rlep_resumes_to_an_uninterrupted_run(full_run, tmp_path):
    spec = tmp_path / "spec.yaml"
    spec.write_text(SPEC)
    run_dir = tmp_path / "killed"
    sigkill_after_step(spec, run_dir, 4, tmp_path)
    assert [r["step"] for r in _metrics(run_dir)] == [0, 1, 2, 3, 4]
    Run.resume(run_dir).train()
    assert _without_time(_metrics(run_dir)) == _without_time(_metrics(full_run))
    assert _checkpoint_files(run_dir, 6) == _checkpoint_files(full_run, 6)


def test_mlflow_records_the_store_size_and_the_replayed_rollouts_per_step(tmp_path):
    spec = tmp_path / "spec.yaml"
    spec.write_text(SPEC.replace("tracking: {mlflow: null}", "tracking: {mlflow: {experiment: rlep}}"))
    run = Run.start(load_pipeline(spec, ["run.steps=3"]), tmp_path / "run")
    trackers = start_tracking(run)
    run.hooks = trackers
    run.train()
    run_id = json.loads((tmp_path / "run" / "tracking.json").read_text())["mlflow_run_id"]
    client = MlflowClient(trackers[0].uri)
    records = _metrics(tmp_path / "run")
    for key, stage, name in (("stages.store.entries", "store", "entries"),
                             ("stages.rlep.rollouts_replayed", "rlep", "rollouts_replayed"),
                             ("stages.rlep.pool_entries", "rlep", "pool_entries")):
        got = sorted((m.step, m.value) for m in client.get_metric_history(run_id, key))
        assert got == [(r["step"], float(r["stages"][stage][name])) for r in records], key
    assert records[-1]["stages"]["store"]["entries"] > 0


# --- seeds -------------------------------------------------------------------------------------

def test_a_pool_seeded_from_another_run_holds_its_store_s_correct_rollouts(full_run):
    stage = RLEP(RLEP.Config(correction="tis", online=False, seed_from={"run_dir": str(full_run), "stage": "store"}))
    stage.setup(Lent())
    stored = pq.read_table(full_run / "checkpoints" / "step-000006" / "stages" / "store" / "files"
                           / "entries.parquet").to_pylist()
    expected = sorted(f"full::{r['rollout_id']}" for r in stored if r["correct"])
    assert sorted(e.rollout_id for e in stage.pool.entries()) == expected and expected


def test_a_jsonl_seed_is_tokenized_with_the_policy_and_rescored_when_replayed(policy, tmp_path):
    prompt = Prompt("a:0", text="What is 12 + 30? Answer:", verifier=VerifierSpec("arithmetic", "42"))
    seed = tmp_path / "seed.jsonl"
    seed.write_text('{"prompt": "What is 12 + 30? Answer:", "response": " 42"}\n'
                    '{"prompt_id": "a:0", "response": " 41", "reward": 0.0}\n')
    stage = RLEP(RLEP.Config(correction="tis", online=False, seed_from={"jsonl": str(seed)}))
    stage.setup(Lent(policy, TransformersEngine(policy)))
    group = RolloutGroup("a:0@s0", "a:0", 0, 1, [_rollout(policy, "a:0@s0", 0, " 3", 0.0, version=0)])
    stage.run(RolloutGroups([group]), PromptPool([prompt]), StepContext("r", 0, 0, 0))
    (replayed,) = group.rollouts[1:]  # the reward-0 line is not a success
    assert replayed.response_token_ids == policy.tokenizer.encode(" 42", add_special_tokens=False) + [
        policy.tokenizer.eos_token_id]
    assert replayed.replayed_from == "seed-jsonl:1" and replayed.created_step == -1
    assert replayed.segments[0].origin == SegmentOrigin.REPLAYED_TEXT  # no log-probs of its own: rescored
    assert float(replayed.segments[0].behavior_logprobs.sum()) < 0.0


def test_a_bad_jsonl_seed_names_every_bad_line(policy, tmp_path):
    seed = tmp_path / "seed.jsonl"
    seed.write_text('{"prompt_id": "nope", "response": " 42"}\nnot json\n{"prompt_id": "a:0"}\n')
    stage = RLEP(RLEP.Config(correction="tis", online=False, seed_from={"jsonl": str(seed)}))
    stage.setup(Lent(policy, TransformersEngine(policy)))
    with pytest.raises(DataError) as info:
        stage.run(RolloutGroups(), PromptPool([Prompt("a:0", text="1 + 1")]), StepContext("r", 0, 0, 0))
    assert [p.where.line for p in info.value.problems] == [1, 2, 3]
    assert "no prompt of the data matches 'nope'" in str(info.value)


def test_seeding_from_a_run_without_a_store_says_how_to_fix_it(tmp_path):
    stage = RLEP(RLEP.Config(correction="tis", online=False, seed_from={"run_dir": str(tmp_path)}))
    with pytest.raises(GfcrError, match="has no checkpoints") as info:
        stage.setup(Lent())
    assert "replay.store" in info.value.fix
