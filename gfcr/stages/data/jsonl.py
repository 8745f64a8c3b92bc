"""The ``jsonl`` data source: prompts and answers from a JSON-lines file, one object a line.

Each row gives a prompt (``prompt_field``), its ground truth (``answer_field``) and
optionally an id (``id_field``; default: the row's 0-based index among the file's
non-blank lines, so ids do not shift when a bad row is skipped). Prompt ids are
``<name>:<split>:<id>``, the same in every run. The prompt text is ``template`` with
``{prompt}`` (and any other field of the row, ``{topic}``) filled in; prompts are plain
text, scored by ``verifier``.

The file is read one line at a time (``gfcr.stages.data.lines``), a ``.gz`` file through gzip,
and only as far as ``limit`` needs. Bad rows (invalid JSON, a missing or empty field, an answer
the verifier cannot read, a duplicate id; invalid UTF-8, binary data, a row longer than
``max_row_mb``) are reported with ``file:line``. With ``on_error="fail"`` (the default),
``load`` raises one ``DataError`` listing the bad rows (the first ``LISTED``; reading stops
there), so the run never starts; with ``"skip"`` the good rows load and the bad ones are
listed on ``PromptPool.skipped`` (the first ``LISTED``, then how many more). A row over
``max_row_mb`` (8 MiB) is read past in chunks, never held whole.

``check`` is the cheap look ``gfcr validate`` (and ``gfcr run``, before anything is written)
takes: the file is there, is not empty and not binary (its first ``HEAD_BYTES``: compressed,
an archive, UTF-16, a NUL byte), and its first ``HEAD_LINES`` rows are good rows; with
``on_error="skip"`` only the file itself is checked. Bad rows further down are still found by
``load``.

The helpers here (``existing_file``, ``check_head``, ``read_prompts``, ``RowProblems``) are shared
by the other file-backed sources, such as ``gsm8k``.

Example:

>>> import json, pathlib, tempfile
>>> path = pathlib.Path(tempfile.mkdtemp()) / "sums.jsonl"
>>> _ = path.write_text('{"prompt": "2 + 2?", "answer": 4}\\n{"prompt": "3 + 5?", "answer": "8"}\\n')
>>> pool = JsonlSource(JsonlSource.Config(path=str(path), verifier="arithmetic")).load()
>>> [(p.prompt_id, p.text, p.verifier.ground_truth) for p in pool]
[('sums:train:0', '2 + 2?', '4'), ('sums:train:1', '3 + 5?', '8')]

YAML:

.. code-block:: yaml

    data: {source: jsonl, with: {path: data/problems.jsonl, verifier: math}, on_error: skip}
"""

from __future__ import annotations

import json
import logging
import re
import string
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, Callable, Iterator, Literal

from pydantic import Field, field_validator

from gfcr.errors import DataError, Location, Problem
from gfcr.records import Prompt, PromptPool, VerifierSpec, prompt_id
from gfcr.registry import FilePath, StageConfig
from gfcr.stages.data.lines import (
    BINARY_LINE_FIX, DEFAULT_MAX_ROW_MB, MaxRowMb, binary_problem, max_row_bytes, numbered_lines, open_data,
    read_error, read_errors, too_long,
)
from gfcr.stages.verifiers import arithmetic, check_verifier_name, gsm8k

log = logging.getLogger(__name__)

NAME = r"^[A-Za-z0-9_][A-Za-z0-9_.-]*$"
ROW_FIX = "fix the row or remove it, or load with `on_error: skip` to leave bad rows out"
HEAD_LINES, HEAD_BYTES = 20, 1 << 20  # `check` judges the first rows, and sniffs the first bytes for binary
LISTED = 20  # bad rows listed one by one; the rest are counted

# ground-truth checks at load time for the built-in verifiers that need a number; `math`
# answers are left to math-verify at scoring time (importing it would slow every load)
GROUND_TRUTH_CHECKS: dict[str, Callable[[str], object]] = {
    "arithmetic": arithmetic.parse_ground_truth,
    "gsm8k": gsm8k.parse_ground_truth,
}


