"""The ``reasoning_gym`` data source: procedural tasks of set difficulty from reasoning-gym.

reasoning-gym (open-thought/reasoning-gym, Apache-2.0; the ``tasks`` extra installs 0.1.25)
generates about a hundred tasks (``chain_sum``, ``leg_counting``, ``gcd``, ...) from a seed, each
with its own difficulty settings (``min_terms``/``max_terms``, ``min_digits``/``max_digits``, ...)
and its own scorer, ``score_answer``. This source draws ``n`` prompts from the ``tasks`` listed:

- each task has ``levels``, the difficulty bins: a name, a ``share`` (the proportion of the
  task's prompts) and a ``config`` of the task's own settings. A level's settings may be a range
  (``min_digits: 1, max_digits: 3``: reasoning-gym draws within it, and the drawn values are in
  the prompt's metadata) or a point (``min_digits: 2, max_digits: 2``);
- a task's ``weight`` sets its proportion of the pool. Each (task, level) cell gets
  ``n * weight / sum(weights) * share / sum(shares)`` prompts, rounded by largest remainder, so
  the stated proportions hold exactly up to one prompt; the pool's order is a seeded shuffle;
- the cell's items are reasoning-gym's items ``0, 1, ...`` of the task built with the level's
  settings and the cell seed ``crc32("<seed>/<task>/<level>")``, so a cell's problems do not
  depend on the other cells, and a train pool and an eval pool with different ``seed`` s draw
  independently (small settings have few problems, so the two may share some).

Each prompt's ``metadata`` records what lineage needs to place it: ``task``, ``level``, the
level's ``settings``, reasoning-gym's ``seed`` and ``index`` for the item, its ``difficulty``
(reasoning-gym's own record of the settings) and ``drawn``, the item's scalar metadata
(``num_terms``, ``num_digits``, ``expression``: what was drawn within a range).
``gfcr lineage RUN ROLLOUT`` prints it with the prompt, and MLflow's dataset input holds it.

The prompt text is ``template`` (default ``{question}``, reasoning-gym's question), filled with
the question and the ``drawn`` fields: ``What is {expression}? Answer:`` puts ``chain_sum`` into
the tiny-arith models' format (their tokenizer knows about 30 characters; reasoning-gym's
questions hold others). With ``chat: true`` the text is one user message (the policy's chat
template applies). Prompts are scored by the ``reasoning_gym`` verifier, which rebuilds the item
and calls the task's ``score_answer`` (``gfcr.stages.verifiers.reasoning_gym``).
Prompt ids are ``reasoning_gym:<task>.<level>.<seed>:<index>``, the same in every run.

Checked at validate (``gfcr validate``, exit 2 with the fix): an unknown task (with "did you
mean"), a setting the task does not have (with its settings listed), ``seed``/``size`` in a level
(the source sets them), a value of the wrong type, reasoning-gym's own check of the settings
(``min_terms <= max_terms``, ...), and a template field the task's items do not have. These
checks import reasoning-gym (about a second), only for pipelines that use this source.

Deviations: none in the items or the scores (the verifier calls reasoning-gym); the bins, the
proportions and the templates are gfcr's.

Example:

>>> tasks = [{"task": "chain_sum", "levels": [
...     {"name": "1d", "config": {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1}},
...     {"name": "2d", "config": {"min_terms": 2, "max_terms": 2, "min_digits": 2, "max_digits": 2}}]}]
>>> cfg = ReasoningGymSource.Config(n=4, seed=0, tasks=tasks, template="What is {expression}? Answer:")
>>> pool = ReasoningGymSource(cfg).load()
>>> sorted(p.metadata["level"] for p in pool)
['1d', '1d', '2d', '2d']
>>> pool[0].verifier.name, pool[0].metadata["task"]
('reasoning_gym', 'chain_sum')

YAML:

.. code-block:: yaml

    data:
      source: reasoning_gym
      with:
        n: 512
        seed: 0
        template: "What is {expression}? Answer:"
        tasks:
          - task: chain_sum
            levels:
              - {name: 1d, share: 0.5, config: {min_terms: 2, max_terms: 2, min_digits: 1, max_digits: 1}}
              - {name: 2d, share: 0.5, config: {min_terms: 2, max_terms: 2, min_digits: 2, max_digits: 2}}
"""

from __future__ import annotations

import dataclasses
import zlib
from typing import Annotated, Any, Literal

import numpy as np
from pydantic import Field, ValidationInfo, field_validator, model_validator

from gfcr.errors import did_you_mean, known
from gfcr.records import Prompt, PromptPool, VerifierSpec, prompt_id
from gfcr.registry import Seed, StageConfig
from gfcr.spec.problems import fixable
from gfcr.stages.data.jsonl import NAME, template_fields
from gfcr.stages.verifiers.reasoning_gym import build_dataset, freeze

