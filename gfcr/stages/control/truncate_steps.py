"""control.truncate_steps: Step-GRPO's Dynamic Truncated Rollout (an in-flight controller): at a step
boundary, force a trial answer and end the row if the model is confident in it.

Step-GRPO (arXiv 2604.16890; code ``davidweidawang/Step-GRPO``, ``verl/workers/rollout/deer_utils.py``
and ``vllm_rollout_spmd.py``) runs DEER's early exit (arXiv 2504.15895) during training rollouts. The
rule, per running row of the host's generate call, with Step-GRPO's defaults
(``verl/workers/rollout/config.py``):

1. **step boundary**: the row's newest tokens complete one of ``markers`` (Step-GRPO's trigger
   word ``Wait``; a substring match, as vLLM's stop strings there). The boundary is the start of
   the token in which the marker begins (``cut``: the row's new tokens before it; Step-GRPO stops
   the thinking chunk before its ``Wait``). Each occurrence is checked once, a row at most
   ``max_checks`` times (``deer_max_judge_steps``, 10), and only when ``cut >= min_tokens``;
2. **trial answer**: the engine continues the row's context, its first ``cut`` tokens and the
   ``inducer`` (Step-GRPO's ``"\\n**Final Answer**\\n\\\\boxed"``, here with its ``{``) greedily, for
   at most ``probe_tokens`` tokens (``deer_prob_check_max_tokens``, 20), ending at ``answer_end``
   (``}``) or the end of sequence;
3. **confidence** (``confidence: geometric``, Step-GRPO's Eq. 2, ``answer_confidence``): the
   geometric mean of the greedy tokens' probabilities, each floored at 1e-10. Step-GRPO skips the
   first generated token, the ``{`` that opens ``\\boxed{``; here the inducer holds that ``{``, so
   the mean runs over the same tokens. A trial answer that did not end within ``probe_tokens`` has
   confidence 0 (Step-GRPO's ``qwen3_strict``: a confidence counts only when the trial answer
   closed). ``confidence: mean`` is DEER's ``avg1`` (the arithmetic mean), this stage's rule
   before the reference code could be read;
4. **exit**: when the confidence is above ``threshold`` (``should_early_exit``: ``>``, delta
   0.95), or the row's step chunks (its text between consecutive boundaries) have repeated the
   chunk before them ``repeats`` times (DEER's repetition exit, ``is_repetition`` with unigrams,
   3, counted over the row's life), the steps, inducer and answer fit the row's budget, and the
   row's group has fewer than ``max_exits`` exits, the row ends now (finish ``exited``, status
   ``completed``). Its response is its first ``cut`` tokens, the inducer and the trial answer. The
   appended tokens (a segment of origin ``forced``, counted as ``Rollout.forced_tokens``) carry
   their log-probs under the row's sampling distribution, scored at the current policy version,
   so the update treats them as on-policy: a positive advantage raises the probability of
   stopping at that step, which is how a truncated trajectory teaches the early exit. A row that
   does not exit runs on from where it was (Step-GRPO appends its trigger word back; here the
   marker is the row's own).

Step-GRPO's other half, the step-aware relative reward (``compute_score``), is the stage
``filter.step_reward``: put it after ``filter.verify``.

Costs: each trial answer is a prefill of the row's context, its steps and the inducer (charged to
``tokens_scored``) and up to ``probe_tokens`` greedy tokens. A trial answer that is kept is part
of the response and counts as generated there; the tokens of the others are charged to the step as
generated (``Lent.charge_generation``), so budgets and ``gfcr compare`` see them. Scoring the
appended tokens is charged to ``tokens_scored`` as every ``score`` call is.

Metrics per step: ``checks`` (trial answers), ``exits`` (``repetition_exits`` of them by the
repetition rule), ``confidence_mean`` and ``confidence_max`` (over the checks),
``probe_tokens`` (greedy tokens of every trial answer), ``forced_tokens`` (appended to exited rows)
and ``cut_mean`` (the new tokens exited rows kept before their answer).

Engines: both. A trial answer is a generate call made from ``steer`` while the host's rows are in
flight (``engine_needs``: ``generate_in_steer``). The transformers engine serves it from its decode
loop, paused meanwhile; the vLLM engine, whose one engine is stepping the host's rows, serves it
from the trained policy's own decode loop (the weights vLLM holds; docs/vllm.md).

Lineage: an exited rollout's ``finish_reason`` is ``exited``, its ``stop_reason`` names the
boundary, the trial answer and its confidence (or the repeats), and ``forced_tokens`` counts the
appended tokens; ``gfcr lineage`` shows them.

Fidelity: checked against davidweidawang/Step-GRPO@df76889: 33/33 cases
(``tests/fidelity/step_grpo.json``: ``answer_confidence``, ``should_early_exit``,
``is_repetition``; ``compute_score`` is ``filter.step_reward``'s). The rollout loop
(``vllm_rollout_spmd.py``, ``_generate_sequences_deer``) is not a pure function; it was read.

Deviations from it:

- after an exit Step-GRPO discards the trial answer, closes the thinking block (``</think>``)
  and samples the final answer with the rest of the budget; the models here have no thinking
  block, so the trial answer is the answer (the exit then trains the model to answer right
  after the step, which is what the truncation is for). Set ``inducer`` to close a thinking
  block first where a model has one;
- the thinking budget (``deer_think_ratio`` 0.9 of the response length, past which, or within 50
  tokens of which at a check, Step-GRPO forces the answer phase) exists to leave room for that
  answer phase, which this stage does not have: the row's own ``max_new_tokens`` is its budget;
- the trial answer ends at ``answer_end`` (``}``), where Step-GRPO's runs to ``</think>``;
- a repetition exit takes the trial answer as it is (closed or not) as the answer; Step-GRPO goes
  straight to its answer phase there, without a trial answer;
- ``max_exits`` (default: no cap) can keep some rows of each group untruncated; Step-GRPO
  checks every row;
- the appended tokens are trained on as if sampled at the current version (their behaviour
  log-probs are the current policy's): the inducer was not sampled at all, and this is what lets
  the update reward stopping there; SPEC-RL treats its accepted draft prefixes the same way.

It needs an engine that serves a generate call from inside the host's decode loop (both engines;
the fake engine in tests).

Example (the pure parts: where a step ends, and the confidence of a trial answer):

>>> find_marker("3+4=7\\n\\nThen 7*2", ["\\n\\n", "Wait"], since=0)
(5, '\\n\\n')
>>> find_marker("3+4=7\\n\\nThen 7*2", ["\\n\\n", "Wait"], since=8) is None  # seen before
True
>>> cut_at(5, [0, 3, 5, 7, 12])  # tokens' decoded lengths: the first 2 tokens end at char 5
2
>>> round(confidence(np.log([0.9, 1.0, 0.8])), 4)  # geometric mean: (0.9 * 1.0 * 0.8) ** (1/3)
0.8963
>>> round(confidence(np.log([0.9, 1.0, 0.8]), rule="mean"), 4), confidence(np.log([0.9]), closed=False)
(0.9, 0.0)
>>> is_repetition("add the tens", "the tens add"), is_repetition("2 + 2", "2 + 2")  # a repeated word
(True, False)

YAML (SmolLM2 on GSM8K: ``pipelines/truncate_steps_gsm8k_smollm2.yaml``):

.. code-block:: yaml

    steps:   {use: control.truncate_steps, with: {threshold: 0.95}}
    rollout: {use: generate.sample, from: budget, in_flight: [steps], with: {max_new_tokens: 256}}
"""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal, Sequence

