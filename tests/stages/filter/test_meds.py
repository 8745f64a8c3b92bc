"""filter.meds (MEDS, arXiv 2604.11297): the penalty and the HDBSCAN clusters by hand, the error
memory across steps with real tiny-arith fingerprints, the fingerprint cost charged to the step,
loud misconfiguration, and the memory surviving checkpoint, resume and a SIGKILL."""

from __future__ import annotations

import json
import math
import textwrap
from pathlib import Path

import numpy as np
import pytest
from pydantic import ValidationError
from typer.testing import CliRunner

from gfcr.cli.main import app
from gfcr.engines import load_policy
from gfcr.errors import ModelError
from gfcr.graph import load_pipeline
from gfcr.records import Origin, Prompt, PromptPool, Rollout, RolloutGroup, RolloutGroups, Segment, StepContext
from gfcr.runtime.session import Run
from gfcr.runtime.state_tree import read_tree, write_tree
from gfcr.spec import PolicySpec
from gfcr.stages.common.fingerprints import fingerprints
from gfcr.stages.filter.error_memory import ErrorMemory, clusters
from gfcr.stages.filter.meds import MEDS, meds_penalty
from gfcr.stages.resources import Resources
from tests.conftest import REPO
from tests.killing import sigkill_after_step

cli = CliRunner()
PROMPTS = PromptPool([Prompt("a:0", text="What is 12 + 30? Answer:"), Prompt("b:0", text="What is 7 + 5? Answer:")])


@pytest.fixture(scope="module")
def policy():
    return load_policy(PolicySpec(model="tiny-arith"))


def group(policy, prompt: str, step: int, answers: list[tuple[str, bool]]) -> RolloutGroup:
    gid = f"{prompt}@s{step}"
    rollouts = []
    for i, (text, correct) in enumerate(answers):
        ids = list(policy.tokenizer.encode(text, add_special_tokens=False))
        rollouts.append(Rollout(f"{gid}/{i}", gid, prompt, ids, [Segment(0, len(ids), step, [0.0] * len(ids))],
                                text=text, reward=float(correct), correct=correct))
    return RolloutGroup(gid, prompt, step, len(rollouts), rollouts)


def stage(policy, **config) -> tuple[MEDS, Resources]:
    resources = Resources(policy)
    s = MEDS(MEDS.Config(**config))
    s.setup(resources)
    return s, resources


def step(s: MEDS, n: int, *groups: RolloutGroup) -> RolloutGroups:
    s.before_step(StepContext("r", n, 0, n))
    return s.run(RolloutGroups(list(groups)), PROMPTS)


# --- by hand -----------------------------------------------------------------------------------

def test_the_penalty_by_hand():
    assert meds_penalty(0, 0.1, 0.5) == 0.0  # noise
    assert meds_penalty(4, 0.1, 0.5) == pytest.approx(0.1 * math.log(5))  # 0.16094
    assert meds_penalty(3, 1.0, 5.0) == pytest.approx(math.log(4))  # 1.38629
    assert meds_penalty(200, 0.1, 0.5) == 0.5  # 0.1 * ln 201 = 0.530 > the cap
    with pytest.raises(ValueError, match=">= 0"):
        meds_penalty(-1, 0.1, 0.5)


def test_hdbscan_clusters_by_hand():
    # three identical points and a far one: one cluster of 3, the far one noise
    labels, sizes = clusters(np.array([[0, 0], [0, 0], [0, 0], [9, 9]], dtype=np.float32), 2)
    assert labels == [0, 0, 0, -1] and sizes == [3, 3, 3, 0]
    # two pairs of equal points 7.07 apart and a point as far again: two clusters of 2, the last one noise
    labels, sizes = clusters(np.array([[0, 0], [0, 0], [5, 5], [5, 5], [10, 10]], dtype=np.float32), 2)
    assert sizes == [2, 2, 2, 2, 0] and labels[0] != labels[2]
    # two points are never clustered (HDBSCAN would call any pair one cluster); nor fewer than min_cluster_size
    assert clusters(np.array([[0, 0], [0, 0]], dtype=np.float32), 2) == ([-1, -1], [0, 0])
    assert clusters(np.zeros((3, 2), dtype=np.float32), 4) == ([-1] * 3, [0] * 3)


