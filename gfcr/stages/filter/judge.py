"""filter.judge: score every unscored rollout by asking a language model (a generative judge, the
LLM-as-a-judge of Zheng et al., 2023, arXiv 2306.05685: single-answer grading, optionally against a reference).

For each rollout whose ``reward`` is None, the stage renders its ``template`` with the prompt
(``{prompt}``), the response (``{response}``, cut to its first ``max_response_chars`` characters)
and the prompt's ground truth (``{reference}``), asks the judge model for at most
``max_new_tokens`` tokens, and reads a score from the answer with its ``parse`` (the first number
in ``range``, mapped onto [0, 1], or the first ``yes`` / ``no``; ``gfcr.stages.filter.judge_prompts``).
It writes what ``filter.verify`` writes, so the filters and the update downstream read it unchanged:

- ``reward``: the score in [0, 1];
- ``correct``: ``reward >= pass_at``;
- ``reward_components = {"judge": reward, "judge_fallback": 0 | 1}``, and ``reward_reason``
  (``judge score 8 in [0, 10]``, ``judge said yes``), which the lineage records.

The judge: ``model: policy`` (the default) asks the policy's own engine, the transformers
engine or vLLM (CPU or GPU), between generation and the update, so it judges with the weights
that sampled the step, and its verdicts move as the policy trains. Any other ``model`` (an alias
or a local Hugging Face folder) is a frozen copy the runtime loads once and serves on a
transformers engine of its own (``Lent.judges``), never updated; a second vLLM engine is not
started beside the policy's. ``gfcr validate`` refuses the stage under the Ray executor, whose engine
replicas take no in-flight controller (the deadline below).

Declared fallbacks (reward ``fallback``, ``correct`` False, ``judge_fallback`` 1, and the reason in
the lineage), one for each answer no score can be read from:

- an empty answer, or one with no number / no ``yes`` or ``no`` (unparseable);
- a number outside ``range`` (with ``parse.out_of_range: fallback``, the default; ``clip`` clips);
- a hang: every judge row still decoding ``timeout_s`` after the step's judge call started is
  stopped (an in-flight controller checks the clock every 8 decode steps) and falls back with
  ``judge timed out after ...``; the rows that finished keep their scores. A single decode step
  that never returns is not interrupted;
- a huge answer is read only up to ``parse.max_output_chars`` (default 2000), and a huge response
  is cut before it reaches the judge's prompt, so neither costs more than a short one.

Budget: the judge's prompt tokens are charged to the step's ``tokens_scored`` and its answer's tokens
to ``tokens_generated`` (``Lent.charge_scoring`` / ``charge_generation``, zero rollouts), so a
comparison pays for the judge; ``stages.<id>`` in metrics.jsonl has ``judged``, ``fallbacks``,
``judge_prompt_tokens``, ``judge_tokens`` and ``timeouts``.

Seeds: each judge request is ``judge:<rollout id>`` with the stage's ``seed``, sampled from its own
stream (``row_seed``), so with ``temperature > 0`` the judge's answers are reproducible too; the
default ``temperature: 0`` is greedy. A run whose judge hits ``timeout_s`` is not reproducible (the
clock decides which rows finish).

Deviations: TRL's judges and verl's GenRM ask a served model over HTTP and retry; here the judge is
one engine call per step with no retries (a retried greedy call would answer the same). Rubric
rewards (several criteria, weighted) are ``filter.rubric``, whose judge criteria ask through this
stage; a discriminative reward model is ``filter.reward_model``.

Fidelity: gfcr's own: the LLM-as-a-judge pattern (Zheng et al., 2023, arXiv 2306.05685), single-answer
grading with an optional reference; no reference code is followed.

Example (tiny-arith, the policy, judging on its own transformers engine; a poor judge: the
second answer, 870, falls outside the range and gets the fallback):

>>> from gfcr.engines import TransformersEngine, load_policy
>>> from gfcr.records import Prompt, PromptPool, RolloutGroups, VerifierSpec
>>> from gfcr.spec import PolicySpec
>>> from gfcr.stages.resources import Lent
>>> from gfcr.stages.testing import scored_group
>>> policy = load_policy(PolicySpec(model="tiny-arith"))
>>> pool = PromptPool([Prompt("p:0", text="What is 12 + 47? Answer:", verifier=VerifierSpec("arithmetic", "59"))])
>>> group = scored_group("p:0", [0, 0])
>>> for rollout, text in zip(group.rollouts, ["59", "58"]):
...     rollout.reward, rollout.text = None, text
>>> config = Judge.Config(template="What is {response} + 1? Answer:", parse={"kind": "number", "range": [0, 99]}, max_new_tokens=4)
>>> stage = Judge(config)
>>> stage.setup(Lent(policy, TransformersEngine(policy)))
>>> scored = stage.run(RolloutGroups([group]), pool)
>>> [(r.reward, r.reward_reason) for r in scored.rollouts()]
[(0.8888888888888888, 'judge score 88 in [0, 99]'), (0.0, 'judge fallback 0: judge score 870 outside [0, 99]')]

YAML:

.. code-block:: yaml

    judge: {use: filter.judge, from: rollout, with: {model: policy, template: "Question: {prompt}\\nAnswer: {response}\\nIs the answer correct? Say yes or no.", parse: {kind: yes_no}}}
"""