import numpy as np
from pydantic import Field

from gfcr.registry import StageConfig
from gfcr.stages.engine import (
    Exit, GenerationRequest, InFlightView, LiveRow, SamplingParams, ScoreRequest, Steer,
)
from gfcr.stages.resources import Engine, Policy, Lent

DEER_INDUCER = "\n**Final Answer**\n\\boxed{"


def find_marker(text: str, markers: Sequence[str], since: int) -> tuple[int, str] | None:
    """The earliest marker occurrence in ``text`` that ends after character ``since`` (completed by
    text not seen before): ``(start, marker)``, or None."""
    best: tuple[int, str] | None = None
    for marker in markers:
        start = text.find(marker, max(0, since - len(marker) + 1))
        if start >= 0 and (best is None or start < best[0]):
            best = (start, marker)
    return best


def cut_at(start: int, lengths: Sequence[int]) -> int:
    """The tokens before character ``start``: the largest ``k`` with ``lengths[k] <= start``, where
    ``lengths[k]`` is the length of the first ``k`` tokens' text (``lengths[0] == 0``)."""
    k = 0
    while k + 1 < len(lengths) and lengths[k + 1] <= start:
        k += 1
    return k


MIN_PROBABILITY = 1e-10  # Step-GRPO floors each token's probability here before the geometric mean


