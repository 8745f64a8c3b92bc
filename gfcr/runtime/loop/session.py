"""A training run: the policy, the engine, the runner, evaluation, and the run directory.

``Run.start`` makes a run directory and writes the resolved spec; ``Run.resume`` rebuilds a
run from its directory and its newest checkpoint (from step 0 when it was stopped before its
first checkpoint). ``train`` then runs the remaining steps:

    for each step:  evaluate (every ``eval.every`` steps, step 0 included)
                    run the step (the local runner)
                    append its metrics line and write its lineage
                    checkpoint (every ``run.checkpoint_every`` steps)
    at the end:     evaluate once more, checkpoint, write summary.json
"""

from __future__ import annotations

import contextlib
import contextvars
import json
import math
import os
import platform
import queue
import shutil
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np

from gfcr.engines.run_log import RUN_LOG, holds_output, open_run_log
from gfcr.errors import CheckpointError, EvalError, GfcrError, RunDirError
from gfcr.graph import CompiledPipeline, load_pipeline
from gfcr.records import StepReport
from gfcr.registry import STAGES, Registry
from gfcr.runtime.store.checkpoint import load_checkpoint, save_checkpoint
from gfcr.runtime.store.diskspace import disk_write, tree_bytes
from gfcr.runtime.store.manifest import intact_checkpoint, no_intact_checkpoint, strict_refusal
from gfcr.runtime.loop.evaluation import EvalResult, evaluate
from gfcr.runtime.store.lineage import write_control_lineage, write_lineage
from gfcr.runtime.loop.events import HookChannel
from gfcr.runtime.loop.local import LocalRunner
from gfcr.runtime.store.rundir import RunDir, check_new_run_dir, gfcr_version, new_run_dir, write_text
from gfcr.runtime.store.rundir_lock import LOCK_NAME, lock_run_dir, only_the_lock, release_run_dir
from gfcr.spec import PipelineSpec
from gfcr.runtime.services import RuntimeServices
from gfcr.runtime.weights import make_mover, mover_name
from gfcr.stages.resources import Lent


def build_services(spec: PipelineSpec, mover: str | None = None, log: Path | None = None) -> RuntimeServices:
    """Load the policy and start its engine (nothing when the pipeline has no policy), with the
    weight mover ``mover`` (default: ``mover_name(spec)``); ``log``: the run's log file, where the
    vLLM engine's output goes. In process, judge models other than the policy (``filter.judge``)
    are lent as ``Lent.judges``, each loaded on first use (``gfcr.engines.judges``); under every executor,
    reward models (``filter.reward_model``, which runs in the driver) as ``Lent.reward_models``."""
    from gfcr.engines.reward_models import RewardModels

    services = _services(spec, mover, log)
    services.lent.reward_models = RewardModels()
    if spec.executor.kind != "ray":
        from gfcr.engines.judges import JudgeModels

        services.lent.judges = JudgeModels()
    return services


def _services(spec: PipelineSpec, mover: str | None, log: Path | None) -> RuntimeServices:
    name = mover or mover_name(spec)
    if spec.executor.kind == "ray":  # engine replicas and verification on Ray (docs/ray.md)
        from gfcr.runtime.ray.executor import ray_services

        return ray_services(spec, name)
    if spec.policy is None:
        return RuntimeServices(mover=make_mover(name, None))
    from gfcr.engines import TransformersEngine, load_policy

    if spec.policy.engine == "vllm":  # the policy trains beside it; vLLM loads its weights after each update
        from gfcr.engines import VLLMEngine, require_vllm

        require_vllm(spec.policy.where())  # before the policy loads: a missing package fails in a second
        policy = load_policy(spec.policy)
        if spec.lifecycle.mode != "sync":  # vLLM, in a process of its own, serves a second copy, which the
            # schedule loads with the weights it picks and reloads vLLM from (gfcr.runtime.loop.lifecycle)
            engine = VLLMEngine(load_policy(spec.policy), spec.policy.vllm_settings(), seed=spec.run.seed, log=log,
                                own_process=True)
            return RuntimeServices(Lent(policy, engine), make_mover("none", engine), closers=[engine.close])
        engine = VLLMEngine(policy, spec.policy.vllm_settings(), seed=spec.run.seed, log=log,
                            adapters_kept=spec.lifecycle.staleness_bound() + 1)  # LoRA: versions a lifecycle may sample
        return RuntimeServices(Lent(policy, engine), make_mover(name, engine), closers=[engine.close])
    policy = load_policy(spec.policy)
    if spec.lifecycle.mode != "sync":  # generation samples a second copy, which the schedule keeps lagging
        engine = TransformersEngine(load_policy(spec.policy), score_path=spec.policy.score_path)
        return RuntimeServices(Lent(policy, engine), make_mover("none", engine))
    engine = TransformersEngine(policy, score_path=spec.policy.score_path)
    return RuntimeServices(Lent(policy, engine), make_mover(name, engine))


