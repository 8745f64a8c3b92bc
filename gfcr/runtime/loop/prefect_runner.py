"""The Prefect runner: the default way ``gfcr run`` runs a pipeline (DESIGN.md section 6).

A run is one Prefect flow run, of a flow named after the pipeline, whose flow run is named
after the run directory. Each stage execution (a stage's ``run`` in one step or loop round)
is one Prefect task run of a task named after the stage id; evaluation is a task named
``eval``. What runs, and in which order, is exactly the local runner's plan (this class only
changes how a stage call is made), so the two runners' ``metrics.jsonl`` agree.

Retries and timeouts are per stage (``retries``, ``retry_delay_s``, ``timeout_s`` on a stage's
spec). By default generate and filter stages are retried twice: they are idempotent, since
sampling is seeded by (run seed, step, round) and verification re-scores only unscored
rollouts. Control, replay and update stages change state when they run, so they are not
retried unless the spec asks. When the retries are spent, the run stops with a ``StageError``
naming the stage; ``gfcr resume`` continues from the last checkpoint.

Prefect talks to ``PREFECT_API_URL`` when it is set (probed first: a server that cannot be
reached fails in seconds with a clear error, ``check_prefect_api``), and otherwise starts its
embedded, ephemeral server (a SQLite database under ``PREFECT_HOME``) for the life of the process.
``configure_prefect`` sets what gfcr needs before Prefect is imported: no console logging (a
run's logs still reach the Prefect API and UI), no telemetry, a longer server start-up
timeout for small machines, and a guard that stops the embedded server when the process that
started it dies, even by SIGKILL (``gfcr.runtime.loop.server_guard``). Settings the user has already
made are left alone.

Stage code never imports Prefect: only this module and the CLI do.
"""

from __future__ import annotations

import functools
import logging
import os
from pathlib import Path
from typing import Any, Callable, Sequence, TypeVar

from gfcr.errors import StageError
from gfcr.graph import CompiledPipeline
from gfcr.records import PromptPool, StepContext
from gfcr.runtime.loop.events import HookChannel
from gfcr.runtime.loop.local import LocalRunner
from gfcr.runtime.loop.server_guard import guard_embedded_server, wait_for_restarts
from gfcr.runtime.services import RuntimeServices

T = TypeVar("T")

RETRIED_FAMILIES = ("generate", "filter")
DEFAULT_RETRIES = 2

# environment defaults for a quiet, self-contained Prefect; a value the user set wins
PREFECT_DEFAULTS = {
    "PREFECT_SERVER_ANALYTICS_ENABLED": "false",  # no telemetry from the embedded server
    # nor from the SDK: its first-run telemetry notice on a terminal, and its usage events
    # (Prefect reads this cross-tool variable on import; it has no PREFECT_ setting for them)
    "DO_NOT_TRACK": "1",
    "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "180",  # 2 busy cores start it slowly
    "PREFECT_RESULTS_PERSIST_BY_DEFAULT": "false",  # results live in the run directory
    "PREFECT_TASKS_REFRESH_CACHE": "false",
    # the embedded server's own log (e.g. events still in flight when it is stopped at exit)
    "PREFECT_SERVER_LOGGING_LEVEL": "CRITICAL",
}
DRAIN_SECONDS = 30.0  # at most this long, after a run, for the server to record its last task runs


@functools.cache
def configure_prefect() -> None:
    """Set gfcr's Prefect defaults, import Prefect, and turn its console output off (once).

    Prefect's log records still go to its API (the UI shows them); only the terminal stays
    quiet, as gfcr prints its own progress.
    """
    for key, value in PREFECT_DEFAULTS.items():
        os.environ.setdefault(key, value)
    from prefect.logging.configuration import setup_logging
    from prefect.settings import PREFECT_API_URL

    setup_logging()
    if not PREFECT_API_URL.value():  # the embedded server: it must not outlive a killed run
        guard_embedded_server()
    for name in ("prefect", "prefect.server", "docket", "uvicorn", "uvicorn.error", "uvicorn.access"):
        logger = logging.getLogger(name)
        for handler in list(logger.handlers):
            if isinstance(handler, logging.StreamHandler):  # the console; the API handler is not one
                logger.removeHandler(handler)
        logger.propagate = False
        if not logger.handlers:
            logger.addHandler(logging.NullHandler())