def confidence(logprobs: Sequence[float], closed: bool = True, rule: str = "geometric") -> float:
    """The confidence of a trial answer from its tokens' log-probs (the tokens after the inducer).

    ``geometric`` (Step-GRPO's Eq. 2, ``answer_confidence``; DEER's policy ``avg2``): the geometric
    mean of the tokens' probabilities, each floored at 1e-10. ``mean`` (DEER's ``avg1``): their
    arithmetic mean. 0.0 for an answer with no tokens, or one that did not ``closed`` (end within
    its token budget: Step-GRPO's strict rule, which accepts a confidence only when the trial answer
    closed the thinking block)."""
    lp = np.asarray(logprobs, np.float64)
    if not len(lp) or not closed:
        return 0.0
    if rule == "mean":
        return float(np.mean(np.exp(lp)))
    if rule != "geometric":
        raise ValueError(f"unknown confidence rule {rule!r}; use 'geometric' (Step-GRPO) or 'mean' (DEER's avg1)")
    return float(np.exp(np.mean(np.maximum(lp, np.log(MIN_PROBABILITY)))))


def should_exit(conf: float, threshold: float) -> bool:
    """The exit test: the trial answer's confidence is strictly above the threshold (a tie stays)."""
    return conf > threshold


def is_repetition(previous: str, chunk: str, n: int = 1) -> bool:
    """DEER's repetition test (Step-GRPO's ``is_repetition``): two consecutive step chunks whose sets of
    word ``n``-grams (words split at single spaces) are the same and as large as each chunk's n-gram
    count, i.e. every n-gram of each is distinct and shared with the other."""
    def grams(text: str) -> tuple[set[tuple[str, ...]], int]:
        words = text.split(" ")
        found = [tuple(words[i:i + n]) for i in range(max(0, len(words) - n + 1))]
        return set(found), len(found)

    (a, count_a), (b, count_b) = grams(previous), grams(chunk)
    shared = len(a & b)
    return shared == count_a == count_b


