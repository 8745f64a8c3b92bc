"""filter.meds (MEDS, arXiv 2604.11297): the penalty, the kNN assignment and the HDBSCAN memory by
hand (the reference's own cases are in tests/fidelity/test_meds*.py), the memory across steps with
real tiny-arith fingerprints, the fingerprint cost charged to the step, loud misconfiguration, and
the memory surviving checkpoint, resume and a SIGKILL."""

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
from gfcr.runtime.loop.session import Run
from gfcr.runtime.store.state_tree import read_tree, write_tree
from gfcr.spec import PolicySpec
from gfcr.stages.common.fingerprints import answer_logits, boxed_anchor, fingerprints, first_token_anchor
from gfcr.stages.filter.error_memory import ErrorMemory, hdbscan_labels
from gfcr.stages.filter.meds import MEDS, meds_penalty, shaped
from gfcr.stages.resources import Lent
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


def stage(policy, **config) -> tuple[MEDS, Lent]:
    resources = Lent(policy)
    s = MEDS(MEDS.Config(**{"anchor": "first_token", **config}))
    s.setup(resources)
    return s, resources


def step(s: MEDS, n: int, *groups: RolloutGroup) -> RolloutGroups:
    s.before_step(StepContext("r", n, 0, n))
    return s.run(RolloutGroups(list(groups)), PROMPTS)


# --- by hand -----------------------------------------------------------------------------------

def test_the_penalty_by_hand():
    assert meds_penalty(0, 0.1, 0.5) == 0.0  # first sight
    assert meds_penalty(4, 0.1, 0.5) == pytest.approx(0.1 * math.log(5))  # 0.16094
    assert meds_penalty(3, 1.0, 5.0) == pytest.approx(math.log(4))  # 1.38629
    assert meds_penalty(200, 0.1, 0.5) == 0.5  # 0.1 * ln 201 = 0.530 > the cap
    assert shaped(0.0, False, 0.2) == -0.2 and shaped(1.0, True, 0.25) == 0.8  # wrong: r - p; right: r / (1 + p)
    with pytest.raises(ValueError, match=">= 0"):
        meds_penalty(-1, 0.1, 0.5)


def test_hdbscan_labels_by_hand():
    # on L2-normalised points: two directions, two points each: two clusters
    labels = hdbscan_labels(np.array([[1, 0], [2, 0], [0, 1], [0, 3]], dtype=float), 2)
    assert labels[0] == labels[1] >= 0 and labels[2] == labels[3] >= 0 and labels[0] != labels[2]
    # one group and a far point: no single cluster is allowed (as in the reference), all noise
    assert hdbscan_labels(np.array([[1, 0], [2, 0], [3, 0], [0, 1]], dtype=float), 2).tolist() == [-1] * 4
    # fewer than two points are all noise
    assert hdbscan_labels(np.zeros((1, 2)), 2).tolist() == [-1]


def test_assignment_is_a_knn_vote_over_past_labels_counting_the_past_only():
    m = ErrorMemory(k=3)
    a = np.array([[1.0, 0.0, 0.0]] * 3 + [[0.0, 1.0, 0.0]] * 2)
    assert m.assign(("p", False), a) == ([None] * 5, [0] * 5)  # first sight: size 0
    m.add(("p", False), a)
    assert m.clusters(("p", False)) == 2
    labels, sizes = m.assign(("p", False), np.array([[2.0, 0.1, 0.0], [0.0, 3.0, 0.1]]))
    assert sizes == [3, 2] and labels[0] != labels[1]  # cosine: scale does not matter
    # the right answers of the prompt have a memory of their own
    assert m.assign(("p", True), a[:1])[1] == [0]
    # a point among past noise takes the noise label, and its size counts the past noise (as the reference)
    noisy = ErrorMemory(k=3)
    noisy.add(("q", False), np.eye(3))  # three orthogonal points: all noise
    assert noisy.labels[("q", False)].tolist() == [-1, -1, -1]
    assert noisy.assign(("q", False), np.array([[1.0, 0.1, 0.0]])) == ([-1], [3])


def test_memory_caps_per_key_and_keys_and_round_trips(tmp_path):
    m = ErrorMemory(per_key=2, max_keys=2)
    m.add(("a", False), np.array([[1.0], [2.0]]))
    m.add(("b", False), np.array([[3.0]]))
    m.add(("a", False), np.array([[4.0]]))  # a keeps its newest two: [2], [4]; a is now the most recent
    assert m.rows[("a", False)].tolist() == [[2.0], [4.0]] and len(m.labels[("a", False)]) == 2
    m.add(("c", True), np.array([[5.0]]))  # b, the least recently updated, leaves
    assert list(m.rows) == [("a", False), ("c", True)] and m.entries == 3 and m.prompts == 2
    write_tree(m.state_dict(), tmp_path)
    back = ErrorMemory(2, 2)
    back.load_state_dict(read_tree(tmp_path))
    assert list(back.rows) == list(m.rows) and all(np.array_equal(back.rows[k], m.rows[k]) for k in m.rows)
    assert all(np.array_equal(back.labels[k], m.labels[k]) for k in m.rows)
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


def test_answer_logits_and_anchors_on_tiny_arith(policy):
    tok = policy.tokenizer
    prompt = policy.encode(PROMPTS.get("a:0"))
    rows = [(prompt, tok.encode(t, add_special_tokens=False)) for t in (" 41", " 42", " 51")]
    anchors = [first_token_anchor([tok.decode([t]) for t in r]) for _, r in rows]
    assert anchors == [0, 0, 0]  # the space, which predicts the first digit
    f = answer_logits(policy.model, [(p, r, a) for (p, r), a in zip(rows, anchors)], tok.eos_token_id, 14)
    assert f.shape == (3, 2)  # 2 decoder layers (fewer than 14)
    assert np.array_equal(f[0], f[1]) and not np.allclose(f[0], f[2])  # same first digit, same context
    assert boxed_anchor([1, 2, 3, 4], [2, 3], ["a", "b", "c", "d"]) == 2  # the last token of the marker
    assert boxed_anchor([1, 2], [7, 8], ["a", "b"]) is None


