"""The ``gsm8k`` data source: grade-school math word problems (Cobbe et al., 2021, arXiv 2110.14168).

Reads GSM8K's JSON-lines files (``{"question": ..., "answer": "...\\n#### 18"}``). The
ground truth is the number after ``####`` with thousands commas removed, scored by the
``gsm8k`` verifier; the full worked solution is kept in ``metadata["solution"]``. Prompts
are chat messages (one user turn), so the policy's chat template applies. Prompt ids are
``gsm8k:<split>:<row index>``, e.g. ``gsm8k:test:17``.

The file: ``path`` if given, else ``<root>/<split>.jsonl`` where ``root`` is the folder in
the ``GFCR_GSM8K_DIR`` environment variable, or ``../shared/data/gsm8k`` relative to the
directory gfcr runs in (where this project keeps its offline copy). Nothing is downloaded.

The default ``template`` asks for the answer after ``Answer:``, the phrasing the project's
SmolLM2-Instruct baseline prompts use; the verifier also reads ``#### N``,
``\\boxed{N}``, "the answer is N", and otherwise the last number.

Bad rows (invalid JSON, a missing or empty ``question`` or ``answer``, an answer with no
``#### <number>``; invalid UTF-8, binary data, a row over ``max_row_mb``) are reported with
``file:line``: together (the first 20) in a ``DataError`` with
``on_error="fail"``, or left out and listed on ``PromptPool.skipped`` with ``"skip"``.

Deviations: none from the dataset; the ``####`` number is the official answer, as in
lm-evaluation-harness's ``gsm8k`` task.

Example:

>>> import pathlib, tempfile
>>> folder = pathlib.Path(tempfile.mkdtemp())
>>> _ = (folder / "test.jsonl").write_text('{"question": "2 + 2?", "answer": "2 + 2 = 4\\\\n#### 4"}\\n')
>>> pool = Gsm8kSource(Gsm8kSource.Config(path=str(folder / "test.jsonl"), split="test")).load()
>>> pool[0].prompt_id, pool[0].verifier
('gsm8k:test:0', VerifierSpec(name='gsm8k', ground_truth='4', options={}))

YAML:

.. code-block:: yaml

    data: {source: gsm8k, with: {split: train}}
    eval: {source: gsm8k, with: {split: test, limit: 200}, every: 10}
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import Field, field_validator

from gfcr.errors import Problem
from gfcr.records import Prompt, PromptPool, VerifierSpec, prompt_id
from gfcr.registry import FilePath, StageConfig
from gfcr.stages.data.jsonl import (
    RowProblems, check_head, existing_file, read_prompts, row_count, template_fields, text_field,
)
from gfcr.stages.data.lines import DEFAULT_MAX_ROW_MB, MaxRowMb

ROOT_ENV = "GFCR_GSM8K_DIR"
DEFAULT_ROOT = Path("..") / "shared" / "data" / "gsm8k"
DEFAULT_TEMPLATE = "{question}\nPut the final answer (a number) after 'Answer:'."
FINAL = re.compile(r"####\s*(.*?)\s*$", re.DOTALL)
NUMBER = re.compile(r"-?\d+(?:\.\d+)?")
ROW_SHAPE = "GSM8K rows are {\"question\": ..., \"answer\": \"...\\n#### <number>\"}; check that `path` is a GSM8K file"


def final_answer(solution: str) -> str | None:
    """The number after the last ``####`` with commas (and a ``$``) removed, or None."""
    marker = solution.rfind("####")
    if marker < 0:
        return None
    found = FINAL.match(solution, marker)
    number = found[1].replace(",", "").removeprefix("$") if found else ""
    return number if NUMBER.fullmatch(number) else None


def default_path(split: str) -> Path:
    root = os.environ.get(ROOT_ENV) or DEFAULT_ROOT
    return Path(root) / f"{split}.jsonl"


class Gsm8kSource:
    """GSM8K word problems as chat prompts, with the ``####`` number as ground truth."""

    class Config(StageConfig):
        split: Literal["train", "test"] = Field("train", description="which GSM8K file, and the ids' middle part")
        path: FilePath | None = Field(None, description=f"the file (relative to the pipeline file's folder); default: "
                                                        f"<${ROOT_ENV} or {DEFAULT_ROOT}>/<split>.jsonl")
        limit: Annotated[int, Field(ge=1, description="load at most this many prompts")] | None = None
        template: str = Field(DEFAULT_TEMPLATE, description="the user turn; `{question}` is filled in")
        max_row_mb: MaxRowMb = DEFAULT_MAX_ROW_MB

        @field_validator("template")
        @classmethod
        def _only_question(cls, template: str) -> str:
            names = set(template_fields(template))
            if names != {"question"}:
                raise ValueError(f"template {template!r} must use `{{question}}` and no other field")
            return template

    def __init__(self, config: Config):
        self.config = config

    def _path_and_fix(self) -> tuple[Path, str]:
        cfg = self.config
        path = Path(cfg.path) if cfg.path is not None else default_path(cfg.split)
        return path, (f"set `path:`, or point the {ROOT_ENV} environment variable at the folder holding "
                      f"`{cfg.split}.jsonl`")

    def check(self, on_error: Literal["fail", "skip"] = "fail") -> list[Problem]:
        """The problems of the file and of its first rows, read cheaply (``jsonl.check_head``);
        with ``on_error: skip`` only the file itself."""
        path, fix = self._path_and_fix()
        return check_head(path, f"the GSM8K {self.config.split} file", fix, self.config.max_row_mb, on_error,
                          self._prompt)

    def count_prompts(self, up_to: int) -> int | None:
        """The most prompts ``load`` can give (bad rows may make it fewer), counted up to ``up_to``."""
        return row_count(self._path_and_fix()[0], min(up_to, self.config.limit or up_to), self.config.max_row_mb)

    def load(self, on_error: Literal["fail", "skip"] = "fail") -> PromptPool:
        cfg = self.config
        path, fix = self._path_and_fix()
        existing_file(path, f"the GSM8K {cfg.split} file", fix)
        problems = RowProblems(str(path), stop=on_error == "fail")
        prompts = read_prompts(path, problems, cfg.max_row_mb, cfg.limit, self._prompt)
        return problems.pool(prompts, f"gsm8k/{cfg.split}", on_error)

    def _prompt(self, row: dict[str, Any], line: int, index: int, problems: RowProblems) -> Prompt | None:
        question = text_field(row, "question", line, problems, ROW_SHAPE)
        solution = text_field(row, "answer", line, problems, ROW_SHAPE)
        if solution is None or question is None:
            return None
        truth = final_answer(solution)
        if truth is None:
            tail = solution[-40:].replace("\n", "\\n")
            problems.add(line, f"answer has no `#### <number>` line (it ends {tail!r})")
            return None
        content = self.config.template.format(question=question)
        return Prompt(prompt_id("gsm8k", self.config.split, index), messages=[{"role": "user", "content": content}],
                      verifier=VerifierSpec("gsm8k", truth), metadata={"solution": solution, "line": line})
