"""Turn-level trees of trajectories (``generate.elpo``, ``generate.trace``): a continuation from a
turn prefix, and the tree groups of a call's trajectories.

A **prefix** ``P_t`` of a trajectory is its response up to the start of its model turn ``t + 1``
(the first ``t`` model turns and the observations that answered them). A continuation from
``P_t`` is a new episode holding those ids, segments and turns exactly (never re-tokenised) whose
environment is **replayed** to ``P_t``: a fresh one, reset with the trajectory's own seed and
stepped with its first ``t`` actions (each model turn's text and the tool call parsed from it).
An observation that differs from the one recorded (or an episode that ends early) raises, and the
continuation is dropped by the stage's ``on_env_error``: the environment must be deterministic
given its seed and actions, as any rollout tree needs.

The groups: per prompt, its trajectories in creation order (the fresh ones first), with the
``tree`` of them all (``gfcr.stages.generate.tree_topology``: prefixes shared by several
trajectories are nodes); a continuation's ``branch_token_idx`` is its fork, so a copied prefix
counts as generated once. Trajectories whose environment raised are left out of the tree and
removed from the group (lineage keeps them).
"""

from __future__ import annotations

from typing import Any, Callable

from gfcr.records import Rollout, RolloutGroup, RolloutGroups, TreeIndex, Turn, TurnRole, rollout_id
from gfcr.stages.engine import row_seed
from gfcr.stages.environments import TOOL_PARSERS, Action
from gfcr.stages.generate.episodes import Episode, guarded, rollout_of
from gfcr.stages.generate.tree import cut_segments
from gfcr.stages.generate.tree_topology import parents, segment_tree


def model_turns(e: Episode) -> list[Turn]:
    return [t for t in e.turns if t.role == TurnRole.MODEL]


def continue_from(stage: Any, src: Episode, prefix: int, index: int, seed: int) -> tuple[Episode, int]:
    """Episode ``<group>/<index>`` holding ``src``'s prefix ``P_prefix`` (``0 < prefix < its model
    turns``), its environment replayed there; and the fork position."""
    fork = model_turns(src)[prefix].start
    ep = Episode(src.entry, src.gid, rollout_id(src.gid, index), src.prompt_ids)
    ep.tokens = list(src.tokens[:fork])
    ep.segments = list(cut_segments(src.segments, fork))
    ep.turns = [Turn.from_state(t.state()) for t in src.turns if t.end <= fork]
    ep.rewards = [t.reward for t in ep.turns if t.role == TurnRole.MODEL and t.reward is not None]
    guarded(stage, ep, "replay", lambda: _replay(stage, ep, src, prefix, seed))
    return ep, fork


def _replay(stage: Any, ep: Episode, src: Episode, prefix: int, seed: int) -> None:
    """A fresh environment, reset as ``src``'s was and stepped with its first ``prefix`` actions."""
    parser = TOOL_PARSERS[stage.config.tool_parser] if stage.config.tool_parser else None
    ep.env = stage.make()
    ep.env.reset(src.entry.prompt, row_seed(seed, src.rid, 0))
    turns = src.turns
    for j, turn in enumerate(model_turns(src)[:prefix]):
        obs = ep.env.step(Action(turn.text, parser(turn.text) if parser else None))
        after = turns.index(turn) + 1
        recorded = turns[after] if after < len(turns) and turns[after].role == TurnRole.ENVIRONMENT else None
        expected = "" if recorded is None else str(recorded.info.get("observation", recorded.text))
        if obs.done or (obs.text if recorded is not None else "") != expected:
            raise RuntimeError(f"replaying trajectory {src.rid} to model turn {j + 1} gave another observation "
                               f"({obs.text!r}, done={obs.done}) than recorded ({expected!r}); a turn tree "
                               "needs an environment that is deterministic given its seed and actions")
        ep.last = obs


def tree_groups(step: int, episodes: list[Episode], forks: dict[str, tuple[str, int]], decode: Callable[[Any], str],
                components: dict[str, dict[str, float]] | None = None) -> RolloutGroups:
    """One tree group per prompt of ``episodes`` (in order); ``forks``: a continuation's rollout id
    -> (its source's rollout id, the fork position); ``components``: extra ``reward_components``."""
    by_group: dict[str, list[Episode]] = {}
    for e in episodes:
        by_group.setdefault(e.gid, []).append(e)
    return RolloutGroups([_group(step, members, forks, decode, components or {}) for members in by_group.values()])


def _group(step: int, members: list[Episode], forks: dict[str, tuple[str, int]], decode: Callable[[Any], str],
           components: dict[str, dict[str, float]]) -> RolloutGroup:
    entry, gid = members[0].entry, members[0].gid
    rollouts = []
    for e in members:
        r = rollout_of(e, step, decode)
        if e.rid in forks:
            r.branch_token_idx = forks[e.rid][1]
        r.reward_components.update(components.get(e.rid, {}))
        rollouts.append(r)
    group = RolloutGroup(gid, entry.prompt_id, step, len(rollouts), rollouts, sample_weight=entry.sample_weight)
    group.tree = _tree(group.rollouts, forks, [e for e in members if e.error is None])
    for e in members:
        if e.error is not None:
            group.remove(e.rid, e.error)
    return group


def _tree(rollouts: list[Rollout], forks: dict[str, tuple[str, int]], kept: list[Episode]) -> TreeIndex:
    """The turn-level tree of the trajectories whose environment did not raise; each rollout's
    ``tree_id`` (its fresh ancestor's index), ``node_id`` and ``parent_node_id``."""
    ids = [e.rid for e in kept]
    position = {rid: i for i, rid in enumerate(ids)}
    tree = segment_tree([position[forks[rid][0]] if rid in forks else None for rid in ids],
                        [forks[rid][1] if rid in forks else 0 for rid in ids], [len(e.tokens) for e in kept], ids)
    up = parents(tree)
    leaf = {leaves[0]: node for node, leaves in tree.leaves.items() if len(leaves) == 1 and not tree.children.get(node)}
    by_id = {r.rollout_id: r for r in rollouts}
    for rid in ids:
        root = rid
        while root in forks:
            root = forks[root][0]
        by_id[rid].tree_id, by_id[rid].node_id = f"t{root.rsplit('/', 1)[1]}", leaf[rid]
        by_id[rid].parent_node_id = up.get(leaf[rid])
    return tree
