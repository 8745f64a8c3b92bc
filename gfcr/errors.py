"""The one error taxonomy of gfcr.

``GfcrError`` > ``SpecError`` (YAML and config), ``GraphError`` (compile), ``RegistryError``
(lookups), ``DataError`` (a data source's file or rows), ``StageError`` (raised inside a
stage). Spec, graph and data errors carry every ``Problem`` found, so that a file's
mistakes are reported together, each with where it is (``file:line:col`` and the key path)
and how to fix it.
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


class GfcrError(Exception):
    """Base of every error gfcr raises on purpose."""


class _ProblemsError(GfcrError):
    def __init__(self, problems: Iterable[Problem]):
        self.problems = list(problems)
        count = len(self.problems)
        lines = [f"{count} problem{'s' if count != 1 else ''}:"] + [str(p) for p in self.problems]
        super().__init__("\n".join(lines))


class SpecError(_ProblemsError):
    """The YAML, the schema, a reference or an override of a pipeline spec is wrong."""


class GraphError(_ProblemsError):
    """The pipeline does not compile: unknown stage, bad stage config, wiring or types."""


class DataError(_ProblemsError):
    """A data source cannot load: its file is missing, or rows are bad (each bad row a
    ``Problem`` at ``file:line``, all of them at once)."""


class RegistryError(GfcrError):
    """A lookup or registration in a registry failed."""

    def __init__(self, message: str, fix: str | None = None):
        self.message, self.fix = message, fix
        super().__init__(f"{message}\n    fix: {fix}" if fix else message)


class StageError(GfcrError):
    """An exception raised inside a stage, with the stage id, step and run id it happened at."""

    def __init__(self, stage_id: str, step: int, run_id: str, cause: BaseException, round: int | None = None):
        self.stage_id, self.step, self.run_id, self.cause, self.round = stage_id, step, run_id, cause, round
        where = f"step {step}" + (f", loop round {round}" if round is not None else "")
        super().__init__(
            f"stage `{stage_id}` failed at {where} of run {run_id}: {type(cause).__name__}: {cause}"
        )


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