def test_the_memory_makes_a_recurring_error_cost_more_across_steps(policy):
    s, resources = stage(policy)
    first = group(policy, "a:0", 0, [(" 41", False), (" 41", False), (" 42", True)])
    step(s, 0, first)
    # first sight: no penalty; the two errors are remembered (right answers are not: target wrong)
    assert [r.reward for r in first.rollouts] == [0.0, 0.0, 1.0]
    assert [r.reward_components["meds"] for r in first.rollouts] == [0.0, 0.0, 0.0]
    assert s.step_metrics()["memory_entries"] == 2 and s.step_metrics()["penalised"] == 0
    later = group(policy, "a:0", 1, [(" 41", False), (" 42", True), (" 37", False)])
    other = group(policy, "b:0", 1, [(" 41", False)])
    step(s, 1, later, other)
    # a:0: " 41" joins the past cluster of 2: 0.1 * ln 3; " 37" starts with another digit, but its
    # nearest past labels are the same cluster's (k = 3 over 2 points), so it counts 2 as well
    assert later.rollouts[0].reward == pytest.approx(-0.1 * math.log(3))
    assert later.rollouts[0].reward_components["meds"] == pytest.approx(-0.1 * math.log(3))
    assert later.rollouts[1].reward == 1.0 and later.rollouts[2].reward == pytest.approx(-0.1 * math.log(3))
    assert other.rollouts[0].reward == 0.0  # b:0 has its own memory, empty until now
    m = s.step_metrics()
    assert (m["fingerprinted"], m["penalised"], m["memory_prompts"], m["memory_entries"]) == (3, 2, 2, 5)
    assert m["penalty_mean"] == m["penalty_max"] == pytest.approx(0.1 * math.log(3))


def test_target_both_divides_right_answers_in_a_past_cluster(policy):
    s, _ = stage(policy, target="both")
    step(s, 0, group(policy, "a:0", 0, [(" 42", True), (" 42", True)]))
    later = group(policy, "a:0", 1, [(" 42", True), (" 41", False)])
    step(s, 1, later)
    assert later.rollouts[0].reward == pytest.approx(1.0 / (1.0 + 0.1 * math.log(3)))
    assert later.rollouts[1].reward == 0.0  # its wrong-answer memory was empty


def test_a_response_without_boxed_is_not_fingerprinted_by_default(policy):
    s, _ = stage(policy, anchor="boxed")
    g = group(policy, "a:0", 0, [(" 41", False), (" 41", False)])
    step(s, 0, g)
    assert s.step_metrics()["no_answer"] == 2 and s.step_metrics()["fingerprinted"] == 0 and s.memory.entries == 0
    assert [r.reward_components["meds"] for r in g.rollouts] == [0.0, 0.0]


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
    # only rollouts 2 and 3 are fingerprinted; the replayed one has no component
    assert s.step_metrics()["fingerprinted"] == 2 and s.memory.entries == 2
    assert "meds" not in g.rollouts[0].reward_components and g.rollouts[1].reward == -0.2
    assert all("meds" not in r.reward_components for r in dropped.rollouts)


# --- misconfiguration --------------------------------------------------------------------------

@pytest.mark.parametrize("config, match", [
    ({"alpha": -0.1}, "greater than or equal to 0"),
    ({"min_cluster_size": 1}, "greater than or equal to 2"),
    ({"memory_per_prompt": 0}, "greater than or equal to 1"),
    ({"anchor": "last"}, "'boxed' or 'first_token'"),
    ({"target": "all"}, "'wrong', 'right' or 'both'"),
    ({"penalty": 0.5}, "Extra inputs are not permitted"),
])
def test_bad_configs_are_refused(config, match):
    with pytest.raises(ValidationError, match=match):
        MEDS.Config(**config)


def test_setup_refuses_layers_out_of_range_and_a_pipeline_without_a_policy(policy):
    with pytest.raises(ModelError, match=r"\[5\] out of range for a policy with 2 decoder layers"):
        stage(policy, layers=[0, 5])
    with pytest.raises(ModelError, match="needs a policy"):
        MEDS(MEDS.Config()).setup(Lent())


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
      meds:    {use: filter.meds, from: reward, with: {memory_per_prompt: 8, anchor: first_token}}
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
        assert 0.0 <= m["penalty_mean"] <= m["penalty_max"] <= 0.2


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
    assert (g["keys"], g["counts"], g["labels"]) == (e["keys"], e["counts"], e["labels"]) and sum(e["counts"]) > 0
    assert np.array_equal(g["vectors"], e["vectors"])


def test_the_shipped_pipeline_validates_and_runs_a_few_steps(tmp_path):
    assert cli.invoke(app, ["validate", str(REPO / "pipelines" / "meds_arith.yaml")]).exit_code == 0
    compiled = load_pipeline(REPO / "pipelines" / "meds_arith.yaml",
                             ["run.steps=3", "eval.every=100", "executor.kind=local", "tracking.mlflow=null"])
    Run.start(compiled, tmp_path / "run").train()
    records = _metrics(tmp_path / "run")
    assert [r["step"] for r in records] == [0, 1, 2]
    assert all(r["stages"]["meds"]["fingerprinted"] > 0 for r in records)
