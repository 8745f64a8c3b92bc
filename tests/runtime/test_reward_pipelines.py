"""The model-based reward stages inside a run: the shipped rubric pipeline (pipelines/examples/rubric_arith.yaml)
for 2 steps; a reward model (a tiny BERT classifier built here, so no trained checkpoint is needed) lent by the
runtime and charged to the step; and, under ``lifecycle: async``, the reward model scoring step t in the
producer thread while the trainer runs the update of an earlier step (docs/rewards.md, "While generation
continues")."""

from __future__ import annotations

import json
import textwrap
import threading
import time
from pathlib import Path

import pytest

from gfcr.graph import load_pipeline
from gfcr.runtime.loop.session import Run
from gfcr.runtime.store.lineage import read_lineage
from gfcr.stages.filter.reward_model import RewardModel
from gfcr.stages.testing import FakeUpdate
from tests.conftest import REPO
from tests.stages.filter.test_reward_model import _classifier

SCORED = textwrap.dedent("""\
    name: reward-model-small
    policy: {{model: tiny-arith}}
    data: {{source: arithmetic, with: {{n: 200, seed: 0}}}}
    stages:
      pick:    {{use: control.uniform, with: {{batch_size: 4}}}}
      budget:  {{use: control.fixed_n, from: pick, with: {{n: 4}}}}
      rollout: {{use: generate.sample, from: budget, with: {{max_new_tokens: 6}}}}
      score:   {{use: filter.reward_model, from: rollout, with: {{model: {model}, batch_size: 4}}}}
    update: {update}
    run: {{steps: {steps}, seed: 0}}
    executor: {{kind: local}}
    tracking: {{mlflow: null}}
    """)


LIFECYCLES = {"async": "lifecycle: {mode: async, max_staleness: 1}\n", "sync": ""}


