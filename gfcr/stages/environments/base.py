"""The environment contract of ``generate.multi_turn``: gfcr's own small typed protocol, shaped
after OpenEnv's ``Environment`` (``openenv-core`` 0.3.0: ``reset`` / ``step`` returning an
``Observation`` with ``done``, ``reward`` and ``metadata``).

gfcr does not import OpenEnv, nor ``verifiers`` (0.4.0): both pull in network and LLM-client
stacks (OpenEnv: fastapi, uvicorn, gradio, openai, fastmcp; verifiers: openai, anthropic, mcp,
prime-sandboxes) that a rollout on the policy's own engine does not need. An environment here is
any class with the two methods below; an OpenEnv-style environment whose observations carry a
``text`` fits by shape (``docs/multi-turn.md`` says how).

One environment object serves one trajectory: ``generate.multi_turn`` builds a fresh one per
trajectory (``make_environment``), calls ``reset`` once and ``step`` once per model turn.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Protocol, runtime_checkable

from gfcr.errors import GfcrError
from gfcr.records import Prompt


@dataclass(frozen=True, slots=True)
class ToolCall:
    """A tool call a declared parser found in a model turn (``gfcr.stages.environments.tools``)."""

    name: str
    arguments: dict[str, Any] = field(default_factory=dict)

    def state(self) -> dict[str, Any]:
        return {"name": self.name, "arguments": dict(self.arguments)}


@dataclass(frozen=True, slots=True)
class Action:
    """What the model did in a turn: the turn's decoded text and, when the stage declares a tool
    parser and the parser found one, the tool call in it."""

    text: str
    tool_call: ToolCall | None = None


@dataclass(frozen=True, slots=True)
class Observation:
    """The environment's answer to a turn (OpenEnv's ``Observation``: ``done``, ``reward``,
    ``metadata``, plus the ``text`` the model reads next). ``text`` is tokenised into the
    trajectory's context when the episode goes on; ``reward`` is this turn's (None: none given);
    ``metadata`` may say ``correct`` (bool) and ``reason`` (str) for the trajectory's outcome."""

    text: str = ""
    done: bool = False
    reward: float | None = None
    metadata: dict[str, Any] = field(default_factory=dict)


class Environment(Protocol):
    """One episode of a multi-turn task. The prompt is the first observation (already in the
    context, tokenised with the policy's chat template); ``step`` answers each model turn."""

    def reset(self, prompt: Prompt, seed: int) -> None:
        """Start an episode on ``prompt`` (its ``verifier`` and ``metadata`` carry the task)."""
        ...

    def step(self, action: Action) -> Observation:
        """Answer one model turn."""
        ...


@runtime_checkable
class ClosesEnvironment(Protocol):
    """An environment with something to release when its episode ends (a process, a file): the
    stage calls ``close`` once, after the last turn, whatever ended the episode."""

    def close(self) -> None: ...


@runtime_checkable
class ChecksOptions(Protocol):
    """An environment class that can say, without an episode, what is wrong with its ``with``
    arguments (an unknown dataset, a config its library refuses): ``gfcr validate`` calls
    ``check_options(**with)`` and shows a ValueError's message with ``stages.<id>.with.environment``."""

    @classmethod
    def check_options(cls, *args: Any, **kwargs: Any) -> None: ...


EnvironmentFactory = Callable[..., Environment]


class EnvironmentFailed(GfcrError):
    """An environment raised in ``reset`` or ``step`` and the stage's ``on_env_error`` is ``fail``."""