def test_memory_is_fifo_per_prompt_evicts_the_least_recent_prompt_and_round_trips(tmp_path):
    m = ErrorMemory(per_prompt=2, max_prompts=2)
    m.add("a", np.array([[1.0], [2.0]], dtype=np.float32))
    m.add("b", np.array([[3.0]], dtype=np.float32))
    m.add("a", np.array([[4.0]], dtype=np.float32))  # a keeps its newest two: [2], [4]; a is now the most recent
    assert m.of("a", 1).tolist() == [[2.0], [4.0]]
    m.add("c", np.array([[5.0]], dtype=np.float32))  # b, the least recently updated, leaves
    assert list(m.rows) == ["a", "c"] and m.entries == 3
    write_tree(m.state_dict(), tmp_path)
    back = ErrorMemory(2, 2)
    back.load_state_dict(read_tree(tmp_path))
    assert list(back.rows) == ["a", "c"] and all(np.array_equal(back.rows[k], m.rows[k]) for k in m.rows)
    empty = ErrorMemory(2, 2)
    write_tree(empty.state_dict(), tmp_path / "empty")
    empty.load_state_dict(read_tree(tmp_path / "empty"))
    assert empty.rows == {}


# --- with the tiny-arith policy ----------------------------------------------------------------

def test_fingerprints_are_unit_vectors_of_layers_times_width_and_equal_for_equal_rollouts(policy):
    tok = policy.tokenizer
    prompt = policy.encode(PROMPTS.get("a:0"))
    rows = [(prompt, tok.encode(t, add_special_tokens=False)) for t in (" 41", " 41", " 40")]
    f = fingerprints(policy.model, rows, tok.eos_token_id)
    assert f.shape == (3, 2 * 128)  # 2 decoder layers of width 128
    assert np.allclose(np.linalg.norm(f, axis=1), 1.0, atol=1e-5)
    assert np.allclose(f[0], f[1], atol=1e-6) and not np.allclose(f[0], f[2], atol=1e-3)
    assert fingerprints(policy.model, rows, tok.eos_token_id, layers=[-1]).shape == (3, 128)
    # a batch of one gives the same fingerprint as the padded batch of three
    assert np.allclose(fingerprints(policy.model, rows[2:], tok.eos_token_id)[0], f[2], atol=1e-5)


def test_the_memory_makes_a_recurring_error_cost_more_across_steps(policy):
    s, resources = stage(policy)
    first = group(policy, "a:0", 0, [(" 41", False), (" 41", False), (" 42", True)])
    step(s, 0, first)
    # two errors only: not clustered, no penalty; both remembered
    assert [r.reward for r in first.rollouts] == [0.0, 0.0, 1.0]
    assert [r.reward_components["meds"] for r in first.rollouts] == [0.0, 0.0, 0.0]
    assert s.step_metrics()["memory_entries"] == 2 and s.step_metrics()["penalised"] == 0
    later, other = group(policy, "a:0", 1, [(" 41", False), (" 42", True)]), group(policy, "b:0", 1, [(" 41", False)])
    step(s, 1, later, other)
    # a:0: the memory's two " 41" and this one are one cluster of 3: 0.1 * ln 4 = 0.13863
    assert later.rollouts[0].reward == pytest.approx(-0.1 * math.log(4))
    assert later.rollouts[0].reward_components["meds"] == pytest.approx(-0.1 * math.log(4))
    assert later.rollouts[1].reward == 1.0
    assert other.rollouts[0].reward == 0.0  # b:0 has its own memory, empty until now
    m = s.step_metrics()
    assert (m["errors_fingerprinted"], m["penalised"], m["error_clusters"], m["memory_prompts"], m["memory_entries"]) \
        == (2, 1, 1, 2, 4)
    assert m["penalty_mean"] == m["penalty_max"] == pytest.approx(0.1 * math.log(4))


