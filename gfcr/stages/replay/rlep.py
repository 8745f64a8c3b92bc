"""replay.rlep: RLEP's experience replay, M verified successes appended to each group of G fresh rollouts.

RLEP (Zhang et al., 2025, "RLEP: Reinforcement Learning with Experience rePlay for LLM
Reasoning", arXiv 2507.07451) keeps a pool of verified-correct responses per training prompt
and, at every step, appends ``M`` of them, drawn at random without replacement, to the ``G``
fresh rollouts of each prompt's group (reference code: ``experience_replay_num = 2``,
``G = 16``). The advantages are then computed over the mixed group of ``G' = G + M``
rollouts by the update's estimator, e.g. GRPO's

    A_i = (r_i - mean(r_1..r_G')) / (std(r_1..r_G') + eps),   i = 1..G'

so a group whose fresh rollouts all failed still gets a signal from its replayed successes.
Replayed rollouts carry ``origin = replayed`` (``Rollout.reused``), ``replayed_from`` (the original
rollout id), ``created_step`` and ``replayed_policy_version`` (the original's step and oldest policy
version); the lineage records the three and the stage that appended them, and the step's
``rollouts_generated``, ``tokens_generated``, ``tokens_with_signal``, ``reward_mean`` and
``correct_fraction`` leave them out (``StepReport.rollouts_replayed`` counts them).

Pool: ``seed_from: {run_dir: ...}`` (the correct rollouts of another run's replay store, its
newest checkpoint) or ``seed_from: {jsonl: ...}`` (responses as text, tokenized with the policy),
and, with ``online: true`` (the default), the verified successes of the run's earlier steps:
those of the ``replay.store`` stage named by ``store`` (its correct entries), or, without
``store``, the stage's own pool, which every step's finished correct fresh rollouts join (kept
or dropped groups alike) after the update, at most ``max_per_prompt`` per prompt (the oldest
leave first). A step never replays its own rollouts.

Off-policy correction (``correction``): ``none`` (the paper) rescores each replayed response
under the current policy (one ``score`` forward pass, counted in ``tokens_scored``) and makes
that its behaviour log-probs, at the current policy version (one ``replayed_text`` segment): the PPO ratio is 1 at the update's
start, as when the reference code recomputes ``old_log_probs``. ``tis`` keeps the stored behaviour
log-probs and policy versions, so the update's truncated importance sampling weights the
replayed tokens by ``min(pi_old / mu, C)``: the update must use ``correction: {use: tis}``
(``update_needs``; ``gfcr validate`` checks it).

Metrics per step (``stages.<id>`` in ``metrics.jsonl`` and MLflow): ``rollouts_replayed``,
``tokens_replayed``, ``groups_short`` (groups that got fewer than ``M``: their prompt had fewer
candidates), ``pool_entries`` and ``pool_prompts`` (what the pool holds: the own pool plus,
with ``store``, the store's correct entries).

Which candidates: a prompt with at most ``M`` candidates gets all of them, in pool order (oldest
first), as the reference takes its candidate list whole; with more, ``M`` are drawn at random
without replacement (the reference's ``random.sample``; gfcr's draw is seeded per run, step and
group, so it is not the reference's).

Defaults: ``replayed_per_group`` 2, the main script's (``recipe/rlep/rlep_training.sh``,
``experience_replay_num=2``); ``online``, ``max_per_prompt`` 16 and ``correction: none`` are gfcr's
(the reference's pool is built offline, static and uncapped, and its old log-probs are recomputed).

Deviations:
- the reference code pads a prompt with fewer than ``M`` candidates with empty responses; this
  appends the candidates there are (none for a prompt never solved) and counts the group in
  ``groups_short`` (5 reference cases);
- the pool keeps one entry per distinct response of a prompt; the reference's candidate list
  may repeat one, and replays both copies (1 reference case);
- the reference code stores text and re-tokenizes it; this replays the stored token ids
  (``seed_from.jsonl`` is text, and is tokenized once, when the pool is seeded);
- the paper's pool is built offline by a seed policy and is static; ``online`` (the default)
  also adds the run's own successes, and ``seed_from`` is optional;
- ``correction: tis`` is not in the paper (an option the seed-method notes ask for);
- replayed rollouts keep the reward and correctness they were verified with.

Fidelity: checked against Kwai-Klear/RLEP@c15e5b4: 10/16 cases, 6 documented deviations
(``tests/fidelity/rlep.json``: the dataset's candidates block and the rollout's replay block, run on
one prompt's candidates: how many responses are appended, how many are empty, that they are
distinct candidates, and their order where no draw is made; ``random.sample``'s draw itself is not
compared). The order when every candidate is taken was corrected against these cases (it was a
random permutation).

Example (a group whose two fresh rollouts failed gets the two stored successes of its prompt):

>>> from gfcr.records import PromptPool, RolloutGroups, StepContext
>>> from gfcr.stages.resources import Lent
>>> from gfcr.stages.testing import scored_group
>>> stage = RLEP(RLEP.Config(replayed_per_group=2, correction="tis"))
>>> stage.setup(Lent())
>>> for r in scored_group("p:0", [1, 1, 0], step=0).rollouts:
...     _ = stage.pool.add_rollout(r, step=0) if r.correct else None
>>> len(stage.pool)  # the two successes have the same tokens: one is kept
1
>>> group = scored_group("p:0", [0, 0], step=1)
>>> out = stage.run(RolloutGroups([group]), PromptPool([]), StepContext("r", 1, 0, 1))
>>> [(r.rollout_id, r.origin.value, r.reward, r.replayed_from) for r in group.rollouts]
[('p:0@s1/0', 'fresh', 0.0, None), ('p:0@s1/1', 'fresh', 0.0, None), ('p:0@s1/2', 'replayed', 1.0, 'p:0@s0/0')]
>>> stage.step_metrics()["groups_short"]  # one candidate, not two
1

YAML:

.. code-block:: yaml

    store:  {use: replay.store, from: reward, with: {correct_only: true}}
    rlep:   {use: replay.rlep, from: store, with: {replayed_per_group: 2, store: store}}
    update: {use: update.grpo, from: rlep}

With the stored behaviour log-probs and truncated importance sampling in the update:

.. code-block:: yaml

    rlep:   {use: replay.rlep, from: reward, with: {correction: tis, seed_from: {run_dir: runs/seed-policy}}}
    update: {use: update.grpo, from: rlep, with: {correction: {use: tis, with: {cap: 2.0}}}}
"""

