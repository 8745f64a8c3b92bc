"""What the runtime lends to stages (``Lent``): the policy being trained, the engine that samples
it, where to fan out pure work, the counters a stage charges, and the stores of other stages
that a stage reads.

Stages never build models or engines themselves. A stage that needs them defines
``setup(self, lent: Lent)``; the runtime calls it once, after building the stages and before the
first step. The protocols live here, in the stages layer, so that stages can be typed against
them while the implementations (``gfcr.engines``) sit one layer up (DESIGN.md section 5) and
never get imported by ``gfcr validate``.

What a stage is *not* lent: the other stages, the runtime's clean-up, the trainer ranks, the
weight movers and the runtime's own metrics: those belong to ``gfcr.runtime``'s
``RuntimeServices`` (DESIGN.md section 12, "Who owns what"). A stage reads another stage's store
only where that stage declares it owns one (``OwnsStore``: ``replay.store``) and through
``require_store``.

The Engine protocol and its records live in ``gfcr.stages.engine`` (per-request sampling
params, continuation from a response prefix, in-flight control, ``score``); they are
re-exported here, where stages have always imported them from.

Stages get the engine through ``require_engine``, which wraps it in a ``MeteredEngine``: the
response tokens a stage *scores* without generating them (a pilot's re-scoring, a draft
check) are counted in ``Lent.tokens_scored``, which the runner reports per step, so that
a comparison charges such methods for that compute.

``Lent.map`` is where a stage fans out pure per-item work (``filter.verify`` scores its
rollouts through it): in-process by default, batches of Ray tasks under the Ray executor
(``gfcr.runtime.ray``). The stage sees one function either way and never imports Ray.

``Lent.judges`` serves a judge model other than the policy (``filter.judge``): the runtime loads it
once, frozen, on a transformers engine of its own (``gfcr.engines.judges``).

``Lent.reward_models`` serves a discriminative reward model (``filter.reward_model``): the runtime
loads each local sequence-classifier folder once, frozen, on the CPU (``gfcr.engines.reward_models``).

``Lent.steps_optimizer`` is False in the driver where the update runs as trainer ranks
(``executor: {kind: ray}`` with ``resources.replicas`` on the update): the runtime builds the
update stage in every rank, and the driver's copy then only prepares batches and reports.
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
    lora: Any  # the LoRA adapter's spec (gfcr.spec.LoraSpec); None where every weight trains

    def adapter_state(self) -> dict[str, Any]:
        """The LoRA adapter's tensors by peft's saved names (empty without ``lora``)."""
        ...

    def load_adapter_state(self, state: dict[str, Any]) -> None:
        """Put an ``adapter_state`` back."""
        ...

    def encode(self, prompt: Prompt) -> list[int]:
        """The prompt's token ids, with the chat template applied when the tokenizer has one."""
        ...

    def reference(self) -> Any:
        """A frozen copy of the initial weights (for a KL term), loaded from the source."""
        ...


class Classifier(Protocol):
    """A frozen sequence classifier scoring (prompt, response) rows (``gfcr.engines.reward_models.RewardModel``):
    one ``RowScore`` (``logit``, ``tokens`` read, ``cut``) a row, None for the rows not started before
    ``deadline`` (``time.monotonic()``)."""

    def score(self, prompts: Sequence[str], responses: Sequence[str], *, format: str, max_length: int,
              batch_size: int, label: int = 1, deadline: float | None = None) -> list[Any]: ...


Map = Callable[[Callable[[Any], Any], Sequence[Any]], list[Any]]
"""``map(fn, items) -> [fn(item) for item in items]``, in order, wherever the runtime runs it."""


def in_process_map(fn: Callable[[Any], Any], items: Sequence[Any]) -> list[Any]:
    """The default ``Lent.map``: call ``fn`` on each item in this process, in order."""
    return [fn(item) for item in items]


@dataclass
class Lent:
    """What the runtime lends to stages; ``None`` where the pipeline has no policy.

    ``map`` runs a pure function over items and returns the results in order; the runtime
    may run it elsewhere (Ray tasks), so ``fn`` and the items must pickle (a module-level
    function or a ``functools.partial`` of one) and ``fn`` must not mutate its item: the
    stage writes the results back itself. ``stores`` are the stores that stages declaring
    ``OwnsStore`` own, by stage id, each a function returning it (read through ``require_store``).
    """

    policy: Policy | None = None
    engine: Engine | None = None
    map: Map = in_process_map
    tokens_scored: int = 0  # response tokens stages scored through ``require_engine``'s engine
    # rollouts and response tokens a stage generated itself, outside the plan's generate stages
    # (sGPO's profiling pass), charged with ``charge_generation``
    rollouts_charged: int = 0
    tokens_charged: int = 0
    stores: dict[str, Callable[[], Any]] = field(default_factory=dict)
    steps_optimizer: bool = True  # False in the driver where trainer ranks step the update
    # a judge model by alias or folder -> (its frozen policy, the engine serving it), loaded once each
    # (``filter.judge`` with a model other than the policy's); None where the runtime serves none
    judges: Callable[[str], tuple[Policy, Engine]] | None = None
    # a reward model folder -> the frozen sequence classifier scoring with it, loaded once each
    # (``filter.reward_model``); None where the runtime serves none
    reward_models: Callable[[str], "Classifier"] | None = None

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

    def require_judge(self, model: str, stage: str) -> tuple[Policy, Engine]:
        """The frozen judge ``model`` (an alias or folder) and the engine serving it."""
        if self.judges is None:
            raise ModelError(f"`{stage}` asks the model `{model}` to judge, and this runtime serves no judge model of "
                             "its own (the Ray executor does not)", f"set `model: policy` on `{stage}` (the policy's "
                             "own engine judges), or run with `executor: {kind: local}` or `prefect`")
        return self.judges(model)

    def require_reward_model(self, path: str, stage: str) -> "Classifier":
        """The frozen reward model in the folder ``path``."""
        if self.reward_models is None:
            raise ModelError(f"`{stage}` scores with the reward model `{path}`, and this runtime serves no reward "
                             "model", "run it with `gfcr run` (the local, Prefect or Ray executor lends one), or "
                             "lend `Lent(reward_models=RewardModels())` (gfcr.engines.reward_models) in a test")
        return self.reward_models(path)

    def require_store(self, stage_id: str, by: str) -> Callable[[], Any]:
        """The store stage ``stage_id`` owns (``OwnsStore``: ``replay.store``), as a function that
        returns it (the owner builds it in its own ``setup``), for a stage that reads it
        (``replay.rlep``); the compiler has checked the pairing (``check_pipeline``)."""
        if stage_id not in self.stores:
            raise ModelError(f"`{by}` reads the store of the stage `{stage_id}`, and the pipeline has no such "
                             "store", f"add a `replay.store` stage `{stage_id}` to the pipeline, or change the "
                             f"stage id `{by}` names")
        return self.stores[stage_id]


class MeteredEngine:
    """The engine as a stage sees it: every call passes through unchanged, and the response
    tokens of every ``score`` call are added to ``lent.tokens_scored``."""

    def __init__(self, engine: Engine, lent: Lent):
        self._engine, self._lent = engine, lent

    def score(self, requests: Sequence[ScoreRequest]) -> list[Scored]:
        self._lent.tokens_scored += sum(len(r.response_token_ids) for r in requests)
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