def test_the_fingerprint_pass_is_charged_to_tokens_scored(policy):
    s, resources = stage(policy)
    g = group(policy, "a:0", 0, [(" 41", False), (" 4", False), (" 42", True)])
    step(s, 0, g)
    prompt = len(policy.encode(PROMPTS.get("a:0")))
    expected = (prompt + len(g.rollouts[0])) + (prompt + len(g.rollouts[1]))  # the two errors, prompt + response
    assert resources.take_tokens_scored() == expected == s.step_metrics()["tokens_fingerprinted"]
    with pytest.raises(ValueError, match=">= 0"):
        resources.charge_scoring(-1)


def test_reused_shaped_and_dropped_rollouts_are_left_alone(policy):
    s, _ = stage(policy)
    g = group(policy, "a:0", 0, [(" 41", False)] * 4)
    g.rollouts[0].origin, g.rollouts[0].replayed_from = Origin.REPLAYED, "a:0@s-1/0"
    g.rollouts[1].reward_components = {"meds": -0.2}
    g.rollouts[1].reward = -0.2
    dropped = group(policy, "a:0", 0, [(" 41", False)] * 3)
    dropped.drop("zero variance")
    step(s, 0, g, dropped)
    # only rollouts 2 and 3 are fingerprinted: two points, no cluster; the replayed one has no component
    assert s.step_metrics()["errors_fingerprinted"] == 2 and s.memory.entries == 2
    assert "meds" not in g.rollouts[0].reward_components and g.rollouts[1].reward == -0.2
    assert all("meds" not in r.reward_components for r in dropped.rollouts)


# --- misconfiguration --------------------------------------------------------------------------

@pytest.mark.parametrize("config, match", [
    ({"alpha": -0.1}, "greater than or equal to 0"),
    ({"min_cluster_size": 1}, "greater than or equal to 2"),
    ({"memory_per_prompt": 0}, "greater than or equal to 1"),
    ({"penalty": 0.5}, "Extra inputs are not permitted"),
])
def test_bad_configs_are_refused(config, match):
    with pytest.raises(ValidationError, match=match):
        MEDS.Config(**config)


def test_setup_refuses_layers_out_of_range_and_a_pipeline_without_a_policy(policy):
    with pytest.raises(ModelError, match=r"\[5\] out of range for a policy with 2 decoder layers"):
        stage(policy, layers=[0, 5])
    with pytest.raises(ModelError, match="needs a policy"):
        MEDS(MEDS.Config()).setup(Resources())


def test_an_unscored_rollout_is_an_error_naming_its_group(policy):
    s, _ = stage(policy)
    g = group(policy, "a:0", 0, [(" 41", False)])
    g.rollouts[0].reward, g.rollouts[0].correct = None, None
    with pytest.raises(ValueError, match=r"group a:0@s0: rollouts a:0@s0/0 have no reward.*filter.verify"):
        step(s, 0, g)


SPEC = textwrap.dedent("""\
    name: meds-small
    policy: {model: tiny-arith}
    data: {source: arithmetic, with: {n: 8, seed: 0, digits: 2, operators: ["+", "-"]}}
    stages:
      pick:    {use: control.uniform, with: {batch_size: 4}}
      budget:  {use: control.fixed_n, from: pick, with: {n: 4}}
      rollout: {use: generate.sample, from: budget, with: {max_new_tokens: 8}}
      reward:  {use: filter.verify, from: rollout}
      meds:    {use: filter.meds, from: reward, with: {memory_per_prompt: 8}}
    update: {use: update.grpo, from: meds, with: {lr: 3.0e-4, loss: {use: ppo_clip, with: {clip: [0.2, 0.28]}}}}
    run: {steps: 6, seed: 0, checkpoint_every: 2}
    tracking: {mlflow: null}
    """)


