"""control.truncate_steps: Step-GRPO's Dynamic Truncated Rollout, with DEER's answer-confidence test
at step boundaries (an in-flight controller).

Step-GRPO (arXiv 2604.16890, ACL 2026; code "None") splits reasoning into steps at linguistic
markers, and its Dynamic Truncated Rollout "exposes the model to concise high-confidence
trajectories during exploration". Its method section was not readable here (seed_methods 2.17:
the marker set, the truncation criterion and the reward formula are open), so the criterion is
DEER's (arXiv 2504.15895, code ``BugSmith/DEER``, ``vllm-deer.py``), the inference-time early exit
that Step-GRPO sets out to internalise in training: at a step boundary, force a trial answer and
exit if the model is confident in it.

The rule, per running row of the host's generate call:

1. **step boundary**: the row's newest tokens complete one of ``markers``. The boundary is the
   start of the token in which the marker begins (``cut``: the row's new tokens before it; DEER
   likewise stops a thinking chunk before its ``Wait``). Each occurrence is checked once, a row at
   most ``max_checks`` times (DEER's ``max_judge_steps``, 10), and only when ``cut >= min_tokens``;
2. **trial answer**: the engine continues the row's context, its first ``cut`` tokens and the
   ``inducer`` (DEER's ``"\\n**Final Answer**\\n\\\\boxed"``, here with its ``{``) greedily, for at
   most ``probe_tokens`` tokens (DEER's 20), ending at ``answer_end`` (``}``) or the end of sequence;
3. **confidence**: the mean probability of the greedy tokens (``confidence``; DEER's default policy
   ``avg1``, over the tokens DEER averages: its first generated token is the ``{`` that our
   inducer already holds). A trial answer that does not end within ``probe_tokens`` has none
   (DEER scores it anyway);
4. **exit**: when the trial answer closed, its confidence is above ``threshold`` (DEER's ``>``,
   0.95), the steps, inducer and answer fit the row's budget, and the row's group has fewer than
   ``max_exits`` exits, the row ends now (finish ``exited``, status ``completed``). Its response
   is its first ``cut`` tokens, the inducer and the trial answer. The appended tokens (a segment
   of origin ``forced``, counted as ``Rollout.forced_tokens``) carry their log-probs under the
   row's sampling distribution, scored at the current policy version, so the update treats them
   as on-policy: a positive advantage raises the probability of stopping at that step, which is
   how a truncated trajectory teaches the early exit. A row that does not exit runs on from where
   it was (DEER appends its ``Wait`` to a row it keeps; here the marker is the row's own).

Costs: each trial answer is a prefill of the row's context, its steps and the inducer (charged to
``tokens_scored``) and up to ``probe_tokens`` greedy tokens. A trial answer that is kept is part
of the response and counts as generated there; the tokens of the others are charged to the step as
generated (``Resources.charge_generation``), so budgets and ``gfcr compare`` see them. Scoring the
appended tokens is charged to ``tokens_scored`` as every ``score`` call is.

Metrics per step: ``checks`` (trial answers), ``exits``, ``confidence_mean`` and ``confidence_max``
(over the checks),
``probe_tokens`` (greedy tokens of every trial answer), ``forced_tokens`` (appended to exited rows)
and ``cut_mean`` (the new tokens exited rows kept before their answer).

Engines: both. A trial answer is a generate call made from ``steer`` while the host's rows are in
flight (``engine_needs``: ``generate_in_steer``). The transformers engine serves it from its decode
loop, paused meanwhile; the vLLM engine, whose one engine is stepping the host's rows, serves it
from the trained policy's own decode loop (the weights vLLM holds; docs/vllm.md).

Lineage: an exited rollout's ``finish_reason`` is ``exited``, its ``stop_reason`` names the
boundary, the trial answer and its confidence, and ``forced_tokens`` counts the appended tokens;
``gfcr lineage`` shows them.

Deviations (choices the abstract leaves open, and where DEER is followed or not):

- the step-aware relative reward (Step-GRPO's second half) is not implemented: its formula is not
  public. This stage is the truncation half, and composes with any reward and update;
- the markers: DEER uses one transition word (``Wait``, or ``Alternatively``); Step-GRPO's set is
  not public. The default is DEER's two words, ``Hmm`` and the blank line ``"\\n\\n"`` (the step
  separator of instruct models that do not write ``Wait``, SmolLM2 among them);
- the trial answer is greedy, as DEER's code comment and its "max prob" confidence say (the line
  that would set it is commented out there, leaving vLLM's default temperature);
- after an exit DEER closes the thinking block (``</think>``) and lets the model write its final
  answer freely; for models without one (every model here) the trial answer is the answer. Set
  ``inducer`` to end a thinking block first where a model has one;
- DEER checks every row; ``max_exits`` (default: no cap) can keep some rows of each group
  untruncated, so that a group compares truncated with full trajectories;
- a trial answer that does not end (``answer_end`` or end of sequence) within ``probe_tokens`` is
  not taken, whatever its confidence (DEER scores the tokens it has);
- the appended tokens are trained on as if sampled at the current version (their behaviour
  log-probs are the current policy's): the inducer was not sampled at all, and this is what lets
  the update reward stopping there; SPEC-RL treats its accepted draft prefixes the same way;
- DEER's token budget split (``think_ratio``) and repetition exit are not used: the row's own
  ``max_new_tokens`` is its budget.

It needs an engine that serves a generate call from inside the host's decode loop (both engines;
the fake engine in tests).

Fidelity: public code at davidweidawang/Step-GRPO@df76889; reference cases pending
(``verl/workers/rollout/deer_utils.py``: ``answer_confidence``, ``should_early_exit``;
``examples/reward_function/step_grpo.py``: ``compute_score``; issue 29).

Example (the pure parts: where a step ends, and the confidence of a trial answer):

>>> find_marker("3+4=7\\n\\nThen 7*2", ["\\n\\n", "Wait"], since=0)
(5, '\\n\\n')
>>> find_marker("3+4=7\\n\\nThen 7*2", ["\\n\\n", "Wait"], since=8) is None  # seen before
True
>>> cut_at(5, [0, 3, 5, 7, 12])  # tokens' decoded lengths: the first 2 tokens end at char 5
2
>>> round(confidence(np.log([0.9, 1.0, 0.8])), 4)
0.9

YAML (SmolLM2 on GSM8K: ``pipelines/truncate_steps_gsm8k_smollm2.yaml``):

.. code-block:: yaml

    steps:   {use: control.truncate_steps, with: {threshold: 0.95}}
    rollout: {use: generate.sample, from: budget, in_flight: [steps], with: {max_new_tokens: 256}}
"""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Sequence