def check_prefect_api() -> None:
    """A GfcrError within seconds if ``PREFECT_API_URL`` names a server that cannot be reached
    (Prefect itself would retry for tens of seconds, then fail with a traceback); nothing for
    the embedded server. Called before a run directory is written."""
    from prefect.settings import PREFECT_API_URL

    from gfcr.runtime.preflight.endpoint import probe

    url = PREFECT_API_URL.value()
    if url:
        probe(url, "/health", "Prefect API", "start that server (`prefect server start`) or correct "
              "PREFECT_API_URL; unset it to use the embedded server, or run with `--executor local`")


def stage_retries(pipeline: CompiledPipeline, sid: str) -> int:
    """The spec's ``retries`` for a stage, else the default of its family."""
    node = pipeline.nodes[sid]
    if node.spec.retries is not None:
        return node.spec.retries
    return DEFAULT_RETRIES if node.info.family in RETRIED_FAMILIES else 0


class PrefectRunner(LocalRunner):
    """The local runner's plan, with every stage execution made a Prefect task run.

    Must run inside a flow (``run_in_flow``); outside one, Prefect runs each task on its own.
    """

    def __init__(self, pipeline: CompiledPipeline, *, pool: PromptPool | None = None,
                 stages: dict[str, Any] | None = None, run_id: str | None = None,
                 hooks: tuple[Any, ...] | HookChannel = (), services: RuntimeServices | None = None,
                 schedule: Any = None):
        configure_prefect()
        check_prefect_api()
        from prefect import task
        from prefect.cache_policies import NO_CACHE

        self._tasks = {}
        for sid, node in pipeline.nodes.items():
            if not node.runs:  # an in-flight controller runs inside its host's generation
                continue
            self._tasks[sid] = task(
                _named_call(sid), name=sid, task_run_name="{label}", cache_policy=NO_CACHE, persist_result=False,
                retries=stage_retries(pipeline, sid), retry_delay_seconds=node.spec.retry_delay_s,
                timeout_seconds=node.spec.timeout_s, log_prints=False)
        self._eval = task(_named_call("eval"), name="eval", task_run_name="{label}", cache_policy=NO_CACHE,
                          persist_result=False)
        self.task_runs = 0  # started so far: how many the server must record before the process may exit
        super().__init__(pipeline, pool=pool, stages=stages, run_id=run_id, hooks=hooks, services=services,
                         schedule=schedule)

    def _execute(self, sid: str, ctx: StepContext, run: Callable, kwargs: dict[str, Any]) -> Any:
        where = f"step {ctx.step}" + (f" round {ctx.round}" if ctx.round is not None else "")
        self.task_runs += 1
        try:
            return self._tasks[sid](lambda: run(**kwargs), label=f"{sid} {where}")
        except StageError:
            raise
        except Exception as exc:  # the retries are spent
            raise StageError(sid, ctx.step, ctx.run_id, exc, ctx.round) from exc

    def call_as(self, name: str, fn: Callable[[], T]) -> T:
        task = self._eval if name == "eval" else self._eval.with_options(name=name)
        self.task_runs += 1
        return task(fn, label=f"{name} step {self.step}")


def _lower_server_priority() -> None:
    """Give Prefect's embedded server (a child process of this one, when no PREFECT_API_URL is
    set) the lowest CPU priority: it idles at a few percent of a core, which on a small machine
    is taken from the training threads, and its requests are few and never urgent."""
    children = Path("/proc")
    if not children.is_dir():  # not Linux: leave it as it is
        return
    me = os.getpid()
    for stat in children.glob("[0-9]*/stat"):
        try:
            pid, ppid = int(stat.parent.name), int(stat.read_text().rsplit(")", 1)[1].split()[1])
            if ppid == me and b"prefect.server" in (stat.parent / "cmdline").read_bytes():
                os.setpriority(os.PRIO_PROCESS, pid, 19)
        except (OSError, ValueError, IndexError):  # gone meanwhile, or not ours to change
            continue