def existing_file(path: Path, what: str, fix: str) -> Path:
    """``path`` if it is a file, else a DataError saying where it was looked for."""
    if not path.is_file():
        where = f"{path.resolve()}" + ("" if path.is_absolute() else f" (relative to {Path.cwd()})")
        state = "is a folder, not a file" if path.is_dir() else "does not exist"
        raise DataError([Problem(Location(str(path)), "", f"{what}: {where} {state}", fix)])
    return path


def check_file(path: Path, what: str, fix: str) -> None:
    """A DataError if ``path`` is missing, a folder, unreadable, empty or not text (its first
    ``HEAD_BYTES`` are a compressed file, an archive, UTF-16 or hold a NUL byte: ``lines.sniff``)."""
    existing_file(path, what, fix)
    head = _head(path)
    if not head.strip():
        raise DataError([Problem(Location(str(path)), "", f"{what}: {path} is empty",
                                 "write one JSON object per line into it, or " + fix)])
    problem = binary_problem(path, head, what, fix)
    if problem is not None:
        raise DataError([problem])


def _head(path: Path) -> bytes:
    """The first ``HEAD_BYTES`` of ``path`` (decompressed, for a ``.gz``); a read error is a DataError
    at the line it was met on (the file is read again line by line to find it)."""
    try:
        with open_data(path) as handle:
            return handle.read(HEAD_BYTES)
    except (EOFError, zlib.error, OSError) as exc:
        error = exc
    with read_errors(path, 1), open_data(path) as handle:
        for _ in numbered_lines(handle, path, HEAD_BYTES):
            pass  # raises the DataError at the line where the stream breaks
    raise read_error(path, 1, error)


def check_head(path: Path, what: str, fix: str, max_row_mb: int, on_error: str,
               judge: Callable[[dict[str, Any], int, int, RowProblems], object]) -> list[Problem]:
    """A source's ``check``: the problems of the file (``check_file``) and, with ``on_error:
    fail``, of its first ``HEAD_LINES`` rows, each passed to ``judge(row, line, index, problems)``."""
    problems = RowProblems(str(path))
    try:
        check_file(path, what, fix)
        if on_error == "fail":
            for line, index, row in json_rows(path, problems, max_row_mb, lines=HEAD_LINES):
                judge(row, line, index, problems)
    except DataError as exc:
        return problems.problems + exc.problems
    return problems.problems


def row_count(path: Path, up_to: int, max_row_mb: int = DEFAULT_MAX_ROW_MB) -> int | None:
    """A JSON-lines file's non-blank lines, counted no further than ``up_to`` (so a large file is
    not read to the end); None when it cannot be read (its own check says why). Parses nothing."""
    rows = 0
    try:
        with open_data(path) as handle:
            for _, raw in numbered_lines(handle, path, max_row_bytes(max_row_mb)):
                rows += raw is None or not raw.isspace()
                if rows >= up_to:
                    break
    except (OSError, DataError):
        return None
    return rows


def template_fields(template: str) -> list[str]:
    """The ``{names}`` a template fills in; ValueError for positional or indexed fields."""
    try:
        names = [name for _, name, _, _ in string.Formatter().parse(template) if name is not None]
    except ValueError as exc:
        raise ValueError(f"template {template!r} is not a valid format string: {exc} (write `{{{{` for a brace)") from None
    for name in names:
        if not name or not name.isidentifier():
            raise ValueError(f"template {template!r}: `{{{name}}}` is not a field name; "
                             "use named fields such as `{prompt}` (no `{}`, `{0}`, `{a.b}` or `{a[0]}`)")
    return names


