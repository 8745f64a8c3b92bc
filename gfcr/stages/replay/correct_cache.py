"""replay.correct_cache: AR3PO response reuse, a cached correct response joins a group with none.

AR3PO (arXiv 2509.25808, "Adaptive Rollout and Response Reuse Policy Optimization"): after
rollout and verification, a prompt none of whose responses is correct gets a correct response
generated for it at an earlier step, when one is cached, so that its group has a reward to
contrast and a gradient. This stage keeps a cache of correct responses per prompt and, for each
group of its input with no correct response, appends the ``join`` newest cached ones.

Cache policy (the paper's details are not available here: abstract and reviews only, so each
rule is this stage's choice, listed under Deviations):

- what enters: every correct rollout (``correct is True``) of the input's groups that was
  generated this step (not a reused one), after the joins, so a group never gets its own step's
  responses back; per prompt the ``per_prompt`` newest distinct responses are kept (a response
  with the same token ids as a cached one replaces it, as newer);
- staleness: a response whose oldest token is more than ``max_staleness`` policy versions
  behind the current policy leaves the cache when it is next looked at, and never joins;
- size: at most ``max_prompts`` prompts; the prompt whose cache changed least recently leaves
  first.

A joined response is a new rollout at the end of the group (``origin: cached_correct``,
``replayed_from`` the original id, ``created_step`` its step, its segments and reward kept), so
the group has ``n + join`` rollouts and the advantage estimator sees one correct among wrong
ones. Its tokens are stale: the shipped pipelines use ``update.grpo``'s correction ``decoupled_clip``
(ratio against ``pi_old``, weighted by ``pi_old / mu``); against the stale ``mu`` alone, a
response the policy has since made likelier than ``1 + eps`` times would be clipped to no
gradient. Put the stage after the verifier and before a zero-variance filter (DAPO, GRESO's
guard), so that a joined group counts as informative.

Metrics per step (``stages.<id>``): ``groups_joined``, ``rollouts_replayed``,
``tokens_replayed``, ``groups_without_correct``, ``cache_prompts``, ``cache_responses``,
``evicted_stale``. The cache is saved with each checkpoint (``files/entries.parquet``, its order
in the stage state).

Deviations (all from an unread paper):
- the response is appended, not swapped for a wrong one, so no generated response is thrown
  away; the group is one larger than the allocation.
- one response joins by default (``join: 1``), the newest; the paper says "a previously
  generated correct response".
- the cache keeps the newest ``per_prompt`` (1) responses of a prompt; staleness is limited
  (``max_staleness``, 16 versions by default) and the size too (``max_prompts``); the paper
  gives no values.
- joined responses keep their stored rewards and are not verified again.
- only groups with no correct response take a cached one, whatever their size or other rewards.

Fidelity: from the abstract: no public code (AR3PO, arXiv 2509.25808); the rules above are this
stage's reading.

Example:

>>> from gfcr.records import RolloutGroups, StepContext
>>> from gfcr.stages.testing import scored_group
>>> stage = CorrectCache(CorrectCache.Config())
>>> _ = stage.run(RolloutGroups([scored_group("a", [0, 1, 0])]), StepContext("r", 0, 0, 0))
>>> later = stage.run(RolloutGroups([scored_group("a", [0, 0], step=1)]), StepContext("r", 1, 0, 1))
>>> [(r.reward, r.origin.value, r.replayed_from) for r in later.groups[0].rollouts]
[(0.0, 'fresh', None), (0.0, 'fresh', None), (1.0, 'cached_correct', 'a@s0/1')]

YAML:

.. code-block:: yaml

    reward: {use: filter.verify, from: rollout}
    cache:  {use: replay.correct_cache, from: reward, with: {per_prompt: 1, max_staleness: 16, max_prompts: 4096}}
    update: {use: update.grpo, from: cache, with: {correction: {use: decoupled_clip}}}
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import numpy as np
from pydantic import Field, model_validator

from gfcr.records import Origin, Rollout, RolloutGroup, RolloutGroups, StepContext, rollout_id
from gfcr.registry import StageConfig
from gfcr.stages.common.reuse import keep, load_entries, reuse, save_entries
from gfcr.stages.common.stored import StoredRollout

ENTRIES = "entries.parquet"
COUNTS = ("groups_without_correct", "groups_joined", "rollouts_replayed", "tokens_replayed", "evicted_stale")


class CorrectCache:
    """AR3PO response reuse: a group with no correct response gets a cached correct one."""

    class Config(StageConfig):
        join: Annotated[int, Field(ge=1, description=(
            "cached correct responses appended to a group with none (the newest first)"))] = 1
        per_prompt: Annotated[int, Field(ge=1, description="correct responses kept per prompt, the newest")] = 1
        max_staleness: Annotated[int | None, Field(ge=0, description=(
            "drop a cached response whose oldest token is more than this many policy versions old; "
            "null keeps them"))] = 16
        max_prompts: Annotated[int | None, Field(ge=1, description=(
            "most prompts cached; the least recently refreshed leaves first; null: no cap"))] = 4096

        @model_validator(mode="after")
        def _join_fits(self) -> "CorrectCache.Config":
            if self.join > self.per_prompt:
                raise ValueError(f"`join: {self.join}` asks for more responses than the cache keeps per prompt "
                                 f"(`per_prompt: {self.per_prompt}`): set `per_prompt` to at least `join`")
            return self

    def __init__(self, config: Config):
        self.config = config
        self.cache: dict[str, list[StoredRollout]] = {}  # prompt id -> newest first; dict order: least recent first
        self.next_entry_id = 0
        self._counts: dict[str, int] = dict.fromkeys(COUNTS, 0)
        self._loaded: dict[str, Any] | None = None

    def before_step(self, ctx: StepContext) -> None:
        self._counts = dict.fromkeys(COUNTS, 0)  # summed over the step's loop rounds

    def run(self, groups: RolloutGroups, ctx: StepContext) -> RolloutGroups:
        counts = self._counts
        counts["evicted_stale"] += self._evict_stale(ctx.policy_version)
        without = [g for g in groups if g.verdict.included and g.rollouts and not any(r.correct for r in g.rollouts)]
        joined = [r for g in without for r in self._join(g)]
        for g in groups:
            self._remember([r for r in g.rollouts if r.correct is True and not r.reused], ctx.step)
        counts["groups_without_correct"] += len(without)
        counts["groups_joined"] += len({r.group_id for r in joined})
        counts["rollouts_replayed"] += len(joined)
        counts["tokens_replayed"] += sum(len(r) for r in joined)
        return groups

    def _join(self, group: RolloutGroup) -> list[Rollout]:
        """Append the newest cached responses of the group's prompt; the rollouts appended."""
        added = []
        for entry in self.cache.get(group.prompt_id, [])[: self.config.join]:
            rid = rollout_id(group.group_id, len(group.rollouts) + len(group.removed))
            added.append(reuse(entry, rid, group.group_id, Origin.CACHED_CORRECT))
            group.rollouts.append(added[-1])
        return added

    def _remember(self, correct: list[Rollout], step: int) -> None:
        for r in correct:
            kept = keep(r, self.next_entry_id, step)
            self.next_entry_id += 1
            same = [e for e in self.cache.pop(r.prompt_id, []) if not np.array_equal(e.response_token_ids,
                                                                                  kept.response_token_ids)]
            self.cache[r.prompt_id] = ([kept] + same)[: self.config.per_prompt]  # newest first, at the back
        while self.config.max_prompts is not None and len(self.cache) > self.config.max_prompts:
            self.cache.pop(next(iter(self.cache)))

    def _evict_stale(self, version: int) -> int:
        """Drop responses more than ``max_staleness`` versions old; how many left."""
        limit = self.config.max_staleness
        if limit is None:
            return 0
        dropped = 0
        for prompt in list(self.cache):
            fresh = [e for e in self.cache[prompt] if e.staleness(version) <= limit]
            dropped += len(self.cache[prompt]) - len(fresh)
            if fresh:
                self.cache[prompt] = fresh
            else:
                del self.cache[prompt]
        return dropped

    def cached(self, prompt_id: str) -> list[StoredRollout]:
        """The cached correct responses of a prompt, newest first."""
        return list(self.cache.get(prompt_id, []))

    def step_metrics(self) -> dict[str, float]:
        """What this step joined, and the cache after it."""
        return {**self._counts, "cache_prompts": len(self.cache),
                "cache_responses": sum(map(len, self.cache.values()))}

    # --- checkpoint ---------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        order = [[prompt, [e.entry_id for e in entries]] for prompt, entries in self.cache.items()]
        return {"next_entry_id": self.next_entry_id, "order": order}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._loaded = state  # the responses arrive with the files (load_files)

    def save_files(self, directory: Path) -> None:
        save_entries([e for entries in self.cache.values() for e in entries], directory / ENTRIES)

    def load_files(self, directory: Path) -> None:
        state, self._loaded = self._loaded, None
        assert state is not None, "load_state_dict comes before load_files"
        entries = {e.entry_id: e for e in load_entries(directory / ENTRIES)}
        self.cache = {prompt: [entries[int(i)] for i in ids] for prompt, ids in state["order"]}
        self.next_entry_id = int(state["next_entry_id"])
