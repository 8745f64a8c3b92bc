"""The one error taxonomy of gfcr.

``GfcrError`` > ``SpecError`` (YAML and config), ``GraphError`` (compile), ``RegistryError``
(lookups), ``DataError`` (a data source's file or rows), ``ModelError`` (a policy model that
cannot be found or loaded), ``RunDirError`` (a run directory that cannot be used),
``CheckpointError`` (a checkpoint that cannot be read), ``EvalError`` (evaluation cannot
score), ``ReplicaLostError`` (an engine replica on Ray that did not survive), ``StageError``
(raised inside a stage). Spec, graph and data errors carry every
``Problem`` found, so that a file's mistakes are reported together, each with where it is
(``file:line:col`` and the key path) and how to fix it.

Every ``GfcrError`` is a user's mistake the user can fix: the CLI prints its message and fix
and exits 2, without a traceback. Anything else escaping the CLI is a bug and keeps its traceback.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass
from typing import Iterable


@dataclass(frozen=True)
class Location:
    """Where a value came from: a file position, or a label such as ``--set run.steps=3``."""

    file: str | None = None
    line: int | None = None  # 1-based
    col: int | None = None  # 1-based

    def __str__(self) -> str:
        parts = [self.file or "<python>"]
        if self.line is not None:
            parts.append(str(self.line))
            if self.col is not None:
                parts.append(str(self.col))
        return ":".join(parts)


@dataclass(frozen=True)
class Problem:
    """One mistake: where, at which key path, what is wrong, and the fix."""

    where: Location
    path: str
    message: str
    fix: str | None = None

    def __str__(self) -> str:
        head = f"{self.where}: {self.path}: {self.message}" if self.path else f"{self.where}: {self.message}"
        return f"{head}\n    fix: {self.fix}" if self.fix else head


FIX_PREFIX = "\n    fix: "


class GfcrError(Exception):
    """Base of every error gfcr raises on purpose: what happened (``message``, which says where)
    and how to fix it (``fix``). ``str()`` renders both, the fix on its own ``    fix:`` line.

    A message written the older way, with the fix inline after ``"\n    fix: "``, is split."""

    def __init__(self, message: str, fix: str | None = None):
        if fix is None and FIX_PREFIX in message:
            message, fix = message.split(FIX_PREFIX, 1)
        self.message, self.fix = message, fix
        super().__init__(f"{message}{FIX_PREFIX}{fix}" if fix else message)

    def __reduce__(self):  # pickles (Prefect tasks, Ray actors) whatever the subclass's __init__ takes
        return _rebuild, (type(self), self.args, self.__dict__)


def _rebuild(cls: type, args: tuple, state: dict) -> GfcrError:
    error = cls.__new__(cls)
    error.args = args
    error.__dict__.update(state)
    return error


class _ProblemsError(GfcrError):
    def __init__(self, problems: Iterable[Problem]):
        self.problems = list(problems)
        count = len(self.problems)
        lines = [f"{count} problem{'s' if count != 1 else ''}:"] + [str(p) for p in self.problems]
        Exception.__init__(self, "\n".join(lines))
        self.message, self.fix = self.args[0], None  # each problem carries its own fix


class SpecError(_ProblemsError):
    """The YAML, the schema, a reference or an override of a pipeline spec is wrong."""


class GraphError(_ProblemsError):
    """The pipeline does not compile: unknown stage, bad stage config, wiring or types."""


class DataError(_ProblemsError):
    """A data source cannot load: its file is missing, or rows are bad (each bad row a
    ``Problem`` at ``file:line``, all of them at once)."""


class RegistryError(GfcrError):
    """A lookup or registration in a registry failed."""


class ModelError(GfcrError):
    """A policy model could not be found or loaded: a missing alias or package, a bad model folder."""


class RunDirError(GfcrError):
    """A run directory cannot be used: not a run directory, already in use, or not writable."""


class CheckpointError(GfcrError):
    """A checkpoint cannot be read: not a checkpoint directory, a truncated or corrupt manifest or
    file, a format this gfcr does not read, a stateful stage without its state."""


class EvalError(GfcrError):
    """Evaluation cannot score: no policy, an eval prompt without a verifier, a bad ground truth."""


class WorkerLost(GfcrError):
    """A process the run placed elsewhere died (a trainer rank on Ray): the step did not complete,
    and the run directory resumes from its last checkpoint."""


class ReplicaLostError(WorkerLost):
    """An engine replica on Ray died more often than ``executor.max_replica_restarts`` allows, or did
    not come back: not the user's mistake, so the CLI exits 1 with the ``gfcr resume`` that continues
    the run (``gfcr.runtime.ray.restarts``)."""


class StageError(GfcrError):
    """An exception raised inside a stage, with the stage id, step and run id it happened at."""

    def __init__(self, stage_id: str, step: int, run_id: str, cause: BaseException, round: int | None = None):
        self.stage_id, self.step, self.run_id, self.cause, self.round = stage_id, step, run_id, cause, round
        where = f"step {step}" + (f", loop round {round}" if round is not None else "")
        Exception.__init__(
            self, f"stage `{stage_id}` failed at {where} of run {run_id}: {type(cause).__name__}: {cause}")
        self.message, self.fix = self.args[0], None  # a GfcrError cause prints its own fix

    @property
    def user_error(self) -> bool:
        """Whether the cause is a mistake the user can fix (a ``GfcrError``), not a bug."""
        return isinstance(self.cause, GfcrError)


def did_you_mean(name: str, candidates: Iterable[str], what: str = "") -> str | None:
    """A 'did you mean' fix for a near-miss name, or None when nothing is close."""
    scored = sorted(((difflib.SequenceMatcher(None, name, c).ratio(), c) for c in set(candidates)), reverse=True)
    scored = [(score, c) for score, c in scored if score >= 0.6]
    if not scored:
        return None
    # only the close runners-up: `control.fixed_n` is no real alternative to `control.uniform`
    matches = [c for score, c in scored[:3] if score >= scored[0][0] - 0.05]
    quoted = " or ".join(f"`{m}`" for m in matches)
    return f"did you mean {quoted}?" + (f" ({what})" if what else "")


def known(candidates: Iterable[str], limit: int = 12) -> str:
    """A short, sorted list of valid names for an error's fix text."""
    names = sorted(candidates)
    shown = ", ".join(f"`{n}`" for n in names[:limit])
    return shown + (f" and {len(names) - limit} more" if len(names) > limit else "")
