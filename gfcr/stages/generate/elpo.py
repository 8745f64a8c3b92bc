"""generate.elpo: ELPO's binary-search rollout trees, localising a failed trajectory's first
irrecoverable turn (arXiv 2602.09598; seed_methods 3.5).

For every allocation entry with ``n_rollouts = n > 0`` the stage first runs ``n`` trajectories of
the environment exactly as ``generate.multi_turn`` does (same Config, same turn loop). Then, for
every **failed** trajectory (the environment scored it, below ``success_reward``) with ``T`` model
turns, a binary search over its turn prefixes: ``P_t`` is the trajectory up to the start of its
model turn ``t + 1`` (the first ``t`` model turns and the observations that answered them).

- ``P_0`` (the prompt) counts as recoverable and ``P_T`` (the trajectory itself) as irrecoverable;
- a **probe** of ``P_t`` samples ``probes`` continuations from it (its ids, never re-tokenised;
  the environment brought to ``P_t`` by replay, below) and runs each to its end; ``P_t`` is
  recoverable when at least one of them reaches ``success_reward``;
- with ``lo`` recoverable and ``hi`` irrecoverable, probe ``mid = (lo + hi) // 2`` and keep the half
  that still holds the change, until ``hi = lo + 1``: model turn ``hi`` is the **first irrecoverable
  turn** (recoverable before it, not after). That is at most ``ceil(log2 T)`` probes per trajectory.

All searches of the call advance together, one probe each per engine round. The continuations are
leaves of their prompt's group beside the ``n`` trajectories (ids ``<group>/<n>``, ``<group>/<n+1>``,
...; ``branch_token_idx`` the fork, so a copied prefix counts as generated once), and the group's
``tree`` is the turn-level tree of them all (``gfcr.stages.generate.tree_topology``: a prefix is a
node; ``advantage: {use: tree}`` gives each span the value of the outcomes below it). The failed
trajectory records what the search found: ``reward_components["first_irrecoverable_turn"]`` (model
turns counted from 1) and ``"first irrecoverable"`` under ``elpo`` in that turn's ``info``.

Replay: a continuation's environment is a fresh one, reset with the trajectory's own seed and
stepped with its first ``t`` actions (``gfcr.stages.generate.turn_tree``). An observation that
differs from the one recorded drops the continuation with that error (``on_env_error``): ELPO
needs an environment that is deterministic given its seed and actions, as a rollout tree does.

Seeding: the continuation ``<group>/<i>``'s turn ``k`` samples from the row stream of request
``<group>/<i>~t<k>``, as any trajectory; a step is as deterministic as its environment.

Deviations (the abstract leaves these open; no public code):
- a probe is ``probes`` continuations (default 2) and "recoverable" means one of them reaches
  ``success_reward`` (default 1.0): the number of continuations and the threshold are not given;
- the search assumes what a binary search must: recoverability only changes once along a
  trajectory; ``P_0`` is not probed (it is assumed recoverable, even in a group where nothing
  succeeded), and every failed trajectory is searched, whichever group it is in;
- the search is over model turns (an action with its thought), not tokens;
- the credit is the update's estimator's: the shipped pipeline uses ``advantage: tree`` over the
  turn-level tree; the abstract's step-level credit to the localised turn is recorded for an
  estimator to use, not applied here;
- the environment's state at a prefix is rebuilt by replay (above), not copied.

Fidelity: from the abstract: no public code (arXiv 2602.09598: "code will be publicly released";
none found).

Example (the ``tiny-arith`` policy and the labelled ``testing.echo`` environment, which scores 0.5
each of its 4 model turns: each trajectory "fails" below ``success_reward`` 3.0, and continuations
from its prefixes fail the same way, so the search ends at the first turn in 2 probes, of
prefixes 2 and 1):

>>> from gfcr.engines import TransformersEngine, load_policy
>>> from gfcr.records import Allocation, AllocationEntry, Prompt, StepContext
>>> from gfcr.spec import PolicySpec
>>> from gfcr.stages.resources import Lent
>>> policy = load_policy(PolicySpec(model="tiny-arith"))
>>> stage = ELPO(ELPO.Config(environment={"use": "testing.echo", "with": {"turns": 4}}, max_turn_tokens=3,
...                          probes=1, success_reward=3.0))
>>> stage.setup(Lent(policy, TransformersEngine(policy)))
>>> groups = stage.run(Allocation(0, (AllocationEntry(Prompt("a:0", text="What is 12 + 30? Answer:"), 1),)),
...                    StepContext("run", step=0, seed=0, policy_version=0))
>>> g = groups.groups[0]
>>> len(g.rollouts), g.rollouts[0].reward_components["first_irrecoverable_turn"], stage.step_metrics()["elpo_probes"]
(3, 1.0, 2.0)
>>> [r.branch_token_idx is not None for r in g.rollouts], g.tree is not None
([False, True, True], True)

YAML:

.. code-block:: yaml

    rollout: {use: generate.elpo, from: budget, with: {environment: {use: reasoning_gym, with: {dataset: chain_sum}},
              max_turns: 3, probes: 2, success_reward: 1.0}}
    update:  {use: update.grpo, from: rollout, with: {advantage: {use: tree}}}
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Annotated, Any, Callable, ClassVar

from pydantic import Field

from gfcr.records import Allocation, RolloutGroups, StepContext
from gfcr.stages.engine import SamplingParams
from gfcr.stages.environments import environment_factory
from gfcr.stages.generate.episodes import (
    Episode, advance, call_settings, decoder, finish, setup_turns, start_episodes,
)
from gfcr.stages.generate.multi_turn import MultiTurn, episode_metrics
from gfcr.stages.generate.turn_tree import continue_from, model_turns, tree_groups
from gfcr.stages.resources import Engine, Lent, Policy


@dataclass
class Search:
    """A binary search for the first irrecoverable model turn of a trajectory of ``turns`` model
    turns: ``lo`` is known recoverable, ``hi`` known irrecoverable."""

    turns: int
    lo: int = 0
    hi: int = -1
    probed: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.hi < 0:
            self.hi = self.turns

    @property
    def open(self) -> bool:
        return self.hi - self.lo > 1

    def next_probe(self) -> int:
        """The prefix to probe next (its number of model turns)."""
        return (self.lo + self.hi) // 2

    def record(self, prefix: int, recoverable: bool) -> None:
        self.probed.append(prefix)
        if recoverable:
            self.lo = prefix
        else:
            self.hi = prefix


def first_irrecoverable(turns: int, recoverable: Callable[[int], bool]) -> tuple[int, list[int]]:
    """The first irrecoverable model turn (from 1) of a failed trajectory of ``turns`` model turns,
    given which prefixes are recoverable, and the prefixes probed, in order."""
    search = Search(turns)
    while search.open:
        prefix = search.next_probe()
        search.record(prefix, recoverable(prefix))
    return search.hi, search.probed


@dataclass
class Probe:
    """One failed trajectory under search, and its continuations so far."""

    source: Episode
    search: Search
    continuations: list[tuple[Episode, int]] = field(default_factory=list)  # (episode, fork position)


class ELPO:
    """Multi-turn trajectories, then a binary search over each failed one's turn prefixes for the
    first turn after which no continuation succeeds; the continuations are tree leaves."""

    class Config(MultiTurn.Config):
        builds_trees: ClassVar[bool] = True  # a capability (gfcr.registry.BuildsTrees)
        probes: Annotated[int, Field(ge=1, description="continuations sampled from a prefix per probe")] = 2
        success_reward: float = Field(1.0, description=(
            "a trajectory whose reward reaches this succeeded; below it, it failed and is searched"))

    def __init__(self, config: Config):
        self.config = config
        self.policy: Policy | None = None
        self.engine: Engine | None = None
        self.factory = environment_factory(config.environment.use)
        self._metrics: dict[str, float] = {}

    def setup(self, lent: Lent) -> None:
        setup_turns(self, lent, "generate.elpo")

    def make(self) -> Any:
        return self.factory(**self.config.environment.with_)

    def step_metrics(self) -> dict[str, float]:
        return dict(self._metrics)

    def run(self, allocation: Allocation, ctx: StepContext | None = None) -> RolloutGroups:
        params, deadline, round_ = call_settings(self, "generate.elpo", allocation, ctx)
        episodes = start_episodes(self, allocation, round_, params.seed)
        advance(self, episodes, params, deadline)
        finish(self, episodes)
        probes = [Probe(e, Search(e.model_turns)) for e in episodes if self._failed(e)]
        self._search(probes, episodes, params, deadline)
        for p in probes:
            self._mark(p)
        made = [c for p in probes for c, _ in p.continuations]
        self._metrics = {**episode_metrics(episodes + made), "elpo_searches": float(len(probes)),
                         "elpo_probes": float(sum(len(p.search.probed) for p in probes)),
                         "elpo_continuations": float(len(made)),
                         "elpo_first_irrecoverable_mean": (sum(p.search.hi for p in probes) / len(probes)
                                                           if probes else 0.0)}
        return self._groups(allocation, episodes, probes)

    def _failed(self, e: Episode) -> bool:
        return e.error is None and bool(e.rewards) and sum(e.rewards) < self.config.success_reward

    def _succeeded(self, e: Episode) -> bool:
        return e.error is None and bool(e.rewards) and sum(e.rewards) >= self.config.success_reward

    def _search(self, probes: list[Probe], episodes: list[Episode], params: SamplingParams,
                deadline: float | None) -> None:
        """Advance every open search by one probe per round, all continuations of a round together."""
        count: dict[str, int] = {}
        for e in episodes:
            count[e.gid] = count.get(e.gid, 0) + 1
        seed = params.seed
        while any(p.search.open for p in probes):
            this_round: list[tuple[Probe, int, list[Episode]]] = []
            for p in (p for p in probes if p.search.open):
                prefix = p.search.next_probe()
                made = []
                for _ in range(self.config.probes):
                    c, fork = continue_from(self, p.source, prefix, count[p.source.gid], seed)
                    count[p.source.gid] += 1
                    p.continuations.append((c, fork))
                    made.append(c)
                this_round.append((p, prefix, made))
            batch = [c for _, _, made in this_round for c in made]
            advance(self, batch, params, deadline)
            finish(self, batch)
            for p, prefix, made in this_round:
                p.search.record(prefix, any(self._succeeded(c) for c in made))

    @staticmethod
    def _mark(p: Probe) -> None:
        model_turns(p.source)[p.search.hi - 1].info["elpo"] = "first irrecoverable"

    def _groups(self, allocation: Allocation, episodes: list[Episode], probes: list[Probe]) -> RolloutGroups:
        forks = {c.rid: (p.source.rid, fork) for p in probes for c, fork in p.continuations}
        found = {p.source.rid: {"first_irrecoverable_turn": float(p.search.hi)} for p in probes}
        made = [c for p in probes for c, _ in p.continuations]
        return tree_groups(allocation.step, episodes + made, forks, decoder(self.policy), found)
