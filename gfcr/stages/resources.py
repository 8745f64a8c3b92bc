"""What the runtime lends to stages: the policy being trained and the engine that samples it.

Stages never build models or engines themselves. A stage that needs them defines
``setup(self, resources: Resources)``; the runtime calls it once, after building the stages
and before the first step. The protocols live here, in the stages layer, so that stages can
be typed against them while the implementations (``gfcr.engines``) sit one layer up
(DESIGN.md section 5) and never get imported by ``gfcr validate``.

The Engine protocol and its records live in ``gfcr.stages.engine`` (per-request sampling
params, continuation from a response prefix, in-flight control, ``score``); they are
re-exported here, where stages have always imported them from.

Stages get the engine through ``require_engine``, which wraps it in a ``MeteredEngine``: the
response tokens a stage *scores* without generating them (a pilot's re-scoring, a draft
check) are counted in ``Resources.tokens_scored``, which the runner reports per step, so that
a comparison charges such methods for that compute.

``Resources.map`` is where a stage fans out pure per-item work (``filter.verify`` scores its
rollouts through it): in-process by default, batches of Ray tasks under the Ray executor
(``gfcr.runtime.ray_executor``). The stage sees one function either way and never imports Ray.

``Resources.start_trainers`` is set where the update runs as trainer ranks (``executor: {kind:
ray}`` with ``resources.replicas`` on the update: ``gfcr.runtime.trainer_ranks``): the update
calls it in ``setup`` with its class and Config and gets a ``TrainerGroup``, whose ranks each
build the same stage over their own copy of the policy and call its ``train_shard`` on a part
of the batch, with ``Ranks`` to sum tensors across them. The stage never imports Ray or
``torch.distributed``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Protocol, Sequence

from gfcr.errors import ModelError
from gfcr.records import Prompt
from gfcr.stages.engine import (  # noqa: F401  (re-exported: the protocol's historical home)
    Completion, Engine, GenerationRequest, InFlightController, InFlightView, LiveRow, ResponsePrefix,
    SamplingParams, Scored, ScoreRequest, Steer, row_seed,
)


class Policy(Protocol):
    """The model being trained, its tokenizer, and its version (bumped by each update)."""

    name: str
    model: Any  # a torch.nn.Module (a transformers causal LM)
    tokenizer: Any
    version: int

    def encode(self, prompt: Prompt) -> list[int]:
        """The prompt's token ids, with the chat template applied when the tokenizer has one."""
        ...

    def reference(self) -> Any:
        """A frozen copy of the initial weights (for a KL term), loaded from the source."""
        ...


Map = Callable[[Callable[[Any], Any], Sequence[Any]], list[Any]]
"""``map(fn, items) -> [fn(item) for item in items]``, in order, wherever the runtime runs it."""


def in_process_map(fn: Callable[[Any], Any], items: Sequence[Any]) -> list[Any]:
    """The default ``Resources.map``: call ``fn`` on each item in this process, in order."""
    return [fn(item) for item in items]


def _one_rank(tensors: list[Any]) -> None:
    """The sum over one rank: the tensors as they are."""


@dataclass(frozen=True)
class Ranks:
    """Where one shard of a distributed update runs: rank ``rank`` of ``world_size`` trainer ranks,
    and ``all_reduce_sum``, which replaces each tensor of a list by its sum over the ranks, in
    place. In one process (the default) it is rank 0 of 1 and the sum does nothing."""

    rank: int = 0
    world_size: int = 1
    all_reduce_sum: Callable[[list[Any]], None] = _one_rank


class TrainerGroup(Protocol):
    """The update's trainer ranks, driven from the driver process (``gfcr.runtime.trainer_ranks``).

    ``step(shards, *args)`` calls ``train_shard(shards[r], *args, ranks)`` on the stage built in
    rank ``r`` and returns the answers in rank order; ``weights()`` is rank 0's policy
    ``state_dict`` (on the CPU); ``load_weights`` puts the driver's into every rank;
    ``state_dict`` / ``load_state_dict`` are rank 0's stage state / every rank's."""

    world_size: int
    version: int  # the policy version the ranks hold

    def step(self, shards: list[list[Any]], *args: Any) -> list[Any]: ...

    def weights(self) -> dict[str, Any]: ...

    def load_weights(self, weights: dict[str, Any], version: int) -> None: ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


StartTrainers = Callable[[type, Any], TrainerGroup]
"""``start_trainers(stage_class, config)``: the update's trainer ranks, each holding
``stage_class(config)`` set up over its own copy of the policy."""


