"""filter.rubric: score every unscored rollout on several named criteria, each in [0, 1], and make
the reward their weighted combination.

A criterion is one of:

- ``verifier``: a rule verifier's verdict (1 correct, 0 not), the prompt's own verifier or the one
  named (``math`` checks with math-verify), in the killable worker processes of ``filter.verify``
  (a verifier error or timeout scores 0 with its reason, as there);
- ``regex``: 1 when the response matches ``pattern`` (``re.search``), else 0 (a format rule);
- ``length``: 1 when the response has at most ``max_tokens`` tokens, else 0;
- ``judge``: a question to a judge model, asked and parsed exactly as ``filter.judge`` asks (the
  same settings: ``model``, ``template``, ``parse``, ``timeout_s``, ``fallback`` ...); each judge
  criterion is one engine call a step, charged to the step's tokens as the judge's are.

The reward is ``sum(w_i * s_i) / sum(w_i)`` (``normalise: weighted_mean``, the default: in [0, 1],
verifiers 0.4.0's ``RubricJudge.score``) or ``sum(w_i * s_i)`` (``normalise: sum``);
``correct = reward >= pass_at``. Each criterion's score goes into ``reward_components`` under its
name, with ``rubric_fallbacks`` (how many criteria fell back), and the reason in the lineage lists
them: ``rubric 0.8: correct 1 (answer 18 == 18); format 1; short 0 (41 tokens > 32)``.

Declared fallbacks: a judge criterion whose answer gives no score (empty, unparseable, out of
range, timed out) scores its own ``fallback``, and the reason says why (``helpful fallback 0: judge
timed out after ...``), by the rule ``filter.judge`` follows (``gfcr.stages.filter.model_scores``).
The rule criteria always give a score.

Why not the ``verifiers`` package's rubric: verifiers 0.4.0 (on the index) has ``RubricJudge``, a
weighted rubric whose criteria are all graded by one LLM call over an OpenAI-compatible HTTP client
(``AsyncOpenAI``), answering JSON; rule criteria are separate ``@reward`` functions of its taskset.
gfcr's judge is an in-process engine call, and its rule criteria are its verifiers, so the class does
not fit; installing it would add 21 packages (openai, mcp, prime-sandboxes ...) for a weighted mean.
Its normalisation is kept (weights >= 0, divided by their total) and ``normalise: sum`` is offered
beside it.

Deviations: from verifiers 0.4.0's ``RubricJudge``: rule criteria sit beside judge questions in one
rubric; each judge criterion is its own judge call (``RubricJudge`` grades all its criteria in one
call, ``max_criteria`` at a time) with a yes/no or number parse, not a JSON verdict over ordered
choices; a judge criterion that gives no score falls back (``RubricJudge`` errors the rollout).

Fidelity: gfcr's own: no paper; the weighted mean is that of verifiers 0.4.0's ``RubricJudge.score``
(``sum(w * s) / sum(w)``).

Example (a correctness criterion with the ``arithmetic`` verifier, a format rule and a length rule):

>>> from gfcr.records import Prompt, PromptPool, RolloutGroups, VerifierSpec
>>> from gfcr.stages.testing import scored_group
>>> pool = PromptPool([Prompt("p:0", text="What is 12 + 47? Answer:", verifier=VerifierSpec("arithmetic", "59"))])
>>> group = scored_group("p:0", [0, 0])
>>> for rollout, text in zip(group.rollouts, [" 59", "Answer: 58"]):
...     rollout.reward, rollout.text = None, text
>>> stage = Rubric(Rubric.Config(criteria={
...     "correct": {"kind": "verifier", "weight": 3},
...     "format": {"kind": "regex", "pattern": "^Answer: ", "weight": 1},
...     "short": {"kind": "length", "max_tokens": 4, "weight": 1}}))
>>> scored = stage.run(RolloutGroups([group]), pool)
>>> [(r.reward, r.reward_reason) for r in scored.rollouts()]
[(0.8, 'rubric 0.8: correct 1 (answer 59 == 59); format 0; short 1'), (0.4, 'rubric 0.4: correct 0 (answer 58 != 59); format 1; short 1')]

YAML:

.. code-block:: yaml

    reward:
      use: filter.rubric
      from: rollout
      with:
        criteria:
          correct: {kind: verifier, verifier: math, weight: 0.7}
          format:  {kind: regex, pattern: "\\\\boxed\\\\{", weight: 0.2}
          short:   {kind: length, max_tokens: 256, weight: 0.1}
"""

