"""ReplayStore with the real all-MiniLM-L6-v2 and real FAISS: adds, exact and near duplicates,
kNN by response and by prompt, eviction (fifo, staleness, priority, bytes), files that
round-trip for each index kind, and damaged files that fail with a CheckpointError.

Expected numbers are computed by hand here: byte estimates from the documented formula,
cosines as dot products of the embedder's unit vectors."""

from __future__ import annotations

import numpy as np
import pytest
from pydantic import ValidationError

from gfcr.errors import CheckpointError
from gfcr.records import Rollout, Segment
from gfcr.stages.common.embedding import load_embedder
from gfcr.stages.common.store_files import ENTRIES
from gfcr.stages.replay.rollout_store import RESPONSES_INDEX, ReplayStore, StoreConfig

DIM = 384
PROMPTS = {"p:0": "2 + 2 =", "p:1": "Name a city in France.", "p:2": "7 - 5 =", "p:3": "3 * 3 =", "p:4": "9 / 3 ="}


@pytest.fixture(scope="module")
def embedder():
    return load_embedder()


def _rollout(pid: str, tokens: list[int], text: str, reward: float = 1.0, version: int = 0, step: int = 0,
             i: int = 0) -> Rollout:
    gid = f"{pid}@s{step}"
    logprobs = np.linspace(-1.0, -0.1, len(tokens))
    return Rollout(f"{gid}/{i}", gid, pid, list(tokens), [Segment(0, len(tokens), version, logprobs)], text=text,
                   reward=reward, correct=reward == 1.0, created_step=step)


def _store(embedder, **config) -> ReplayStore:
    return ReplayStore(StoreConfig(background=False, **config), embedder)


def _cos(embedder, a: str, b: str) -> float:
    x, y = embedder.encode([a, b])
    return float(x @ y)


def test_an_add_keeps_token_ids_segments_versions_reward_step_and_counts_bytes(embedder):
    store = _store(embedder)
    result = store.add([_rollout("p:0", [4], "4", 1.0, version=3, step=5), _rollout("p:0", [5], "5", 0.0, i=1)],
                       PROMPTS, step=5, policy_version=3)
    assert result.added == [0, 1] and len(store) == 2 and store.prompt_count == 1
    entry = store.get(0)
    assert entry.response_token_ids.tolist() == [4] and entry.segments[0].policy_version == 3
    assert entry.policy_version == 3 and entry.step == 5 and entry.added_step == 5
    assert entry.reward == 1.0 and entry.correct is True and entry.text == "4" and entry.prompt_id == "p:0"
    assert entry.segments[0].behavior_logprobs.tolist() == pytest.approx([-1.0])
    # 64 fixed + 8 per token + 24 per segment + 1 byte of text + 4 * 384; the prompt: 16 + 7 + 4 * 384
    assert entry.nbytes == 64 + 8 + 24 + 1 + 1536 == 1633
    assert store.nbytes == 2 * 1633 + (16 + 7 + 1536)
    replayed = entry.to_rollout("p:0@replay/0", "p:0@replay")
    assert replayed.replayed_from == "p:0@s5/0" and replayed.origin.value == "replayed"
    assert replayed.response_token_ids == [4] and replayed.segments[0].policy_version == 3


def test_exact_duplicates_are_skipped_within_an_add_and_across_adds(embedder):
    store = _store(embedder)
    first = store.add([_rollout("p:0", [4], "4"), _rollout("p:0", [4], "4", i=1), _rollout("p:0", [5], "5", i=2)],
                      PROMPTS, 0, 0)
    assert first.added == [0, 1] and first.exact_duplicates == 1
    again = store.add([_rollout("p:0", [4], "4", step=1), _rollout("p:2", [4], "4", step=1)], PROMPTS, 1, 1)
    assert again.added == [2] and again.exact_duplicates == 1  # the same tokens for another prompt are stored
    assert [e.prompt_id for e in store.entries()] == ["p:0", "p:0", "p:2"]
    assert store.totals == {"added": 3, "exact_duplicates": 2, "near_duplicates": 0, "evicted": 0}


def test_near_duplicates_of_the_same_prompt_are_skipped_at_the_cosine_threshold(embedder):
    a, b = "The answer is 4.", "the answer is four"
    cos = _cos(embedder, a, b)
    assert 0.5 < cos < 0.999
    below = _store(embedder, dedup_threshold=cos - 1e-4)
    result = below.add([_rollout("p:0", [1], a), _rollout("p:0", [2], b, i=1), _rollout("p:2", [2], b, i=2)],
                       PROMPTS, 0, 0)
    assert result.added == [0, 1] and result.near_duplicates == 1  # p:2's copy is another prompt's
    assert [e.prompt_id for e in below.entries()] == ["p:0", "p:2"]
    above = _store(embedder, dedup_threshold=min(cos + 1e-4, 1.0))
    assert above.add([_rollout("p:0", [1], a), _rollout("p:0", [2], b, i=1)], PROMPTS, 0, 0).added == [0, 1]