class TruncateSteps:
    """End a row at a step boundary when the model is confident of a trial answer (Step-GRPO, DEER)."""

    every: int = 1  # decode steps between steer calls (the in-flight controller role)

    class Config(StageConfig):
        markers: Annotated[list[Annotated[str, Field(min_length=1)]], Field(min_length=1, description=(
            "text that starts a new reasoning step; the row is checked before it (Step-GRPO: Wait)"))] = ["Wait"]
        threshold: Annotated[float, Field(ge=0.0, le=1.0, description=(
            "exit when the trial answer's confidence is above it (Step-GRPO's delta: 0.95)"))] = 0.95
        confidence: Annotated[Literal["geometric", "mean"], Field(description=(
            "geometric: geometric mean of the trial answer's token probabilities (Step-GRPO); "
            "mean: their arithmetic mean (DEER's avg1)"))] = "geometric"
        repeats: Annotated[int | None, Field(ge=1, description=(
            "end a row, whatever its confidence, once this many of its step chunks have repeated the one "
            "before (DEER's repetition exit, as Step-GRPO runs it: 3); None: never"))] = 3
        inducer: Annotated[str, Field(min_length=1, description=(
            "text appended after the steps to ask for the answer (DEER's, with its `{`)"))] = DEER_INDUCER
        answer_end: Annotated[list[Annotated[str, Field(min_length=1)]], Field(min_length=1, description=(
            "text that closes the trial answer"))] = ["}"]
        probe_tokens: Annotated[int, Field(ge=1, description="greedy tokens a trial answer may take (DEER: 20)")] = 20
        max_checks: Annotated[int, Field(ge=1, description="trial answers per row (DEER's max_judge_steps)")] = 10
        min_tokens: Annotated[int, Field(ge=1, description="new tokens a row needs before a boundary is checked")] = 1
        max_exits: Annotated[int | None, Field(ge=0, description=(
            "exits per group at most (None: every row may exit, as in DEER)"))] = None

        # a capability (gfcr.registry.NeedsOfEngine): each trial answer is a generate call made from `steer`
        engine_needs: ClassVar[frozenset[str]] = frozenset({"generate_in_steer"})

    def __init__(self, config: Config):
        self.config = config
        self.policy: Policy | None = None
        self.engine: Engine | None = None
        self.lent: Lent | None = None
        self._inducer: tuple[int, ...] = ()
        self._seen: dict[tuple[str, int], int] = {}  # row -> characters of its text already scanned
        self._cut: dict[tuple[str, int], int] = {}  # row -> the cut of its last check
        self._checks: dict[tuple[str, int], int] = {}
        self._chunk: dict[tuple[str, int], tuple[int, str]] = {}  # row -> where its step began, the step before
        self._repeats: dict[tuple[str, int], int] = {}  # row -> repeated step chunks so far
        self._exits: dict[str, int] = {}  # group key -> exits so far
        self._step: dict[str, float] = {}
        self._confidences: list[float] = []
        self._cuts: list[int] = []
        self.before_step(None)

    def setup(self, lent: Lent) -> None:
        self.lent = lent
        self.policy = lent.require_policy("control.truncate_steps")
        self.engine = lent.require_engine("control.truncate_steps")
        self._inducer = tuple(self.policy.tokenizer.encode(self.config.inducer, add_special_tokens=False))

    def _decode(self, ids: Sequence[int]) -> str:
        return self.policy.tokenizer.decode(list(ids), skip_special_tokens=True)

    def steer(self, view: InFlightView) -> Steer:
        open_rows = [row for row in view.rows if not self._capped(view.group_of(row.request_id))]
        due = [d for d in (self._boundary(row) for row in open_rows) if d is not None]
        if not due:
            return Steer()
        probes = [GenerationRequest(f"{row.request_id}.probe{row.sample_index}.{self._checks[_key(row)]}",
                                    view.contexts[row.request_id] + row.token_ids[:cut] + self._inducer, 1,
                                    SamplingParams(temperature=0.0, max_new_tokens=self.config.probe_tokens,
                                                   stop=tuple(self.config.answer_end)))
                  for row, cut, _, _ in due]
        self.lent.charge_scoring(sum(len(p.prompt_token_ids) for p in probes))
        answers = [c for (c,) in self.engine.generate(probes)]
        exits, why, rejected = [], {}, 0
        for (row, cut, marker, repeated), answer in zip(due, answers):
            closed = answer.finish_reason == "stop"  # answer_end, or the end of sequence
            conf = confidence(answer.logprobs, closed, self.config.confidence)
            forced = self._inducer + answer.token_ids
            group = view.group_of(row.request_id)
            self._confidences.append(conf)
            self._step["probe_tokens"] += len(answer.token_ids)
            fits = cut + len(forced) <= view.budgets[row.request_id]
            if (repeated or should_exit(conf, self.config.threshold)) and fits and not self._capped(group):
                self._exits[group] = self._exits.get(group, 0) + 1
                exits.append((row, cut, forced))
                reason = (f"{self._repeats[_key(row)]} repeated step chunks" if repeated else
                          f"confidence {conf:.3f} > {self.config.threshold}")
                why[_key(row)] = (f"control.truncate_steps: trial answer {self._decode(answer.token_ids)!r} "
                                  f"({reason}) before step marker {marker!r} "
                                  f"at token {cut} (check {self._checks[_key(row)]} of {self.config.max_checks})")
                self._step["repetition_exits"] += repeated
            else:
                rejected += len(answer.token_ids)
        self.lent.charge_generation(0, rejected)
        return Steer(why=why, exit=self._exits_of(exits, view))

    def _capped(self, group: str) -> bool:
        return self.config.max_exits is not None and self._exits.get(group, 0) >= self.config.max_exits

    def _boundary(self, row: LiveRow) -> tuple[LiveRow, int, str, bool] | None:
        """The row's newest unchecked step boundary (the row, its cut, the marker, and whether its step
        chunks have now repeated ``repeats`` times), or None."""
        key = _key(row)
        if row.finish_reason is not None or not row.token_ids or self._checks.get(key, 0) >= self.config.max_checks:
            return None
        text = self._decode(row.token_ids)
        found = find_marker(text, self.config.markers, self._seen.get(key, 0))
        self._seen[key] = len(text)
        if found is None:
            return None
        cut = cut_at(found[0], [len(self._decode(row.token_ids[:k])) for k in range(len(row.token_ids) + 1)])
        if cut < self.config.min_tokens or cut <= self._cut.get(key, -1):  # no new step since the last check
            return None
        self._cut[key] = cut
        self._checks[key] = self._checks.get(key, 0) + 1
        self._step["checks"] += 1
        return row, cut, found[1], self._repeated(key, text, *found)

    def _repeated(self, key: tuple[str, int], text: str, start: int, marker: str) -> bool:
        """Count a repeat when the step chunk that ends at ``start`` (the text since the previous
        boundary's marker) repeats the chunk before it; True once ``repeats`` are counted (never reset)."""
        begin, previous = self._chunk.get(key, (0, None))
        chunk = text[begin:start]
        self._chunk[key] = (start + len(marker), chunk)
        if self.config.repeats is None or previous is None or not is_repetition(previous, chunk):
            return False
        self._repeats[key] = self._repeats.get(key, 0) + 1
        return self._repeats[key] >= self.config.repeats

    def _exits_of(self, exits: list[tuple[LiveRow, int, tuple[int, ...]]], view: InFlightView) -> dict:
        """Each exiting row's ``Exit``: the appended tokens scored under the row's sampling distribution."""
        if not exits:
            return {}
        scored = self.engine.score([ScoreRequest(view.contexts[row.request_id] + row.token_ids[:cut], forced,
                                                 view.params[row.request_id].temperature)
                                    for row, cut, forced in exits])
        out = {}
        for (row, cut, forced), s in zip(exits, scored):
            out[_key(row)] = Exit(cut, forced, s.logprobs, s.entropy)
            self._step["exits"] += 1
            self._step["forced_tokens"] += len(forced)
            self._cuts.append(cut)
        return out

    def before_step(self, ctx: Any) -> None:
        self._seen, self._cut, self._checks, self._exits = {}, {}, {}, {}
        self._chunk, self._repeats = {}, {}
        self._step = {"checks": 0.0, "exits": 0.0, "repetition_exits": 0.0, "probe_tokens": 0.0, "forced_tokens": 0.0}
        self._confidences, self._cuts = [], []

    @property
    def confidences(self) -> tuple[float, ...]:
        """The confidence of every trial answer this step, in the order they were made (0 for one
        that did not end)."""
        return tuple(self._confidences)

    def step_metrics(self) -> dict[str, float]:
        out = dict(self._step)
        if self._confidences:
            out["confidence_mean"] = float(np.mean(self._confidences))
            out["confidence_max"] = float(np.max(self._confidences))
        if self._cuts:
            out["cut_mean"] = float(np.mean(self._cuts))
        return out


def _key(row: LiveRow) -> tuple[str, int]:
    return row.request_id, row.sample_index
