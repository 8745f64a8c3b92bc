"""What a pipeline reads from outside, checked cheaply before anything runs: its data files and
its policy model (issue 16). ``gfcr validate`` and ``gfcr run`` call ``check_inputs`` once the
spec compiles, so a missing, empty, binary or wrong-field data file, or a model that cannot be
found, is an exit-2 error at validate time instead of a failure after the run has started.

- data and eval sources with a ``check(on_error)`` method (the file-backed ``jsonl`` and
  ``gsm8k``) look at their file and its first rows (``gfcr.stages.data.jsonl.file_head``); a
  problem is reported at the data file's ``file:line``;
- ``policy.model`` is looked up as ``resolve_model`` would, without loading, converting or
  downloading anything (``gfcr.engines.models.check_model``); a problem is reported at the
  spec's ``policy.model`` line.

Nothing here imports torch. A tokenizer or weights that do not load are still found by ``run``.
"""

from __future__ import annotations

from gfcr.engines.models import ModelError, check_model
from gfcr.errors import DataError, Problem
from gfcr.graph import CompiledPipeline


def input_problems(pipeline: CompiledPipeline) -> list[Problem]:
    """Every problem of the pipeline's data files and policy model, cheaply found."""
    problems: list[Problem] = []
    for binding in (pipeline.data, pipeline.eval):
        check = getattr(binding.cls, "check", None) if binding is not None else None
        if check is not None:
            problems += binding.cls(binding.config).check(binding.on_error)
    policy = pipeline.spec.policy
    if policy is not None:
        try:
            check_model(policy.model)
        except ModelError as exc:
            problems.append(Problem(pipeline.spec.source.locate(("policy", "model")), "",
                                    exc.message, exc.fix))
    return problems


def check_inputs(pipeline: CompiledPipeline) -> None:
    """A DataError listing ``input_problems``, if there are any."""
    problems = input_problems(pipeline)
    if problems:
        raise DataError(problems)
