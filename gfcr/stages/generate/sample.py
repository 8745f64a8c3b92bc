"""generate.sample: independent samples per prompt from the policy's engine (GRPO's rollouts).

For every allocation entry with ``n_rollouts > 0`` the engine draws that many independent
completions of the prompt's token ids (tokenized once, chat template applied by the
policy). Each completion becomes a ``Rollout`` holding its token ids, one segment with the
current policy version and the per-token behaviour log-probabilities, its status
(``completed`` at end-of-sequence or a stop string, ``truncated`` at ``max_new_tokens``)
and its decoded text for the verifiers. The rollouts of one prompt form one group.

Each request carries its own ``SamplingParams`` (from the Config). With ``entropy: true`` the
per-token entropy of the sampling distribution is kept on ``Rollout.token_entropy``.
``max_in_flight`` caps the rows the engine decodes at once (a freed slot is refilled).

Hand-over (``lifecycle: {stream_groups: true}``): the runtime gives the stage a sink
(``hand_over``), and each group goes to it as soon as all its rows have ended (the engine's
``ready``), while the engine decodes the others; the stage returns the same group objects, in
allocation order, as without it (the transformers, vLLM and fake engines hand groups over).

In-flight control: the runtime attaches the pipeline's in-flight controllers
(``attach_in_flight``) and the engine consults them while it decodes. Several controllers
are composed: each is called on its own schedule (``every``) and their ``Steer`` answers
are merged (union of aborted and pruned rows; ``stop`` if any asks). A row a controller
ends is kept with status ``aborted_partial`` (resumable) or ``pruned``; a group holding an
``aborted_partial`` rollout is dropped for this step ("stopped in flight ... (partial kept)"),
its rollouts kept on the record for a Replay stage to resume.

Seeding: the requests' seed is derived from ``(seed, step, loop round)`` and the engine
derives each row's stream from it, the request id and the sample index, so a step samples
the same tokens whether the run was interrupted or not, however the engine batches rows.

Deviations: none from GRPO's independent sampling (Shao et al., 2024, arXiv 2402.03300);
sampling uses ``top_k = 0`` (no top-k truncation) as the peer baselines do, and the
recorded log-probabilities are those of the tempered distribution before top-p truncation.

Fidelity: gfcr's own: GRPO's independent sampling (arXiv 2402.03300) on the policy's engine.

Example (the ``tiny-arith`` policy on the transformers engine):

>>> from gfcr.engines import TransformersEngine, load_policy
>>> from gfcr.records import Allocation, AllocationEntry, Prompt, StepContext
>>> from gfcr.spec import PolicySpec
>>> from gfcr.stages.resources import Lent
>>> policy = load_policy(PolicySpec(model="tiny-arith"))
>>> stage = Sample(Sample.Config(max_new_tokens=8))
>>> stage.setup(Lent(policy, TransformersEngine(policy)))
>>> groups = stage.run(Allocation(0, (AllocationEntry(Prompt("a:0", text="What is 12 + 30? Answer:"), 4),)),
...                    StepContext("run", step=0, seed=0, policy_version=0))
>>> group = groups.groups[0]
>>> len(group.rollouts), group.rollouts[0].rollout_id
(4, 'a:0@s0/0')
>>> all(len(r.behavior_logprobs) == len(r) for r in group.rollouts)
True

YAML:

.. code-block:: yaml

    rollout: {use: generate.sample, from: budget, with: {temperature: 1.0, max_new_tokens: 32}}
"""

from __future__ import annotations

from typing import Annotated, Callable, Sequence

import numpy as np
from pydantic import Field, field_validator

from gfcr.records import (
    Allocation, AllocationEntry, Rollout, RolloutGroup, RolloutGroups, RolloutStatus, StepContext, group_id,
    rollout_id,
)
from gfcr.registry import Seed, StageConfig
from gfcr.spec.problems import fixable
from gfcr.stages.common.seeds import step_seed
from gfcr.stages.engine import (
    Completion, Exit, InFlightController, InFlightView, SamplingParams, Steer, splice,
)
from gfcr.stages.resources import Engine, GenerationRequest, Policy, Lent, prompt_tokens