def test_knn_by_response_ranks_by_cosine(embedder):
    store = _store(embedder)
    texts = ["four", "The capital of France is Paris.", "seven"]
    store.add([_rollout(f"p:{i}", [i], t, i=i) for i, t in enumerate(texts)], PROMPTS, 0, 0)
    query = "Paris is the French capital"
    hits = store.knn_by_response(query, k=3)
    expected = sorted(((_cos(embedder, query, t), t) for t in texts), reverse=True)
    assert [h.entry.text for h in hits] == [t for _, t in expected] and hits[0].entry.text == texts[1]
    assert [h.score for h in hits] == pytest.approx([c for c, _ in expected], abs=1e-5)
    only_p0 = store.knn_by_response(query, k=3, prompt_id="p:0")
    assert [h.entry.text for h in only_p0] == ["four"]


def test_knn_by_prompt_returns_the_nearest_prompt_s_rollouts_newest_first(embedder):
    store = _store(embedder)
    store.add([_rollout("p:0", [4], "4"), _rollout("p:1", [1], "Lyon", i=1)], PROMPTS, 0, 0)
    store.add([_rollout("p:1", [2], "Paris", step=1)], PROMPTS, 1, 1)
    prompts = store.knn_prompts("a French city", k=2)
    assert [p.prompt_id for p in prompts] == ["p:1", "p:0"] and [p.entries for p in prompts] == [2, 1]
    assert prompts[0].score == pytest.approx(_cos(embedder, "a French city", PROMPTS["p:1"]), abs=1e-5)
    hits = store.knn_by_prompt("a French city", k=2)
    assert [h.entry.text for h in hits] == ["Paris", "Lyon"] and hits[0].score == prompts[0].score


def test_fifo_eviction_keeps_the_newest_max_entries_and_drops_emptied_prompts(embedder):
    store = _store(embedder, max_entries=3)
    results = [store.add([_rollout(f"p:{i}", [i], str(i), step=i)], PROMPTS, i, i) for i in range(5)]
    assert [r.evicted for r in results] == [{}, {}, {}, {"max_entries": 1}, {"max_entries": 1}]
    assert [e.entry_id for e in store.entries()] == [2, 3, 4]
    assert store.prompt_count == 3 and store.knn_prompts("2 + 2 =", k=5)[0].prompt_id != "p:0"
    assert store.nbytes == sum(e.nbytes for e in store.entries()) + sum(16 + len(PROMPTS[f"p:{i}"]) + 1536
                                                                        for i in (2, 3, 4))


def test_max_staleness_drops_rollouts_older_than_the_limit(embedder):
    store = _store(embedder, max_staleness=1)
    result = store.add([_rollout("p:0", [v], str(v), version=v, i=v) for v in (0, 1, 2)], PROMPTS, 2, policy_version=2)
    assert result.added == [0, 1, 2] and result.evicted == {"staleness": 1}  # version 0 < 2 - 1
    assert [e.policy_version for e in store.entries()] == [1, 2]


def test_staleness_eviction_removes_the_oldest_policy_version_first(embedder):
    store = _store(embedder, max_entries=2, evict="staleness")
    for i, version in enumerate((2, 0, 1)):
        store.add([_rollout(f"p:{i}", [i], str(i), version=version)], PROMPTS, i, 2)
    assert [e.policy_version for e in store.entries()] == [2, 1]


def test_priority_eviction_removes_the_lowest_reward_first_ties_oldest_first(embedder):
    store = _store(embedder, max_entries=2, evict="priority")
    rewards = [0.5, 0.1, 0.9, 0.1]
    result = store.add([_rollout("p:0", [i], str(i), r, i=i) for i, r in enumerate(rewards)], PROMPTS, 0, 0)
    assert result.evicted == {"max_entries": 2}
    assert [(e.entry_id, e.reward) for e in store.entries()] == [(0, 0.5), (2, 0.9)]
    store.add([_rollout("p:0", [9], "9", 0.2, step=1)], PROMPTS, 1, 1, priorities=[0.7])  # a caller's priority
    assert [e.entry_id for e in store.entries()] == [2, 4]


def test_max_bytes_evicts_until_the_store_fits(embedder):
    prompt_bytes, entry_bytes = 16 + len(PROMPTS["p:0"]) + 1536, 1633
    store = _store(embedder, max_entries=None, max_bytes=prompt_bytes + 2 * entry_bytes)
    results = [store.add([_rollout("p:0", [i], str(i), step=i)], PROMPTS, i, i) for i in range(3)]
    assert results[2].evicted == {"max_bytes": 1}
    assert [e.entry_id for e in store.entries()] == [1, 2] and store.nbytes == prompt_bytes + 2 * entry_bytes


def test_a_background_add_equals_an_inline_one(embedder):
    inline, background = _store(embedder), ReplayStore(StoreConfig(background=True), embedder)
    batch = [_rollout("p:0", [4], "four"), _rollout("p:1", [1], "Paris", i=1)]
    inline.add(batch, PROMPTS, 0, 0)
    background.submit(batch, PROMPTS, 0, 0)
    assert background.pending and background.finish().added == [0, 1] and not background.pending
    assert background.responses.vectors(np.array([0, 1])).tobytes() == inline.responses.vectors(np.array([0, 1])).tobytes()
    background.close()