@dataclass
class Resources:
    """Everything the runtime lends to stages; ``None`` where the pipeline has no policy.

    ``map`` runs a pure function over items and returns the results in order; the runtime
    may run it elsewhere (Ray tasks), so ``fn`` and the items must pickle (a module-level
    function or a ``functools.partial`` of one) and ``fn`` must not mutate its item: the
    stage writes the results back itself. ``closers`` are the runtime's own clean-up
    (stopping engine actors, a Ray cluster), run by ``close()`` at the end of a run;
    stages never call it.
    """

    policy: Policy | None = None
    engine: Engine | None = None
    extras: dict[str, Any] = field(default_factory=dict)
    map: Map = in_process_map
    closers: list[Callable[[], None]] = field(default_factory=list)
    start_trainers: StartTrainers | None = None  # set where the update runs as trainer ranks (Ray)
    tokens_scored: int = 0  # response tokens stages scored through ``require_engine``'s engine
    stages: dict[str, Any] = field(default_factory=dict)  # the pipeline's stages by id (the runner lends them)
    # rollouts and response tokens a stage generated itself, outside the plan's generate stages
    # (sGPO's profiling pass), charged with ``charge_generation``
    rollouts_charged: int = 0
    tokens_charged: int = 0
    # the runtime's own numbers for each step's metrics line, by key (``ray``: the engine replicas
    # restarted since the last step); the session calls each once a step
    runtime_metrics: dict[str, Callable[[], dict[str, Any]]] = field(default_factory=dict)

    def take_tokens_scored(self) -> int:
        """The tokens scored since the last call (the runner calls it once a step)."""
        taken, self.tokens_scored = self.tokens_scored, 0
        return taken

    def charge_generation(self, rollouts: int, tokens: int) -> None:
        """Charge the current step with ``rollouts`` samples of ``tokens`` response tokens that a
        stage generated through the engine without handing them on as groups (a profiling
        pass): the runner adds them to the step's ``rollouts_generated`` and
        ``tokens_generated``, so budgets and ``gfcr compare`` count them."""
        if rollouts < 0 or tokens < 0:
            raise ValueError(f"a generation charge must be >= 0, got {rollouts} rollouts, {tokens} tokens")
        self.rollouts_charged += rollouts
        self.tokens_charged += tokens

    def charge_scoring(self, tokens: int) -> None:
        """Charge the current step with ``tokens`` tokens a stage ran through the policy itself,
        outside the engine (``filter.meds``'s fingerprint pass): added to ``tokens_scored``, as
        the engine's ``score`` calls are."""
        if tokens < 0:
            raise ValueError(f"a scoring charge must be >= 0, got {tokens} tokens")
        self.tokens_scored += tokens

    def take_generation_charge(self) -> tuple[int, int]:
        """``(rollouts, tokens)`` charged since the last call (the runner calls it once a step)."""
        taken = (self.rollouts_charged, self.tokens_charged)
        self.rollouts_charged = self.tokens_charged = 0
        return taken

    def close(self) -> None:
        """Run the closers, newest first, once (a second call does nothing)."""
        while self.closers:
            self.closers.pop()()

    def require_policy(self, stage: str) -> Policy:
        if self.policy is None:
            raise ModelError(f"`{stage}` needs a policy, and the pipeline has none",
                             "add `policy: {model: tiny-arith}` to the pipeline")
        return self.policy

    def require_engine(self, stage: str) -> Engine:
        if self.engine is None:
            raise ModelError(f"`{stage}` needs an engine, and the pipeline has none",
                             "add `policy: {model: tiny-arith, engine: hf}` to the pipeline")
        return MeteredEngine(self.engine, self)

    def require_stage(self, stage_id: str, by: str) -> Any:
        """Another stage of the pipeline, for a stage that reads its state (``replay.rlep`` reads a
        ``replay.store``'s store); the compiler has checked the pairing (``check_pipeline``)."""
        if stage_id not in self.stages:
            raise ModelError(f"`{by}` reads the stage `{stage_id}`, and the pipeline has no such stage",
                             f"add a stage `{stage_id}` to the pipeline, or change the stage id `{by}` names")
        return self.stages[stage_id]


class MeteredEngine:
    """The engine as a stage sees it: every call passes through unchanged, and the response
    tokens of every ``score`` call are added to ``resources.tokens_scored``."""

    def __init__(self, engine: Engine, resources: Resources):
        self._engine, self._resources = engine, resources

    def score(self, requests: Sequence[ScoreRequest]) -> list[Scored]:
        self._resources.tokens_scored += sum(len(r.response_token_ids) for r in requests)
        return self._engine.score(requests)

    def __getattr__(self, name: str) -> Any:  # generate, sync_weights, max_batch, ...
        return getattr(self._engine, name)


def policy_weights(policy: Policy) -> dict[str, Any]:
    """The policy's ``state_dict`` on the CPU, to send to other processes (trainer ranks, engine
    replicas)."""
    return {k: v.detach().cpu() for k, v in policy.model.state_dict().items()}


def prompt_tokens(policy: Policy, prompt: Prompt) -> list[int]:
    """The prompt's token ids, tokenized once and kept on the prompt (resume and replay reuse them)."""
    if prompt.prompt_token_ids is None:
        prompt.prompt_token_ids = list(policy.encode(prompt))
    return prompt.prompt_token_ids
