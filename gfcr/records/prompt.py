"""Prompts and the pool a pipeline draws them from."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterator, Sequence

from gfcr.records.ids import check_id


@dataclass(frozen=True, slots=True)
class VerifierSpec:
    """How to score answers to a prompt: a verifier name and the ground truth it checks against."""

    name: str
    ground_truth: str
    options: dict[str, Any] = field(default_factory=dict)


@dataclass(slots=True)
class Prompt:
    """One training or evaluation prompt.

    ``prompt_token_ids`` is filled once, by the runtime, with the policy's tokenizer (chat
    template applied); resume and replay work from these ids, never from re-tokenized text.
    """

    prompt_id: str
    text: str | None = None
    messages: list[dict[str, str]] | None = None
    verifier: VerifierSpec | None = None
    prompt_token_ids: list[int] | None = None
    metadata: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        check_id(self.prompt_id, "Prompt.prompt_id")
        if (self.text is None) == (self.messages is None):
            raise ValueError(f"prompt {self.prompt_id}: give exactly one of `text` or `messages`")


class PromptPool(Sequence[Prompt]):
    """The prompts a run draws from, in a fixed order, addressable by id.

    The runtime feeds the pool to every stage input annotated ``PromptPool``; it is not an
    edge of the pipeline graph. ``skipped`` lists the bad rows a data source left out
    (``on_error: skip``), one message each, ``file:line: what was wrong``.
    """

    def __init__(self, prompts: Sequence[Prompt], name: str = "pool", skipped: Sequence[str] = ()):
        self.name = name
        self.skipped: tuple[str, ...] = tuple(skipped)
        self._prompts = tuple(prompts)
        self._by_id: dict[str, int] = {}
        for i, p in enumerate(self._prompts):
            if p.prompt_id in self._by_id:
                raise ValueError(f"{name}: prompt id {p.prompt_id!r} appears twice (rows {self._by_id[p.prompt_id]} and {i})")
            self._by_id[p.prompt_id] = i

    def __len__(self) -> int:
        return len(self._prompts)

    def __getitem__(self, index):  # type: ignore[override]
        return self._prompts[index]

    def __iter__(self) -> Iterator[Prompt]:
        return iter(self._prompts)

    def __contains__(self, prompt_id: object) -> bool:
        return prompt_id in self._by_id

    def get(self, prompt_id: str) -> Prompt:
        return self._prompts[self._by_id[prompt_id]]

    def __repr__(self) -> str:
        return f"PromptPool({self.name!r}, {len(self)} prompts)"