from __future__ import annotations

import time
from typing import Annotated, Any, ClassVar

from pydantic import Field, field_validator

from gfcr.records import Prompt, PromptPool, Rollout, RolloutGroups
from gfcr.registry import StageConfig
from gfcr.stages.engine import GenerationRequest, InFlightView, SamplingParams, Steer
from gfcr.stages.filter.judge_prompts import Judged, Parse, YesNoParse, check_template, render
from gfcr.stages.filter.model_scores import write_model_score
from gfcr.stages.resources import Engine, Lent, Policy

ALIAS = "filter.judge"
POLICY = "policy"
DEFAULT_TEMPLATE = ("Question: {prompt}\nAnswer: {response}\nIs the answer correct? Reply with yes or no.")
CHECK_EVERY = 8  # decode steps between two looks at the clock


class Deadline:
    """An in-flight controller that stops every unfinished row once ``seconds`` have passed."""

    every = CHECK_EVERY

    def __init__(self, seconds: float):
        self.seconds, self.start = seconds, time.monotonic()

    def steer(self, view: InFlightView) -> Steer:
        return Steer(stop=time.monotonic() - self.start > self.seconds)


class Judge:
    """Ask a judge model to score unscored rollouts; reward in [0, 1], fallbacks declared."""

    class Config(StageConfig):
        marks_correct: ClassVar[bool] = True  # a capability (gfcr.registry.MarksCorrect)
        steers_engine_calls: ClassVar[bool] = True  # its deadline controller (gfcr.registry.SteersItsEngineCalls)
        model: Annotated[str, Field(min_length=1, description=(
            "`policy` (the policy's own engine judges) or a model alias or local folder (a frozen judge on a "
            "transformers engine of its own)"))] = POLICY
        template: Annotated[str, Field(description=(
            "the judge's prompt: a format string over `{response}` (required), `{prompt}`, `{reference}`"))] = (
            DEFAULT_TEMPLATE)
        parse: Parse = Field(default_factory=YesNoParse, description=(
            "how the score is read: `{kind: yes_no}` or `{kind: number, range: [lo, hi]}`"))
        pass_at: Annotated[float, Field(ge=0.0, le=1.0, description="`correct` is `reward >= pass_at`")] = 0.5
        fallback: Annotated[float, Field(ge=0.0, le=1.0, description=(
            "the reward of a rollout whose judge answer gives no score (empty, unparseable, out of range, timed out)"
        ))] = 0.0
        max_new_tokens: Annotated[int, Field(ge=1, le=4096, description="the judge's answer length limit")] = 16
        temperature: Annotated[float, Field(ge=0.0, le=10.0, description="the judge's temperature; 0: greedy")] = 0.0
        seed: Annotated[int, Field(ge=0, description="the judge's sampling seed (with temperature > 0)")] = 0
        max_response_chars: Annotated[int, Field(ge=1, le=1_000_000, description=(
            "the response is cut to its first characters before it goes into the judge's prompt"))] = 4000
        timeout_s: Annotated[float, Field(gt=0.0, le=86400.0, description=(
            "wall-clock seconds for one step's judge call; rows still decoding then get the fallback"))] = 300.0

        def models_loaded(self) -> tuple[tuple[str, str], ...]:
            """The judge model ``gfcr validate`` looks up (none: the policy judges itself)."""
            return () if self.model == POLICY else (("model", self.model),)

        @field_validator("template")
        @classmethod
        def _placeholders(cls, template: str) -> str:
            check_template(template)
            return template

    def __init__(self, config: Config):
        self.config = config
        self.uses = set(check_template(config.template))
        self.judge: Policy | None = None
        self.engine: Engine | None = None
        self.lent = Lent()
        self._metrics: dict[str, float] = {}

    def setup(self, lent: Lent) -> None:
        self.lent = lent
        if self.config.model == POLICY:
            self.judge, self.engine = lent.require_policy(ALIAS), lent.require_engine(ALIAS)
        else:
            self.judge, self.engine = lent.require_judge(self.config.model, ALIAS)

    def step_metrics(self) -> dict[str, float]:
        return dict(self._metrics)

    def run(self, groups: RolloutGroups, pool: PromptPool) -> RolloutGroups:
        todo = [r for r in groups.rollouts() if r.reward is None]
        for rollout, judged in zip(todo, self.judge_rollouts(todo, pool), strict=True):
            self._write(rollout, judged)
        return groups

    def judge_rollouts(self, todo: list[Rollout], pool: PromptPool) -> list[Judged]:
        """Ask the judge about each rollout in one engine call, charge the step, and give what was read
        (``filter.rubric``'s judge criteria call it too)."""
        if self.judge is None or self.engine is None:
            raise RuntimeError(f"{ALIAS} ran before setup: the runtime calls `setup(lent)` first")
        requests = [self._request(r, pool) for r in todo]
        started = time.monotonic()
        completions = self.engine.generate(requests, controller=Deadline(self.config.timeout_s)) if requests else []
        waited = time.monotonic() - started
        verdicts = [self._read(completion, waited) for (completion,) in completions]
        self._charge(requests, completions, verdicts)
        return verdicts

    def _read(self, completion: Any, waited: float) -> Judged:
        if completion.finish_reason == "aborted":  # stopped by the Deadline
            return Judged(None, f"judge timed out after {waited:.1f}s (timeout_s {self.config.timeout_s:g})")
        return self.config.parse.read(completion.text)

    def _request(self, rollout: Rollout, pool: PromptPool) -> GenerationRequest:
        cfg = self.config
        prompt = pool.get(rollout.prompt_id)
        reference = None
        if "reference" in self.uses:
            if prompt.verifier is None:
                raise ValueError(f"{ALIAS}'s template uses `{{reference}}`, and prompt {prompt.prompt_id} has no "
                                 "ground truth; use a data source that sets one, or drop `{reference}`")
            reference = prompt.verifier.ground_truth
        text = render(cfg.template, prompt_text(prompt), (rollout.text or "")[:cfg.max_response_chars], reference)
        ids = self.judge.encode(Prompt(prompt.prompt_id, text=text))  # type: ignore[union-attr]
        params = SamplingParams(temperature=cfg.temperature, max_new_tokens=cfg.max_new_tokens, seed=cfg.seed)
        return GenerationRequest(f"judge:{rollout.rollout_id}", tuple(ids), 1, params)

    def _write(self, rollout: Rollout, judged: Judged) -> None:
        cfg = self.config
        cut = len(rollout.text or "") > cfg.max_response_chars
        write_model_score(rollout, judged, name="judge", fallback=cfg.fallback, pass_at=cfg.pass_at,
                          note=f" (response cut to {cfg.max_response_chars} chars)" if cut else "")

    def _charge(self, requests: list[GenerationRequest], completions: list[Any], verdicts: list[Judged]) -> None:
        """Charge the judge's tokens to the step, and keep the step's numbers."""
        prompt_tokens = sum(len(r.prompt_token_ids) for r in requests)
        answer_tokens = sum(len(c.token_ids) for (c,) in completions)
        self.lent.charge_scoring(prompt_tokens)
        self.lent.charge_generation(0, answer_tokens)
        timeouts = sum(1 for (c,) in completions if c.finish_reason == "aborted")
        self._metrics = {"judged": float(len(requests)), "judge_prompt_tokens": float(prompt_tokens),
                         "judge_tokens": float(answer_tokens), "timeouts": float(timeouts),
                         "fallbacks": float(sum(1 for v in verdicts if v.value is None))}


def prompt_text(prompt: Prompt) -> str:
    """The prompt as the judge reads it: its text, or its messages' contents, one a line."""
    if prompt.text is not None:
        return prompt.text
    return "\n".join(m["content"] for m in prompt.messages or [])
