"""generate.tree: TreeRL's entropy-guided tree search, EPTree (Hou et al., arXiv 2506.11902;
``THUDM/TreeRL``, ``entropy_chain_local_manager.py``, ``tree_node.py``).

For every allocation entry with ``n_rollouts = M > 0``:

1. **M trees**, each from one full sample of the prompt (independent, as ``generate.sample``);
2. **L iterations** (``iterations``) of branching. At each, per tree, every position ``t`` of a
   tree sequence's *own* tokens (those it sampled itself, not a prefix it copied) is a
   candidate with uncertainty ``u_t = -log mu(y_t)`` (``uncertainty: neg_logprob``, the
   reference code's "entropy") or the entropy of the sampling distribution there
   (``uncertainty: entropy``); the ``N`` (``top_n``) candidates of largest ``u`` are chosen,
   and from each, ``T`` (``branches``) continuations are sampled: the new sequence copies
   positions ``[0, t)`` and resamples from ``t`` on (the uncertain token itself is redrawn, as
   the reference's ``get_prefix_ids(split_idx)``). A continuation is generated from token ids
   (``ResponsePrefix``), never from re-tokenized text;
3. every sequence is a **leaf** and becomes one ``Rollout`` of the prompt's group (the M root
   samples first, then the branches in the order they were made), so a group holds up to
   ``M * (1 + L * N * T)`` leaves (fewer when a tree has fewer than ``N`` candidates).

The group's ``tree`` is the segment tree of its leaves (``gfcr.stages.generate.tree_topology``:
nodes are maximal spans of positions that a set of leaves share because the same sampled token
is copied in each; the root is the empty node above the M trees), with each node's span. Each
leaf records ``tree_id`` (``t<m>``, the tree it grew in), ``node_id`` (its own leaf node),
``parent_node_id`` and ``branch_token_idx`` (the fork point: ``None`` for a root sample).

Token accounting: a branch's copied prefix was generated once, by the sequence it came from,
so the step's ``tokens_generated`` counts only each leaf's own tokens
(``Rollout.generated_length = len - branch_token_idx``), and the update counts a shared
position once (``gfcr.stages.update.tree_weights``). Leaf rewards come from the verifier as for
any group; ``advantage: {use: tree}`` on the update gives TreeRL's per-token tree advantages.

Seeding: the root samples use request id ``<group>`` and each branch point its own request id
``<group>~l<iteration>.<k>``, all with the step's seed (``(seed, step, loop round)``), so a step
samples the same trees however the engine batches rows.

Deviations:
- the reference's defaults disagree (seed_methods 3.2): ``(M, N, L, T) = (6, 2, 1, 2)`` in
  ``entropy_guided_tree_search.py``, ``(8, 4, 2, 1)`` as the experience maker's fallbacks; the
  Config holds the first set's ``N, L, T`` (the paper's EPTree setting), and ``M`` is the
  allocation's ``n_rollouts`` (``control.fixed_n`` with ``n: 6`` gives the reference ``M``),
  so the Control stages decide the per-prompt budget as for every generator;
- all leaves go to the update; the reference's experience maker then keeps a random
  ``num_traces`` subset of them (``select_terminal``, balanced by correctness) — a Filter stage
  can do that here;
- the reference masks a node's tokens after a literal "answer"/"conclusion" token from branching
  (GLM's output format); there is no such mask here (every own token is a candidate);
- none in the choice of branch points (``tests/fidelity/tree.json``): as the reference, each
  sequence offers its own top ``N`` (repeated up to ``N`` when it has fewer, so a short
  sequence's point can be chosen twice and branch ``2T`` times), a branch's redrawn first token
  is not a candidate (unless it forks at position 0), ties go to the later sequence and
  position, and a position may be chosen again in a later iteration, which adds siblings at the
  same point;
- no in-flight controllers (the tree is built in whole sampling calls).

Fidelity: checked against THUDM/TreeRL@f0edbea: 22/22 cases (``tests/fidelity/tree.json``: the
branch points of one iteration).

Example (the ``tiny-arith`` policy; M = 2 trees, one iteration of N = 1 point and T = 2 branches):

>>> from gfcr.engines import TransformersEngine, load_policy
>>> from gfcr.records import Allocation, AllocationEntry, Prompt, StepContext
>>> from gfcr.spec import PolicySpec
>>> from gfcr.stages.resources import Lent
>>> policy = load_policy(PolicySpec(model="tiny-arith"))
>>> stage = Tree(Tree.Config(top_n=1, iterations=1, branches=2, max_new_tokens=8))
>>> stage.setup(Lent(policy, TransformersEngine(policy)))
>>> groups = stage.run(Allocation(0, (AllocationEntry(Prompt("a:0", text="What is 12 + 30? Answer:"), 2),)),
...                    StepContext("run", step=0, seed=0, policy_version=0))
>>> group = groups.groups[0]
>>> len(group.rollouts), [r.tree_id for r in group.rollouts]
(6, ['t0', 't0', 't0', 't1', 't1', 't1'])
>>> [r.branch_token_idx is None for r in group.rollouts]  # the root samples: the 1st of each tree
[True, False, False, True, False, False]
>>> sum(r.generated_length for r in group.rollouts) < sum(len(r) for r in group.rollouts)  # prefixes count once
True

YAML:

.. code-block:: yaml

    budget:  {use: control.fixed_n, from: pick, with: {n: 6}}     # M = 6 trees per prompt
    rollout: {use: generate.tree, from: budget, with: {top_n: 2, iterations: 1, branches: 2}}
    # ...
    update: {use: update.grpo, from: reward, with: {advantage: {use: tree}}}
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, ClassVar, Literal

import numpy as np
from pydantic import Field, field_validator

from gfcr.records import (
    Allocation, Rollout, RolloutGroup, RolloutGroups, Segment, StepContext, group_id, rollout_id,
)
from gfcr.registry import Seed, StageConfig
from gfcr.stages.common.seeds import step_seed
from gfcr.stages.engine import Completion, ResponsePrefix, SamplingParams, splice
from gfcr.stages.generate.sample import STATUS, no_empty_stop
from gfcr.stages.generate.tree_topology import parents, segment_tree
from gfcr.stages.resources import Engine, GenerationRequest, Policy, Lent, prompt_tokens


@dataclass
class Sequence_:
    """One sequence of a tree: a whole response, and where it came from."""

    tree: int
    tokens: list[int]
    segments: list[Segment]
    entropy: np.ndarray | None  # [len] float32
    completion: Completion
    source: int | None = None  # index (in its group's sequences) of the sequence it branched from
    fork: int = 0  # positions [0, fork) copied from the source

    def own_uncertainty(self, kind: str) -> np.ndarray:
        """``[len - fork]``: the uncertainty of each token this sequence sampled itself."""
        if kind == "entropy":
            return np.asarray(self.entropy[self.fork:], dtype=np.float64)
        logprobs = np.concatenate([s.behavior_logprobs for s in self.segments]) if self.segments else np.zeros(0)
        return -np.asarray(logprobs[self.fork:], dtype=np.float64)


def _own_top(s: Sequence_, kind: str, n: int) -> list[tuple[float, int]]:
    """A sequence's ``n`` most uncertain own positions ``(u, position)``, ties to the earlier,
    repeated up to ``n`` when it has fewer (``TreeNode.get_max_entropy_tokens``). A branch's
    first own token (the redrawn one) is not a candidate unless it forks at position 0, as the
    reference masks it only after a non-empty prefix."""
    own = [(float(u), s.fork + k) for k, u in enumerate(s.own_uncertainty(kind))
           if np.isfinite(u) and not (k == 0 and s.fork > 0)]
    top = sorted(own, key=lambda c: -c[0])[:n]
    return (top * n)[:n]


def cut_segments(segments: list[Segment], end: int) -> tuple[Segment, ...]:
    """The segments of positions ``[0, end)``."""
    out = []
    for s in segments:
        if s.start >= end:
            break
        stop = min(s.end, end)
        out.append(Segment(s.start, stop, s.policy_version, s.behavior_logprobs[:stop - s.start], s.origin))
    return tuple(out)


class Tree:
    """TreeRL's EPTree: M sampled trees per prompt, branched at their most uncertain tokens."""

    class Config(StageConfig):
        top_n: Annotated[int, Field(ge=1, description="N: branch points chosen per tree per iteration "
                                                      "(reference 2)")] = 2
        iterations: Annotated[int, Field(ge=0, description="L: rounds of branching (reference 1; 0 = plain "
                                                           "independent samples)")] = 1
        branches: Annotated[int, Field(ge=1, description="T: continuations sampled from each branch point "
                                                         "(reference 2)")] = 2
        uncertainty: Literal["neg_logprob", "entropy"] = Field(
            "neg_logprob", description="a token's uncertainty: -log mu(token) (the reference code) or the "
                                       "entropy of the sampling distribution at it")
        temperature: Annotated[float, Field(ge=0.0, description="0 samples greedily")] = 1.0
        top_p: Annotated[float, Field(gt=0.0, le=1.0, description="nucleus for drawing")] = 1.0
        max_new_tokens: Annotated[int, Field(ge=1, description="cap on a whole response, copied prefix "
                                                               "included")] = 64
        stop: list[str] = Field(default_factory=list, description="stop strings (kept in the response); not empty")
        seed: Seed | None = Field(None, description="sampling seed; default: the run's seed")
        entropy: bool = Field(False, description="record each token's entropy on Rollout.token_entropy "
                                                 "(always on with `uncertainty: entropy`)")
        max_in_flight: Annotated[int | None, Field(ge=1, description="rows decoded at once; default: the "
                                                   "engine's batch")] = None

        @field_validator("stop")
        @classmethod
        def _no_empty_stop(cls, stop: list[str]) -> list[str]:
            return no_empty_stop(stop)

        builds_trees: ClassVar[bool] = True  # capabilities (gfcr.registry.BuildsTrees, RecordsEntropy, NeedsOfEngine)

        @property
        def records_entropy(self) -> bool:
            return self.entropy or self.uncertainty == "entropy"

        @property
        def engine_needs(self) -> frozenset[str]:
            return frozenset({"top_p"} if self.top_p < 1.0 else ())

    def __init__(self, config: Config):
        self.config = config
        self.policy: Policy | None = None
        self.engine: Engine | None = None
        self._metrics: dict[str, float] = {}

    def setup(self, lent: Lent) -> None:
        self.policy = lent.require_policy("generate.tree")
        self.engine = lent.require_engine("generate.tree")

    def step_metrics(self) -> dict[str, float]:
        """This step's trees: leaves, branch points, and the tokens copied rather than generated."""
        return dict(self._metrics)

    def run(self, allocation: Allocation, ctx: StepContext | None = None) -> RolloutGroups:
        if self.engine is None or self.policy is None:
            raise RuntimeError("generate.tree was not set up with a policy and engine")
        ctx = ctx or StepContext("", allocation.step, 0, 0)
        cfg, round_ = self.config, ctx.round or 0
        seed = ctx.seed if cfg.seed is None else cfg.seed
        params = SamplingParams(cfg.temperature, cfg.top_p, cfg.max_new_tokens, tuple(cfg.stop),
                                step_seed(seed, allocation.step, round_), cfg.records_entropy)
        entries = allocation.active()
        gids = [group_id(e.prompt_id, allocation.step, round_) for e in entries]
        prompts = [tuple(prompt_tokens(self.policy, e.prompt)) for e in entries]
        version = self.engine.policy_version
        roots = [GenerationRequest(gid, p, e.n_rollouts, params) for gid, p, e in zip(gids, prompts, entries)]
        forest: list[list[Sequence_]] = []
        for request, completions in zip(roots, self.engine.generate(roots, None, cfg.max_in_flight)):
            forest.append([self._sequence(m, request, c, version) for m, c in enumerate(completions)])
        points = 0
        for level in range(cfg.iterations):
            requests, origins = [], []  # origins[i]: (entry index, source sequence index, fork)
            for e, (gid, prompt, seqs) in enumerate(zip(gids, prompts, forest)):
                for k, (q, t) in enumerate(self._branch_points(seqs)):
                    src = seqs[q]
                    prefix = ResponsePrefix(tuple(src.tokens[:t]), cut_segments(src.segments, t))
                    requests.append(GenerationRequest(f"{gid}~l{level}.{k}", prompt, cfg.branches, params, prefix))
                    origins.append((e, q, t))
            if not requests:
                break
            points += len(requests)
            for request, (e, q, t), completions in zip(requests, origins,
                                                       self.engine.generate(requests, None, cfg.max_in_flight)):
                src = forest[e][q]
                for c in completions:
                    branch = self._sequence(src.tree, request, c, version)
                    if branch.entropy is not None and src.entropy is not None:  # the copied tokens' own entropies
                        branch.entropy[:t] = src.entropy[:t]
                    branch.source, branch.fork = q, t
                    forest[e].append(branch)
        groups = [self._group(gid, e, seqs, allocation.step) for gid, e, seqs in zip(gids, entries, forest)]
        leaves = [r for g in groups for r in g.rollouts]
        self._metrics = {"tree_leaves": float(len(leaves)), "tree_branch_points": float(points),
                         "tree_tokens_generated": float(sum(r.generated_length for r in leaves)),
                         "tree_tokens_copied": float(sum(len(r) - r.generated_length for r in leaves))}
        return RolloutGroups(groups)

    def _sequence(self, tree: int, request: GenerationRequest, c: Completion, version: int) -> Sequence_:
        tokens, segments = splice(request.prefix, c, version)
        entropy = None
        if c.entropy is not None:  # a prefix's entropies are copied in by the caller
            entropy = np.concatenate([np.full(len(tokens) - len(c.token_ids), np.nan, np.float32), c.entropy])
        return Sequence_(tree, tokens, segments, entropy, c)

    def _branch_points(self, seqs: list[Sequence_]) -> list[tuple[int, int]]:
        """Per tree, the ``top_n`` most uncertain own positions ``(sequence, position)`` of its
        sequences, chosen as the reference does: each sequence's own top ``N`` (repeated to ``N``
        when it has fewer), then the tree's top ``N`` of those, ties to the later sequence and
        position (its descending tuple sort)."""
        n, chosen = self.config.top_n, []
        for tree in sorted({s.tree for s in seqs}):
            candidates = []  # (-u, -sequence, -position): ascending = most uncertain, then latest
            for q, s in enumerate(seqs):
                if s.tree == tree:
                    candidates += [(-u, -q, -t) for u, t in _own_top(s, self.config.uncertainty, n)]
            chosen += [(-q, -t) for _, q, t in sorted(candidates)[:n]]
        return chosen

    def _group(self, gid: str, entry, seqs: list[Sequence_], step: int) -> RolloutGroup:
        order = sorted(range(len(seqs)), key=lambda q: (seqs[q].tree, q))  # tree by tree, in creation order
        position = {q: i for i, q in enumerate(order)}
        ids = [rollout_id(gid, i) for i in range(len(order))]
        tree = segment_tree([None if seqs[q].source is None else position[seqs[q].source] for q in order],
                            [seqs[q].fork for q in order], [len(seqs[q].tokens) for q in order], ids)
        up = parents(tree)
        leaf_node = {leaves[0]: node for node, leaves in tree.leaves.items()
                     if len(leaves) == 1 and not tree.children.get(node)}
        rollouts = []
        for i, q in enumerate(order):
            s, c = seqs[q], seqs[q].completion
            node = leaf_node[ids[i]]
            rollouts.append(Rollout(ids[i], gid, entry.prompt_id, s.tokens, s.segments, status=STATUS[c.finish_reason],
                                    finish_reason=c.finish_reason, created_step=step, text=c.text, replica=c.replica,
                                    ray_node=c.ray_node, token_entropy=s.entropy, tree_id=f"t{s.tree}", node_id=node,
                                    parent_node_id=up.get(node), branch_token_idx=None if s.source is None else s.fork))
        return RolloutGroup(gid, entry.prompt_id, step, len(rollouts), rollouts, tree=tree,
                            sample_weight=entry.sample_weight)