def test_validate_refuses_meds_before_the_verifier_with_file_and_line(tmp_path):
    spec = tmp_path / "bad.yaml"
    spec.write_text(SPEC.replace("reward:  {use: filter.verify, from: rollout}", "reward:  {use: filter.verify, from: meds}")
                    .replace("meds:    {use: filter.meds, from: reward,", "meds:    {use: filter.meds, from: rollout,")
                    .replace("from: meds, with: {lr", "from: reward, with: {lr"))
    result = cli.invoke(app, ["validate", str(spec)])
    assert result.exit_code == 2
    assert f"{spec}:9" in result.output and "no errors to remember" in result.output and "from: reward" in result.output
    spec.write_text(SPEC.replace("memory_per_prompt: 8", "memory_per_prompt: 0"))
    result = cli.invoke(app, ["validate", str(spec)])
    assert result.exit_code == 2 and f"{spec}:9" in result.output and "memory_per_prompt" in result.output


# --- real runs: the shipped pipeline, resume, SIGKILL --------------------------------------------

def _metrics(run_dir: Path) -> list[dict]:
    return [{k: v for k, v in json.loads(line).items() if k != "time"}
            for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _memory(run_dir: Path, step: int) -> dict:
    state = read_tree(run_dir / "checkpoints" / f"step-{step:06d}" / "stages" / "meds")
    return state


@pytest.fixture(scope="module")
def full_run(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("meds")
    spec = root / "spec.yaml"
    spec.write_text(SPEC)
    Run.start(load_pipeline(spec), root / "full").train()
    return root / "full"


def test_a_run_penalises_recurring_errors_and_charges_the_fingerprints(full_run):
    records = _metrics(full_run)
    assert [r["step"] for r in records] == list(range(6))
    meds = [r["stages"]["meds"] for r in records]
    assert meds[-1]["memory_entries"] > 0 and sum(m["penalised"] for m in meds) > 0
    for r, m in zip(records, meds):
        assert r["tokens_scored"] == m["tokens_fingerprinted"]  # nothing else scores in this pipeline
        assert 0.0 <= m["penalty_mean"] <= m["penalty_max"] <= 0.5


def test_resume_gives_the_memory_and_metrics_of_an_uninterrupted_run(full_run, tmp_path):
    spec = tmp_path / "spec.yaml"
    spec.write_text(SPEC)
    part = tmp_path / "part"
    Run.start(load_pipeline(spec, ["run.steps=3"]), part).train()
    Run.resume(part, steps=6).train()
    assert _metrics(part) == _metrics(full_run)
    _same_memory(_memory(part, 6), _memory(full_run, 6))


@pytest.mark.slow
def test_a_sigkilled_run_resumes_to_the_memory_and_metrics_of_an_uninterrupted_run(full_run, tmp_path):
    spec = tmp_path / "spec.yaml"
    spec.write_text(SPEC)
    run_dir = tmp_path / "killed"
    sigkill_after_step(spec, run_dir, 4, tmp_path)
    assert [r["step"] for r in _metrics(run_dir)] == [0, 1, 2, 3, 4]
    Run.resume(run_dir).train()
    assert _metrics(run_dir) == _metrics(full_run)
    _same_memory(_memory(run_dir, 6), _memory(full_run, 6))


def _same_memory(got: dict, expected: dict) -> None:
    g, e = got["memory"], expected["memory"]
    assert (g["prompts"], g["counts"]) == (e["prompts"], e["counts"]) and sum(e["counts"]) > 0
    assert np.array_equal(g["vectors"], e["vectors"])


def test_the_shipped_pipeline_validates_and_runs_a_few_steps(tmp_path):
    assert cli.invoke(app, ["validate", str(REPO / "pipelines" / "meds_arith.yaml")]).exit_code == 0
    compiled = load_pipeline(REPO / "pipelines" / "meds_arith.yaml",
                             ["run.steps=3", "eval.every=100", "executor.kind=local", "tracking.mlflow=null"])
    Run.start(compiled, tmp_path / "run").train()
    records = _metrics(tmp_path / "run")
    assert [r["step"] for r in records] == [0, 1, 2]
    assert all(r["stages"]["meds"]["errors_fingerprinted"] > 0 for r in records)
