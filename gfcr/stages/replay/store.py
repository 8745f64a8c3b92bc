"""replay.store: keep the step's rollouts in a FAISS-indexed buffer that other Replay stages query.

An ingest stage: it reads ``StepOutputs`` (every group the step produced, kept or dropped) and
adds their rollouts, with token ids, segments (policy versions, behaviour log-probs), reward,
step and prompt id, to a ``ReplayStore`` (``gfcr.stages.replay.rollout_store``): the response and
prompt texts are embedded with a sentence-transformers model (all-MiniLM-L6-v2 by default,
offline) into FAISS indexes (flat, IVF or HNSW), the metadata kept as parquet. It passes its
``groups`` input through unchanged, so it sits just before the update
(``update: {from: store}``) and, as an ingest stage, runs after everything else of the step.

Rules (``StoreConfig``): exact duplicates (same prompt, same token ids) and, with
``dedup_threshold``, near duplicates (response cosine >= the threshold, same prompt) are
skipped; after each add, rollouts older than ``max_staleness`` policy versions leave, then
``evict`` (fifo, staleness or priority = reward) enforces ``max_entries`` and ``max_bytes``.
Which rollouts are stored: ``kept_only`` (groups and rollouts the filters kept),
``correct_only``, ``finished_only`` (completed or truncated, not partials) and
``store_replayed`` (rollouts another Replay stage replayed, skipped by default).

Without ``dedup_threshold`` the rollouts are stored (and evicted) at once and only their
vectors wait: embedding runs in the background (``background``) while the update and
the next step's generation run, and joins the index at the next add, query or checkpoint.
The model runs in a worker process of its own at a lower priority (``embed_in: process``,
the default: the step keeps its cores and the interpreter lock) or in this process
(``embed_in: thread``).
With it, the step's metrics wait for the embeddings. The metrics (``entries``, ``prompts``,
``bytes``, ``added``, ``exact_duplicates``, ``near_duplicates``, ``evicted``) go to
``metrics.jsonl`` under ``stages.<id>`` and to MLflow. The store is saved with each checkpoint in the stage's own
``files/`` directory (``entries.parquet``, ``prompts.parquet``, ``responses.faiss``,
``prompts.faiss``) and its counters in the stage state, so a resumed run has the same store.
``gfcr replay inspect RUN_DIR`` shows what a run's store holds.

Other Replay stages (RLEP, DOTS rollout replay, AR3PO's cache) query ``stage.store``
(``knn_by_prompt``, ``knn_by_response``, ``for_prompt``, ``get``...), or own a ``ReplayStore``.

Deviations: not a published method; it is the storage of section 7.7 of the seed-method
notes (one store interface, several policies). RLEP stores text and re-tokenizes; this keeps
token ids and behaviour log-probs and never re-tokenizes. A rollout without decoded text is
embedded by its token ids written out as text. The prompt index is always flat.

Fidelity: gfcr's own: the store the Replay stages share (not a published method).

Example:

>>> from gfcr.records import Prompt, PromptPool, RolloutGroups, StepContext, StepOutputs
>>> from gfcr.stages.resources import Lent
>>> from gfcr.stages.testing import scored_group
>>> stage = Store(Store.Config(background=False))
>>> stage.setup(Lent())
>>> pool = PromptPool([Prompt("p:0", text="2 + 2 ="), Prompt("p:1", text="7 - 5 =")])
>>> a, b = scored_group("p:0", [1, 0]), scored_group("p:1", [1, 1])
>>> for r, text in zip([*a.rollouts, *b.rollouts], ["4", "5", "2", "2"]):
...     r.text, r.response_token_ids[0] = text, int(text)
>>> out = stage.run(RolloutGroups([a, b]), StepOutputs(0, (a, b)), pool, StepContext("r", 0, 0, 0))
>>> stage.step_metrics()["entries"], stage.step_metrics()["exact_duplicates"]  # b's two "2"s are one
(3, 1)
>>> [h.entry.text for h in stage.store.knn_by_prompt("3 + 1 =", k=2)]  # p:0's rollouts, newest first
['5', '4']

YAML:

.. code-block:: yaml

    store:  {use: replay.store, from: reward, with: {max_entries: 50000, evict: fifo}}
    update: {use: update.grpo, from: store}
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, ClassVar

from pydantic import Field

from gfcr.records import Origin, Prompt, PromptPool, Rollout, RolloutGroups, StepContext, StepOutputs
from gfcr.records.group import FINISHED
from gfcr.stages.common.embedding import load_embedder
from gfcr.stages.replay.embed_worker import worker_embedder
from gfcr.stages.replay.rollout_store import ReplayStore, StoreConfig


class Store:
    """Add every step's rollouts to a FAISS-indexed replay store; pass the groups through."""

    class Config(StoreConfig):
        serves_store: ClassVar[bool] = True  # a capability (gfcr.registry.ServesStore)
        kept_only: Annotated[bool, Field(description=(
            "store only the groups (and rollouts) the filters kept; false stores dropped groups too"))] = False
        correct_only: Annotated[bool, Field(description="store only rollouts a verifier judged correct")] = False
        finished_only: Annotated[bool, Field(description=(
            "store only completed or truncated rollouts, not partials, pruned or failed ones"))] = True
        store_replayed: Annotated[bool, Field(description=(
            "also store rollouts another Replay stage replayed into the step (origin `replayed`)"))] = False

    def __init__(self, config: Config):
        self.config = config
        self.store: ReplayStore | None = None
        self._state: dict[str, Any] | None = None

    def setup(self, lent: Any) -> None:
        embed = worker_embedder if self.config.embed_in == "process" else load_embedder
        self.store = ReplayStore(self.config, embed(self.config.embedder))

    def owned_store(self) -> ReplayStore:
        """The store, for the stages that read it (``OwnsStore``; ``replay.rlep``'s ``store``)."""
        return self._require()

    def _require(self) -> ReplayStore:
        if self.store is None:
            self.setup(None)
        assert self.store is not None
        return self.store

    def run(self, groups: RolloutGroups, produced: StepOutputs, pool: PromptPool, ctx: StepContext) -> RolloutGroups:
        rollouts = [r for r in self._rollouts(produced) if self._wanted(r)]
        texts = {r.prompt_id: _prompt_text(pool, r.prompt_id) for r in rollouts}
        self._require().submit(rollouts, texts, ctx.step, ctx.policy_version)
        return groups

    def _rollouts(self, produced: StepOutputs) -> list[Rollout]:
        if self.config.kept_only:
            return [r for g in produced.kept() for r in g.rollouts]
        return [r for g in produced for r in g.generated]

    def _wanted(self, rollout: Rollout) -> bool:
        return ((not self.config.finished_only or rollout.status in FINISHED)
                and (not self.config.correct_only or rollout.correct is True)
                and (self.config.store_replayed or rollout.origin != Origin.REPLAYED))

    def step_metrics(self) -> dict[str, float]:
        """The store after this step's add: sizes, and what the add did."""
        store = self._require()
        store.settle()  # waits for the embeddings only when the near-duplicate check needs them
        last = store.last_result
        return {"entries": len(store), "prompts": store.prompt_count, "bytes": store.nbytes,
                "added": len(last.added), "exact_duplicates": last.exact_duplicates,
                "near_duplicates": last.near_duplicates, "evicted": sum(last.evicted.values())}

    def state_dict(self) -> dict[str, Any]:
        return self._require().state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._state = state  # the files arrive next (load_files), and the store loads from both

    def save_files(self, directory: Path) -> None:
        self._require().save(directory)

    def load_files(self, directory: Path) -> None:
        state, self._state = self._state, None
        assert state is not None, "load_state_dict comes before load_files"
        self._require().load(directory, state)


def _prompt_text(pool: PromptPool, prompt_id: str) -> str:
    """The prompt's text (its messages' contents, joined, for a chat prompt); the id if not in the pool."""
    if prompt_id not in pool:
        return prompt_id
    prompt: Prompt = pool.get(prompt_id)
    if prompt.text is not None:
        return prompt.text
    return "\n".join(m.get("content", "") for m in prompt.messages or ())
