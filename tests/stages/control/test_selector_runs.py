"""The prompt selectors (MoPPS, VADE, sGPO, HIVE, DOTS) in real runs of the tiny-arith policy: their
per-step decisions in ``metrics.jsonl`` and MLflow, sGPO's profile charged to step 0's
generated tokens, and resume (from a checkpoint, and after a SIGKILL mid-run) giving the
metrics of an uninterrupted run."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest
from mlflow import MlflowClient

from gfcr.graph import load_pipeline
from gfcr.runtime.loop.session import Run
from gfcr.tracking.mlflow_tracker import start_tracking
from tests.conftest import REPO
from tests.killing import sigkill_after_step

BASE = textwrap.dedent("""\
    name: {name}
    policy: {{model: tiny-arith}}
    data: {{source: arithmetic, with: {{n: 40, seed: 0, digits: 2, operators: ["+", "-"]}}}}
    stages:
      pick:    {pick}
    {budget}  rollout: {{use: generate.sample, from: {rollout_from}, with: {{max_new_tokens: 8{entropy}}}}}
      reward:  {{use: filter.verify, from: rollout}}
    update: {{use: update.grpo, from: reward, with: {{lr: 3.0e-4, loss: {{use: ppo_clip, with: {{clip: [0.2, 0.28]}}}}}}}}
    run: {{steps: 6, seed: 0, checkpoint_every: 2}}
    tracking: {{mlflow: null}}
    """)
FIXED = "  budget:  {use: control.fixed_n, from: pick, with: {n: 4}}\n"
SELECTORS = {
    "mopps": ("{use: control.beta_thompson, with: {batch_size: 4, candidate_ratio: 2, decay: 0.5}}", True),
    "vade": ("{use: control.vade, with: {batch_size: 4, slow_decay: 0.9}}", True),
    "sgpo": ("{use: control.sgpo, with: {batch_size: 4, profile_samples: 4, phase_steps: [2, 4], "
             "unsolved_rate: 0.5, max_new_tokens: 8}}", False),
    "hive": ("{use: control.hive, with: {batch_size: 4, candidate_ratio: 2}}", True),
    "dots": ("{use: control.dots, with: {batch_size: 4, interval: 2, fresh_fraction: 0.5, reference_prompts: 8, "
             "reference_samples: 4, train_prompts: 16, hidden_size: 32, max_new_tokens: 8}}", True),
}
NEEDS_ENTROPY = {"hive"}  # stage 1 ranks by the response entropy generate.sample records
# what each selector decided on, reported every step under control.pick
DECISIONS = {"mopps": ("posterior_mean", "draw_mean"), "vade": ("posterior_mean", "gain_mean", "unseen"),
             "sgpo": ("phase", "group_size", "predicted_success", "trivial", "learnable_g2"),
             "hive": ("candidates", "off_edge", "kept_stage1", "kept_stage2", "prompt_entropy_mean", "tokens_scored"),
             "dots": ("round", "reference_rollouts", "predicted_mean", "distance_mean", "calibration_slope")}
REPORTED_AS = {"hive": "stages", "dots": "stages"}  # step_metrics (stages.<id>); the others: the Allocation's controller_state


def spec_text(name: str) -> str:
    pick, fixed = SELECTORS[name]
    return BASE.format(name=f"{name}-small", pick=pick, budget=FIXED if fixed else "",
                       rollout_from="budget" if fixed else "pick",
                       entropy=", entropy: true" if name in NEEDS_ENTROPY else "")


def write_spec(tmp_path: Path, name: str) -> Path:
    spec = tmp_path / f"{name}.yaml"
    spec.write_text(spec_text(name))
    return spec


def _metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _without_time(records: list[dict]) -> list[dict]:
    return [{k: v for k, v in r.items() if k != "time"} for r in records]


@pytest.fixture(scope="module")
def full_runs(tmp_path_factory) -> dict[str, Path]:
    """One uninterrupted 6-step run per selector: the reference of the resume tests."""
    root = tmp_path_factory.mktemp("selectors")
    runs = {}
    for name in SELECTORS:
        runs[name] = root / f"{name}-full"
        Run.start(load_pipeline(write_spec(root, name)), runs[name]).train()
    return runs


@pytest.mark.parametrize("name", list(SELECTORS))
def test_every_step_reports_what_the_selector_decided_on(full_runs, name):
    records = _metrics(full_runs[name])
    assert [r["step"] for r in records] == list(range(6))
    for r in records:
        decided = r[REPORTED_AS.get(name, "control")]["pick"]
        assert all(isinstance(decided[key], (int, float)) for key in DECISIONS[name])


def test_sgpo_s_profile_is_charged_to_step_0_and_its_group_sizes_reach_the_generator(full_runs):
    records = _metrics(full_runs["sgpo"])
    first = records[0]
    control = first["control"]["pick"]
    assert control["profile_rollouts"] == 40 * 4  # every prompt, 4 samples
    # step 0 generated the profile and its own groups, each of the phase's group size
    assert first["rollouts_generated"] - control["profile_rollouts"] == control["chosen"] * control["group_size"]
    assert first["tokens_generated"] > control["profile_tokens"] > 0
    for r in records:  # phase boundaries at steps 2 and 4 (an empty phase is skipped: later, never earlier)
        assert r["control"]["pick"]["phase"] >= (0 if r["step"] < 2 else 1 if r["step"] < 4 else 2)
        assert r["control"]["pick"]["group_size"] == [2, 4, 8][r["control"]["pick"]["phase"]]
    for r in records[1:]:
        pick = r["control"]["pick"]
        assert r["rollouts_generated"] == pick["chosen"] * pick["group_size"]  # no profile after step 0
        assert pick["profile_tokens"] == control["profile_tokens"]


@pytest.mark.parametrize("name", list(SELECTORS))
def test_resume_from_a_checkpoint_gives_the_metrics_of_an_uninterrupted_run(full_runs, tmp_path, name):
    part = tmp_path / "part"
    Run.start(load_pipeline(write_spec(tmp_path, name), ["run.steps=3"]), part).train()  # checkpoints 2 and 3
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


def test_hive_s_prompt_entropy_pass_is_counted_in_the_step_s_scored_tokens(full_runs):
    for r in _metrics(full_runs["hive"]):
        pick = r["stages"]["pick"]
        assert r["tokens_scored"] == pick["tokens_scored"] > 0  # the only stage that scores here
        assert (pick["candidates"], pick["kept_stage2"]) == (8, 4)
        assert pick["kept_stage2"] <= pick["kept_stage1"] <= pick["candidates"] - pick["off_edge"]


def test_dots_reference_rollouts_are_counted_in_the_step_s_budget(full_runs):
    records = _metrics(full_runs["dots"])
    for r in records:
        pick = r["stages"]["pick"]
        # the reference set (8 prompts, 4 samples) in the rounds' steps (0, 2, 4), nothing in the others;
        # step 0 also samples the predictor's 16 training prompts, 4 times each
        reference = (32 if r["step"] % 2 == 0 else 0) + (64 if r["step"] == 0 else 0)
        assert pick["reference_rollouts"] == reference and pick["rounds_run"] == 1 - r["step"] % 2
        assert ("train_loss" in pick) == (r["step"] == 0)
        # round 0 selects mu * B = 8 (4 a step), later rounds mu * sigma * B = 4 (2 a step); 4 rollouts each
        assert pick["dispatched"] == (4 if r["step"] < 2 else 2)
        assert r["rollouts_generated"] == pick["dispatched"] * 4 + pick["reference_rollouts"]
        assert r["tokens_generated"] > pick["reference_tokens"]
        # the embedding pass (every prompt, once, at step 0) is the only scoring
        assert r["tokens_scored"] == pick["embedding_tokens"] and (pick["embedded_prompts"] > 0) == (r["step"] == 0)
    assert records[0]["stages"]["pick"]["embedded_prompts"] == 40


def test_mlflow_records_the_decisions_per_step(tmp_path):
    spec = tmp_path / "sgpo.yaml"
    spec.write_text(spec_text("sgpo").replace("tracking: {mlflow: null}", "tracking: {mlflow: {experiment: sgpo}}"))
    run = Run.start(load_pipeline(spec, ["run.steps=2"]), tmp_path / "run")
    trackers = start_tracking(run)
    run.hooks = trackers
    run.train()
    run_id = json.loads((tmp_path / "run" / "tracking.json").read_text())["mlflow_run_id"]
    client = MlflowClient(trackers[0].uri)
    records = _metrics(tmp_path / "run")
    for key in ("predicted_success", "group_size", "trivial", "profile_tokens"):
        got = sorted((m.step, m.value) for m in client.get_metric_history(run_id, f"control.pick.{key}"))
        assert got == [(r["step"], float(r["control"]["pick"][key])) for r in records]
    tokens = sorted((m.step, m.value) for m in client.get_metric_history(run_id, "tokens_generated"))
    assert tokens[0][1] == records[0]["tokens_generated"] > records[0]["control"]["pick"]["profile_tokens"]
