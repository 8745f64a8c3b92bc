"""A FAISS index of unit vectors under integer ids: flat (exact), IVF or HNSW, with removal.

Scores are inner products of unit vectors, i.e. cosine similarities.

- ``flat``: ``IndexIDMap2(IndexFlatIP)``; exact search, removal compacts the vectors.
- ``ivf``: ``IndexIVFFlat`` (inner product) with ``nlist`` lists, searched over ``nprobe`` of
  them. It needs training, so the index stays flat (exact) until it holds ``train_size``
  vectors, then trains its coarse quantizer on all of them (FAISS's k-means, seed 1234) and
  moves them over; it is not retrained later. Removal by id (a hash-table direct map).
- ``hnsw``: ``IndexIDMap2(IndexHNSWFlat)`` with ``M`` links per node. HNSW cannot remove a
  vector, so a removed id becomes a tombstone that every search leaves out (an ``IDSelector``),
  and the graph is rebuilt from the live vectors once tombstones outnumber them.

Files: ``save(path)`` writes ``faiss.write_index``; the tombstones travel in ``state()``.
A file FAISS cannot read (truncated, not an index) is a ``CheckpointError`` naming it.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np

from gfcr.errors import CheckpointError

IndexKind = Literal["flat", "ivf", "hnsw"]


@dataclass(frozen=True)
class IndexSettings:
    kind: IndexKind = "flat"
    nlist: int = 64
    nprobe: int = 8
    train_size: int | None = None  # default 39 * nlist, FAISS's own minimum for k-means
    hnsw_m: int = 32
    ef_construction: int = 40
    ef_search: int = 64

    @property
    def ivf_train_size(self) -> int:
        return self.train_size if self.train_size is not None else 39 * self.nlist


def _faiss() -> Any:
    import faiss

    return faiss


class VectorIndex:
    """Unit vectors of dimension ``dim`` under int64 ids (see the module docstring)."""

    def __init__(self, settings: IndexSettings, dim: int):
        self.settings, self.dim = settings, dim
        self.dead: set[int] = set()  # hnsw tombstones
        self.index = self._empty()

    # --- building ------------------------------------------------------------------------------

    def _empty(self) -> Any:
        faiss = _faiss()
        if self.settings.kind == "hnsw":
            inner = faiss.IndexHNSWFlat(self.dim, self.settings.hnsw_m, faiss.METRIC_INNER_PRODUCT)
            inner.hnsw.efConstruction = self.settings.ef_construction
            return faiss.IndexIDMap2(inner)
        return faiss.IndexIDMap2(faiss.IndexFlatIP(self.dim))

    @property
    def trained(self) -> bool:
        """Whether an ``ivf`` index has moved to its inverted lists (always True for the others)."""
        return self.settings.kind != "ivf" or not isinstance(self.index, _faiss().IndexIDMap2)

    def add(self, ids: np.ndarray, vectors: np.ndarray) -> None:
        """Add ``vectors`` [n, dim] float32 under ``ids`` [n] int64 (new ids only)."""
        if len(ids) == 0:
            return
        self.index.add_with_ids(np.ascontiguousarray(vectors, dtype=np.float32), np.asarray(ids, dtype=np.int64))
        if not self.trained and self.index.ntotal >= self.settings.ivf_train_size:
            self._train_ivf()

    def _train_ivf(self) -> None:
        faiss = _faiss()
        ids = faiss.vector_to_array(self.index.id_map).astype(np.int64)
        vectors = self.index.index.reconstruct_n(0, self.index.ntotal)
        quantizer = faiss.IndexFlatIP(self.dim)
        ivf = faiss.IndexIVFFlat(quantizer, self.dim, self.settings.nlist, faiss.METRIC_INNER_PRODUCT)
        ivf.train(vectors)
        ivf.set_direct_map_type(faiss.DirectMap.Hashtable)
        ivf.add_with_ids(vectors, ids)
        self.index = ivf

    def remove(self, ids: np.ndarray) -> None:
        ids = np.asarray(ids, dtype=np.int64)
        if len(ids) == 0:
            return
        if self.settings.kind == "hnsw":
            self.dead.update(int(i) for i in ids)
            if len(self.dead) > len(self):
                self._rebuild()
            return
        faiss = _faiss()
        # an IVF's hash-table direct map removes only by an explicit id array
        selector = faiss.IDSelectorBatch(ids) if isinstance(self.index, faiss.IndexIDMap2) else \
            faiss.IDSelectorArray(ids)
        self.index.remove_ids(selector)

    def _rebuild(self) -> None:
        faiss = _faiss()
        ids = faiss.vector_to_array(self.index.id_map).astype(np.int64)
        live = np.array([i for i in ids if int(i) not in self.dead], dtype=np.int64)
        vectors = self.vectors(live)
        self.dead = set()
        self.index = self._empty()
        self.add(live, vectors)

    # --- reading -------------------------------------------------------------------------------

    def __len__(self) -> int:
        return int(self.index.ntotal) - len(self.dead)

    def vectors(self, ids: np.ndarray) -> np.ndarray:  # [n, dim] float32
        out = np.zeros((len(ids), self.dim), dtype=np.float32)
        for row, i in enumerate(ids):
            out[row] = self.index.reconstruct(int(i))
        return out

    def search(self, queries: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        """The ``k`` nearest live vectors of each query: (scores [q, k] float32, ids [q, k] int64),
        best first, id -1 where fewer than ``k`` exist."""
        queries = np.ascontiguousarray(queries, dtype=np.float32).reshape(-1, self.dim)
        k = max(1, min(k, len(self))) if len(self) else 0
        if k == 0:
            return np.zeros((len(queries), 0), dtype=np.float32), np.zeros((len(queries), 0), dtype=np.int64)
        faiss = _faiss()
        if self.settings.kind == "hnsw":
            params = faiss.SearchParametersHNSW(efSearch=max(self.settings.ef_search, k))
            if self.dead:
                self._selector = faiss.IDSelectorNot(faiss.IDSelectorBatch(np.array(sorted(self.dead), np.int64)))
                params.sel = self._selector  # kept alive on self: FAISS holds a raw pointer
            return self.index.search(queries, k, params=params)
        if self.trained and self.settings.kind == "ivf":
            return self.index.search(queries, k, params=faiss.SearchParametersIVF(nprobe=self.settings.nprobe))
        return self.index.search(queries, k)

    # --- files and state -----------------------------------------------------------------------

    def save(self, path: Path) -> None:
        _faiss().write_index(self.index, str(path))

    def load(self, path: Path) -> None:
        faiss = _faiss()
        try:
            index = faiss.read_index(str(path))
        except Exception as exc:  # FAISS raises RuntimeError with its C++ message on a short file
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise CheckpointError(f"{path} is not a readable FAISS index (truncated or corrupt): {first}",
                                  "the replay store's checkpoint files are damaged: delete this checkpoint "
                                  "directory to resume from an older one, or start the run again") from None
        if index.d != self.dim:
            raise CheckpointError(f"{path} holds vectors of dimension {index.d}, the embedder makes {self.dim}",
                                  "resume with the embedder this store was built with")
        if isinstance(index, faiss.IndexIVF):
            index.set_direct_map_type(faiss.DirectMap.Hashtable) if index.direct_map.type == 0 else None
        self.index = index

    def state(self) -> dict[str, Any]:
        return {"dead": np.array(sorted(self.dead), dtype=np.int64)}

    def restore_state(self, state: dict[str, Any]) -> None:
        self.dead = {int(i) for i in np.asarray(state["dead"]).tolist()}