@dataclass
class RowProblems:
    """The bad rows of one file, as ``Problem`` s at ``file:line``: the first ``LISTED``, and a
    count of the rest (a file of a million bad rows costs no more memory than one of twenty).
    With ``stop`` (``on_error: fail``: the run will not start) reading stops once ``LISTED``
    are found."""

    file: str
    stop: bool = False
    problems: list[Problem] = field(default_factory=list)
    unlisted: int = 0
    stopped_at: int | None = None  # the line reading stopped at, with ``stop``

    def add(self, line: int, message: str, fix: str = ROW_FIX) -> None:
        if len(self.problems) < LISTED:
            self.problems.append(Problem(Location(self.file, line), "", message, fix))
        else:
            self.unlisted += 1

    @property
    def count(self) -> int:
        """The problems found, listed or not."""
        return len(self.problems) + self.unlisted

    def should_stop(self, line: int) -> bool:
        """With ``stop``, whether ``LISTED`` problems are found (then ``stopped_at`` is ``line``)."""
        if self.stop and len(self.problems) >= LISTED:
            self.stopped_at = line
        return self.stopped_at is not None

    def all(self) -> list[Problem]:
        """The listed problems, and one saying how many more there are (or where reading stopped)."""
        more = []
        if self.stopped_at is not None:
            more = [Problem(Location(self.file, self.stopped_at), "", f"reading stopped here after {LISTED} "
                            "problems; there may be more", "fix these first")]
        elif self.unlisted:
            more = [Problem(Location(self.file), "", f"and {self.unlisted} more problem(s) not listed "
                            f"(the first {LISTED} are)", "fix the rows listed, then load again to see the rest")]
        return self.problems + more

    def pool(self, prompts: list[Prompt], name: str, on_error: str) -> PromptPool:
        """The pool of ``prompts``; a DataError if any row was bad and ``on_error`` is ``fail``,
        or if no row was good."""
        problems = self.all()
        if not prompts:
            raise DataError(problems + [Problem(Location(self.file), "", "no usable rows",
                                                "check the file and the field names in the source's config")])
        if problems and on_error != "skip":
            raise DataError(problems)
        skipped = [f"{p.where}: {p.message}" for p in problems]
        if skipped:
            log.warning("%s: skipped the bad rows (on_error: skip), %d problem(s); the first: %s", self.file,
                        self.count, skipped[0])
        return PromptPool(prompts, name=name, skipped=skipped)


def json_rows(path: Path, problems: RowProblems, max_row_mb: int = DEFAULT_MAX_ROW_MB,
              lines: int | None = None) -> Iterator[tuple[int, int, dict[str, Any]]]:
    """``(line, index, row)`` for each JSON object line of ``path`` (of its first ``lines``), read
    one line at a time (``lines.numbered_lines``); blank lines are passed over, and lines that are
    not JSON objects, or longer than ``max_row_mb``, are recorded in ``problems``. ``index``
    counts the non-blank lines from 0, bad ones included."""
    with read_errors(path, 1), open_data(path) as handle:
        index = 0
        for line, raw in numbered_lines(handle, path, max_row_bytes(max_row_mb)):
            if (lines is not None and line > lines) or problems.should_stop(line):
                return
            if raw is None:
                problems.add(line, *too_long(max_row_mb, problems.file))
            elif raw.isspace():
                continue
            elif (row := _decode(raw, line, problems)) is not None:
                yield line, index, row
            index += 1


def read_prompts(path: Path, problems: RowProblems, max_row_mb: int, limit: int | None,
                 build: Callable[[dict[str, Any], int, int, RowProblems], Prompt | None]) -> list[Prompt]:
    """The prompts ``build(row, line, index, problems)`` makes of the rows of ``path``, the first
    ``limit`` of them: the rows after those are not read."""
    prompts: list[Prompt] = []
    if limit is not None and limit <= 0:
        return prompts
    for line, index, row in json_rows(path, problems, max_row_mb):
        prompt = build(row, line, index, problems)
        if prompt is not None:
            prompts.append(prompt)
            if limit is not None and len(prompts) >= limit:
                break
    return prompts


