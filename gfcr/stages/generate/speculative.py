"""generate.speculative: SPEC-RL's speculative rollouts, previous rollouts of a prompt as drafts.

SPEC-RL (Liu et al., arXiv 2509.23232; ``ShopeeLLM/Spec-RL``, ``verl/utils/speculative_decoding.py``
``spec_cut``, ``ray_trainer.py``): the responses a prompt got the last time it was sampled are
drafts for its responses now. For every allocation entry (prompt, ``n``):

1. **drafts**: the stage's draft store holds, per prompt id, the rollouts this stage made for
   it the last time (up to ``n`` are used, in order; row ``i`` gets draft ``i``);
2. **verify**: each draft's tokens are scored under the current policy (``engine.score``, at
   the sampling temperature): ``delta_t = log pi_new(y_t) - log pi_old(y_t)``, with ``pi_old``
   the behaviour log-prob the draft recorded when it was sampled. Token ``t`` is accepted if
   ``delta_t + lenience >= 0`` or ``log U_t <= delta_t + lenience``, ``U_t ~ Uniform(0, 1)``:
   acceptance probability ``min(1, e^lenience * pi_new / pi_old)``; ``lenience = 0`` is standard
   speculative-decoding acceptance (``accepted_length``);
3. **continue**: the accepted prefix is the first ``cut`` tokens (``cut`` = the first rejected
   position, or the whole draft). A whole draft is reused as it is (status and finish reason
   kept); otherwise the engine continues ``prompt + prefix`` from token ids with the budget
   left (``max_new_tokens`` caps the whole response). A draft rejected at its first token, and
   a row with no draft, are sampled afresh;
4. **store**: the step's rollouts replace the prompt's drafts (all of them, kept or later
   dropped: SPEC-RL saves the step's responses before any filter).

An accepted prefix is treated as the current policy's (the code recomputes ``old_log_probs``
of the whole response with the current actor): its segment is at the current policy version,
with the scored ``log pi_new`` as its behaviour log-probs and origin ``draft_accepted``; the new
tokens follow in a sampled segment. The rollout records ``draft_from`` (the draft's id) and
``draft_tokens`` (``cut``); its origin is ``draft_accepted`` when ``cut > 0``. Token accounting:
the accepted tokens are not generated again (``Rollout.generated_length`` leaves them out),
and the draft tokens scored count in the step's ``tokens_scored``.

Seeding: rows draw as ``generate.sample``'s (request ``<group>`` for a group with no draft, so a
prompt's first sampling is ``generate.sample``'s exactly; ``<group>/<i>`` per row otherwise), and
the acceptance uniforms of row ``i`` come from ``row_seed(seed, "<group>~spec", i)``.

Metrics per step: ``drafts`` (rows with a draft), ``draft_tokens`` (scored), ``accepted_tokens``,
``acceptance_rate`` (accepted / draft tokens), ``fully_accepted`` (drafts reused whole),
``response_tokens`` (of the step's rollouts), ``reused_token_fraction`` (accepted over response
tokens) and ``stored_prompts``.

Deviations:

- drafts are matched by prompt id and are the prompt's latest rollouts, whenever they were made
  (with ``control.uniform`` that is the previous epoch); the reference keeps one bucket per step
  index of an epoch and re-matches by prompt text (``align_prev_to_gen``);
- the reference builds drafts from the *previous epoch only*; here a prompt sampled twice in an
  epoch (a top-up round, a selector that repeats prompts) drafts from its latest sampling;
- the lenience is the log-space ``lenience`` (default 0.5, the script's ``--bias 0.5``);
- no in-flight controllers on draft verification (they steer the continuations as usual).

Fidelity: checked against ShopeeLLM/Spec-RL@97da99e: 18/18 cases (``tests/fidelity/spec_rl.json``:
the cut of ``spec_cut`` and ``spec_cut_with_knobs``; the draft matching is not compared).

Example (the ``tiny-arith`` policy; the second call drafts from the first, and with the
policy unchanged every draft is accepted whole at any lenience):

>>> from gfcr.engines import TransformersEngine, load_policy
>>> from gfcr.records import Allocation, AllocationEntry, Prompt, StepContext
>>> from gfcr.spec import PolicySpec
>>> from gfcr.stages.resources import Lent
>>> policy = load_policy(PolicySpec(model="tiny-arith"))
>>> stage = Speculative(Speculative.Config(max_new_tokens=8))
>>> stage.setup(Lent(policy, TransformersEngine(policy)))
>>> entry = AllocationEntry(Prompt("a:0", text="What is 12 + 30? Answer:"), 4)
>>> first = stage.run(Allocation(0, (entry,)), StepContext("run", step=0, seed=0, policy_version=0))
>>> second = stage.run(Allocation(1, (entry,)), StepContext("run", step=1, seed=0, policy_version=0))
>>> [r.draft_from for r in second.groups[0].rollouts]
['a:0@s0/0', 'a:0@s0/1', 'a:0@s0/2', 'a:0@s0/3']
>>> stage.step_metrics()["acceptance_rate"], stage.step_metrics()["fully_accepted"]
(1.0, 4)

YAML:

.. code-block:: yaml

    rollout: {use: generate.speculative, from: budget, with: {lenience: 0.5, max_new_tokens: 32}}
"""

