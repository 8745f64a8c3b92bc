"""What the replay store's calls return: a search hit, a prompt hit, and what one add did."""

from __future__ import annotations

from dataclasses import dataclass, field

from gfcr.stages.common.stored import StoredRollout


@dataclass(frozen=True, slots=True)
class Hit:
    """A search result: a stored rollout and its cosine similarity to the query (for a search by
    prompt, the similarity of its prompt)."""

    entry: StoredRollout
    score: float


@dataclass(frozen=True, slots=True)
class PromptHit:
    prompt_id: str
    text: str
    score: float
    entries: int  # how many rollouts of the prompt the store holds


@dataclass(slots=True)
class AddResult:
    """What one ``add`` did: the entry ids it stored, the rollouts it skipped as duplicates, and
    the entries eviction then removed (by reason: ``staleness``, ``max_entries``, ``max_bytes``)."""

    added: list[int] = field(default_factory=list)
    exact_duplicates: int = 0
    near_duplicates: int = 0
    evicted: dict[str, int] = field(default_factory=dict)