from __future__ import annotations

import zlib
from pathlib import Path
from typing import Annotated, Any, Literal

import numpy as np
from pydantic import Field, model_validator

from gfcr.records import (
    PromptPool, Rollout, RolloutGroup, RolloutGroups, Segment, SegmentOrigin, StepContext, StepReport, rollout_id,
)
from gfcr.records.group import FINISHED
from gfcr.records.rollout import REUSED_ORIGINS
from gfcr.registry import FilePath, PipelineProblem, ServesStore, StageConfig, UpdateNeed
from gfcr.stages.common.stored import StoredRollout
from gfcr.stages.replay.experience_pool import ExperiencePool, seed_jsonl, seed_run_dir
from gfcr.stages.resources import Engine, Policy, Lent, ScoreRequest, prompt_tokens

ALIAS = "replay.rlep"


class SeedFrom(StageConfig):
    """Where the pool's first entries come from: one of ``run_dir`` or ``jsonl``."""

    run_dir: FilePath | None = Field(None, description=(
        "a run directory whose newest checkpoint holds a replay store (replay.store or replay.rlep): its "
        "correct rollouts"))
    stage: str | None = Field(None, description="the stage id of that store, when the checkpoint holds several")
    jsonl: FilePath | None = Field(None, description=(
        'a JSONL file of responses, one {"prompt_id" or "prompt", "response", "reward"?} a line, tokenized '
        "with the policy"))

    @model_validator(mode="after")
    def _one_source(self) -> "SeedFrom":
        if (self.run_dir is None) == (self.jsonl is None):
            raise ValueError("`seed_from` takes one of `run_dir` (another run's replay store) or `jsonl` (a file "
                             "of responses)")
        if self.stage is not None and self.run_dir is None:
            raise ValueError("`seed_from.stage` names a store in `seed_from.run_dir`; set `run_dir` or remove `stage`")
        return self


