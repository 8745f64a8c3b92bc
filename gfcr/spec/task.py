"""Tasks: a policy, its training data and its evaluation, swapped into pipelines as one unit.

``gfcr compare --task NAME`` runs several pipelines on one task: each pipeline keeps its
stages, loops, update and run settings, and gets the task's ``policy``, ``data`` and ``eval``
sections instead of its own. A task file has exactly those three sections (the same keys as
a pipeline's) plus a ``name`` and a ``description``::

    name: arith-mix
    description: graded procedural arithmetic for tiny-arith-mix
    policy: {model: tiny-arith-mix, engine: hf}
    data: {source: arithmetic_mix, with: {n: 4000, seed: 0, split: train}}
    eval: {source: arithmetic_mix, with: {n: 300, seed: 1, split: eval}, every: 10, max_new_tokens: 8}

Shipped tasks live in ``gfcr/tasks/<name>.yaml`` and are named by ``name``; any other task
is given by its path. Generation lengths stay the pipeline's (``stages.<id>.with.
max_new_tokens``): a task with long answers says so in its description, and ``--set`` fits
the pipelines to it.

>>> task = load_task("gsm8k-smollm2")
>>> task.spec.policy.model, sorted(task.sections)
('smollm2-135m-instruct', ['data', 'eval', 'policy'])
>>> doc = apply_task({"name": "p", "policy": {"model": "tiny-arith"}, "stages": {}}, task)
>>> doc["policy"]["model"], doc["data"]["source"]
('smollm2-135m-instruct', 'gsm8k')
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Annotated, Any

from pydantic import Field, ValidationError

from gfcr.errors import Location, Problem, SpecError, did_you_mean
from gfcr.spec.models import DataSpec, EvalSpec, PolicySpec, StrictModel
from gfcr.spec.problems import problems_from_validation
from gfcr.spec.yaml_source import parse_yaml

SECTIONS = ("policy", "data", "eval")


class TaskSpec(StrictModel):
    """A task file, validated: what ``--task`` puts into every pipeline."""

    name: Annotated[str, Field(pattern=r"^[A-Za-z0-9_.-]+$", description="the task's name, used in reports")]
    description: Annotated[str, Field(description="one line: what the task is")] = ""
    policy: Annotated[PolicySpec, Field(description="the policy every pipeline trains")]
    data: Annotated[DataSpec, Field(description="the training prompts")]
    eval: Annotated[EvalSpec, Field(description="the held-out evaluation")]


@dataclass(frozen=True)
class Task:
    """A loaded task: its spec, its sections as written (what replaces a pipeline's) and its file."""

    spec: TaskSpec
    sections: dict[str, Any]
    path: Path
    text: str


def shipped_tasks() -> dict[str, Path]:
    """The tasks gfcr ships, by name: ``gfcr/tasks/<name>.yaml``."""
    folder = Path(str(resources.files("gfcr") / "tasks"))
    return {p.stem: p for p in sorted(folder.glob("*.yaml"))}


def load_task(name_or_path: str | Path) -> Task:
    """A shipped task by name, or a task file by path; every problem at once, with a fix."""
    shipped = shipped_tasks()
    path = shipped.get(str(name_or_path)) or Path(name_or_path)
    if not path.is_file():
        hint = did_you_mean(str(name_or_path), list(shipped))
        raise SpecError([Problem(Location(str(name_or_path)), "--task", "no shipped task has this name and no file "
                                 "is at this path", f"{hint + '; ' if hint else ''}shipped tasks: "
                                 f"{', '.join(shipped) or 'none'}, or give the path of a task YAML file")])
    text = path.read_text(encoding="utf-8")
    data, source, problems = parse_yaml(text, str(path))
    if not problems and not isinstance(data, dict):
        problems.append(Problem(source.locate(()), "", "a task file must be a mapping of keys",
                                "write `name`, `description`, `policy`, `data` and `eval` at the top level"))
    if problems:
        raise SpecError(problems)
    try:
        spec = TaskSpec.model_validate(data)
    except ValidationError as exc:
        raise SpecError(problems_from_validation(exc, TaskSpec, data, source)) from None
    return Task(spec, {k: data[k] for k in SECTIONS}, path, text)


def apply_task(pipeline: dict[str, Any], task: Task) -> dict[str, Any]:
    """A copy of the pipeline document with the task's ``policy``, ``data`` and ``eval``."""
    merged = copy.deepcopy(pipeline)
    merged.update(copy.deepcopy(task.sections))
    return merged