from __future__ import annotations

from typing import Annotated, Any

import numpy as np
from pydantic import Field

from gfcr.records import (
    Allocation, AllocationEntry, Origin, Rollout, RolloutGroup, RolloutGroups, Segment, SegmentOrigin, StepContext,
    group_id, rollout_id,
)
from gfcr.stages.engine import ResponsePrefix, SamplingParams, ScoreRequest, row_seed
from gfcr.stages.generate.rollout_state import rollout_from_state, rollout_state, snapshot
from gfcr.stages.generate.sample import Sample, to_rollout
from gfcr.stages.resources import GenerationRequest, prompt_tokens


def accepted_length(new_logprobs: np.ndarray, old_logprobs: np.ndarray, lenience: float,
                    uniforms: np.ndarray) -> int:
    """SPEC-RL's cut: the first position whose token is rejected, or the draft's length.

    Token ``t`` is accepted if ``delta + lenience >= 0`` or ``log(u_t) <= delta + lenience``, with
    ``delta = new - old``: probability ``min(1, e^lenience * pi_new / pi_old)``.

    >>> import math
    >>> old = np.log([0.5, 0.5, 0.5])
    >>> accepted_length(np.log([0.5, 0.25, 0.5]), old, 0.0, np.array([0.9, 0.6, 0.1]))  # 0.6 > 0.5: rejected
    1
    >>> accepted_length(np.log([0.5, 0.25, 0.5]), old, 0.0, np.array([0.9, 0.4, 0.1]))
    3
    >>> accepted_length(np.log([0.5, 0.25, 0.5]), old, math.log(2), np.array([0.9, 0.99, 0.1]))  # e^l = 2
    3
    """
    threshold = np.asarray(new_logprobs, np.float64) - np.asarray(old_logprobs, np.float64) + lenience
    # U is floored at 1e-12 as the reference's clamp_min: a token below log(1e-12) of its old log-prob is
    # rejected even at U = 0
    accept = (threshold >= 0) | (np.log(np.maximum(uniforms[:len(threshold)], 1e-12)) <= threshold)
    rejected = np.flatnonzero(~accept)
    return int(rejected[0]) if len(rejected) else len(threshold)


