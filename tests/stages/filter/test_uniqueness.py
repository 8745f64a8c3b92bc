"""filter.uniqueness (uniqueness-aware RL, arXiv 2601.08763): hand-computed weights, the clusterings
(exact, and real MiniLM embeddings), the weight reaching the advantage in update.grpo, loud
misconfiguration, and the shipped pipeline running a few steps."""

from __future__ import annotations

import json
import math
import textwrap

import numpy as np
import pytest
from pydantic import ValidationError
from typer.testing import CliRunner

from gfcr.cli.main import app
from gfcr.engines import TransformersEngine, load_policy
from gfcr.errors import ModelError
from gfcr.graph import load_pipeline
from gfcr.records import Prompt, PromptPool, Rollout, RolloutGroup, RolloutGroups, Segment, StepContext
from gfcr.runtime.loop.session import Run
from gfcr.spec import PolicySpec
from gfcr.stages.filter.strategy_clusters import EmbeddingClustering, components
from gfcr.stages.filter.uniqueness import Uniqueness, uniqueness_weight
from gfcr.stages.resources import Lent
from gfcr.stages.update.grpo import GRPOUpdate
from tests.conftest import REPO

cli = CliRunner()


def rollout(gid: str, i: int, tokens: list[int], correct: bool | None, text: str | None = None) -> Rollout:
    return Rollout(f"{gid}/{i}", gid, gid.split("@")[0], list(tokens), [Segment(0, len(tokens), 0, [0.0] * len(tokens))],
                   text=text, reward=None if correct is None else float(correct), correct=correct)


def group(gid: str, rows: list[tuple[list[int], bool | None]]) -> RolloutGroup:
    return RolloutGroup(gid, gid.split("@")[0], 0, len(rows), [rollout(gid, i, t, c) for i, (t, c) in enumerate(rows)])


def stage(**config) -> Uniqueness:
    s = Uniqueness(Uniqueness.Config(**{"clustering": {"use": "exact"}, **config}))
    s.before_step(StepContext("r", 0, 0, 0))
    return s


# --- weights by hand ---------------------------------------------------------------------------

def test_weights_by_hand_alpha_one_and_a_half():
    # correct rollouts' tokens: [1], [1], [1], [2], [3]: clusters of 3, 1, 1; two wrong rollouts
    rows = [([1], True), ([1], True), ([5], False), ([1], True), ([2], True), ([3], True), ([5], False)]
    g = group("p@s0", rows)
    stage().run(RolloutGroups([g]))
    assert [r.sample_weight for r in g.rollouts] == pytest.approx([1 / 3, 1 / 3, 1, 1 / 3, 1, 1, 1])
    g = group("p@s0", rows)
    stage(alpha=0.5).run(RolloutGroups([g]))
    s3 = 1 / math.sqrt(3)  # 0.57735
    assert [r.sample_weight for r in g.rollouts] == pytest.approx([s3, s3, 1, s3, 1, 1, 1])
    g = group("p@s0", rows)
    stage(alpha=0.0).run(RolloutGroups([g]))
    assert [r.sample_weight for r in g.rollouts] == [1.0] * 7


def test_weight_incorrect_clusters_the_wrong_rollouts_among_themselves():
    # wrong: [5], [5], [6] -> clusters of 2 and 1; right: [1], [1] -> a cluster of 2 (not merged with wrong ones)
    g = group("p@s0", [([1], True), ([5], False), ([5], False), ([1], True), ([6], False)])
    s = stage(weight_incorrect=True)
    s.run(RolloutGroups([g]))
    assert [r.sample_weight for r in g.rollouts] == [0.5, 0.5, 0.5, 0.5, 1.0]
    m = s.step_metrics()
    # weights 0.5 x4 and 1.0: mean 3/5; one singleton of five; correct clusters per group: 1
    assert m == {"groups_clustered": 1, "clusters_per_group": 1.0, "weight_mean": 0.6, "weight_min": 0.5,
                 "singleton_fraction": 0.2}


def test_weights_compose_with_an_earlier_sample_weight_and_dropped_groups_are_left_alone():
    g, dropped = group("p@s0", [([1], True), ([1], True)]), group("q@s0", [([1], True), ([1], True)])
    g.rollouts[0].sample_weight = 4.0
    dropped.drop("zero variance")
    s = stage()
    s.run(RolloutGroups([g, dropped]))
    assert [r.sample_weight for r in g.rollouts] == [2.0, 0.5]
    assert [r.sample_weight for r in dropped.rollouts] == [1.0, 1.0]
    assert s.step_metrics()["groups_clustered"] == 1


