"""generate.trace: TRACE's tree rollout allocation over turn prefixes (arXiv 2606.11119; seed_methods 3.4).

Each ReAct turn (a model turn and the observation that answers it) is a node. For every allocation
entry with ``n_rollouts = n > 0`` (the prompt's budget of trajectories, continuations included):

1. ``roots`` fresh trajectories of the environment, as ``generate.multi_turn`` runs them;
2. then rounds, until the budget is spent: each prompt chooses one **anchor** (the prompt itself,
   or a turn prefix ``P_t`` of one of its trajectories: its first ``t`` model turns and their
   observations, ``0 < t <`` its model turns) and samples ``branches`` trajectories from it (a
   fresh one from the prompt; a continuation, its environment replayed, from a prefix:
   ``gfcr.stages.generate.turn_tree``). Every prompt's round runs in one engine call per turn.

The anchor is the one predicted to give the most **mixed** outcomes: the largest ``p (1 - p)``,
where ``p`` is the anchor's success probability, a shared predictor's estimate anchored on the
anchor's own evidence:

    p_model = sigmoid(w . x(anchor) + b)                      shared across prompts and steps
    p       = (kappa * p_model + S) / (kappa + N)             S successes of the N trajectories below it

(ties: the prompt first, then the trajectories and prefixes in creation order). ``x`` is four
numbers: the prefix's depth ``t / max_turns``, its reward so far, the mean behaviour log-prob of its
model tokens, and 1 for the prompt itself (0 otherwise). A trajectory succeeds when its reward
reaches ``success_reward``. After the rounds the predictor takes ``predictor_steps`` gradient steps
on the binomial log-loss of every anchor of the last ``predictor_history`` calls, this one's included
(``(x, S of N)``; ``gfcr.stages.common.logistic``), warm-started, so what one step learns about which
prefixes stay open steers the next; its weights and that history are the stage's state
(checkpointed).

The groups are turn-level trees (``tree``; ``advantage: {use: tree}`` on the update gives each
span the value of the outcomes below it); a continuation's ``branch_token_idx`` is its fork.

Seeding: as ``generate.multi_turn`` (trajectory ``<group>/<i>``'s turn ``k`` from the row stream of
``<group>/<i>~t<k>``); a step is as deterministic as its environment.

Deviations (the abstract states the rule, not its parts; no public code):
- the predictor is a logistic model over the four prefix features above, not the paper's
  (unstated) predictor; its prior weight ``kappa``, the mixedness score ``p (1 - p)`` and the
  greedy one-anchor-per-round allocation are this stage's choices;
- the initial ``roots`` fresh trajectories, the ``branches`` per anchor, and "success" as a reward
  threshold are open choices of this stage;
- Generate and Control in one stage: the anchors appear between the turns of one call, where no
  Control stage of the plan runs; the per-prompt budget still comes from the Control stages;
- the environment's state at a prefix is rebuilt by replay, not copied.

Fidelity: from the abstract: no public code (arXiv 2606.11119; none found).

Example (the ``tiny-arith`` policy and the labelled ``testing.echo`` environment, 2 model turns; a
budget of 4: 2 fresh trajectories, then one round of 2 from the most mixed anchor):

>>> from gfcr.engines import TransformersEngine, load_policy
>>> from gfcr.records import Allocation, AllocationEntry, Prompt, StepContext
>>> from gfcr.spec import PolicySpec
>>> from gfcr.stages.resources import Lent
>>> policy = load_policy(PolicySpec(model="tiny-arith"))
>>> stage = Trace(Trace.Config(environment={"use": "testing.echo", "with": {"turns": 2}}, max_turn_tokens=3,
...                            roots=2, branches=2, success_reward=1.0))
>>> stage.setup(Lent(policy, TransformersEngine(policy)))
>>> groups = stage.run(Allocation(0, (AllocationEntry(Prompt("a:0", text="What is 12 + 30? Answer:"), 4),)),
...                    StepContext("run", step=0, seed=0, policy_version=0))
>>> g = groups.groups[0]
>>> len(g.rollouts), g.tree is not None, stage.step_metrics()["trace_rounds"]
(4, True, 1.0)

YAML:

.. code-block:: yaml

    rollout: {use: generate.trace, from: budget, with: {environment: {use: reasoning_gym, with: {dataset: chain_sum}},
              max_turns: 3, roots: 2, branches: 2}}
    update:  {use: update.grpo, from: rollout, with: {advantage: {use: tree}}}
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, replace
from typing import Annotated, Any, ClassVar

import numpy as np
from pydantic import Field

from gfcr.records import Allocation, RolloutGroups, SegmentOrigin, StepContext, rollout_id
from gfcr.stages.common.logistic import LogisticSuccess, with_history
from gfcr.stages.environments import environment_factory
from gfcr.stages.generate.episodes import (
    Episode, advance, call_settings, decoder, finish, guarded, reset_episode, setup_turns, start_episodes,
)
from gfcr.stages.generate.multi_turn import MultiTurn, episode_metrics
from gfcr.stages.generate.turn_tree import continue_from, model_turns, tree_groups
from gfcr.stages.resources import Engine, Lent, Policy

FEATURES = 4  # depth, reward so far, mean behaviour log-prob of the prefix's model tokens, is the prompt


@dataclass(frozen=True)
class Anchor:
    """The prompt (``source`` None, ``prefix`` 0) or the prefix ``P_prefix`` of trajectory ``source``."""

    gid: str
    source: str | None
    prefix: int


def mixedness(p_model: np.ndarray, successes: np.ndarray, trials: np.ndarray, kappa: float) -> np.ndarray:
    """``p (1 - p)`` of each anchor, ``p`` the prediction anchored on the anchor's own evidence."""
    p = with_history(np.asarray(p_model, dtype=np.float64), successes, trials, kappa)
    return p * (1.0 - p)