class Speculative(Sample):
    """Rollouts that start from the accepted prefix of the prompt's previous rollouts (SPEC-RL)."""

    _alias = "generate.speculative"
    hand_over = None  # its own run hands no group over: not streamed (`lifecycle.stream_groups` refuses it)

    class Config(Sample.Config):
        lenience: float = Field(0.5, description="log-space lenience l: accept with min(1, e^l pi_new/pi_old)")
        max_drafts_per_prompt: Annotated[int | None, Field(ge=1, description=(
            "drafts kept per prompt; default: every rollout of its last sampling"))] = None

    def __init__(self, config: Config):
        super().__init__(config)
        self.drafts: dict[str, list[Rollout]] = {}  # prompt id -> its latest rollouts
        self._metrics: dict[str, float] = {}

    def run(self, allocation: Allocation, ctx: StepContext | None = None) -> RolloutGroups:
        ctx, round_, params = self.sampling(allocation, ctx)
        cfg = self.config
        version = self.engine.policy_version
        plans = [_Plan(e, group_id(e.prompt_id, allocation.step, round_), tuple(prompt_tokens(self.policy, e.prompt)),
                       self.drafts.get(e.prompt_id, [])[:e.n_rollouts]) for e in allocation.active()]
        self._verify(plans, params)
        requests = [req for p in plans for req in p.requests(params, version)]
        results = iter(self.engine.generate(requests, self.controller, cfg.max_in_flight) if requests else [])
        groups = [p.group([next(results) for _ in range(p.n_requests)], version, allocation.step, self)
                  for p in plans]
        keep = cfg.max_drafts_per_prompt
        for p, g in zip(plans, groups):
            self.drafts[p.entry.prompt_id] = [snapshot(r) for r in g.rollouts[:keep]]
        self._metrics = _metrics(plans, groups, len(self.drafts))
        return RolloutGroups(groups)

    def _verify(self, plans: list["_Plan"], params: SamplingParams) -> None:
        """Score every draft under the current policy in one batched call, and cut each."""
        drafts = [(p, i, d) for p in plans for i, d in enumerate(p.drafts) if len(d)]
        scored = self.engine.score([ScoreRequest(p.prompt_ids, tuple(d.response_token_ids), params.temperature)
                                    for p, _, d in drafts]) if drafts else []
        for (p, i, d), s in zip(drafts, scored):
            u = np.random.default_rng(row_seed(params.seed, f"{p.gid}~spec", i)).random(len(d))
            p.cuts[i] = accepted_length(s.logprobs, d.behavior_logprobs, self.config.lenience, u)
            p.scored[i] = np.asarray(s.logprobs, np.float32)

    def step_metrics(self) -> dict[str, float]:
        return dict(self._metrics)

    def state_dict(self) -> dict[str, Any]:
        return {"drafts": [[pid, [rollout_state(r) for r in rs]] for pid, rs in self.drafts.items()]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.drafts = {pid: [rollout_from_state(r) for r in rs] for pid, rs in state["drafts"]}


class _Plan:
    """One allocation entry: its drafts, their cuts, and the requests for what is left to sample."""

    def __init__(self, entry: AllocationEntry, gid: str, prompt_ids: tuple[int, ...], drafts: list[Rollout]):
        self.entry, self.gid, self.prompt_ids, self.drafts = entry, gid, prompt_ids, drafts
        self.cuts: dict[int, int] = {}
        self.scored: dict[int, np.ndarray] = {}
        self.kinds: list[tuple[str, Any]] = []  # per row: ("fresh", i) | ("whole", i) | ("request", its request)
        self.n_requests = 0

    def requests(self, params: SamplingParams, version: int) -> list[GenerationRequest]:
        n = self.entry.n_rollouts
        if not self.cuts:  # no draft: generate.sample's request (Sample.request), so a first sampling is the same
            self.kinds = [("fresh", i) for i in range(n)]
            self.n_requests = 1
            self.fresh = GenerationRequest(self.gid, self.prompt_ids, n, params)
            return [self.fresh]
        out = []
        for i in range(n):
            cut = self.cuts.get(i, 0)
            draft = self.drafts[i] if i < len(self.drafts) else None
            if draft is not None and cut == len(draft) and cut > 0:
                self.kinds.append(("whole", i))
                continue
            prefix = ResponsePrefix(tuple(draft.response_token_ids[:cut]), (self._accepted(i, cut, version),)) \
                if draft is not None and cut > 0 else None
            request = GenerationRequest(rollout_id(self.gid, i), self.prompt_ids, 1, params, prefix, self.gid)
            self.kinds.append(("request", request))
            out.append(request)
        self.n_requests = len(out)
        return out

    def _accepted(self, i: int, cut: int, version: int) -> Segment:
        """The accepted prefix as the current policy's (the reference's recomputed old log-probs)."""
        return Segment(0, cut, version, self.scored[i][:cut], SegmentOrigin.DRAFT_ACCEPTED)

    def group(self, results: list[list[Any]], version: int, step: int, stage: Sample) -> RolloutGroup:
        e, results = self.entry, iter(results)
        if self.kinds and self.kinds[0][0] == "fresh":
            return stage.group(e, self.fresh, next(results), version, step)
        rollouts = [self._rollout(i, kind, results, version, step, stage) for i, kind in enumerate(self.kinds)]
        return RolloutGroup(self.gid, e.prompt_id, step, e.n_rollouts, rollouts, sample_weight=e.sample_weight)

    def _rollout(self, i: int, kind: tuple[str, Any], results: Any, version: int, step: int, stage: Sample) -> Rollout:
        rid = rollout_id(self.gid, i)
        if kind[0] == "whole":
            d, cut = self.drafts[i], len(self.drafts[i])
            r = Rollout(rid, self.gid, d.prompt_id, list(d.response_token_ids), [self._accepted(i, cut, version)],
                        status=d.status, origin=Origin.DRAFT_ACCEPTED, finish_reason=d.finish_reason,
                        created_step=step, text=d.text, replica=d.replica, ray_node=d.ray_node)
        else:
            request = kind[1]
            r = to_rollout(request, 0, self.entry.prompt_id, next(results)[0], version, step, stage.why(request, 0))
            r.rollout_id, r.group_id = rid, self.gid
        cut = self.cuts.get(i, 0)  # > 0 exactly when the row starts with an accepted prefix of draft i
        if cut:
            r.origin, r.draft_from, r.draft_tokens = Origin.DRAFT_ACCEPTED, self.drafts[i].rollout_id, cut
        return r


def _metrics(plans: list[_Plan], groups: list[RolloutGroup], stored: int) -> dict[str, float]:
    draft_tokens = sum(len(d) for p in plans for d in p.drafts)
    accepted = sum(c for p in plans for c in p.cuts.values())
    tokens = sum(len(r) for g in groups for r in g.rollouts)
    return {"drafts": sum(len(p.drafts) for p in plans), "draft_tokens": draft_tokens, "accepted_tokens": accepted,
            "acceptance_rate": accepted / draft_tokens if draft_tokens else 0.0,
            "fully_accepted": sum(k[0] == "whole" for p in plans for k in p.kinds),
            "response_tokens": tokens, "reused_token_fraction": accepted / tokens if tokens else 0.0,
            "stored_prompts": stored}