SET_BY_SOURCE = ("seed", "size")  # dataclass fields of every task config that the source sets
INSTALL_FIX = "install it: `pip install 'gfcr[tasks]'` (reasoning-gym 0.1.25)"


def _factory() -> dict[str, tuple[type, type]]:
    """reasoning-gym's registry, ``name -> (dataset class, config class)`` (imported here, not at
    module load: the import takes about a second)."""
    try:
        from reasoning_gym.factory import DATASETS
    except ImportError:
        raise fixable("the `reasoning_gym` source needs the reasoning-gym package, which is not installed",
                      INSTALL_FIX) from None
    return DATASETS


def task_settings(task: str) -> dict[str, Any]:
    """The settings of ``task`` a level may set, with reasoning-gym's defaults."""
    config_cls = _factory()[task][1]
    return {f.name: f.default for f in dataclasses.fields(config_cls) if f.name not in SET_BY_SOURCE}


def check_task(task: str) -> str:
    """``task`` if reasoning-gym has it, else an error with the fix."""
    names = sorted(_factory())
    if task not in names:
        hint = did_you_mean(task, names) or f"use one of reasoning-gym's tasks: {known(names)}"
        raise fixable(f"reasoning-gym has no task `{task}`",
                      f"{hint} (`python -c 'import reasoning_gym; print(sorted(reasoning_gym.factory.DATASETS))'` "
                      "lists all)")
    return task


def _type_ok(value: Any, default: Any) -> bool:
    """Whether ``value`` can stand for a setting whose default is ``default``."""
    if default is None or default is dataclasses.MISSING:
        return True
    if isinstance(default, bool) or isinstance(value, bool):
        return isinstance(value, bool) and isinstance(default, bool)
    if isinstance(default, int):
        return isinstance(value, int)
    if isinstance(default, float):
        return isinstance(value, (int, float))
    if isinstance(default, (tuple, list)):
        return isinstance(value, list)
    return isinstance(value, type(default))


def check_settings(task: str, level: str, settings: dict[str, Any]) -> None:
    """An error with the fix for a setting ``task`` lacks, one the source sets, a value of the wrong type,
    or settings reasoning-gym's own ``validate`` refuses."""
    known_settings = task_settings(task)
    where = f"level `{level}` of task `{task}`"
    for key, value in settings.items():
        if key in SET_BY_SOURCE:
            raise fixable(f"{where} sets `{key}`, which the source sets (from its `seed` and `n`)",
                          f"remove `{key}` from the level's `config`")
        if key not in known_settings:
            listed = ", ".join(f"`{k}`" for k in known_settings)
            hint = did_you_mean(key, known_settings)
            raise fixable(f"{where}: `{task}` has no difficulty setting `{key}`",
                          f"{hint + ' ' if hint else ''}(its settings: {listed})")
        default = known_settings[key]
        if not _type_ok(value, default):
            raise fixable(f"{where}: setting `{key}` is {value!r} ({type(value).__name__})",
                          f"give a {type(default).__name__}, like its default {_plain(default)!r}")
    try:
        build_dataset(task, freeze({**settings, "seed": 0, "size": 1}))
    except (AssertionError, ValueError, TypeError) as exc:
        raise fixable(f"{where}: reasoning-gym refuses the settings {settings}: {exc or type(exc).__name__}",
                      "fix the level's `config`") from None


def _plain(value: Any) -> Any:
    """``value`` as JSON-able data (reasoning-gym's metadata holds tuples)."""
    if isinstance(value, (tuple, list)):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    return value


def drawn_fields(entry: dict[str, Any]) -> dict[str, Any]:
    """The item's scalar metadata: what was drawn within the level's ranges (and template fields)."""
    return {k: v for k, v in entry["metadata"].items()
            if isinstance(v, (int, float, str, bool)) and k not in ("source_index", "source_dataset")}


class Level(StageConfig):
    """One difficulty bin of a task: a name, its share of the task's prompts, and the task's settings."""

    name: Annotated[str, Field(pattern=NAME, description="the bin's name, in prompt ids and lineage")]
    share: Annotated[float, Field(gt=0, description="the bin's proportion of the task's prompts "
                                                    "(relative to the other levels' shares)")] = 1.0
    config: dict[str, Any] = Field(default_factory=dict, description="the task's settings for this bin "
                                   "(reasoning-gym's config fields, e.g. `min_digits`); the rest keep their defaults")


class TaskEntry(StageConfig):
    """A reasoning-gym task, its weight in the pool and its difficulty bins."""

    task: Annotated[str, Field(min_length=1, description="reasoning-gym's task name, e.g. `chain_sum`")]
    weight: Annotated[float, Field(gt=0, description="the task's proportion of the pool (relative)")] = 1.0
    levels: list[Level] = Field(default_factory=lambda: [Level(name="default")], min_length=1,
                                description="the difficulty bins; default: one bin of reasoning-gym's defaults")

    @field_validator("task")
    @classmethod
    def _known_task(cls, task: str) -> str:
        return check_task(task)

    @field_validator("levels")
    @classmethod
    def _levels(cls, levels: list[Level], info: ValidationInfo) -> list[Level]:
        names = [level.name for level in levels]
        if len(set(names)) != len(names):
            raise fixable(f"each level name may appear once, got {names}", "rename the repeats")
        task = info.data.get("task")
        for level in levels if task is not None else ():  # an unknown task is reported on its own
            check_settings(task, level.name, level.config)
        return levels


