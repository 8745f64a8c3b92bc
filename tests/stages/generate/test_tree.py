"""generate.tree (TreeRL EPTree) on the deterministic fake engine: the branch points are the most
uncertain own tokens of each tree, branches copy their prefix token for token, the topology is
the one the fork points imply, and the tokens a branch copied are not counted as generated.
Then a short real run on the tiny-arith policy, with tree advantages in the update."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from gfcr.engines.fake import FakeEngine
from gfcr.graph import load_pipeline
from gfcr.records import Allocation, AllocationEntry, Prompt, RolloutGroup, StepReport
from gfcr.runtime.loop.session import Run
from gfcr.stages.generate.tree import Tree
from gfcr.stages.resources import Lent
from tests.conftest import REPO
from tests.engines.test_decode_loop import FakePolicy


class CountingEngine(FakeEngine):
    """TEST/FAKE: the fake engine, counting the NEW tokens of every completion it returns."""

    def __init__(self):
        super().__init__()
        self.new_tokens, self.calls = 0, []

    def generate(self, requests, controller=None, max_in_flight=None):
        out = super().generate(requests, controller, max_in_flight)
        self.new_tokens += sum(len(c.token_ids) for group in out for c in group)
        self.calls.append(list(requests))
        return out


def run_tree(m=2, prompts=2, **config) -> tuple[list[RolloutGroup], CountingEngine]:
    engine = CountingEngine()
    stage = Tree(Tree.Config(max_new_tokens=config.pop("max_new_tokens", 12), **config))
    stage.setup(Lent(FakePolicy(engine), engine))
    allocation = Allocation(0, tuple(AllocationEntry(Prompt(f"p:{i}", text=f"{i}+{i}="), m) for i in range(prompts)))
    return stage.run(allocation).groups, engine


def most_uncertain(leaves, n):
    """Hand rule: the n largest -log mu over the leaves' OWN tokens, ties to the earlier leaf/position."""
    cands = []
    for q, r in enumerate(leaves):
        own = r.branch_token_idx or 0
        for t in range(own, len(r)):
            cands.append((float(r.behavior_logprobs[t]), q, t))  # ascending log mu = descending -log mu
    cands.sort()
    return [(q, t) for _, q, t in cands[:n]]


def test_one_iteration_branches_at_the_top_n_uncertain_tokens_of_each_tree():
    groups, engine = run_tree(m=2, top_n=2, iterations=1, branches=2)
    for g in groups:
        assert len(g.rollouts) == 2 * (1 + 1 * 2 * 2)  # M * (1 + L N T)
        for tree in ("t0", "t1"):
            leaves = [r for r in g.rollouts if r.tree_id == tree]
            root, branches = leaves[0], leaves[1:]
            assert root.branch_token_idx is None
            forks = sorted(t for _, t in most_uncertain([root], 2))
            # T = 2 branches from each chosen position of the root sample
            assert sorted(r.branch_token_idx for r in branches) == [forks[0]] * 2 + [forks[1]] * 2
            for r in branches:  # the prefix is copied token for token, with its behaviour log-probs
                t = r.branch_token_idx
                assert r.response_token_ids[:t] == root.response_token_ids[:t]
                np.testing.assert_array_equal(r.behavior_logprobs[:t], root.behavior_logprobs[:t])
                assert r.generated_length == len(r) - t
    # every request of the branching call continues a prefix from token ids
    assert all(req.prefix is not None and req.n == 2 for req in engine.calls[1])
    assert len(engine.calls) == 2  # one call for the roots, one per iteration


def test_tokens_generated_count_each_sampled_token_once():
    groups, engine = run_tree(m=3, top_n=2, iterations=2, branches=2)
    generated = sum(r.generated_length for g in groups for r in g.rollouts)
    assert generated == engine.new_tokens  # exactly what the engine sampled
    assert generated < sum(len(r) for g in groups for r in g.rollouts)  # copied prefixes are not
    report = StepReport("run", 0, 0, tuple(groups), None, {}, {})
    assert report.tokens_generated == engine.new_tokens
    assert report.rollouts_generated == sum(len(g.rollouts) for g in groups) == 2 * 3 * (1 + 2 * 2 * 2)


