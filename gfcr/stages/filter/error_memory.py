"""The online memory of ``filter.meds``, as MEDS's ``cluster_and_log`` keeps it
(Linxi000/MEDS@2e2b040, ``recipe/MEDS/layer_logits_utils.py``, ``cluster_method: hdbscan``).

One memory per key, a prompt and a correctness (its wrong and its right answers apart): the
fingerprints of the key's past rollouts, oldest first, and the HDBSCAN label of each from the
last time new ones joined. A step's new fingerprints of a key are sized against the *past* only:

1. ``assign``: each new fingerprint takes the majority label of its ``k`` nearest past fingerprints
   (cosine distance, brute force; a tie goes to the smallest label, noise ``-1`` first), and its
   cluster size is the number of past fingerprints with that label. Noise is a label like any
   other here, as in the reference: a new point among past noise counts the past noise. A key
   without labels yet (first sight) gives size 0.
2. ``add``: the new fingerprints join the memory, which is relabelled from scratch by HDBSCAN
   (``min_cluster_size``, ``min_samples = 1``, Euclidean distance on the L2-normalised
   fingerprints; fewer than 2 points are all noise).

The reference keeps every fingerprint; ``per_key`` (the newest) and ``max_keys`` (the least
recently updated key leaves first) bound the memory when set. It is stage state: the
fingerprints travel as one ``[N, D]`` float64 array, the keys, row counts and labels as JSON
(``state_dict`` / ``load_state_dict``), so a resumed run has the same memory.
"""

from __future__ import annotations

from typing import Any

import numpy as np

Key = tuple[str, bool]  # (prompt id, correct)


class ErrorMemory:
    """Past fingerprints and their HDBSCAN labels, per (prompt, correctness), least recently updated first."""

    def __init__(self, per_key: int | None = None, max_keys: int | None = None, k: int = 3,
                 min_cluster_size: int = 2):
        self.per_key, self.max_keys, self.k, self.min_cluster_size = per_key, max_keys, k, min_cluster_size
        self.rows: dict[Key, np.ndarray] = {}  # key -> [m, D] float64, oldest first
        self.labels: dict[Key, np.ndarray] = {}  # key -> [m] int HDBSCAN labels of rows[key]

    def assign(self, key: Key, vectors: np.ndarray) -> tuple[list[int | None], list[int]]:
        """Each new fingerprint's label by a kNN vote over the key's past labels, and its
        cluster's size among the past (0 and None at first sight)."""
        past, labels = self.rows.get(key), self.labels.get(key)
        if past is None or not len(past):
            return [None] * len(vectors), [0] * len(vectors)
        from sklearn.neighbors import NearestNeighbors

        nn = NearestNeighbors(n_neighbors=min(self.k, len(past)), metric="cosine", algorithm="brute").fit(past)
        votes = labels[nn.kneighbors(vectors, return_distance=False)]  # [n, k]
        chosen = [int(_majority(v)) for v in votes]
        return chosen, [int(np.sum(labels == x)) for x in chosen]

    def add(self, key: Key, vectors: np.ndarray) -> None:
        """Append the new fingerprints (capped at the newest ``per_key``) and relabel the key."""
        if not len(vectors):
            return
        old = self.rows.pop(key, None)
        self.labels.pop(key, None)
        joined = np.asarray(vectors, dtype=np.float64) if old is None else np.concatenate([old, vectors])
        self.rows[key] = np.ascontiguousarray(joined if self.per_key is None else joined[-self.per_key:])
        self.labels[key] = hdbscan_labels(self.rows[key], self.min_cluster_size)
        while self.max_keys is not None and len(self.rows) > self.max_keys:
            oldest = next(iter(self.rows))
            del self.rows[oldest], self.labels[oldest]

    def clusters(self, key: Key) -> int:
        """Clusters (not noise) among the key's fingerprints."""
        return len({int(x) for x in self.labels.get(key, ()) if x >= 0})

    @property
    def entries(self) -> int:
        return sum(len(v) for v in self.rows.values())

    @property
    def prompts(self) -> int:
        return len({prompt for prompt, _ in self.rows})

    def state_dict(self) -> dict[str, Any]:
        keys = list(self.rows)
        vectors = np.concatenate([self.rows[k] for k in keys]) if keys else None
        return {"keys": [[p, c] for p, c in keys], "counts": [len(self.rows[k]) for k in keys], "vectors": vectors,
                "labels": [int(x) for k in keys for x in self.labels[k]]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.rows, self.labels, start = {}, {}, 0
        for (prompt, correct), count in zip(state["keys"], state["counts"]):
            key = (prompt, bool(correct))
            self.rows[key] = np.ascontiguousarray(state["vectors"][start:start + count], dtype=np.float64)
            self.labels[key] = np.asarray(state["labels"][start:start + count], dtype=int)
            start += count


def hdbscan_labels(points: np.ndarray, min_cluster_size: int) -> np.ndarray:  # [n] int
    """HDBSCAN labels of ``points`` ([n, D]) after L2 normalisation; all noise below 2 points."""
    if len(points) < 2:
        return np.full(len(points), -1, dtype=int)
    from sklearn.cluster import HDBSCAN
    from sklearn.preprocessing import normalize

    return HDBSCAN(min_cluster_size=min_cluster_size, min_samples=1, copy=True).fit(normalize(points)).labels_.astype(int)


def _majority(votes: np.ndarray) -> int:
    """The most frequent label; a tie to the smallest (``np.unique`` sorts)."""
    values, counts = np.unique(votes, return_counts=True)
    return values[np.argmax(counts)]
