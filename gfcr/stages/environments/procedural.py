"""``reasoning_gym``: any reasoning-gym dataset, by name, as a multi-turn environment with retries.

reasoning-gym (``pip install reasoning-gym``; 100+ procedural tasks:
arithmetic, puzzles, logic, games, each with difficulty settings) makes single-answer tasks:
``create_dataset(name, **config)[i]`` is ``{question, answer, metadata}``, scored by the dataset's
own ``score_answer(answer, entry)`` (1.0 correct; some tasks give partial credit). This adapter
turns one into an episode: the model answers; a wrong answer is told so (``feedback``, with
``{score}`` filled in) and the model tries again, up to ``max_attempts`` answers. The episode
ends at a score of 1 (reward 1) or after the last attempt (reward: its score, the task's partial
credit included). Only the last turn carries a reward, so the trajectory's reward is the task's
score of its last answer.

``dataset`` is any name of reasoning-gym's registry, ``config`` its keyword arguments (``seed``,
``size`` and the dataset's own fields, e.g. ``{min_terms: 2, max_terms: 2}`` for ``chain_sum``);
both are checked when the pipeline is validated (an unknown name, with the nearest ones, or a
field the dataset's config does not take). ``answer_tag``: read the answer from
``<answer_tag>...</answer_tag>`` (reasoning-gym's ``extract_answer``; none in the turn scores
0); none (the default): the whole turn, stripped.

Which task a prompt is: the prompts come from a data source serving the same dataset and config
(each trajectory's environment rebuilds the dataset, cached per process, and takes its entry):

- the prompt's ``metadata["source_index"]`` (reasoning-gym's own key in every entry's metadata),
  checked against the prompt (its text holds the entry's question, or its ground truth is the
  entry's answer); or else
- the entry whose question is the prompt's text (the whole dataset is generated once for this).

A prompt that is neither is an error naming the dataset and config, so data and environment that
disagree (another seed) fail at the first trajectory, never score against the wrong task.

Fidelity: the score is reasoning-gym's own ``score_answer``, called as is; the pinned cases
(``tests/fixtures/environments/reasoning_gym_scores.json``: reasoning-gym 0.1.25) check the adapter's rewards
against it. The retry loop with feedback is gfcr's own (reasoning-gym has no turn loop).
"""

from __future__ import annotations

import functools
import json
from typing import Any

from gfcr.errors import did_you_mean, known
from gfcr.records import Prompt
from gfcr.stages.environments.base import Action, Observation
from gfcr.stages.verifiers.reasoning_gym import build_dataset, freeze

INSTALL_FIX = "install it: `pip install reasoning-gym` (0.1.25 is the version gfcr is tested with)"
FEEDBACK = "That is not correct (score {score:g}). Try again."


def _gym() -> Any:
    try:
        import reasoning_gym
    except ImportError:
        raise ValueError(f"reasoning_gym: the `reasoning-gym` package is not installed; {INSTALL_FIX}") from None
    return reasoning_gym


@functools.lru_cache(maxsize=16)
def _dataset(name: str, config_json: str) -> Any:
    gym = _gym()
    if name not in gym.factory.DATASETS:
        hint = did_you_mean(name, gym.factory.DATASETS) or f"the datasets are: {known(gym.factory.DATASETS, 20)}"
        raise ValueError(f"reasoning_gym: unknown dataset `{name}`; {hint}")
    try:
        return build_dataset(name, freeze(json.loads(config_json)))  # the verifier's cache: one dataset per config
    except (TypeError, ValueError, AssertionError) as exc:
        raise ValueError(f"reasoning_gym: dataset `{name}` refuses config {config_json}: {exc}") from None


@functools.lru_cache(maxsize=4)
def _by_question(name: str, config_json: str) -> dict[str, int]:
    dataset = _dataset(name, config_json)
    return {dataset[i]["question"].strip(): i for i in range(len(dataset))}


class ReasoningGym:
    """A reasoning-gym task with retries on a wrong answer (see the module docstring)."""

    def __init__(self, dataset: str, config: dict[str, Any] | None = None, max_attempts: int = 3,
                 feedback: str = FEEDBACK, answer_tag: str | None = None):
        self.check_options(dataset, config, max_attempts, feedback, answer_tag)
        self.name, self.config_json = dataset, json.dumps(config or {}, sort_keys=True)
        self.max_attempts, self.feedback, self.answer_tag = max_attempts, feedback, answer_tag
        self.entry: dict[str, Any] | None = None
        self.attempts = 0

    @classmethod
    def check_options(cls, dataset: str, config: dict[str, Any] | None = None, max_attempts: int = 3,
                      feedback: str = FEEDBACK, answer_tag: str | None = None) -> None:
        """ValueError saying what is wrong with these arguments (``gfcr validate`` calls it)."""
        if max_attempts < 1:
            raise ValueError(f"reasoning_gym: max_attempts is {max_attempts}; it must be 1 or more")
        try:
            feedback.format(score=0.5)
        except (KeyError, IndexError, ValueError) as exc:
            raise ValueError(f"reasoning_gym: feedback {feedback!r} may use `{{score}}` and no other field "
                             f"({type(exc).__name__}: {exc})") from None
        _dataset(dataset, json.dumps(config or {}, sort_keys=True))

    def reset(self, prompt: Prompt, seed: int) -> None:
        self.entry, self.attempts = self._entry(prompt), 0

    def _entry(self, prompt: Prompt) -> dict[str, Any]:
        dataset, text = _dataset(self.name, self.config_json), _text(prompt)
        where = f"dataset `{self.name}` with config {self.config_json}"
        index = prompt.metadata.get("source_index")
        if index is None:
            found = _by_question(self.name, self.config_json).get(text.strip())
            if found is None:
                raise ValueError(f"reasoning_gym: prompt {prompt.prompt_id} is no question of {where}, and has no "
                                 "`source_index` in its metadata; serve the prompts from the same dataset and config")
            return dataset[found]
        if not isinstance(index, int) or not 0 <= index < len(dataset):
            raise ValueError(f"reasoning_gym: prompt {prompt.prompt_id}'s source_index {index!r} is not an index of "
                             f"{where} ({len(dataset)} entries)")
        entry = dataset[index]
        truth = prompt.verifier.ground_truth if prompt.verifier is not None else None
        if entry["question"].strip() not in text and str(truth).strip() != str(entry["answer"]).strip():
            raise ValueError(f"reasoning_gym: prompt {prompt.prompt_id} is not entry {index} of {where} (neither its "
                             "question nor its answer match); give the data source and the environment the same "
                             "dataset, seed, size and config")
        return entry

    def step(self, action: Action) -> Observation:
        assert self.entry is not None, "step before reset"
        self.attempts += 1
        answer = self._answer(action.text)
        score = float(_dataset(self.name, self.config_json).score_answer(answer, self.entry))
        if score >= 1.0 or self.attempts >= self.max_attempts:
            reason = "correct" if score >= 1.0 else f"score {score:g} after {self.attempts} attempts"
            return Observation(done=True, reward=score, metadata={
                "correct": score >= 1.0, "reason": reason, "attempts": self.attempts, "answer": answer})
        return Observation(self.feedback.format(score=score), metadata={"score": score, "attempt": self.attempts})

    def _answer(self, text: str) -> str | None:
        if self.answer_tag is None:
            return text.strip()
        return _gym().utils.extract_answer(text, tag_name=self.answer_tag)


def _text(prompt: Prompt) -> str:
    if prompt.text is not None:
        return prompt.text
    return "\n".join(str(m.get("content", "")) for m in prompt.messages or [])