import numpy as np
from pydantic import Field

from gfcr.registry import StageConfig
from gfcr.stages.engine import (
    Exit, GenerationRequest, InFlightView, LiveRow, SamplingParams, ScoreRequest, Steer,
)
from gfcr.stages.resources import Engine, Policy, Resources

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


def confidence(logprobs: np.ndarray) -> float:
    """DEER's answer confidence (policy ``avg1``): the mean probability of the trial answer's tokens."""
    return float(np.mean(np.exp(np.asarray(logprobs, np.float64)))) if len(logprobs) else 0.0


class TruncateSteps:
    """End a row at a step boundary when the model is confident of a trial answer (Step-GRPO, DEER)."""

    every: int = 1  # decode steps between steer calls (the in-flight controller role)

    class Config(StageConfig):
        markers: Annotated[list[Annotated[str, Field(min_length=1)]], Field(min_length=1, description=(
            "text that starts a new reasoning step; the row is checked before it"))] = [
            "\n\n", "Wait", "Alternatively", "Hmm"]
        threshold: Annotated[float, Field(ge=0.0, le=1.0, description=(
            "exit when the trial answer's mean token probability is above it (DEER: 0.95)"))] = 0.95
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
        self.resources: Resources | None = None
        self._inducer: tuple[int, ...] = ()
        self._seen: dict[tuple[str, int], int] = {}  # row -> characters of its text already scanned
        self._cut: dict[tuple[str, int], int] = {}  # row -> the cut of its last check
        self._checks: dict[tuple[str, int], int] = {}
        self._exits: dict[str, int] = {}  # group key -> exits so far
        self._step: dict[str, float] = {}
        self._confidences: list[float] = []
        self._cuts: list[int] = []
        self.before_step(None)

    def setup(self, resources: Resources) -> None:
        self.resources = resources
        self.policy = resources.require_policy("control.truncate_steps")
        self.engine = resources.require_engine("control.truncate_steps")
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
                  for row, cut, _ in due]
        self.resources.charge_scoring(sum(len(p.prompt_token_ids) for p in probes))
        answers = [c for (c,) in self.engine.generate(probes)]
        exits, why, rejected = [], {}, 0
        for (row, cut, marker), answer in zip(due, answers):
            conf = confidence(answer.logprobs) if answer.finish_reason == "stop" else 0.0  # closed, or eos
            forced = self._inducer + answer.token_ids
            group = view.group_of(row.request_id)
            self._confidences.append(conf)
            self._step["probe_tokens"] += len(answer.token_ids)
            fits = cut + len(forced) <= view.budgets[row.request_id]
            if conf > self.config.threshold and fits and not self._capped(group):
                self._exits[group] = self._exits.get(group, 0) + 1
                exits.append((row, cut, forced))
                why[_key(row)] = (f"control.truncate_steps: trial answer {self._decode(answer.token_ids)!r} at "
                                  f"confidence {conf:.3f} > {self.config.threshold} before step marker {marker!r} "
                                  f"at token {cut} (check {self._checks[_key(row)]} of {self.config.max_checks})")
            else:
                rejected += len(answer.token_ids)
        self.resources.charge_generation(0, rejected)
        return Steer(why=why, exit=self._exits_of(exits, view))

    def _capped(self, group: str) -> bool:
        return self.config.max_exits is not None and self._exits.get(group, 0) >= self.config.max_exits

    def _boundary(self, row: LiveRow) -> tuple[LiveRow, int, str] | None:
        """The row's newest unchecked step boundary (the row, its cut, the marker), or None."""
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
        return row, cut, found[1]

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
        self._step = {"checks": 0.0, "exits": 0.0, "probe_tokens": 0.0, "forced_tokens": 0.0}
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