def choose(scores: np.ndarray) -> int:
    """The anchor with the largest score; the first of equal ones."""
    return int(np.argmax(scores))


class Trace:
    """Multi-turn trajectories grown as turn-level trees: each round, a prompt's budget goes to the
    anchor (prompt or turn prefix) whose outcomes are predicted to be the most mixed."""

    class Config(MultiTurn.Config):
        builds_trees: ClassVar[bool] = True  # a capability (gfcr.registry.BuildsTrees)
        roots: Annotated[int, Field(ge=1, description="fresh trajectories per prompt before any branching")] = 2
        branches: Annotated[int, Field(ge=1, description="trajectories sampled from the chosen anchor per round")] = 2
        success_reward: float = Field(1.0, description="a trajectory whose reward reaches this succeeded")
        kappa: Annotated[float, Field(gt=0.0, description=(
            "the predictor's weight, in pseudo-trajectories, against an anchor's own outcomes"))] = 2.0
        predictor_lr: Annotated[float, Field(gt=0.0, description="the predictor's gradient step")] = 0.5
        predictor_steps: Annotated[int, Field(ge=0, description="gradient steps on each call's anchors")] = 20
        predictor_l2: Annotated[float, Field(ge=0.0, description="L2 penalty on the predictor's weights")] = 1e-3
        predictor_history: Annotated[int, Field(ge=1, description=(
            "calls whose anchors the predictor is fitted on (the latest ones)"))] = 8

    def __init__(self, config: Config):
        self.config = config
        self.policy: Policy | None = None
        self.engine: Engine | None = None
        self.factory = environment_factory(config.environment.use)
        self.predictor = LogisticSuccess(FEATURES)
        self.history: deque[list[list[float]]] = deque(maxlen=config.predictor_history)  # per call: [x..., s, n] rows
        self.decisions: list[tuple[Anchor, float]] = []  # this call's chosen anchors and their scores
        self._metrics: dict[str, float] = {}

    def setup(self, lent: Lent) -> None:
        setup_turns(self, lent, "generate.trace")

    def make(self) -> Any:
        return self.factory(**self.config.environment.with_)

    def step_metrics(self) -> dict[str, float]:
        return dict(self._metrics)

    def state_dict(self) -> dict[str, Any]:
        return {"predictor": self.predictor.state_dict(), "history": [list(map(list, c)) for c in self.history]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.predictor.load_state_dict(state["predictor"])
        self.history.clear()
        self.history.extend(state.get("history", []))

    def run(self, allocation: Allocation, ctx: StepContext | None = None) -> RolloutGroups:
        params, deadline, round_ = call_settings(self, "generate.trace", allocation, ctx)
        cfg = self.config
        first = Allocation(allocation.step, tuple(replace(e, n_rollouts=min(cfg.roots, e.n_rollouts))
                                                  for e in allocation.active()))
        episodes = start_episodes(self, first, round_, params.seed)
        entries = {e.prompt_id: e for e in allocation.active()}
        for e in episodes:  # the whole budget's entry, not the roots' share of it
            e.entry = entries[e.entry.prompt_id]
        advance(self, episodes, params, deadline)
        finish(self, episodes)
        budget = {e.gid: e.entry.n_rollouts - sum(x.gid == e.gid for x in episodes) for e in episodes}
        forks: dict[str, tuple[str, int]] = {}
        self.decisions, rounds = [], 0
        while any(left > 0 for left in budget.values()):
            made = self._round(episodes, forks, budget, params.seed)
            advance(self, made, params, deadline)
            finish(self, made)
            episodes += made
            rounds += 1
        loss = self._fit(episodes, forks)
        self._metrics = {**episode_metrics(episodes), "trace_rounds": float(rounds),
                         "trace_root_branches": float(sum(a.source is None for a, _ in self.decisions)),
                         "trace_prefix_branches": float(sum(a.source is not None for a, _ in self.decisions)),
                         "trace_continuations": float(len(forks)), "trace_predictor_loss": loss}
        return tree_groups(allocation.step, episodes, forks, decoder(self.policy))

    def _round(self, episodes: list[Episode], forks: dict[str, tuple[str, int]], budget: dict[str, int],
               seed: int) -> list[Episode]:
        """Each prompt with budget left: its most mixed anchor, and ``branches`` new episodes from it."""
        made: list[Episode] = []
        for gid in [g for g, left in budget.items() if left > 0]:
            members = [e for e in episodes if e.gid == gid]
            anchors = self.anchors(members, forks)
            x, s, n = self._evidence(anchors, members, forks)
            scores = mixedness(self.predictor.predict(x), s, n, self.config.kappa)
            k = choose(scores)
            self.decisions.append((anchors[k], float(scores[k])))
            for _ in range(min(self.config.branches, budget[gid])):
                made.append(self._branch(anchors[k], members[0], len(members) + len([m for m in made if m.gid == gid]),
                                         {e.rid: e for e in members}, forks, seed))
                budget[gid] -= 1
        return made

    def _branch(self, anchor: Anchor, first: Episode, index: int, by_id: dict[str, Episode],
                forks: dict[str, tuple[str, int]], seed: int) -> Episode:
        if anchor.source is None:  # a fresh trajectory of the prompt
            ep = Episode(first.entry, first.gid, rollout_id(first.gid, index), first.prompt_ids)
            guarded(self, ep, "reset", lambda: reset_episode(self, ep, seed))
            return ep
        ep, fork = continue_from(self, by_id[anchor.source], anchor.prefix, index, seed)
        forks[ep.rid] = (anchor.source, fork)
        return ep

    def anchors(self, members: list[Episode], forks: dict[str, tuple[str, int]]) -> list[Anchor]:
        """The prompt, then each trajectory's own prefixes (those past its fork), in creation order."""
        out = [Anchor(members[0].gid, None, 0)]
        for e in members:
            if e.error is not None:
                continue
            own = self._fork_turn(e, forks) + 1
            out += [Anchor(e.gid, e.rid, t) for t in range(own, e.model_turns)]
        return out

    @staticmethod
    def _fork_turn(e: Episode, forks: dict[str, tuple[str, int]]) -> int:
        """How many model turns ``e`` copied (0 for a fresh trajectory)."""
        if e.rid not in forks:
            return 0
        return sum(t.end <= forks[e.rid][1] for t in model_turns(e))

    def _evidence(self, anchors: list[Anchor], members: list[Episode],
                  forks: dict[str, tuple[str, int]]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Per anchor: its features ``[A, 4]``, and the successes and trajectories below it."""
        by_id = {e.rid: e for e in members}
        x, s, n = [], [], []
        for a in anchors:
            below = [e for e in members if e.error is None and self._below(e.rid, a, forks, by_id)]
            x.append(self._features(a, by_id))
            s.append(float(sum(self._succeeded(e) for e in below)))
            n.append(float(len(below)))
        return np.array(x, dtype=np.float64).reshape(-1, FEATURES), np.array(s), np.array(n)

    @staticmethod
    def _below(rid: str, anchor: Anchor, forks: dict[str, tuple[str, int]], by_id: dict[str, Episode]) -> bool:
        """Whether trajectory ``rid`` passes through ``anchor`` (shares its prefix)."""
        if anchor.source is None:
            return True
        at = None  # the prefix (in model turns) at which rid's line of descent leaves anchor.source
        while rid != anchor.source:
            if rid not in forks:
                return False
            src, fork = forks[rid]
            at = fork
            rid = src
        if at is None:
            return True
        starts = [t.start for t in model_turns(by_id[anchor.source])]
        return starts.index(at) >= anchor.prefix  # it left at a prefix at or past the anchor's

    def _features(self, a: Anchor, by_id: dict[str, Episode]) -> list[float]:
        if a.source is None:
            return [0.0, 0.0, 0.0, 1.0]
        e = by_id[a.source]
        fork = model_turns(e)[a.prefix].start
        rewards = [t.reward or 0.0 for t in model_turns(e)[:a.prefix]]
        logps = [s.behavior_logprobs[:max(0, fork - s.start)] for s in e.segments
                 if s.origin != SegmentOrigin.ENVIRONMENT and s.start < fork]
        mean_logp = float(np.concatenate(logps).mean()) if logps and sum(map(len, logps)) else 0.0
        return [a.prefix / self.config.max_turns, float(sum(rewards)), mean_logp, 0.0]

    def _succeeded(self, e: Episode) -> bool:
        return e.error is None and bool(e.rewards) and sum(e.rewards) >= self.config.success_reward

    def _fit(self, episodes: list[Episode], forks: dict[str, tuple[str, int]]) -> float:
        """Train the shared predictor on every anchor of the last ``predictor_history`` calls (this
        one's added); its loss before the steps."""
        rows: list[list[float]] = []
        for gid in dict.fromkeys(e.gid for e in episodes):
            members = [e for e in episodes if e.gid == gid]
            x, s, n = self._evidence(self.anchors(members, forks), members, forks)
            rows += np.column_stack([x, s, n]).tolist()
        self.history.append(rows)
        data = np.array([row for call in self.history for row in call], dtype=np.float64).reshape(-1, FEATURES + 2)
        if not len(data):
            return float("nan")
        cfg = self.config
        return self.predictor.fit(data[:, :FEATURES], data[:, FEATURES], data[:, FEATURES + 1], cfg.predictor_steps,
                                  cfg.predictor_lr, cfg.predictor_l2)