def build_schedule(spec: PipelineSpec, lent: Lent) -> Any:
    """The stale lifecycle's schedule over the trained policy and the engine's copy (neither in a
    pipeline without a policy: versions only); None under ``sync``."""
    if spec.lifecycle.mode == "sync":
        return None
    from gfcr.runtime.loop.lifecycle import AsyncSchedule, PipelinedSchedule

    kind = AsyncSchedule if spec.lifecycle.mode == "async" else PipelinedSchedule
    vllm = spec.policy is not None and spec.policy.engine == "vllm"
    ray = spec.executor.kind == "ray"
    if spec.lifecycle.in_flight and (ray or not vllm):  # `gfcr validate`/`run` refuse it first (preflight, placement)
        raise GfcrError("`lifecycle.in_flight: true` publishes new versions between the decode steps of a running "
                        "generate call, which only the vLLM engine does so far, on the local or Prefect executor",
                        "set `policy.engine: vllm` with `executor.kind: prefect` (or `local`), or remove `in_flight`")
    if lent.policy is None or lent.engine is None:
        return kind(spec.lifecycle.staleness_bound())
    # vLLM and the Ray engine replicas (of either engine) hold copies of their own: the schedule
    # reloads them from its own, vLLM by its reload, the replicas by the group's weight sync
    reloads = vllm or (spec.policy is not None and ray)
    engine = lent.engine if reloads else None
    if spec.lifecycle.in_flight:  # newer versions reach vLLM between its decode steps
        return AsyncSchedule(spec.lifecycle.staleness_bound(), lent.policy, lent.engine.policy, engine, in_flight=True)
    return kind(spec.lifecycle.staleness_bound(), lent.policy, lent.engine.policy, engine=engine)


