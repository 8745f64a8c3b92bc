"""Turns: a rollout that is a trajectory (``generate.multi_turn``) says who wrote which tokens.

A multi-turn rollout keeps the one token-level record every stage already reads: its
``response_token_ids`` hold, in order, every turn after the prompt (the model's turns and the
environment's observations and tool results, tokenised into the context), and its segments tile
them as always. A model turn's tokens sit in segments of origin ``sampled`` with the policy
version and behaviour log-probs of the engine that sampled them; an environment turn's tokens
sit in segments of origin ``environment``, whose "log-probs" are zeros (no policy wrote them)
and which the update never trains on (``Rollout.trained_mask``). ``Rollout.turns`` lists the
turns as spans of response positions: they tile the response, and each span holds segments of
its own kind only, so the loss mask follows from the record alone.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any


class TurnRole(StrEnum):
    MODEL = "model"  # sampled by the policy's engine: trained on
    ENVIRONMENT = "environment"  # an observation or tool result, tokenised into the context: never trained on


@dataclass(slots=True)
class Turn:
    """One turn of a trajectory: the response positions ``[start, end)`` it holds, its text, and
    what the environment said of it. A model turn may carry the tool call parsed from it and the
    reward the environment gave for it; an environment turn carries the observation's text."""

    role: TurnRole
    start: int
    end: int
    text: str = ""
    reward: float | None = None  # the environment's reward for this (model) turn, when it gave one
    tool_call: dict[str, Any] | None = None  # {"name": ..., "arguments": {...}} parsed from a model turn
    info: dict[str, Any] = field(default_factory=dict)  # the environment's metadata for the turn

    def __post_init__(self) -> None:
        self.role = TurnRole(self.role)
        if not 0 <= self.start <= self.end:
            raise ValueError(f"turn [{self.start}, {self.end}) is not a valid span")

    def __len__(self) -> int:
        return self.end - self.start

    def state(self) -> dict[str, Any]:
        """As JSON-able values (checkpoints, lineage)."""
        return {"role": str(self.role), "start": self.start, "end": self.end, "text": self.text,
                "reward": self.reward, "tool_call": self.tool_call, "info": dict(self.info)}

    @classmethod
    def from_state(cls, d: dict[str, Any]) -> "Turn":
        return cls(TurnRole(d["role"]), int(d["start"]), int(d["end"]), d.get("text", ""), d.get("reward"),
                   d.get("tool_call"), dict(d.get("info") or {}))