def test_metrics_over_a_step_and_a_group_with_no_correct_rollout():
    s = stage()
    s.run(RolloutGroups([group("p@s0", [([1], True), ([2], True), ([2], True)]), group("q@s0", [([1], False)])]))
    m = s.step_metrics()
    # p: clusters {1}, {2, 2} -> weights 1, 1/2, 1/2; q has nothing to cluster
    assert m["groups_clustered"] == 1 and m["clusters_per_group"] == 2.0
    assert m["weight_mean"] == pytest.approx(2 / 3) and m["weight_min"] == 0.5
    assert m["singleton_fraction"] == pytest.approx(1 / 3)
    s.before_step(StepContext("r", 1, 0, 1))
    assert s.step_metrics() == {"groups_clustered": 0, "clusters_per_group": 0.0, "weight_mean": 1.0,
                                "weight_min": 1.0, "singleton_fraction": 0.0}


def test_uniqueness_weight_and_components():
    assert uniqueness_weight(1, 1.0) == 1.0 and uniqueness_weight(4, 1.0) == 0.25 and uniqueness_weight(4, 0.5) == 0.5
    with pytest.raises(ValueError, match="at least one"):
        uniqueness_weight(0, 1.0)
    # 0-2 linked, 2-3 linked (a chain), 1 alone: single linkage joins 0, 2, 3
    similar = np.array([[1, 0, 1, 0], [0, 1, 0, 0], [1, 0, 1, 1], [0, 0, 1, 1]], dtype=bool)
    assert components(similar) == [0, 1, 0, 0]


# --- the embedding clustering, with the real offline MiniLM -----------------------------------

def test_embedding_clusters_near_duplicates_and_separates_other_strategies():
    texts = ["Add the tens first: 40 + 2 = 42. Answer: 42",
             "add the tens first: 40 + 2 = 42. answer: 42",
             "Count up from 30 by ones twelve times to reach 42. Answer: 42",
             "Add the tens first: 40 + 2 = 42. Answer: 42"]
    rollouts = [rollout("p@s0", i, [i + 1], True, text) for i, text in enumerate(texts)]
    clusterer = EmbeddingClustering(use="embedding", threshold=0.9).build()
    clusterer.setup()
    vectors = clusterer.model.encode(texts)
    cos = vectors @ vectors.T
    assert cos[0, 1] >= 0.9 and cos[0, 2] < 0.9  # what the threshold separates
    assert clusterer.labels([rollouts]) == [[0, 0, 1, 0]]
    assert clusterer.labels([rollouts[::-1]]) == [[0, 1, 0, 0]]  # same partition in another order
    assert clusterer.labels([rollouts[:2], rollouts[2:]]) == [[0, 0], [0, 1]]  # one batch, two subsets


def test_embedding_needs_response_text():
    g = group("p@s0", [([1], True)])
    s = Uniqueness(Uniqueness.Config())
    with pytest.raises(ValueError, match=r"no response text.*clustering: \{use: exact\}"):
        s.run(RolloutGroups([g]))


# --- the weight reaches the update ------------------------------------------------------------

def test_the_weight_scales_the_advantage_in_update_grpo():
    policy = load_policy(PolicySpec(model="tiny-arith"))
    prompt = Prompt("a:0", text="What is 12 + 30? Answer:")

    def make(i: int, text: str, reward: float) -> Rollout:
        ids = list(policy.tokenizer.encode(text, add_special_tokens=False)) + [policy.tokenizer.eos_token_id]
        return Rollout(f"a:0@s0/{i}", "a:0@s0", "a:0", ids, [Segment(0, len(ids), 0, [-1.0] * len(ids))],
                       text=text, reward=reward, correct=reward == 1.0)

    # correct: " 42" twice and "42" (other tokens) once; " 41" is wrong
    rollouts = [make(0, " 42", 1.0), make(1, " 42", 1.0), make(2, "42", 1.0), make(3, " 41", 0.0)]
    groups = RolloutGroups([RolloutGroup("a:0@s0", "a:0", 0, 4, rollouts)])
    Uniqueness(Uniqueness.Config(clustering={"use": "exact"})).run(groups)
    assert [r.sample_weight for r in rollouts] == [0.5, 0.5, 1.0, 1.0]
    update = GRPOUpdate(GRPOUpdate.Config(lr=1e-3))  # mean_std: sample std (ddof 1), eps 1e-6
    update.setup(Lent(policy, TransformersEngine(policy)))
    update.run(groups, PromptPool([prompt]))
    # rewards [1, 1, 1, 0]: mean 3/4, sample std sqrt((3 * 1/16 + 9/16) / 3) = 1/2
    # GRPO advantages [1/2, 1/2, 1/2, -3/2], times the weights [1/2, 1/2, 1, 1]
    a = 0.25 / (0.5 + 1e-6)
    assert [r.advantage for r in rollouts] == pytest.approx([a / 2, a / 2, a, -3 * a], rel=1e-9)