STATUS = {"stop": RolloutStatus.COMPLETED, "length": RolloutStatus.TRUNCATED,
          "aborted": RolloutStatus.ABORTED_PARTIAL, "pruned": RolloutStatus.PRUNED,
          "exited": RolloutStatus.COMPLETED}  # exited: cut at a step and answered by a controller



def no_empty_stop(stop: list[str], unit: str = "response") -> list[str]:
    """A stage Config's ``stop`` strings, refused with the fix if one is empty: it matches at once,
    so every ``unit`` would be one token (and every update skipped)."""
    if "" in stop:
        raise fixable(f"`stop` holds an empty string (item {stop.index('')}), which would end every "
                      f"{unit} after its first token", "remove the empty string from `stop`")
    return stop

class Sample:
    """Independent samples of every allocated prompt, grouped by prompt."""

    class Config(StageConfig):
        temperature: Annotated[float, Field(ge=0.0, description="0 samples greedily")] = 1.0
        top_p: Annotated[float, Field(gt=0.0, le=1.0)] = 1.0
        max_new_tokens: Annotated[int, Field(ge=1)] = 64
        stop: list[str] = Field(default_factory=list, description="stop strings (kept in the response); not empty")
        seed: Seed | None = Field(None, description="sampling seed; default: the run's seed")
        entropy: bool = Field(False, description="record each token's entropy on Rollout.token_entropy")
        max_in_flight: Annotated[int | None, Field(ge=1, description="rows decoded at once; default: the "
                                                   "engine's batch")] = None

        @field_validator("stop")
        @classmethod
        def _no_empty_stop(cls, stop: list[str]) -> list[str]:
            return no_empty_stop(stop)

        @property
        def records_entropy(self) -> bool:  # a capability (gfcr.registry.RecordsEntropy)
            return self.entropy

        @property
        def engine_needs(self) -> frozenset[str]:  # a capability (gfcr.registry.NeedsOfEngine)
            return frozenset({"top_p"} if self.top_p < 1.0 else ())

    _alias = "generate.sample"  # in set-up errors; the generators that extend this one name themselves

    def __init__(self, config: Config):
        self.config = config
        self.policy: Policy | None = None
        self.engine: Engine | None = None
        self.controller: InFlightController | None = None
        self.sink: Callable[[RolloutGroup], None] | None = None  # where groups go as they end (hand_over)

    def setup(self, lent: Lent) -> None:
        self.policy = lent.require_policy(self._alias)
        self.engine = lent.require_engine(self._alias)

    def attach_in_flight(self, controllers: Sequence[InFlightController]) -> None:
        """The in-flight controllers the engine consults while generating (composed, see the docstring)."""
        self.controller = Composed(list(controllers)) if controllers else None

    def why(self, request: GenerationRequest, index: int) -> str:
        """Why an in-flight controller ended row ``index`` of ``request`` this call ("" if none said)."""
        return self.controller.why.get((request.request_id, index), "") if self.controller is not None else ""

    def sampling(self, allocation: Allocation, ctx: StepContext | None) -> tuple[StepContext, int, SamplingParams]:
        """The step's context (the runtime passes the current one), loop round and sampling params;
        the controllers' stop reasons of the last call are forgotten (a call starts here)."""
        if self.engine is None or self.policy is None:
            raise RuntimeError(f"{self._alias} was not set up with a policy and engine")
        if self.controller is not None:
            self.controller.why.clear()
        ctx = ctx or StepContext("", allocation.step, 0, 0)
        cfg, round_ = self.config, ctx.round or 0
        seed = ctx.seed if cfg.seed is None else cfg.seed
        return ctx, round_, SamplingParams(cfg.temperature, cfg.top_p, cfg.max_new_tokens, tuple(cfg.stop),
                                           step_seed(seed, allocation.step, round_), cfg.entropy)

    def hand_over(self, sink: Callable[[RolloutGroup], None] | None) -> None:
        """Hand each group to ``sink`` as soon as all its rows have ended (None: return them all at
        the end), the runtime's ``lifecycle: {stream_groups: true}``."""
        self.sink = sink

    def run(self, allocation: Allocation, ctx: StepContext | None = None) -> RolloutGroups:
        ctx, round_, params = self.sampling(allocation, ctx)
        entries = allocation.active()
        requests = [self.request(e, allocation.step, round_, params) for e in entries]
        done: dict[int, RolloutGroup] = {}

        def ready(i: int, completions: list[Completion]) -> None:  # the engine: request i's rows all ended
            done[i] = self.ended(entries[i], requests[i], completions, allocation.step)
            self.sink(done[i])

        streamed = {"ready": ready} if self.sink is not None else {}
        results = self.engine.generate(requests, self.controller, self.config.max_in_flight, **streamed)
        return RolloutGroups([done[i] if i in done else self.ended(e, r, c, allocation.step)
                              for i, (e, r, c) in enumerate(zip(entries, requests, results))])

    def ended(self, entry: AllocationEntry, request: GenerationRequest, completions: Sequence[Completion],
                 step: int) -> RolloutGroup:
        """An entry's group once its rows have ended, dropped if a controller stopped any of them."""
        group = self.group(entry, request, completions, self.engine.policy_version, step)
        stopped = sum(r.status == RolloutStatus.ABORTED_PARTIAL for r in group.rollouts)
        if stopped:
            group.drop(f"stopped in flight: {stopped} of {len(group.rollouts)} rollouts unfinished (partial kept)")
        return group

    def request(self, entry: AllocationEntry, step: int, round_: int, params: SamplingParams) -> GenerationRequest:
        """An allocation entry's one request of ``n`` rows, under its group id."""
        prompt = tuple(prompt_tokens(self.policy, entry.prompt))
        return GenerationRequest(group_id(entry.prompt_id, step, round_), prompt, entry.n_rollouts, params)

    def group(self, entry: AllocationEntry, request: GenerationRequest, completions: Sequence[Completion],
              version: int, step: int) -> RolloutGroup:
        """An entry's group from its request's completions, each row with its stop reason."""
        rollouts = [to_rollout(request, i, entry.prompt_id, c, version, step, self.why(request, i))
                    for i, c in enumerate(completions)]
        return RolloutGroup(request.request_id, entry.prompt_id, step, entry.n_rollouts, rollouts,
                            sample_weight=entry.sample_weight)