class Run:
    """One pipeline run bound to its directory."""

    def __init__(self, pipeline: CompiledPipeline, run_dir: RunDir, hooks: tuple[Any, ...] = ()):
        self.pipeline, self.dir = pipeline, run_dir
        self.channel = HookChannel(hooks)  # one channel: the runner's events and the run's
        self.spec = pipeline.spec
        self.pool = pipeline.data.load()
        self.eval_pool = pipeline.eval.load() if pipeline.eval is not None else None
        self.services = build_services(self.spec, log=run_dir.path / RUN_LOG)
        runner_cls = LocalRunner
        if self.spec.executor.kind != "local":
            from gfcr.runtime.loop.prefect_runner import PrefectRunner as runner_cls  # type: ignore[assignment]
        self.runner = runner_cls(pipeline, pool=self.pool, run_id=run_dir.path.name, services=self.services,
                                 hooks=self.channel,
                                 schedule=build_schedule(self.spec, self.services.lent))
        self.last_checkpoint: Path | None = None
        self.skipped_checkpoints: list[CheckpointError] = []
        self.restarted = False  # resumed from step 0: killed before its first checkpoint
        self.made_dir = False  # `start` made the run directory: a failure before step 1 removes it

    @classmethod
    def start(cls, pipeline: CompiledPipeline, run_dir: Path | None = None, hooks: tuple[Any, ...] = ()) -> "Run":
        made_here = run_dir is None or not Path(run_dir).exists()
        path = Path(run_dir) if run_dir is not None else new_run_dir(pipeline.spec.name)
        lock_run_dir(path)  # one process at a time (a second is refused, naming this one)
        check_new_run_dir(path)
        try:
            run = cls(pipeline, RunDir(path), hooks)  # data and policy load before anything is written
        except BaseException:
            release_run_dir(path)
            if made_here and only_the_lock(path):  # nothing was written: leave no empty run directory behind
                shutil.rmtree(path, ignore_errors=True)
            raise
        run.made_dir = made_here
        open_run_log(path / RUN_LOG)  # every run has one (the terminal shows it in the summary)
        write_text(run.dir.spec, pipeline.spec.to_yaml())
        write_text(run.dir.info, json.dumps({
            "run_id": path.name, "pipeline": pipeline.spec.name, "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "command": sys.argv, "python": platform.python_version(), "gfcr": gfcr_version(),
        }, indent=2) + "\n")
        return run

    @classmethod
    def resume(cls, path: Path, steps: int | None = None, hooks: tuple[Any, ...] = (),
               stages: Registry[type] = STAGES, executor: str | None = None, strict: bool = False) -> "Run":
        """Rebuild the run in ``path`` from its spec (compiled against ``stages``) and newest checkpoint,
        to run until ``steps`` (default: its ``run.steps``), on ``executor`` (default: its own).

        A run killed before its first checkpoint starts again from step 0 (``restarted``); a run
        whose checkpoints are all damaged, or only format-1 pickles, is refused. A damaged newest
        checkpoint (any file's size or sha256 off) is set aside as ``checkpoints/damaged-step-N``
        and the run continues from the newest intact one, its metrics and lineage cut back to that
        step; with ``strict`` it is refused instead. Nothing in ``path``
        changes (``spec.yaml``, ``metrics.jsonl``) until the run is built and its checkpoint loaded."""
        rd = RunDir(path)
        if not rd.spec.is_file():
            state = "does not exist" if not Path(path).exists() else "is not a gfcr run directory (no spec.yaml)"
            raise RunDirError(f"{path} {state}",
                              "pass the folder `gfcr run` printed, e.g. runs/quickstart-20261130-101500")
        lock_run_dir(path)  # before anything is read for writing: a second resume is refused
        overrides = [f"run.steps={steps}"] if steps is not None else []
        overrides += [f"executor.kind={executor}"] if executor is not None else []
        pipeline = load_pipeline(rd.spec, overrides, stages)
        checkpoint, damaged = intact_checkpoint(rd)  # damaged newer ones are passed over (or, strict, refused)
        if strict and damaged:
            raise strict_refusal(damaged)
        if checkpoint is None and (damaged or rd.legacy_checkpoints()):
            raise _no_checkpoint(rd, damaged)  # before the policy loads: it fails in a second
        run = cls(pipeline, rd, hooks)
        if checkpoint is not None:
            load_checkpoint(checkpoint, run.runner, run.services.lent)
            run.last_checkpoint = checkpoint
        # else: killed before its first checkpoint; a new Run is the state of step 0, and its seeded
        # run replays exactly the steps the killed one had recorded
        run.restarted = checkpoint is None
        # the resumed run is known to start: only now does anything in its directory change
        if overrides:
            write_text(rd.spec, pipeline.spec.to_yaml())
        rd.truncate_metrics(run.runner.step)
        rd.truncate_lineage(run.runner.step)  # the steps after the checkpoint run again and write theirs anew
        run.skipped_checkpoints = [_set_aside(path, problem) for path, problem in damaged]  # the CLI warns
        return run

    # --- the loop --------------------------------------------------------------------------

    def train(self, new_flow_run: bool = True) -> dict[str, Any]:
        """Run to ``run.steps``: in-process (``executor.kind: local``), else as one Prefect flow run
        (a subflow run when called inside a flow; ``new_flow_run=False`` runs in the current one)."""
        try:
            if self.spec.executor.kind == "local" or not new_flow_run:
                return self._train()
            from gfcr.runtime.loop.prefect_runner import run_in_flow

            return run_in_flow(self.spec.name, self.dir.path.name, self._train,
                               lambda: getattr(self.runner, "task_runs", 0))
        except Exception:
            self._remove_if_unwritten()
            raise

    def _remove_if_unwritten(self) -> None:
        """A new run that failed before its first step leaves no run directory behind: nothing
        in it but what ``start`` wrote (the spec, run.json, the lock, the run log's header) is
        worth resuming; a run log a library wrote to is kept, and the error names it."""
        path = self.dir.path
        left = {p.name for p in path.iterdir() if not (p.name == RUN_LOG and not holds_output(p))}
        left -= {self.dir.spec.name, self.dir.info.name, LOCK_NAME}  # nor a run.log with its header alone
        if self.made_dir and self.runner.step == 0 and not left:
            release_run_dir(path)
            shutil.rmtree(path, ignore_errors=True)

    def _train(self) -> dict[str, Any]:
        start = self._line_written = time.perf_counter()
        self.channel.emit("before_run", self.runner.step, run=self)
        spent = self._spent()
        if self.runner.schedule is not None:
            with one_torch_thread():  # the same float sums overlapped or not (PipelinedSchedule's docstring)
                if self.spec.lifecycle.overlaps():
                    self._train_overlapped(spent)
                else:
                    while self.runner.step < self.spec.run.steps and not self._budget_spent(spent):
                        self._step(self.runner.run_step, spent)
        else:
            while self.runner.step < self.spec.run.steps and not self._budget_spent(spent):
                self._step(self.runner.run_step, spent)
        final = self._evaluate(self.runner.step) if self.eval_pool is not None else None
        if self.last_checkpoint is None or self.last_checkpoint != self.dir.checkpoint(self.runner.step):
            self._checkpoint()
        summary = self._summary(final, time.perf_counter() - start)
        text = json.dumps(summary, indent=2) + "\n"
        with disk_write("run summary", self.dir.summary, lambda: len(text.encode())):
            write_text(self.dir.summary, text)
        self.channel.emit("after_run", self.runner.step, summary=summary)
        self.services.close()  # engine actors, a Ray cluster gfcr started
        release_run_dir(self.dir.path)  # finished: `gfcr resume --steps N` may go on from here
        return summary

    def _step(self, run_step: Callable[[], StepReport], spent: dict[str, int], since: float | None = None,
              waits: dict[str, float] | None = None) -> None:
        """One step as the run records it: evaluation when due, ``run_step``, its metrics line and
        lineage, and a checkpoint when due. ``since``: when the step's wall time starts (an
        overlapped run: the previous step's end); ``waits``: seconds each side waited, for ``time``."""
        step = self.runner.step
        result = self._evaluate(step) if self._eval_due(step) else None
        t0 = time.perf_counter() if since is None else since
        report = run_step()
        evaluated = result.seconds if result is not None and since is not None else 0.0  # eval_s has it
        now = time.perf_counter()
        record = step_record(report, result, now - t0 - evaluated)
        record["time"]["wall_s"] = now - self._line_written  # since the last line: what a step costs the run
        self._line_written = now
        if self.runner.schedule is not None:  # how stale the batch was (sync runs keep their keys)
            record["staleness"] = staleness_counts(report)
            record["time"].update(waits or {})
        record.update({key: take() for key, take in self.services.runtime_metrics.items()})
        self._record(step, record, report)
        spent["rollouts"] += record["rollouts_generated"]
        spent["tokens"] += record["tokens_generated"]
        self.channel.emit("step_recorded", step, record=record, report=report)
        every = self.spec.run.checkpoint_every
        if every is not None and self.runner.step % every == 0:
            self._checkpoint()

    def _train_overlapped(self, spent: dict[str, int]) -> None:
        """The pipelined schedule with generation overlapping the update: a producer thread runs
        each step's stages (``produce_step``) as soon as the weights of ``lag`` steps before are
        recorded, while this thread trains the produced steps in order (``train_step``). The
        producer stops at the run's steps or budget, as the sequential run would, and waits
        before a step the trainer is to checkpoint before, so every checkpoint is the state the
        sequential run would have (``gfcr.runtime.loop.lifecycle``)."""
        runner, schedule = self.runner, self.runner.schedule
        gate = StepGate(self.spec.run.checkpoint_every, runner.step)
        produced: queue.Queue = queue.Queue()
        schedule.record_start(runner.step, runner.policy_version)

        def produce() -> None:
            budget = dict(spent)
            try:
                for step in range(runner.step, self.spec.run.steps):
                    waited = time.perf_counter()
                    gate.wait(step)
                    waited = time.perf_counter() - waited
                    item = runner.produce_step(step)
                    item.waited_s = waited + schedule.waited_s  # for a checkpoint, then for weights
                    produced.put(item)
                    budget["rollouts"] += item.report.rollouts_generated
                    budget["tokens"] += item.report.tokens_generated
                    if self._budget_spent(budget):
                        break
            except BaseException as exc:  # noqa: BLE001  (handed to the trainer, which raises it)
                produced.put(exc)
            produced.put(None)

        producer = threading.Thread(target=contextvars.copy_context().run, args=(produce,),
                                    name="gfcr-producer", daemon=True)
        producer.start()
        try:
            since = time.perf_counter()
            while (item := produced.get()) is not None:
                if isinstance(item, BaseException):
                    raise item
                waits = {"trainer_wait_s": time.perf_counter() - since, "producer_wait_s": item.waited_s}
                if schedule.engine is not None:  # vLLM: the producer's reload of the weights it samples with
                    waits["weight_move_s"] = item.moved_s
                self._step(lambda: runner.train_step(item), spent, since, waits)
                since = time.perf_counter()
                gate.checkpointed(runner.step if self.last_checkpoint == self.dir.checkpoint(runner.step) else None)
        finally:
            schedule.stop()
            gate.stop()
            producer.join()

    def _record(self, step: int, record: dict[str, Any], report: StepReport) -> None:
        """Write a step's metrics line and lineage files; on a full disk, a ``DiskFullError``
        with the file before it as it was (a metrics line whole or not at all, lineage renamed in)."""
        line = len(json.dumps(record, sort_keys=True)) + 1
        with disk_write(f"metrics of step {step}", self.dir.metrics, lambda: line):
            self.dir.append_metrics(record)
        writers = ((self.dir.lineage(step), write_lineage), (self.dir.control_lineage(step), write_control_lineage))
        for path, write in writers:
            previous = path.with_name(path.name.replace(f"{step:06d}", f"{max(step - 1, 0):06d}"))
            with disk_write(f"lineage of step {step}", path, lambda: tree_bytes(previous) or None):
                write(path, report)

    def _spent(self) -> dict[str, int]:
        """Rollouts and tokens generated so far (by the steps before a resume, too)."""
        records = self.dir.read_metrics() if self.runner.step else []
        return {"rollouts": sum(r["rollouts_generated"] for r in records),
                "tokens": sum(r["tokens_generated"] for r in records)}

    def _budget_spent(self, spent: dict[str, int]) -> bool:
        """Whether ``run.max_rollouts`` or ``run.max_tokens`` is reached: the step that crosses
        a budget completes, so a run overshoots it by less than one step's generation."""
        run = self.spec.run
        return ((run.max_rollouts is not None and spent["rollouts"] >= run.max_rollouts)
                or (run.max_tokens is not None and spent["tokens"] >= run.max_tokens))

    def _eval_due(self, step: int) -> bool:
        return self.eval_pool is not None and self.spec.eval is not None and step % self.spec.eval.every == 0

    def _evaluate(self, step: int) -> EvalResult:
        assert self.eval_pool is not None and self.spec.eval is not None
        policy, engine = self.services.lent.policy, self.services.lent.engine
        if self.runner.schedule is not None and policy is not None:  # the trained policy, not the lagging copy
            from gfcr.engines import TransformersEngine

            engine = TransformersEngine(policy, score_path=self.spec.policy.score_path if self.spec.policy else "forward")
        if policy is None or engine is None:
            raise EvalError("`eval` needs a policy to evaluate", "add `policy: {model: ...}` or remove `eval`")
        self.channel.emit("before_eval", step)
        spec, pool = self.spec.eval, self.eval_pool
        result = self.runner.call_as("eval", lambda: evaluate(policy, engine, pool, spec.max_new_tokens,
                                                               spec.batch_size))
        self.channel.emit("after_eval", step, result=result)
        return result

    def _checkpoint(self) -> None:
        self.last_checkpoint = save_checkpoint(self.dir, self.runner, self.services.lent,
                                               self.spec.run.keep_checkpoints)

    @property
    def hooks(self) -> tuple[Any, ...]:
        """The hooks of the run's channel, which its runner emits on too (``gfcr.runtime.loop.events``)."""
        return self.channel.hooks

    @hooks.setter
    def hooks(self, hooks: tuple[Any, ...]) -> None:
        self.channel.hooks = tuple(hooks)

    def _summary(self, final: EvalResult | None, seconds: float) -> dict[str, Any]:
        records = self.dir.read_metrics()
        evals = [(r["step"], r["eval_accuracy"]) for r in records if "eval_accuracy" in r]
        return {
            "run_dir": str(self.dir.path), "pipeline": self.spec.name, "steps": self.runner.step,
            "policy_version": self.runner.policy_version,
            "eval_accuracy_before": evals[0][1] if evals and evals[0][0] == 0 else None,
            "eval_accuracy_after": None if final is None else final.accuracy,
            "rollouts_generated": sum(r["rollouts_generated"] for r in records),
            "tokens_generated": sum(r["tokens_generated"] for r in records),
            "rollouts_in_update": sum(r["rollouts_in_update"] for r in records),
            "tokens_in_update": sum(r["tokens_in_update"] for r in records),
            "seconds_this_session": round(seconds, 3),
            "metrics": str(self.dir.metrics), "lineage": str(self.dir.lineage_dir),
            "log": str(open_run_log(self.dir.path / RUN_LOG)),
            "checkpoint": None if self.last_checkpoint is None else str(self.last_checkpoint),
        }


