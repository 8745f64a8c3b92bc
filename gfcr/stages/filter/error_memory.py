"""The online error memory of ``filter.meds``: per prompt, the fingerprints of its recent incorrect
rollouts, clustered with HDBSCAN.

The memory keeps, for each prompt, the newest ``per_prompt`` fingerprints (FIFO) and at most
``max_prompts`` prompts (the least recently updated leaves first). It is stage state: the
fingerprints travel as one ``[N, D]`` float32 array and the prompt order and row counts as JSON
(``state_dict`` / ``load_state_dict``), so a resumed run has the same memory.

``clusters`` runs scikit-learn's HDBSCAN over the memory of one prompt together with the new
fingerprints (``min_cluster_size``, ``allow_single_cluster=True``: one prompt's errors may well be
one recurring mistake, and identical fingerprints, the same wrong answer sampled twice, must form a
cluster rather than fall to noise) and returns each point's label and its cluster's size (label
-1, noise, has size 0). HDBSCAN is density-relative, so among scattered errors the closest few can
still form a cluster; with fewer than 3 points it is not run (any two points would be a cluster).
"""

from __future__ import annotations

from typing import Any

import numpy as np

MIN_POINTS = 3  # HDBSCAN on two points calls them one cluster whatever their distance


class ErrorMemory:
    """Fingerprints of past incorrect rollouts, per prompt, least recently updated prompt first."""

    def __init__(self, per_prompt: int, max_prompts: int | None):
        self.per_prompt, self.max_prompts = per_prompt, max_prompts
        self.rows: dict[str, np.ndarray] = {}  # prompt id -> [m, D] float32, oldest first

    def of(self, prompt_id: str, dim: int) -> np.ndarray:  # [m, dim]
        return self.rows.get(prompt_id, np.zeros((0, dim), dtype=np.float32))

    def add(self, prompt_id: str, vectors: np.ndarray) -> None:
        if not len(vectors):
            return
        old = self.rows.pop(prompt_id, None)
        joined = vectors if old is None else np.concatenate([old, vectors])
        self.rows[prompt_id] = np.ascontiguousarray(joined[-self.per_prompt:], dtype=np.float32)
        while self.max_prompts is not None and len(self.rows) > self.max_prompts:
            self.rows.pop(next(iter(self.rows)))

    @property
    def entries(self) -> int:
        return sum(len(v) for v in self.rows.values())

    def state_dict(self) -> dict[str, Any]:
        prompts = list(self.rows)
        vectors = np.concatenate([self.rows[p] for p in prompts]) if prompts else None
        return {"prompts": prompts, "counts": [len(self.rows[p]) for p in prompts], "vectors": vectors}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.rows, start = {}, 0
        vectors = state["vectors"]
        for prompt, count in zip(state["prompts"], state["counts"]):
            self.rows[prompt] = np.ascontiguousarray(vectors[start:start + count], dtype=np.float32)
            start += count


def clusters(points: np.ndarray, min_cluster_size: int) -> tuple[list[int], list[int]]:
    """HDBSCAN labels of ``points`` ([n, D]) and each point's cluster size (0 for noise)."""
    n = len(points)
    if n < max(MIN_POINTS, min_cluster_size):
        return [-1] * n, [0] * n
    from sklearn.cluster import HDBSCAN

    labels = HDBSCAN(min_cluster_size=min_cluster_size, allow_single_cluster=True, copy=True).fit(points.astype(np.float64)).labels_
    sizes = {int(k): int(v) for k, v in zip(*np.unique(labels, return_counts=True))}
    return [int(x) for x in labels], [0 if x < 0 else sizes[int(x)] for x in labels]
