"""One channel of run events, with one record type (``RunEvent``), heard by progress bars,
trackers and tests alike.

The runner (``gfcr.runtime.loop.local``) and the run around it (``gfcr.runtime.loop.session``)
emit on the same ``HookChannel``; a hook is any object with a method named after the events it
wants, each called with the ``RunEvent`` (a hook implements any subset):

==================  ==========  ====================================================================
kind                emitted by  payload (read as attributes of the event: ``event.report``)
==================  ==========  ====================================================================
``before_run``      the run     ``run`` (the ``Run``), before its first step
``before_step``     the runner  ``ctx`` (the step's ``StepContext``)
``after_stage``     the runner  ``stage_id``, ``ctx``, ``output``, ``seconds``: one stage execution
``loop_round``      the runner  ``loop``, ``rounds``: a loop round ended and the loop goes on
``loop_stopped``    the runner  ``loop``, ``rounds``, ``limit``: a loop stopped at a limit, not done
``after_step``      the runner  ``report`` (the ``StepReport``), after every stage observed it
``before_eval``     the run     (nothing more): an evaluation starts
``after_eval``      the run     ``result`` (the ``EvalResult``)
``step_recorded``   the run     ``record`` (the step's ``metrics.jsonl`` line), ``report``
``after_run``       the run     ``summary`` (``summary.json``'s content)
==================  ==========  ====================================================================

``event.step`` is the step the event belongs to.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterable, Literal

EventKind = Literal["before_run", "before_step", "after_stage", "loop_round", "loop_stopped", "after_step",
                    "before_eval", "after_eval", "step_recorded", "after_run"]


@dataclass(frozen=True)
class RunEvent:
    """One event of a run: its ``kind``, the ``step`` it belongs to, and its ``payload`` (whose
    keys read as attributes: ``event.report`` is ``event.payload["report"]``)."""

    kind: EventKind
    step: int
    payload: dict[str, Any] = field(default_factory=dict)

    def __getattr__(self, name: str) -> Any:
        try:
            return self.__dict__["payload"][name]
        except KeyError:
            raise AttributeError(f"a `{self.__dict__.get('kind')}` event has no `{name}` (it has: "
                                 f"{', '.join(self.__dict__.get('payload', {})) or 'nothing more'})") from None


class HookChannel:
    """The hooks of a run, and ``emit``, which hands each of them the event by its kind."""

    def __init__(self, hooks: Iterable[Any] = ()):
        self.hooks: tuple[Any, ...] = tuple(hooks)

    def emit(self, kind: EventKind, step: int, **payload: Any) -> None:
        event = RunEvent(kind, step, payload)
        for hook in self.hooks:
            method = getattr(hook, kind, None)
            if method is not None:
                method(event)