class ReasoningGymSource:
    """reasoning-gym's procedural tasks, in difficulty bins of stated proportions."""

    class Config(StageConfig):
        tasks: list[TaskEntry] = Field(min_length=1, description="the tasks: each `{task, weight: 1.0, levels: "
                                       "[{name, share: 1.0, config: {<the task's settings>}}]}`")
        n: Annotated[int, Field(ge=1, description="number of prompts")] = 1000
        seed: Seed = Field(0, description="seeds every cell's items and the pool's order")
        template: str = Field("{question}", description="the prompt text; `{question}` and the item's scalar "
                              "metadata (`{expression}`, ...) are filled in")
        chat: bool = Field(False, description="one user message (the chat template applies) instead of plain text")

        @field_validator("template")
        @classmethod
        def _valid_template(cls, template: str) -> str:
            template_fields(template)
            return template

        @model_validator(mode="after")
        def _cells(self) -> ReasoningGymSource.Config:
            tasks = [t.task for t in self.tasks]
            if len(set(tasks)) != len(tasks):
                raise fixable(f"each task may be listed once, got {tasks}", "merge the repeats' levels into one entry")
            wanted = set(template_fields(self.template))
            for entry in self.tasks:
                for level in entry.levels:
                    item = build_dataset(entry.task, freeze({**level.config, "seed": 0, "size": 1}))[0]
                    missing = wanted - {"question"} - set(drawn_fields(item))
                    if missing:
                        fields = ", ".join(f"`{{{k}}}`" for k in ["question", *sorted(drawn_fields(item))])
                        raise fixable(f"the template's {', '.join(f'`{{{k}}}`' for k in sorted(missing))} is not a "
                                      f"field of task `{entry.task}`'s items (level `{level.name}`)",
                                      f"use the fields its items have: {fields}")
            return self

    def __init__(self, config: Config):
        self.config = config

    def count_prompts(self, up_to: int) -> int:
        return self.config.n

    def cells(self) -> list[tuple[TaskEntry, Level, int]]:
        """Each (task, level) and its number of prompts: the stated proportions, by largest remainder."""
        cfg = self.config
        pairs = [(t, lv) for t in cfg.tasks for lv in t.levels]
        total_weight = sum(t.weight for t in cfg.tasks)
        exact = np.array([cfg.n * t.weight / total_weight * lv.share / sum(x.share for x in t.levels)
                          for t, lv in pairs])
        counts = np.floor(exact).astype(int)
        for i in np.argsort(-(exact - counts), kind="stable")[: cfg.n - counts.sum()]:
            counts[i] += 1
        return [(t, lv, int(c)) for (t, lv), c in zip(pairs, counts)]

    def load(self, on_error: Literal["fail", "skip"] = "fail") -> PromptPool:
        """The pool; ``on_error`` is accepted for the data-source protocol (generated items are never bad)."""
        cfg = self.config
        cells = [c for c in self.cells() if c[2] > 0]
        labels = np.repeat(np.arange(len(cells)), [c for _, _, c in cells])
        order = np.random.default_rng(cfg.seed).permutation(labels)
        taken = [0] * len(cells)
        prompts = []
        for cell in order:
            task, level, count = cells[cell]
            prompts.append(self._prompt(task.task, level, count, taken[cell]))
            taken[cell] += 1
        return PromptPool(prompts, name="reasoning_gym/" + "+".join(t.task for t in cfg.tasks))

    def _prompt(self, task: str, level: Level, count: int, index: int) -> Prompt:
        cfg = self.config
        seed = zlib.crc32(f"{cfg.seed}/{task}/{level.name}".encode())
        settings = {**level.config, "seed": seed, "size": count}
        entry = build_dataset(task, freeze(settings))[index]
        drawn = _plain(drawn_fields(entry))
        text = cfg.template.format_map({**drawn, "question": entry["question"]})
        spec = VerifierSpec("reasoning_gym", str(entry["answer"]),
                            {"task": task, "settings": _plain(settings), "index": index})
        metadata = {"task": task, "level": level.name, "settings": _plain(level.config), "seed": seed,
                    "index": index, "difficulty": _plain(entry["metadata"].get("difficulty")), "drawn": drawn}
        pid = prompt_id("reasoning_gym", f"{task}.{level.name}.{cfg.seed}", index)
        if cfg.chat:
            return Prompt(pid, messages=[{"role": "user", "content": text}], verifier=spec, metadata=metadata)
        return Prompt(pid, text=text, verifier=spec, metadata=metadata)