from __future__ import annotations

import re
from typing import Annotated, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from gfcr.records import PromptPool, Rollout, RolloutGroups, VerifierSpec
from gfcr.registry import StageConfig
from gfcr.spec.problems import fixable
from gfcr.stages.filter.judge import Judge
from gfcr.stages.filter.model_scores import settle
from gfcr.stages.resources import Lent
from gfcr.stages.verifiers import check_verifier_name
from gfcr.stages.verifiers.scoring import response_text, score_texts

ALIAS = "filter.rubric"
Weight = Annotated[float, Field(ge=0.0, description="the criterion's share of the reward")]
_NAME = re.compile(r"^[a-z][a-z0-9_]*$")


class _Criterion(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True, allow_inf_nan=False)


class VerifierCriterion(_Criterion):
    """1 when the rule verifier says correct, else 0."""

    kind: Literal["verifier"]
    weight: Weight = 1.0
    verifier: str | None = Field(None, description="the verifier; default: each prompt's own")
    timeout_s: Annotated[float, Field(gt=0.0, le=3600.0, description="seconds per verifier call")] = 5.0

    @field_validator("verifier")
    @classmethod
    def _known(cls, name: str | None) -> str | None:
        return None if name is None else check_verifier_name(name)


class RegexCriterion(_Criterion):
    """1 when the response matches ``pattern`` (``re.search``), else 0."""

    kind: Literal["regex"]
    weight: Weight = 1.0
    pattern: Annotated[str, Field(min_length=1, description="a Python regular expression")]

    @field_validator("pattern")
    @classmethod
    def _compiles(cls, pattern: str) -> str:
        try:
            re.compile(pattern)
        except re.error as exc:
            raise fixable(f"`pattern` {pattern!r} is not a regular expression ({exc})",
                          "escape the characters `\\ ( ) [ ] { } . * + ?` that are meant literally") from None
        return pattern


class LengthCriterion(_Criterion):
    """1 when the response has at most ``max_tokens`` tokens, else 0."""

    kind: Literal["length"]
    weight: Weight = 1.0
    max_tokens: Annotated[int, Field(ge=1, description="the longest response that scores 1, in tokens")]


class JudgeCriterion(Judge.Config):
    """A question to a judge model: ``filter.judge``'s settings, its parse and its fallback."""

    kind: Literal["judge"]
    weight: Weight = 1.0


Criterion = Annotated[VerifierCriterion | RegexCriterion | LengthCriterion | JudgeCriterion,
                      Field(discriminator="kind")]