def _named_call(name: str) -> Callable[..., Any]:
    """A task function named ``name``: Prefect keys a task by its function's name, so each stage
    gets its own key (and its own row in the UI) although they all do the same thing."""

    def call(fn: Callable[[], Any], label: str) -> Any:
        return fn()

    call.__name__ = call.__qualname__ = name
    return call


def run_in_flow(flow_name: str, run_name: str, body: Callable[[], T],
                task_runs: Callable[[], int] = lambda: 0) -> T:
    """Call ``body`` as one flow run of a flow named ``flow_name`` (a subflow run inside a flow);
    ``task_runs()`` counts the task runs started so far, awaited on the server at the end."""
    configure_prefect()
    from prefect import flow
    from prefect.context import FlowRunContext
    from prefect.settings import PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS

    started: dict[str, Any] = {}

    def pipeline_run() -> T:
        _lower_server_priority()
        started["id"], started["before"] = FlowRunContext.get().flow_run.id, task_runs()
        try:
            return body()
        finally:  # an embedded server that died and is starting again: let it answer the flow's last state
            wait_for_restarts(PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS.value())

    try:
        return flow(pipeline_run, name=flow_name, flow_run_name=run_name, persist_result=False,
                    validate_parameters=False, log_prints=False)()
    finally:
        if "id" in started:
            _drain(started["id"], task_runs() - started["before"])


def _drain(flow_run_id: Any, expected: int) -> None:
    """Wait (bounded) until the server has recorded the final state of the flow run's task runs.
    Task run states reach the server as events, processed a moment later; the embedded server
    stops when this process exits, and whatever it had not recorded would be missing in the UI."""
    import time

    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import (
        TaskRunFilter, TaskRunFilterFlowRunId, TaskRunFilterState, TaskRunFilterStateType,
    )
    from prefect.client.schemas.objects import StateType

    final = [StateType.COMPLETED, StateType.FAILED, StateType.CRASHED, StateType.CANCELLED]
    recorded = TaskRunFilter(flow_run_id=TaskRunFilterFlowRunId(any_=[flow_run_id]),
                             state=TaskRunFilterState(type=TaskRunFilterStateType(any_=final), name=None))
    deadline = time.monotonic() + DRAIN_SECONDS
    try:
        with get_client(sync_client=True) as client:
            while time.monotonic() < deadline:
                done, page = 0, 200
                while page == 200:
                    page = len(client.read_task_runs(task_run_filter=recorded, limit=200, offset=done))
                    done += page
                if done >= expected:
                    return
                time.sleep(0.2)
    except Exception:  # the run is over and its results are on disk; the UI record is best effort
        return


def map_in_flow(flow_name: str, run_name: str, fn: Callable[[Any], T], items: Sequence[Any],
                labels: Sequence[str], parallel: int = 1) -> list[T]:
    """One flow run that calls ``fn`` on every item, each call a task run (``labels`` name them),
    ``parallel`` at a time in threads. A run started inside ``fn`` becomes a subflow run."""
    configure_prefect()
    from prefect import flow, task
    from prefect.cache_policies import NO_CACHE
    from prefect.task_runners import ThreadPoolTaskRunner

    cell = task(_named_call("cell"), name="cell", task_run_name="{label}", cache_policy=NO_CACHE,
                persist_result=False)

    def each() -> list[T]:
        futures = [cell.submit(lambda item=item: fn(item), label=label) for item, label in zip(items, labels)]
        return [f.result() for f in futures]

    return flow(each, name=flow_name, flow_run_name=run_name, persist_result=False, validate_parameters=False,
                log_prints=False, task_runner=ThreadPoolTaskRunner(max_workers=parallel))()