def _records(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def classifier(tmp_path_factory) -> str:
    return _classifier(tmp_path_factory.mktemp("rm"))


def test_the_shipped_rubric_pipeline_scores_each_criterion(tmp_path):
    spec = REPO / "pipelines" / "examples" / "rubric_arith.yaml"
    run_dir = tmp_path / "run"
    Run.start(load_pipeline(spec, ["run.steps=2", "executor.kind=local", "tracking.mlflow=null",
                                   "stages.pick.with.batch_size=4", "stages.budget.with.n=4"]), run_dir).train()
    records = _records(run_dir)
    assert [r["step"] for r in records] == [0, 1]
    for record in records:
        means = record["stages"]["reward"]
        assert set(means) == {"correct_mean", "format_mean", "short_mean", "fallbacks"} and means["fallbacks"] == 0
    rows = [r for r in read_lineage(run_dir / "lineage").to_pylist() if r["reward"] is not None]
    assert len(rows) == 32
    for row in rows:
        reason = row["reward_reason"]
        assert reason.startswith(f"rubric {row['reward']:.3g}: correct ") and "; format " in reason
        parts = dict(p.split(" ")[:2] for p in reason.split(": ", 1)[1].split("; "))
        expected = 0.8 * float(parts["correct"]) + 0.1 * float(parts["format"]) + 0.1 * float(parts["short"])
        assert row["reward"] == pytest.approx(expected) and row["correct"] == (row["reward"] >= 0.5)


def test_a_reward_model_is_lent_by_the_runtime_and_charged_to_the_step(write_spec, tmp_path, classifier):
    run_dir = tmp_path / "run"
    update = "{use: update.grpo, from: score, with: {lr: 1.0e-4}}"
    spec = write_spec(SCORED.format(model=classifier, steps=2, update=update))
    Run.start(load_pipeline(spec), run_dir).train()
    for record in _records(run_dir):
        score = record["stages"]["score"]
        assert score["scored"] == 16 and score["fallbacks"] == 0 and score["rm_tokens"] > 16 * 4
        assert record["tokens_scored"] >= score["rm_tokens"]
        assert record["reward_mean"] is not None and 0 < record["reward_mean"] < 1
    rows = [r for r in read_lineage(run_dir / "lineage").to_pylist() if r["reward"] is not None]
    assert len(rows) == 32 and all(r["reward_reason"].startswith("reward model logit ") for r in rows)


@pytest.mark.parametrize("lifecycle", ["async", "sync"])
def test_under_async_the_reward_model_scores_while_the_trainer_updates(write_spec, tmp_path, classifier, monkeypatch,
                                                                       lifecycle):
    """Under async the producer (control, generation, filters) runs step t while the trainer runs an earlier
    step's update: the reward model's scoring intervals, in the producer thread, overlap the update's.
    Under sync (the control) they never do."""
    scoring, updating = [], []
    score_rollouts, train_shard = RewardModel.score_rollouts, FakeUpdate.train_shard

    def timed_score(self, *args, **kwargs):
        start = time.monotonic()
        out = score_rollouts(self, *args, **kwargs)
        scoring.append((start, time.monotonic(), threading.current_thread().name))
        return out

    def timed_update(self, *args, **kwargs):  # the trainer's step (update.fake sleeps `latency_s` in it)
        start = time.monotonic()
        out = train_shard(self, *args, **kwargs)
        updating.append((start, time.monotonic(), threading.current_thread().name))
        return out

    monkeypatch.setattr(RewardModel, "score_rollouts", timed_score)
    monkeypatch.setattr(FakeUpdate, "train_shard", timed_update)
    spec = write_spec(SCORED.format(model=classifier, steps=4, update="{use: update.fake, from: score, "
                                    "with: {latency_s: 0.5}}") + LIFECYCLES[lifecycle])
    Run.start(load_pipeline(spec), tmp_path / "run").train()
    assert len(scoring) == 4 and len(updating) == 4
    overlapping = [s for s in scoring if any(s[0] < u[1] and u[0] < s[1] for u in updating)]
    if lifecycle == "sync":
        assert not overlapping
        return
    assert {name for _, _, name in scoring} != {name for _, _, name in updating}  # two threads
    assert overlapping, (scoring, updating)


TRAINED = REPO / "runs" / "reward-model-gsm8k"
GSM8K = REPO.parent / "shared" / "data" / "gsm8k"


@pytest.mark.slow
@pytest.mark.skipif(not TRAINED.is_dir(), reason=f"make {TRAINED} with `python benchmarks/train_reward_model.py`")
def test_the_shipped_reward_model_pipeline_runs_with_the_trained_model(tmp_path):
    """benchmarks/pipelines/reward_model_gsm8k_smollm2.yaml, 2 steps of 2 prompts x 2 rollouts of at most 32
    tokens: SmolLM2 answers GSM8K and the trained MiniLM classifier scores every answer."""
    if not GSM8K.is_dir():
        pytest.skip(f"needs the GSM8K files in {GSM8K}")
    spec = REPO / "benchmarks" / "pipelines" / "reward_model_gsm8k_smollm2.yaml"
    run_dir = tmp_path / "run"
    Run.start(load_pipeline(spec, ["run.steps=2", "executor.kind=local", "tracking.mlflow=null",
                                   "stages.pick.with.batch_size=2", "stages.budget.with.n=2",
                                   "stages.rollout.with.max_new_tokens=32",
                                   f"data.with.path={GSM8K / 'train.jsonl'}"]), run_dir).train()
    for record in _records(run_dir):
        score = record["stages"]["score"]
        assert score["scored"] == 4 and score["fallbacks"] == 0 and record["tokens_scored"] >= score["rm_tokens"] > 0
    rows = [r for r in read_lineage(run_dir / "lineage").to_pylist() if r["reward"] is not None]
    assert len(rows) == 8 and all(0 < r["reward"] < 1 for r in rows)
    assert all(r["reward_reason"].startswith("reward model logit ") for r in rows)