@contextlib.contextmanager
def one_torch_thread() -> Iterator[None]:
    """torch's intra-op threads set to 1 for a while. A matrix product sums in an order that
    depends on how many threads it gets, and two threads of one process (the producer and the
    trainer of an overlapped run) get a varying share of torch's pool; with one each, every sum
    is the sequential run's, bit for bit."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


class StepGate:
    """Keeps the producer of an overlapped run from starting a step the trainer is to checkpoint
    before (every ``every`` steps) until that checkpoint is written."""

    def __init__(self, every: int | None, step: int):
        self.every, self._open = every, threading.Condition()
        self.allowed = math.inf if every is None else (step // every + 1) * every  # steps below may start
        self.stopped = False

    def wait(self, step: int) -> None:
        with self._open:
            self._open.wait_for(lambda: step < self.allowed or self.stopped)
            if self.stopped:
                raise RuntimeError("the run stopped while generation waited for a checkpoint")

    def checkpointed(self, step: int | None) -> None:
        """The trainer wrote the checkpoint of ``step`` (None: none this step)."""
        if step is None or self.every is None:
            return
        with self._open:
            self.allowed = max(self.allowed, step + self.every)
            self._open.notify_all()

    def stop(self) -> None:
        with self._open:
            self.stopped = True
            self._open.notify_all()


def step_record(report: StepReport, result: EvalResult | None, seconds: float) -> dict[str, Any]:
    """The ``metrics.jsonl`` line of one step. Everything that depends on the clock is under
    ``time``; the rest is a deterministic function of the seed."""
    # finished by sampling this step: not reused, not unfinished (half a response), not carried whole
    rollouts = [r for g in report.groups for r in g.generated if not (r.reused or r.unfinished or r.carried)]
    rewards = [r.reward for r in rollouts if r.reward is not None]
    update = report.update
    record: dict[str, Any] = {
        "step": report.step,
        "policy_version": report.policy_version,
        "prompts": report.prompts_sampled,
        "groups": len(report.groups),
        "groups_kept": report.groups_kept,
        "zero_variance_groups": report.zero_variance_groups,
        "rollouts_generated": report.rollouts_generated,
        "tokens_generated": report.tokens_generated,
        "rollouts_in_update": update.rollouts_in_update if update else 0,
        "tokens_in_update": update.tokens_in_update if update else 0,
        "tokens_with_signal": report.tokens_with_signal,
        "tokens_scored": report.tokens_scored,
        "reward_mean": sum(rewards) / len(rewards) if rewards else None,
        "correct_fraction": sum(bool(r.correct) for r in rollouts) / len(rollouts) if rollouts else None,
        "loop_rounds": report.loop_rounds,
        "update_skipped": bool(update.skipped) if update else True,
        "skip_reason": update.skip_reason if update else "no update",
        "loss": update.loss if update else None,
        "update": dict(update.metrics) if update else {},
        "control": report.controller_state,
        "time": {"step_s": seconds, "stages_s": report.stage_seconds,
                 "rollouts_per_s": report.rollouts_generated / seconds if seconds > 0 else None,
                 "sync_s": update.sync_s if update else 0.0,  # the sync's cost: seconds and bytes
                 "sync_bytes": update.sync_bytes if update else 0},
    }
    if report.metrics:  # the ReportsMetrics stages' numbers, by stage id
        record["stages"] = {sid: dict(values) for sid, values in report.metrics.items()}
    if result is not None:
        record["eval_accuracy"] = result.accuracy
        record["eval_n"] = result.n
        record["time"]["eval_s"] = result.seconds
    return _finite(record)


def staleness_counts(report: StepReport) -> dict[str, int]:
    """Tokens of the step's update batch by staleness (versions between the token's sampling and
    the update that trained on it), as ``{"0": n0, "2": n2, ...}``."""
    counts: dict[int, int] = {}
    for group in report.groups:
        if group.group_id not in report.update_group_ids or not group.verdict.included:
            continue
        for rollout in group.rollouts:
            for age, n in zip(*np.unique(rollout.staleness(report.trained_version), return_counts=True)):
                counts[int(age)] = counts.get(int(age), 0) + int(n)
    return {str(age): counts[age] for age in sorted(counts)}


def _finite(value: Any) -> Any:
    """JSON has no NaN or infinity: such values become null (the skip reason says why)."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


