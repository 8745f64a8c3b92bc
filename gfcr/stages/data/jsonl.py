"""The ``jsonl`` data source: prompts and answers from a JSON-lines file, one object a line.

Each row gives a prompt (``prompt_field``), its ground truth (``answer_field``) and
optionally an id (``id_field``; default: the row's 0-based index among the file's
non-blank lines, so ids do not shift when a bad row is skipped). Prompt ids are
``<name>:<split>:<id>``, the same in every run. The prompt text is ``template`` with
``{prompt}`` (and any other field of the row, ``{topic}``) filled in; prompts are plain
text, scored by ``verifier``.

Bad rows (invalid JSON, a missing or empty field, an answer the verifier cannot read, a
duplicate id) are reported with ``file:line``. With ``on_error="fail"`` (the default),
``load`` raises one ``DataError`` listing every bad row, so the run never starts; with
``"skip"`` the good rows load and the bad ones are listed on ``PromptPool.skipped``.

``check`` is the cheap look ``gfcr validate`` (and ``gfcr run``, before anything is written)
takes: the file is there, is not empty and not binary, and its first ``HEAD_LINES`` rows (at
most ``HEAD_BYTES`` read) are good rows; with ``on_error="skip"`` only the file itself is
checked. Bad rows further down are still found by ``load``.

The helpers here (``existing_file``, ``file_head``, ``json_rows``, ``RowProblems``) are shared
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
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, Callable, Iterable, Iterator, Literal

from pydantic import Field, field_validator

from gfcr.errors import DataError, Location, Problem
from gfcr.records import Prompt, PromptPool, VerifierSpec, prompt_id
from gfcr.registry import StageConfig
from gfcr.stages.verifiers import arithmetic, check_verifier_name, gsm8k

log = logging.getLogger(__name__)

NAME = r"^[A-Za-z0-9_][A-Za-z0-9_.-]*$"
ROW_FIX = "fix the row or remove it, or load with `on_error: skip` to leave bad rows out"
HEAD_LINES, HEAD_BYTES = 20, 1 << 20  # what `check` reads of a data file

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


def file_head(path: Path, what: str, fix: str) -> list[bytes]:
    """The first ``HEAD_LINES`` lines of ``path`` (of at most ``HEAD_BYTES``), or a DataError
    if it is missing, a folder, empty or binary (it holds a NUL byte: gzip, parquet, a model)."""
    existing_file(path, what, fix)
    try:
        with path.open("rb") as f:
            head = f.read(HEAD_BYTES)
    except OSError as exc:
        raise DataError([Problem(Location(str(path)), "", f"{what}: {path} cannot be read: {exc.strerror}",
                                 "make it readable (check its permissions)")]) from None
    if not head.strip():
        raise DataError([Problem(Location(str(path)), "", f"{what}: {path} is empty",
                                 "write one JSON object per line into it, or " + fix)])
    if b"\0" in head:
        line = head[: head.index(b"\0")].count(b"\n") + 1
        raise DataError([Problem(Location(str(path), line), "",
                                 f"{what}: {path} is a binary file, not JSON lines (a NUL byte on line {line})",
                                 "decompress or convert it to JSON lines (one object per line), or " + fix)])
    lines = head.split(b"\n")
    if len(head) == HEAD_BYTES:
        lines = lines[:-1]  # cut by the read
    return lines[:HEAD_LINES]


def row_count(path: Path, up_to: int) -> int | None:
    """A JSON-lines file's non-blank lines, counted no further than ``up_to`` (so a large file is
    not read to the end); None when it cannot be read (its own check says why). Parses nothing."""
    rows = 0
    try:
        with path.open("rb") as f:
            for line in f:
                rows += bool(line.strip())
                if rows >= up_to:
                    break
    except OSError:
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
    """The bad rows of one file, as ``Problem`` s at ``file:line``."""

    file: str
    problems: list[Problem] = field(default_factory=list)

    def add(self, line: int, message: str, fix: str = ROW_FIX) -> None:
        self.problems.append(Problem(Location(self.file, line), "", message, fix))

    def pool(self, prompts: list[Prompt], name: str, on_error: str) -> PromptPool:
        """The pool of ``prompts``; a DataError if any row was bad and ``on_error`` is ``fail``,
        or if no row was good."""
        if not prompts:
            raise DataError(self.problems + [Problem(Location(self.file), "", "no usable rows",
                                                     "check the file and the field names in the source's config")])
        if self.problems and on_error != "skip":
            raise DataError(self.problems)
        skipped = [f"{p.where}: {p.message}" for p in self.problems]
        if skipped:
            log.warning("%s: skipped %d bad row(s) (on_error: skip); the first: %s", self.file, len(skipped), skipped[0])
        return PromptPool(prompts, name=name, skipped=skipped)


def json_rows(path: Path, problems: RowProblems) -> Iterator[tuple[int, int, dict[str, Any]]]:
    """``(line, index, row)`` for each JSON object line; blank lines are passed over, and
    lines that are not JSON objects are recorded in ``problems``. ``index`` counts the
    non-blank lines from 0, bad ones included."""
    with path.open("rb") as f:
        yield from line_rows(f, problems)


def line_rows(lines: Iterable[bytes], problems: RowProblems) -> Iterator[tuple[int, int, dict[str, Any]]]:
    """``json_rows`` of lines already read (``file_head``'s)."""
    index = 0
    for line, raw in enumerate(lines, start=1):
        if not raw.strip():
            continue
        row = _decode(raw, line, problems)
        if row is not None:
            yield line, index, row
        index += 1


def _decode(raw: bytes, line: int, problems: RowProblems) -> dict[str, Any] | None:
    try:
        row = json.loads(raw.decode("utf-8").lstrip("\ufeff").rstrip("\r\n"))
    except UnicodeDecodeError as exc:
        problems.add(line, f"not UTF-8 text ({exc.reason} at byte {exc.start})", "save the file as UTF-8")
        return None
    except json.JSONDecodeError as exc:
        problems.add(line, f"invalid JSON: {exc.msg} (column {exc.colno})",
                     "write one JSON object per line, e.g. {\"prompt\": \"...\", \"answer\": \"...\"}")
        return None
    if not isinstance(row, dict):
        problems.add(line, f"expected a JSON object, got {_json_type(row)}", "write one JSON object per line")
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


PATH_FIX = "fix `path:` (relative paths start at the directory gfcr runs in)"


def _missing_fix(key: str, config_key: str) -> str:
    return f"add `{key}` to the row, or set `{config_key}:` to the field that holds it"


class JsonlSource:
    """Prompts and ground truths from a JSON-lines file."""

    class Config(StageConfig):
        path: Annotated[str, Field(min_length=1, description="the file; relative to the current directory")]
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

    @property
    def source_name(self) -> str:
        stem = re.sub(r"[^A-Za-z0-9_.-]", "_", Path(self.config.path).stem).lstrip(".-") or "jsonl"
        return self.config.name or stem

    def check(self, on_error: Literal["fail", "skip"] = "fail") -> list[Problem]:
        """The problems of the file and of its first rows (see the module docstring)."""
        try:
            lines = file_head(Path(self.config.path), "the `jsonl` data file", PATH_FIX)
        except DataError as exc:
            return exc.problems
        problems, seen = RowProblems(self.config.path), {}
        for line, index, row in line_rows(lines, problems):
            self._prompt(row, line, index, problems, seen)
        return problems.problems if on_error == "fail" else []

    def count_prompts(self, up_to: int) -> int | None:
        """The most prompts ``load`` can give (bad rows may make it fewer), counted up to ``up_to``."""
        return row_count(Path(self.config.path), min(up_to, self.config.limit or up_to))

    def load(self, on_error: Literal["fail", "skip"] = "fail") -> PromptPool:
        cfg = self.config
        path = existing_file(Path(cfg.path), "the `jsonl` data file", PATH_FIX)
        problems, prompts, seen = RowProblems(cfg.path), [], {}
        for line, index, row in json_rows(path, problems):
            if cfg.limit is not None and len(prompts) >= cfg.limit:
                break
            prompt = self._prompt(row, line, index, problems, seen)
            if prompt is not None:
                prompts.append(prompt)
        return problems.pool(prompts, f"{self.source_name}/{cfg.split}", on_error)

    def _prompt(self, row: dict[str, Any], line: int, index: int, problems: RowProblems,
                seen: dict[str, int]) -> Prompt | None:
        cfg = self.config
        before = len(problems.problems)
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
        if len(problems.problems) > before or text is None or answer is None or row_id is None:
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
        values = {**row, "prompt": text}
        missing = [name for name in self.template_fields if name not in values]
        if missing:
            problems.add(line, f"the template needs field `{missing[0]}`, which the row lacks",
                         "add the field to every row, or change `template:`")
            return None
        return self.config.template.format_map(values)