KINDS = {"flat": {}, "ivf": {"nlist": 2, "nprobe": 2, "ivf_train_size": 4}, "hnsw": {"hnsw_m": 8}}


@pytest.mark.parametrize("kind", KINDS)
def test_a_saved_store_loads_into_the_same_store(embedder, kind, tmp_path):
    store = _store(embedder, index=kind, max_entries=5, **KINDS[kind])
    texts = ["four", "Paris", "seven", "Lyon", "twelve", "Marseille", "nine"]
    for i, text in enumerate(texts):
        store.add([_rollout(f"p:{i % 5}", [i], text, float(i % 2), step=i)], PROMPTS, i, i)
    assert len(store) == 5 and store.responses.trained
    store.save(tmp_path)
    loaded = _store(embedder, index=kind, max_entries=5, **KINDS[kind])
    loaded.load(tmp_path, store.state_dict())
    assert [e.entry_id for e in loaded.entries()] == [e.entry_id for e in store.entries()]
    for a, b in zip(loaded.entries(), store.entries()):
        assert (a.rollout_id, a.text, a.reward, a.nbytes, a.response_token_ids.tolist()) == \
               (b.rollout_id, b.text, b.reward, b.nbytes, b.response_token_ids.tolist())
        assert a.segments[0].behavior_logprobs.tobytes() == b.segments[0].behavior_logprobs.tobytes()
    assert loaded.nbytes == store.nbytes and loaded.totals == store.totals and loaded.prompt_count == store.prompt_count
    for query in ("Paris", "a number"):
        assert [(h.entry.entry_id, h.score) for h in loaded.knn_by_response(query, 3)] == \
               [(h.entry.entry_id, h.score) for h in store.knn_by_response(query, 3)]
    more = [_rollout("p:1", [99], "Nice", step=9)]
    assert loaded.add(more, PROMPTS, 9, 9).added == store.add(more, PROMPTS, 9, 9).added == [7]


def test_hnsw_leaves_removed_rollouts_out_of_searches(embedder):
    store = _store(embedder, index="hnsw", max_entries=2)
    for i, text in enumerate(["Paris", "Lyon", "four"]):
        store.add([_rollout(f"p:{i}", [i], text)], PROMPTS, i, i)
    assert [e.text for e in store.entries()] == ["Lyon", "four"]
    assert [h.entry.text for h in store.knn_by_response("Paris", k=5)] == ["Lyon", "four"]
    assert store.responses.dead == {0}
    at_once = _store(embedder, index="hnsw", max_entries=2)  # evicted before its vector reached the index
    at_once.add([_rollout(f"p:{i}", [i], t, i=i) for i, t in enumerate(["Paris", "Lyon", "four"])], PROMPTS, 0, 0)
    assert at_once.responses.dead == set() and len(at_once.responses) == 2 and at_once.prompt_count == 2


def test_a_truncated_index_file_is_a_checkpoint_error_naming_it(embedder, tmp_path):
    store = _store(embedder)
    store.add([_rollout("p:0", [4], "4")], PROMPTS, 0, 0)
    store.save(tmp_path)
    index = tmp_path / RESPONSES_INDEX
    index.write_bytes(index.read_bytes()[: index.stat().st_size // 2])
    with pytest.raises(CheckpointError) as info:
        _store(embedder).load(tmp_path, store.state_dict())
    assert f"{index} is not a readable FAISS index (truncated or corrupt)" in info.value.message
    assert "delete this checkpoint directory" in info.value.fix


def test_a_truncated_metadata_file_is_a_checkpoint_error_naming_it(embedder, tmp_path):
    store = _store(embedder)
    store.add([_rollout("p:0", [4], "4")], PROMPTS, 0, 0)
    store.save(tmp_path)
    (tmp_path / ENTRIES).write_bytes((tmp_path / ENTRIES).read_bytes()[:40])
    with pytest.raises(CheckpointError, match="entries.parquet is not a readable parquet file"):
        _store(embedder).load(tmp_path, store.state_dict())


def test_a_store_saved_with_another_index_kind_is_refused(embedder, tmp_path):
    store = _store(embedder)
    store.save(tmp_path)
    with pytest.raises(CheckpointError, match="the store's index is `flat`, the pipeline says `hnsw`"):
        _store(embedder, index="hnsw").load(tmp_path, store.state_dict())


def test_index_parameters_of_another_index_kind_are_refused():
    with pytest.raises(ValidationError, match="`nlist` applies to `index: ivf`, and this store's index is `flat`"):
        StoreConfig(nlist=16)
    with pytest.raises(ValidationError, match="`ef_search` applies to `index: hnsw`"):
        StoreConfig(index="ivf", ef_search=16)
    assert StoreConfig(index="ivf", nlist=16).index_settings().ivf_train_size == 39 * 16
