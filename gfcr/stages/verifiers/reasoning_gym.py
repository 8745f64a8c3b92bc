"""The ``reasoning_gym`` verifier: a reasoning-gym task's own ``score_answer``.

The ``reasoning_gym`` data source gives each prompt the item's answer as ground truth and, as
options, the ``task``, the dataset ``settings`` (seed and size included) and the item's
``index``. The verifier rebuilds that item (reasoning-gym's items are a function of seed and
index; datasets are cached per process), checks that its answer is the ground truth (a
different reasoning-gym version could generate another item), extracts the answer from the
response and calls the task's ``score_answer(answer, entry)``.

The answer: inside the last ``<answer>...</answer>`` (reasoning-gym's ``extract_answer``, its
convention); else the rest of the line after the last ``Answer:`` or ``answer is``
(case-insensitive, one trailing full stop removed; the ``gsm8k`` verifier's markers); else the
whole response, stripped. ``formatted``: a tag or a
marker gave the answer, or the response is one line. ``correct``: ``score_answer`` gave 1.0;
the score itself is in ``reason``.

Deviations: reasoning-gym's scorers give partial credit on some tasks (an answer that contains
the oracle scores ``len(oracle) / len(answer)``); gfcr's reward is correct-or-not
(``filter.verify``'s ``format_weight`` aside), so anything below 1.0 counts as wrong. The
marker and whole-response fallbacks are gfcr's (reasoning-gym reads the tag only), so that
policies prompted in the tiny-arith format (``... Answer:`` then the number) and small chat models
that write "The answer is 17." can be scored; an answer written as an equation (``4 * 2 = 8``) is
not the answer reasoning-gym's scorer asks for, and scores as it says.

Fidelity: the scores are reasoning-gym's own (the task's ``score_answer`` is called); checked
against reasoning-gym 0.1.25 (PyPI): 100/100 pinned cases (``tests/stages/verifiers/cases/``: items
and scores written by that version, so a version that generates or scores otherwise fails), and
on 50 items of each task the pipeline and benchmark use, the reference answer scores 1 and a
perturbed one 0 (``tests/stages/verifiers/test_reasoning_gym.py``).

>>> from gfcr.stages.data.reasoning_gym import ReasoningGymSource
>>> cfg = ReasoningGymSource.Config(n=1, tasks=[{"task": "chain_sum"}])
>>> prompt = ReasoningGymSource(cfg).load()[0]
>>> truth = prompt.verifier.ground_truth
>>> verify_reasoning_gym(f"<answer>{truth}</answer>", truth, prompt.verifier.options).correct
True
>>> verify_reasoning_gym(f"Answer: {int(truth) + 1}", truth, prompt.verifier.options).correct
False
"""

from __future__ import annotations

import re
from functools import lru_cache
from typing import Annotated, Any

from pydantic import Field

from gfcr.stages.verifiers.base import Score, VerifierOptions, parse_options

ANSWER_TAG = re.compile(r"<answer>\s?(.*?)\s?</answer>", re.DOTALL)  # reasoning_gym.utils.extract_answer's
MARKER = re.compile(r"\banswer\s*(?::|is\b)", re.IGNORECASE)  # gsm8k's markers: "Answer:", "the answer is"


class ReasoningGymOptions(VerifierOptions):
    task: Annotated[str, Field(min_length=1, description="reasoning-gym's task name")]
    settings: dict[str, Any] = Field(description="the dataset's settings, `seed` and `size` included")
    index: Annotated[int, Field(ge=0, description="the item's index in the dataset")]


def extract(response: str) -> tuple[str, bool]:
    """(the answer, whether it was formatted) by the rule in the module docstring."""
    tags = list(ANSWER_TAG.finditer(response))
    if tags:
        return tags[-1].group(1).strip(), True
    markers = list(MARKER.finditer(response))
    if markers:
        line = response[markers[-1].end():].split("\n", 1)[0].strip()
        return line.removesuffix(".").strip(), True
    text = response.strip()
    return text, "\n" not in text and bool(text)


def freeze(settings: dict[str, Any]) -> tuple[tuple[str, Any], ...]:
    """Hashable settings (lists as tuples, reasoning-gym's own type for sequences), for the cache."""
    return tuple(sorted((k, tuple(v) if isinstance(v, list) else v) for k, v in settings.items()))


@lru_cache(maxsize=256)
def build_dataset(task: str, settings: tuple[tuple[str, Any], ...]) -> Any:
    """reasoning-gym's dataset of ``task`` with ``settings`` (seed and size included), cached: building
    one is cheap, its items are made on demand."""
    from reasoning_gym import create_dataset  # noqa: PLC0415 (a second's import, only when used)

    return create_dataset(task, **dict(settings))


def rebuild(task: str, settings: dict[str, Any], index: int) -> tuple[Any, dict[str, Any]]:
    """(the dataset, its item ``index``) as the data source made them."""
    dataset = build_dataset(task, freeze(settings))
    return dataset, dataset[index]


def verify_reasoning_gym(response: str, ground_truth: str, options: dict[str, Any]) -> Score:
    opts = parse_options(ReasoningGymOptions, options, "reasoning_gym")
    dataset, entry = rebuild(opts.task, opts.settings, opts.index)
    if str(entry["answer"]) != ground_truth:
        raise ValueError(f"reasoning-gym's `{opts.task}` item {opts.index} now has answer {entry['answer']!r}, "
                         f"not the ground truth {ground_truth!r}: was the pool made with another reasoning-gym "
                         "version? Use the version the run was made with (0.1.25)")
    answer, formatted = extract(response)
    if not answer:
        return Score(False, formatted, None, "no answer found")
    score = float(dataset.score_answer(answer, entry))
    shown = answer if len(answer) <= 40 else answer[:37] + "..."
    return Score(score >= 1.0, formatted, answer,
                 f"{opts.task}: score {score:.3g} for {shown!r} (reference {ground_truth!r})")


def _prepare() -> None:
    """Import reasoning-gym once per worker, outside the verifier's timeout (about a second)."""
    import reasoning_gym  # noqa: F401, PLC0415


verify_reasoning_gym.prepare = _prepare  # type: ignore[attr-defined]