# --- misconfiguration -------------------------------------------------------------------------

@pytest.mark.parametrize("config, match", [
    ({"alpha": -1.0}, "greater than or equal to 0"),
    ({"clustering": {"use": "embedding", "threshold": 1.5}}, "less than or equal to 1"),
    ({"clustering": {"use": "judge"}}, "embedding', 'exact'"),
    ({"clustering": {"use": "exact", "threshold": 0.9}}, "Extra inputs are not permitted"),
    ({"weights": 1.0}, "Extra inputs are not permitted"),
])
def test_bad_configs_are_refused(config, match):
    with pytest.raises(ValidationError, match=match):
        Uniqueness.Config(**config)


def test_a_rollout_without_a_verdict_is_an_error_naming_its_group():
    with pytest.raises(ValueError, match=r"group p@s0: rollouts p@s0/1 have no verdict.*filter.verify"):
        stage().run(RolloutGroups([group("p@s0", [([1], True), ([2], None)])]))


def test_a_missing_embedder_folder_fails_at_setup(tmp_path):
    s = Uniqueness(Uniqueness.Config(clustering={"use": "embedding", "embedder": str(tmp_path / "nope")}))
    with pytest.raises(ModelError, match="not a sentence-transformers folder"):
        s.setup(Lent())


BAD = textwrap.dedent("""\
    name: bad-uniqueness
    policy: {model: tiny-arith}
    data: {source: arithmetic, with: {n: 8, seed: 0}}
    stages:
      pick:    {use: control.uniform, with: {batch_size: 2}}
      budget:  {use: control.fixed_n, from: pick, with: {n: 4}}
      rollout: {use: generate.sample, from: budget, with: {max_new_tokens: 8}}
      rare:    {use: filter.uniqueness, from: rollout, with: {clustering: {use: exact}}}
      reward:  {use: filter.verify, from: rare}
    update: {use: update.grpo, from: reward}
    """)


def test_validate_refuses_the_stage_before_the_verifier_and_a_bad_threshold_with_file_and_line(tmp_path):
    spec = tmp_path / "bad.yaml"
    spec.write_text(BAD)
    result = cli.invoke(app, ["validate", str(spec)])
    assert result.exit_code == 2
    assert f"{spec}:8" in result.output and "nothing upstream of this stage marks rollouts correct" in result.output
    assert "from: reward" in result.output
    spec.write_text(BAD.replace("{use: exact}", "{use: embedding, threshold: 2.0}"))
    result = cli.invoke(app, ["validate", str(spec)])
    assert result.exit_code == 2 and f"{spec}:8" in result.output and "threshold" in result.output


# --- the shipped pipeline ---------------------------------------------------------------------

def test_the_shipped_pipeline_validates_and_runs_a_few_steps(tmp_path):
    assert cli.invoke(app, ["validate", str(REPO / "pipelines" / "uniqueness_arith.yaml")]).exit_code == 0
    compiled = load_pipeline(REPO / "pipelines" / "uniqueness_arith.yaml",
                             ["run.steps=3", "eval.every=100", "executor.kind=local", "tracking.mlflow=null"])
    Run.start(compiled, tmp_path / "run").train()
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [0, 1, 2]
    for r in records:
        m = r["stages"]["rare"]
        assert 0 < m["weight_min"] <= m["weight_mean"] <= 1.0
        assert m["groups_clustered"] >= 1 and m["clusters_per_group"] >= 1.0