def to_rollout(request: GenerationRequest, index: int, prompt_id: str, c: Completion, version: int,
               step: int, stop_reason: str = "") -> Rollout:
    """A rollout from one completion; a continued prefix's segments are spliced in front."""
    tokens, segments = splice(request.prefix, c, version)
    entropy = None
    if c.entropy is not None:  # unknown for a prefix's tokens: NaN there
        entropy = np.concatenate([np.full(len(tokens) - len(c.token_ids), np.nan, np.float32), c.entropy])
    return Rollout(rollout_id(request.request_id, index), request.request_id, prompt_id, tokens, segments,
                   status=STATUS[c.finish_reason], finish_reason=c.finish_reason, created_step=step, text=c.text,
                   replica=c.replica, ray_node=c.ray_node, token_entropy=entropy, stop_reason=stop_reason)


class Composed:
    """Several in-flight controllers as one: each steers on its own ``every``; answers are merged."""

    def __init__(self, controllers: list[InFlightController]):
        self.controllers = controllers
        self.every = 1 if len(controllers) != 1 else max(1, controllers[0].every)
        self.why: dict[tuple[str, int], str] = {}  # why each row was ended, this generate call (the first answer's)

    def steer(self, view: InFlightView) -> Steer:
        answers = [c.steer(view) for c in self.controllers
                   if len(self.controllers) == 1 or view.decoded % max(1, c.every) == 0]
        exits: dict[tuple[str, int], Exit] = {}
        for a in answers:
            for key, text in a.why.items():
                self.why.setdefault(tuple(key), text)
            for key, ex in a.exit.items():
                exits.setdefault(tuple(key), ex)
        return Steer(tuple(k for a in answers for k in a.abort), tuple(k for a in answers for k in a.prune),
                     any(a.stop for a in answers), exit=exits)