def _decode(raw: bytes, line: int, problems: RowProblems) -> dict[str, Any] | None:
    nul = raw.find(b"\0")
    if nul >= 0:
        problems.add(line, f"binary data, not JSON text (a NUL byte at byte {nul + 1} of the line)",
                     BINARY_LINE_FIX)
        return None
    try:
        row = json.loads(raw.decode("utf-8").lstrip("\ufeff").rstrip("\r\n"))
    except UnicodeDecodeError as exc:
        problems.add(line, f"not UTF-8 text ({exc.reason} at byte {exc.start + 1} of the line)",
                     f"save the file as UTF-8 (from Latin-1: `iconv -f LATIN1 -t UTF-8 {problems.file} > utf8.jsonl`)")
        return None
    except json.JSONDecodeError as exc:
        problems.add(line, f"invalid JSON: {exc.msg} (column {exc.colno})",
                     "write one JSON object per line, e.g. {\"prompt\": \"...\", \"answer\": \"...\"}")
        return None
    except RecursionError:  # Python's parser recurses once a nesting level: [[[[... a hundred thousand deep
        problems.add(line, "JSON nested too deeply to read", "write rows of plain fields, nested a few levels at most")
        return None
    except ValueError as exc:  # an integer of more than 4300 digits (Python's limit on int parsing)
        problems.add(line, f"a value JSON cannot be read into: {str(exc).split(';')[0]}",
                     "write a number that long as a string (\"123...\")")
        return None
    if not isinstance(row, dict):
        fix = "write one JSON object per line" + (f" (convert a JSON array with `jq -c '.[]' {problems.file} > "
                                                  "rows.jsonl`)" if isinstance(row, list) else "")
        problems.add(line, f"expected a JSON object, got {_json_type(row)}", fix)
        return None
    return row


def _json_type(value: Any) -> str:
    names = {bool: "a boolean", int: "a number", float: "a number", str: "a string", list: "a list",
             dict: "an object", type(None): "null"}
    return names.get(type(value), type(value).__name__)


def text_field(row: dict[str, Any], key: str, line: int, problems: RowProblems, missing_fix: str,
               numbers: bool = False) -> str | None:
    """The non-empty string (or, with ``numbers``, number) in ``row[key]``, or None with the
    problem recorded (``missing_fix`` is the fix when the field is absent)."""
    if key not in row:
        present = ", ".join(f"`{k}`" for k in row) or "none"
        problems.add(line, f"missing field `{key}` (fields present: {present})", missing_fix)
        return None
    value = row[key]
    is_number = isinstance(value, (int, float)) and not isinstance(value, bool)
    if not (isinstance(value, str) or (numbers and is_number)):
        kinds = "a string or a number" if numbers else "a string"
        problems.add(line, f"field `{key}` is {_json_type(value)}, expected {kinds}")
        return None
    text = str(value).strip()
    if not text:
        problems.add(line, f"field `{key}` is empty")
        return None
    return text


PATH_FIX = "fix `path:` (a relative path starts at the pipeline file's folder)"


def _missing_fix(key: str, config_key: str) -> str:
    return f"add `{key}` to the row, or set `{config_key}:` to the field that holds it"


