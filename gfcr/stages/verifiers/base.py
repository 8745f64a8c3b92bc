"""What a verifier is: a function ``(response_text, ground_truth, options) -> Score``.

A verifier extracts an answer from a response and compares it with the ground truth. It is
pure (no state, no I/O of its own, the ``code`` verifier's sandboxed subprocess aside), so
the ``filter.verify`` stage can run it in a killable worker process under a wall-clock and
memory limit (``gfcr.stages.verifiers.pool``; it is shipped there with cloudpickle) and the
evaluation loop can reuse it unchanged. A verifier that imports heavy packages on its first
call may carry a ``prepare()`` attribute doing that import; each worker calls it once,
outside the timeout. ``options`` come from the prompt's ``VerifierSpec``;
each verifier validates them with a small strict pydantic model (``parse_options``), so a
misspelt option is an error, not a silent default.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, TypeVar

from pydantic import BaseModel, ConfigDict, ValidationError


@dataclass(frozen=True, slots=True)
class Score:
    """A verifier's verdict on one response.

    ``formatted``: the answer was found in the expected format (after ``Answer:``, ``####``,
    inside ``\\boxed{}``), not merely guessed from the last number. ``answer``: the extracted
    answer string, or None when nothing was found. ``reason``: one line for people, e.g.
    ``answer 59 == 59``.
    """

    correct: bool
    formatted: bool
    answer: str | None
    reason: str = ""


Verifier = Callable[[str, str, dict[str, Any]], Score]


class VerifierOptions(BaseModel):
    """Base of a verifier's options: frozen, strict, unknown keys rejected, floats finite."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True, allow_inf_nan=False)


O = TypeVar("O", bound=VerifierOptions)


def parse_options(model: type[O], options: dict[str, Any], verifier: str) -> O:
    """Validate ``options`` for ``verifier``; ValueError saying which keys are allowed."""
    try:
        return model.model_validate(options or {})
    except ValidationError as exc:
        allowed = ", ".join(f"`{k}`" for k in model.model_fields) or "none"
        problems = "; ".join(f"{'.'.join(map(str, e['loc'])) or 'options'}: {e['msg']}" for e in exc.errors())
        raise ValueError(f"verifier `{verifier}`: bad options {options!r} ({problems}); "
                         f"the options it accepts are {allowed}") from None