def _set_aside(path: Path, problem: CheckpointError) -> CheckpointError:
    """Rename the damaged checkpoint ``path`` to ``damaged-step-N`` beside it (kept to inspect,
    never loaded or pruned); ``problem``, saying where it went."""
    aside = path.with_name(f"damaged-{path.name}")
    shutil.rmtree(aside, ignore_errors=True)  # an older damaged copy of the same step
    os.replace(path, aside)
    return CheckpointError(f"{problem.message} (moved to {aside}; delete it once looked at)", problem.fix)


def _no_checkpoint(rd: RunDir, damaged: list[tuple[Path, CheckpointError]]) -> CheckpointError:
    """Why ``rd`` cannot resume: every checkpoint it has is damaged, or it holds only format-1 pickles."""
    if damaged:
        return no_intact_checkpoint(rd, damaged)
    legacy = rd.legacy_checkpoints()
    return CheckpointError(
        f"{legacy[0][1]} is not a gfcr checkpoint this gfcr loads: it is a pickle (a format-1 checkpoint of "
        "gfcr before v2, or a file from elsewhere), and loading a pickle can run any code; this gfcr reads "
        "only checkpoint directories of JSON and safetensors",
        "if you trust where it came from, resume it with the gfcr that wrote it; else start the run again "
        "with `gfcr run` in a new run directory")