class Rubric:
    """Score unscored rollouts on weighted criteria; each criterion's score in the lineage."""

    class Config(StageConfig):
        marks_correct: ClassVar[bool] = True  # a capability (gfcr.registry.MarksCorrect)
        criteria: dict[str, Criterion] = Field(min_length=1, description=(
            "name -> criterion: `{kind: verifier | regex | length | judge, weight: w, ...}`"))
        normalise: Literal["weighted_mean", "sum"] = Field("weighted_mean", description=(
            "`weighted_mean`: sum(w * s) / sum(w), in [0, 1]; `sum`: sum(w * s)"))
        pass_at: float = Field(0.5, description="`correct` is `reward >= pass_at`")

        @field_validator("criteria")
        @classmethod
        def _names(cls, criteria: dict[str, Criterion]) -> dict[str, Criterion]:
            for name in criteria:
                if not _NAME.match(name) or name == "rubric_fallbacks":
                    raise fixable(f"criterion name `{name}` is not a lower-case identifier (or is reserved)",
                                  "name criteria like `correct`, `format`, `short_enough`")
            return criteria

        @model_validator(mode="after")
        def _some_weight(self) -> "Rubric.Config":
            if sum(c.weight for c in self.criteria.values()) <= 0:
                raise fixable("every criterion has weight 0, so the reward is undefined",
                              "give at least one criterion a positive `weight`")
            return self

        @property
        def steers_engine_calls(self) -> bool:
            """A judge criterion calls the engine with its deadline (gfcr.registry.SteersItsEngineCalls)."""
            return any(isinstance(c, JudgeCriterion) for c in self.criteria.values())

        def models_loaded(self) -> tuple[tuple[str, str], ...]:
            """The judge models other than the policy, for ``gfcr validate`` (gfcr.registry.LoadsModels)."""
            return tuple((f"criteria.{name}.model", model) for name, c in self.criteria.items()
                         if isinstance(c, JudgeCriterion) for _, model in c.models_loaded())

    def __init__(self, config: Config):
        self.config = config
        self.judges = {name: Judge(c) for name, c in config.criteria.items() if isinstance(c, JudgeCriterion)}
        self._metrics: dict[str, float] = {}

    def setup(self, lent: Lent) -> None:
        for judge in self.judges.values():
            judge.setup(lent)

    def step_metrics(self) -> dict[str, float]:
        return dict(self._metrics)

    def run(self, groups: RolloutGroups, pool: PromptPool) -> RolloutGroups:
        todo = [r for r in groups.rollouts() if r.reward is None]
        scores = {name: self._criterion(name, c, todo, pool) for name, c in self.config.criteria.items()}
        for i, rollout in enumerate(todo):
            self._write(rollout, {name: per_row[i] for name, per_row in scores.items()})
        self._metrics = {f"{name}_mean": sum(s for s, _, _ in rows) / len(rows) for name, rows in scores.items()
                         if rows} | {"fallbacks": float(sum(f for rows in scores.values() for _, f, _ in rows))}
        return groups

    def _criterion(self, name: str, criterion: Criterion, todo: list[Rollout],
                   pool: PromptPool) -> list[tuple[float, bool, str]]:
        """``(score, fell_back, reason)`` of each rollout on one criterion."""
        if isinstance(criterion, JudgeCriterion):
            judged = self.judges[name].judge_rollouts(todo, pool) if todo else []
            return [settle(j, criterion.fallback, f"{name}") for j in judged]
        if isinstance(criterion, VerifierCriterion):
            items = [(response_text(r), _spec(r, pool, criterion.verifier)) for r in todo]
            verdicts = score_texts(items, timeout_s=criterion.timeout_s) if items else []
            return [(float(v.correct), False, v.reason) for _, v in verdicts]
        if isinstance(criterion, RegexCriterion):
            pattern = re.compile(criterion.pattern)
            return [(float(pattern.search(r.text or "") is not None), False, "") for r in todo]
        return [_length(r, criterion.max_tokens) for r in todo]

    def _write(self, rollout: Rollout, scores: dict[str, tuple[float, bool, str]]) -> None:
        cfg = self.config
        total = sum(c.weight * scores[name][0] for name, c in cfg.criteria.items())
        reward = total / sum(c.weight for c in cfg.criteria.values()) if cfg.normalise == "weighted_mean" else total
        rollout.reward, rollout.correct = reward, reward >= cfg.pass_at
        fallbacks = sum(fell for _, fell, _ in scores.values())
        rollout.reward_components = {name: s for name, (s, _, _) in scores.items()} | {
            "rubric_fallbacks": float(fallbacks)}
        parts = [reason if fell else f"{name} {s:g}" + (f" ({reason})" if reason else "")
                 for name, (s, fell, reason) in scores.items()]
        rollout.reward_reason = f"rubric {reward:.3g}: " + "; ".join(parts)


def _spec(rollout: Rollout, pool: PromptPool, verifier: str | None) -> VerifierSpec:
    spec = pool.get(rollout.prompt_id).verifier
    if spec is None:
        raise ValueError(f"prompt {rollout.prompt_id} has no verifier spec (no ground truth), and {ALIAS} has a "
                         "`verifier` criterion; use a data source that sets `Prompt.verifier`, or drop the criterion")
    return spec if verifier is None or verifier == spec.name else VerifierSpec(verifier, spec.ground_truth)


def _length(rollout: Rollout, max_tokens: int) -> tuple[float, bool, str]:
    n = len(rollout.response_token_ids)
    return (1.0, False, "") if n <= max_tokens else (0.0, False, f"{n} tokens > {max_tokens}")