class JsonlSource:
    """Prompts and ground truths from a JSON-lines file."""

    class Config(StageConfig):
        path: Annotated[FilePath, Field(description="the file; relative to the pipeline file's folder")]
        prompt_field: Annotated[str, Field(min_length=1, description="the field holding the prompt text")] = "prompt"
        answer_field: Annotated[str, Field(min_length=1, description="the field holding the ground truth")] = "answer"
        id_field: str | None = Field(None, description="field with a unique row id; default: the row index")
        verifier: str = Field("math", description="the verifier that scores answers to these prompts")
        template: str = Field("{prompt}", description="the prompt text; `{prompt}` and row fields are filled in")
        limit: Annotated[int, Field(ge=1, description="load at most this many prompts")] | None = None
        name: Annotated[str, Field(pattern=NAME, description="the ids' source part")] | None = None
        split: Annotated[str, Field(pattern=NAME, description="the ids' split part")] = "train"
        metadata_fields: list[str] = Field(default_factory=list, description="row fields copied into the prompt's "
                                           "metadata, e.g. `reference_reward` for the `pvpo` estimator")
        max_row_mb: MaxRowMb = DEFAULT_MAX_ROW_MB

        @field_validator("verifier")
        @classmethod
        def _known_verifier(cls, name: str) -> str:
            return check_verifier_name(name)

        @field_validator("template")
        @classmethod
        def _valid_template(cls, template: str) -> str:
            template_fields(template)
            return template

    def __init__(self, config: Config):
        self.config = config
        self.template_fields = template_fields(config.template)
        stem = re.sub(r"[^A-Za-z0-9_.-]", "_", Path(config.path.removesuffix(".gz")).stem).lstrip(".-") or "jsonl"
        self.source_name = config.name or stem

    def check(self, on_error: Literal["fail", "skip"] = "fail") -> list[Problem]:
        """The problems of the file and of its first rows (see the module docstring)."""
        seen: dict[str, int] = {}
        return check_head(Path(self.config.path), "the `jsonl` data file", PATH_FIX, self.config.max_row_mb, on_error,
                          lambda row, line, index, problems: self._prompt(row, line, index, problems, seen))

    def count_prompts(self, up_to: int) -> int | None:
        """The most prompts ``load`` can give (bad rows may make it fewer), counted up to ``up_to``."""
        return row_count(Path(self.config.path), min(up_to, self.config.limit or up_to), self.config.max_row_mb)

    def load(self, on_error: Literal["fail", "skip"] = "fail") -> PromptPool:
        cfg = self.config
        path = existing_file(Path(cfg.path), "the `jsonl` data file", PATH_FIX)
        problems, seen = RowProblems(cfg.path, stop=on_error == "fail"), {}
        prompts = read_prompts(path, problems, cfg.max_row_mb, cfg.limit,
                               lambda row, line, index, problems: self._prompt(row, line, index, problems, seen))
        return problems.pool(prompts, f"{self.source_name}/{cfg.split}", on_error)

    def _prompt(self, row: dict[str, Any], line: int, index: int, problems: RowProblems,
                seen: dict[str, int]) -> Prompt | None:
        cfg = self.config
        before = problems.count
        text = text_field(row, cfg.prompt_field, line, problems, _missing_fix(cfg.prompt_field, "prompt_field"))
        answer = text_field(row, cfg.answer_field, line, problems, _missing_fix(cfg.answer_field, "answer_field"),
                            numbers=True)
        row_id = self._row_id(row, line, index, problems, seen)
        if answer is not None and cfg.verifier in GROUND_TRUTH_CHECKS:
            try:
                GROUND_TRUTH_CHECKS[cfg.verifier](answer)
            except ValueError as exc:
                problems.add(line, f"unusable answer in field `{cfg.answer_field}`: {exc}")
        if text is not None:
            text = self._fill(row, text, line, problems)
        metadata = {"line": line, **self._metadata(row, line, problems)}
        if problems.count > before or text is None or answer is None or row_id is None:
            return None
        return Prompt(prompt_id(self.source_name, cfg.split, row_id), text=text,
                      verifier=VerifierSpec(cfg.verifier, answer), metadata=metadata)

    def _metadata(self, row: dict[str, Any], line: int, problems: RowProblems) -> dict[str, Any]:
        """The ``metadata_fields`` of the row: numbers, strings or booleans, each required."""
        out = {}
        for key in self.config.metadata_fields:
            value = row.get(key)
            if isinstance(value, (int, float, str, bool)):
                out[key] = value
            else:
                problems.add(line, f"metadata field `{key}` is {'missing' if value is None else 'not a number, string or boolean'}",
                             f"give every row a `{key}` value, or remove it from `metadata_fields`")
        return out

    def _row_id(self, row: dict[str, Any], line: int, index: int, problems: RowProblems,
                seen: dict[str, int]) -> str | None:
        key = self.config.id_field
        if key is None:
            return str(index)
        row_id = text_field(row, key, line, problems, _missing_fix(key, "id_field"), numbers=True)
        if row_id is None:
            return None
        if re.search(r"\s", row_id):
            problems.add(line, f"id {row_id!r} in field `{key}` contains whitespace", "ids are single words")
            return None
        if row_id in seen:
            problems.add(line, f"duplicate id `{row_id}` in field `{key}` (first at line {seen[row_id]})",
                         "give every row its own id, or remove the repeated row")
            return None
        seen[row_id] = line
        return row_id

    def _fill(self, row: dict[str, Any], text: str, line: int, problems: RowProblems) -> str | None:
        if self.template_fields == ["prompt"] and self.config.template == "{prompt}":
            return text  # the default: no copy of the row a prompt
        values = {**row, "prompt": text}
        missing = [name for name in self.template_fields if name not in values]
        if missing:
            problems.add(line, f"the template needs field `{missing[0]}`, which the row lacks",
                         "add the field to every row, or change `template:`")
            return None
        return self.config.template.format_map(values)