def test_the_topology_is_the_one_the_fork_points_imply():
    groups, _ = run_tree(m=2, prompts=1, top_n=1, iterations=2, branches=1)
    (g,) = groups
    tree, by_id = g.tree, {r.rollout_id: r for r in g.rollouts}
    assert sorted(tree.children["root"]) == sorted({f"n{i}@0" for i, r in enumerate(g.rollouts)
                                                    if r.branch_token_idx is None or r.branch_token_idx == 0})
    assert sorted(tree.leaves["root"]) == sorted(by_id)
    for node, (start, end) in tree.spans.items():
        leaves = [by_id[i] for i in tree.leaves[node]]
        assert 0 <= start <= end
        if len(leaves) > 1:  # an inner node: its leaves agree on [0, end) and its children split at end
            assert len({tuple(r.response_token_ids[:end]) for r in leaves}) == 1
            assert sorted(i for c in tree.children[node] for i in tree.leaves[c]) == sorted(tree.leaves[node])
            assert all(tree.spans[c][0] == end for c in tree.children[node])
        else:  # a leaf node: the leaf's own, to its end
            (r,) = leaves
            assert end == len(r) and r.node_id == node
    for r in g.rollouts:  # each leaf's path tiles its response
        path = sorted((n for n, ids in tree.leaves.items() if r.rollout_id in ids), key=lambda n: tree.spans[n])
        spans = [tree.spans[n] for n in path if n != "root"]
        assert spans[0][0] == 0 and spans[-1][1] == len(r)
        assert all(a[1] == b[0] for a, b in zip(spans, spans[1:]))
        assert r.parent_node_id == path[-2]
    # L = 2 iterations, N = 1, T = 1 per tree: 3 leaves per tree
    assert [r.tree_id for r in g.rollouts] == ["t0"] * 3 + ["t1"] * 3


def test_entropy_uncertainty_and_the_copied_entropies():
    groups, _ = run_tree(m=2, prompts=1, top_n=1, iterations=1, branches=2, uncertainty="entropy")
    (g,) = groups
    root = g.rollouts[0]
    (fork,) = {r.branch_token_idx for r in g.rollouts[1:3]}
    assert fork == int(np.argmax(root.token_entropy))  # the highest-entropy position of the root sample
    for r in g.rollouts:
        assert r.token_entropy.shape == (len(r),) and np.isfinite(r.token_entropy).all()


def test_zero_iterations_is_independent_sampling():
    groups, engine = run_tree(m=4, prompts=1, iterations=0)
    (g,) = groups
    assert len(g.rollouts) == 4 and all(r.branch_token_idx is None for r in g.rollouts)
    assert sorted(g.tree.children["root"]) == sorted(f"n{i}@0" for i in range(4))
    assert sum(len(r) for r in g.rollouts) == engine.new_tokens


def test_config_refuses_bad_values():
    with pytest.raises(ValueError, match="empty string"):
        Tree.Config(stop=[""])
    with pytest.raises(ValueError):
        Tree.Config(top_n=0)
    with pytest.raises(ValueError):
        Tree.Config(uncertainty="variance")


@pytest.mark.parametrize("pipeline", ["tree_arith", "tree_dapo_arith"])
def test_a_short_tiny_arith_run_with_tree_advantages(tmp_path, pipeline):
    spec = tmp_path / "tree.yaml"
    text = (REPO / "pipelines" / f"{pipeline}.yaml").read_text()
    text = text.replace("n: 4000", "n: 40").replace("batch_size: 16", "batch_size: 4")
    text = text.replace("target_groups: 16", "target_groups: 4")
    text = text.replace("steps: 100, seed: 0, checkpoint_every: 50", "steps: 2, seed: 0, checkpoint_every: 2")
    text = text.replace("eval: {source", "# eval: {source")
    spec.write_text(text + "tracking: {mlflow: null}\n")
    Run.start(load_pipeline(spec), tmp_path / "run").train()
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [0, 1]
    for r in records:
        tree = r["stages"]["rollout"]  # the last loop round's trees (DAPO: every round's rollouts count)
        rounds = r["loop_rounds"].get("collect", 1)
        assert tree["tree_leaves"] <= r["rollouts_generated"] <= rounds * 4 * 2 * 5
        assert tree["tree_tokens_generated"] <= r["tokens_generated"]
        if rounds == 1:
            assert r["rollouts_generated"] == tree["tree_leaves"] and r["tokens_generated"] == tree["tree_tokens_generated"]
        assert tree["tree_tokens_copied"] > 0
    assert any(not r["update_skipped"] for r in records)


def test_lineage_rows_carry_the_tree_and_each_branch_s_fork_point():
    from gfcr.runtime.store.lineage import lineage_rows

    groups, _ = run_tree(m=2, prompts=1, top_n=1, iterations=1, branches=2)
    rows = lineage_rows(StepReport("run", 0, 0, tuple(groups), None, {}, {}))
    (g,) = groups
    assert [row["branch_token_idx"] for row in rows] == [r.branch_token_idx for r in g.rollouts]
    assert [row["branch_token_idx"] is None for row in rows] == [True, False, False, True, False, False]
    assert all(row["tree_id"] == r.tree_id and row["node_id"] == r.node_id and
               row["parent_node_id"] == r.parent_node_id for row, r in zip(rows, g.rollouts))