class RLEP:
    """Append M verified successes of each prompt, from an experience pool, to its group of fresh rollouts."""

    class Config(StageConfig):
        replayed_per_group: Annotated[int, Field(ge=1, description=(
            "M: pool successes appended to each group (drawn at random, without replacement)"))] = 2
        correction: Annotated[Literal["none", "tis"], Field(description=(
            "none: rescore replayed responses under the current policy (the paper: ratio 1 at the update's "
            "start); tis: keep their stored behaviour log-probs for the update's correction `tis`"))] = "none"
        online: Annotated[bool, Field(description=(
            "add the run's own verified successes of earlier steps to the pool (from `store`, or the stage's "
            "own pool); false keeps the seeded pool static, as the paper"))] = True
        store: Annotated[str | None, Field(min_length=1, description=(
            "the id of a `replay.store` stage upstream whose correct entries are the online pool; null: the "
            "stage keeps its own"))] = None
        seed_from: SeedFrom | None = Field(None, description=(
            "the pool's first entries: {run_dir: ..., stage: ...} or {jsonl: ...}"))
        max_per_prompt: Annotated[int | None, Field(ge=1, description=(
            "most successes the own pool keeps per prompt, the oldest leaving first; null: no cap"))] = 16
        temperature: Annotated[float, Field(gt=0.0, description=(
            "correction none: the sampling temperature, so the rescored log-probs are tempered as the "
            "update's"))] = 1.0

        @model_validator(mode="after")
        def _pool_has_a_source(self) -> "RLEP.Config":
            if not self.online and self.store is not None:
                raise ValueError("`store` is the online pool, and `online` is false: set `online: true` or remove "
                                 "`store`")
            if not self.online and self.seed_from is None:
                raise ValueError("with `online: false` and no `seed_from` the pool stays empty: set `seed_from` "
                                 "or `online: true`")
            return self

    @staticmethod
    def check_pipeline(config: "RLEP.Config", view: Any) -> list[PipelineProblem]:
        """``store`` names a ``replay.store`` upstream."""
        found = []
        stores = [sid for sid, _ in view.having(ServesStore)]
        if config.store is not None and config.store not in {sid for sid, _ in view.having(ServesStore, upstream=True)}:
            alias = view.aliases.get(config.store)
            what = ("the pipeline has no stage `{0}`" if alias is None else "`{0}` is `%s`, not a `replay.store`" % alias
                    if config.store not in stores else "`{0}` is not upstream of this stage (it would run after it)")
            found.append(PipelineProblem(
                ("store",), "`store`: " + what.format(config.store),
                f"read from the store (`from: {stores[0]}`) and set `store: {stores[0]}`" if stores
                else "add a `replay.store` stage before this one, or remove `store`"))
        return found

    @staticmethod
    def update_needs(config: "RLEP.Config") -> list[UpdateNeed]:
        """``correction: tis`` keeps the stored behaviour log-probs: the update must correct for them."""
        if config.correction != "tis":
            return []
        return [UpdateNeed("correction", ("tis",), "keeps the replayed rollouts' stored behaviour log-probs "
                           "(`correction: tis`), which the update's correction `tis` weights by min(pi_old/mu, C)")]

    def __init__(self, config: Config):
        self.config = config
        self.pool = ExperiencePool(config.max_per_prompt)
        self.seeded = config.seed_from is None or config.seed_from.jsonl is None  # a JSONL seed needs the data
        self._store: Any = None
        self._policy: Policy | None = None
        self._engine: Engine | None = None
        self._metrics: dict[str, float] = {}
        self._state: dict[str, Any] | None = None

    def setup(self, lent: Lent) -> None:
        cfg = self.config
        if cfg.correction == "none" or (cfg.seed_from is not None and cfg.seed_from.jsonl is not None):
            self._policy = lent.require_policy(ALIAS)
            self._engine = lent.require_engine(ALIAS)
        if cfg.store is not None:
            self._store = lent.require_store(cfg.store, ALIAS)
        if cfg.seed_from is not None and cfg.seed_from.run_dir is not None:
            for entry in seed_run_dir(Path(cfg.seed_from.run_dir), cfg.seed_from.stage):
                self.pool.add_entry(entry)

    # --- the step ----------------------------------------------------------------------------

    def before_step(self, ctx: StepContext) -> None:
        self._metrics = {}

    def run(self, groups: RolloutGroups, pool: PromptPool, ctx: StepContext) -> RolloutGroups:
        self._seed_jsonl(pool)
        appended: list[tuple[RolloutGroup, Rollout]] = []
        short = 0
        for group in groups:
            if not group.verdict.included:
                continue
            chosen = self._choose(group, ctx)
            short += len(chosen) < self.config.replayed_per_group
            start = len(group.generated)
            for j, entry in enumerate(chosen):
                replayed = entry.to_rollout(rollout_id(group.group_id, start + j), group.group_id)
                group.rollouts.append(replayed)
                appended.append((group, replayed))
        self._rescore(appended, pool, ctx)
        for key, value in (("rollouts_replayed", len(appended)), ("tokens_replayed", sum(len(r) for _, r in appended)),
                           ("groups_short", short)):  # summed over a loop block's rounds
            self._metrics[key] = self._metrics.get(key, 0) + value
        return groups

    def _choose(self, group: RolloutGroup, ctx: StepContext) -> list[StoredRollout]:
        """The prompt's candidates from earlier steps, all of them in pool order when there are at most
        M (as the reference), else M drawn from a generator seeded by the run's seed, the step, the
        loop round and the group (the same draw on resume)."""
        candidates = [e for e in self._candidates(group.prompt_id) if e.step < ctx.step]
        m = self.config.replayed_per_group
        if len(candidates) <= m:
            return candidates
        rng = np.random.default_rng([ctx.seed, ctx.step, ctx.round or 0, zlib.crc32(group.group_id.encode())])
        return [candidates[i] for i in rng.choice(len(candidates), size=m, replace=False)]

    def _candidates(self, prompt_id: str) -> list[StoredRollout]:
        own = self.pool.candidates(prompt_id)
        if self._store is None:
            return own
        stored = [e for e in self._store().for_prompt(prompt_id)
                  if e.correct is True and e.origin not in REUSED_ORIGINS]
        return own + stored

    def _rescore(self, appended: list[tuple[RolloutGroup, Rollout]], pool: PromptPool, ctx: StepContext) -> None:
        """Correction none (and any entry without behaviour log-probs): the current policy's log-probs,
        at the current policy version, become the behaviour log-probs."""
        todo = [(g, r) for g, r in appended if len(r) and (self.config.correction == "none" or _text_only(r))]
        if not todo:
            return
        assert self._engine is not None and self._policy is not None, "setup gave the stage an engine"
        requests = [ScoreRequest(tuple(prompt_tokens(self._policy, pool.get(g.prompt_id))),
                                 tuple(r.response_token_ids), self.config.temperature) for g, r in todo]
        for (_, r), scored in zip(todo, self._engine.score(requests)):
            r.segments = [Segment(0, len(r), ctx.policy_version, scored.logprobs, SegmentOrigin.REPLAYED_TEXT)]

    def _seed_jsonl(self, pool: PromptPool) -> None:
        if self.seeded:
            return
        assert self.config.seed_from is not None and self.config.seed_from.jsonl is not None
        for entry in seed_jsonl(Path(self.config.seed_from.jsonl), pool, self._tokenize):
            self.pool.add_entry(entry)
        self.seeded = True

    def _tokenize(self, text: str) -> list[int]:
        assert self._policy is not None
        tokenizer = self._policy.tokenizer
        ids = list(tokenizer.encode(text, add_special_tokens=False))
        return ids + ([tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else [])

    # --- after the step ------------------------------------------------------------------------

    def step_metrics(self) -> dict[str, float]:
        """What the step replayed, and what the pool holds."""
        entries, prompts = len(self.pool), self.pool.prompt_count
        if self._store is not None:
            stored = [e for e in self._store().entries() if e.correct is True]
            entries += len(stored)
            prompts = len({e.prompt_id for e in stored} | {e.prompt_id for e in self.pool.entries()})
        return {"rollouts_replayed": 0, "tokens_replayed": 0, "groups_short": 0, **self._metrics,
                "pool_entries": entries, "pool_prompts": prompts}

    def observe(self, report: StepReport) -> None:
        """The own pool (online, no ``store``) takes the step's finished, correct, fresh rollouts."""
        if not self.config.online or self.config.store is not None:
            return
        for group in report.groups:
            for r in group.generated:
                if r.correct is True and not r.reused and r.status in FINISHED:
                    self.pool.add_rollout(r, report.step)

    # --- checkpoints ---------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        return {"next_entry_id": self.pool.next_entry_id, "seeded": self.seeded}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._state = state  # the pool's file arrives next (load_files)

    def save_files(self, directory: Path) -> None:
        self.pool.save(directory)

    def load_files(self, directory: Path) -> None:
        state, self._state = self._state, None
        assert state is not None, "load_state_dict comes before load_files"
        self.pool.load(directory, int(state["next_entry_id"]))
        self.seeded = bool(state["seeded"])


def _text_only(rollout: Rollout) -> bool:
    """A rollout seeded from text has no behaviour log-probs of its own (its segment is ``replayed_text``)."""
    return any(s.origin == SegmentOrigin.REPLAYED_TEXT for s in rollout.segments)
