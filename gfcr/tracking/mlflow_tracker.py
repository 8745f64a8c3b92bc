"""``MlflowTracker``: a run hook that mirrors one gfcr run into one MLflow run (DESIGN.md section 7).

What the MLflow run holds:

- params: the resolved spec, flattened (``gfcr.tracking.mlflow_values``);
- metrics: every numeric key of each ``metrics.jsonl`` line at MLflow ``step`` = the gfcr step
  (``reward_mean``, ``update.grad_norm``, ``time.step_s``, ...); after the last step, the final
  evaluation as ``eval_accuracy`` and ``eval_accuracy_after`` at ``step = run.steps``, and the
  run's totals as ``total.rollouts_generated``, ``total.tokens_in_update``, ...;
- artifacts: ``spec.yaml`` (resolved), the pipeline drawing (``graph.svg``, or ``graph.dot``
  without Graphviz's ``dot``), ``lineage/step-NNNNNN.parquet`` and ``lineage/control-NNNNNN.parquet``
  (the Control stages' per-prompt decisions) for every step, and at the end
  ``summary.json`` and ``metrics.jsonl``;
- inputs: the training and eval prompts as datasets, contexts ``training`` and ``eval``;
- tags: ``gfcr.pipeline``, ``gfcr.stage.<id>`` = alias, ``gfcr.version``, ``gfcr.run_dir``,
  ``gfcr.seed``, ``mlflow.source.git.commit`` when the working directory is a git checkout,
  ``mlflow.parentRunId`` for an ablation cell, plus any tags the caller passes.

Resume: the MLflow run id and store are kept in ``tracking.json`` in the run directory, and
``gfcr resume`` continues that same MLflow run, so a run directory has exactly one MLflow run
however often it is killed and resumed (one killed after creating its MLflow run but before
writing ``tracking.json`` is found again by its ``gfcr.run_dir`` tag and start time). A run
killed by SIGKILL cannot mark its MLflow run: it stays RUNNING until ``gfcr resume`` continues
it, and is FINISHED when the run is; a run stopped by an error or Ctrl-C is marked FAILED.
MLflow keeps a metric's whole history, so the steps a resumed run re-runs (those after its
checkpoint) appear twice at the same step:
**readers take the last value logged at each step** (``gfcr.tracking.report_series`` does).
Params cannot change in MLflow; a param a resume changes (``run.steps``) is recorded as the tag
``gfcr.resumed.<key>`` = ``old -> new``.

Cost per step: metrics and lineage files are buffered and written in one batch every
``flush_seconds`` (and at the end), so a 0.3 s step does not wait on the store. A run killed
between flushes loses nothing: a resumed run first logs the steps of ``metrics.jsonl`` that
MLflow lacks.

A store that goes away during a run (a tracking server stopped or killed) does not stop the run:
the first write that fails says so once (``notify``), and from then on every write (metrics,
lineage files, totals, the final status) is appended to the run directory's outbox
(``gfcr.tracking.outbox``), in order. At most every ``retry_seconds`` the store is probed (a
bounded connection, ``gfcr.runtime.preflight.endpoint.probe``) and, once it answers, the outbox is sent
and the run goes on sending directly. What is still pending when the run ends is sent by
``gfcr sync RUN_DIR`` or by the next ``gfcr resume``; nothing is lost. The store must be
reachable when a run starts or resumes (a wrong address is a mistake to fix, not a fault).

    tracker = MlflowTracker(spec.tracking.mlflow, parent_run_id=parent, tags={"gfcr.variant": "median"})
    Run.start(pipeline, run_dir, hooks=(tracker,)).train()     # or: hooks = start_tracking(run)
"""

from __future__ import annotations

import json
import re
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Callable

from gfcr.errors import GfcrError
from gfcr.runtime.preflight.endpoint import probe
from gfcr.runtime.store.rundir import write_text
from gfcr.spec.models import MlflowSpec
from gfcr.tracking.mlflow_inputs import dataset_input, run_tags
from gfcr.tracking.mlflow_store import connect, experiment_id, quiet, resolve_uri
from gfcr.tracking.mlflow_values import (
    MAX_TAG_VALUE, METRICS_PER_BATCH, PARAMS_PER_BATCH, batches, fit_value, metric_values, spec_params,
)
from gfcr.tracking.outbox import Outbox, artifact_op, send_entry

TRACKING_FILE = "tracking.json"
SENTINEL = "rollouts_generated"  # a metric every step logs: its history says which steps MLflow has
TOTALS = ("rollouts_generated", "tokens_generated", "rollouts_in_update", "tokens_in_update")
RETRY_SECONDS = 15.0  # while the store is away, at most one probe this often

_DATASETS = threading.Lock()


class MlflowTracker:
    """A run hook: one MLflow run per gfcr run, continued by ``gfcr resume``.

    ``settings`` is the spec's ``tracking.mlflow`` (default: the store of ``resolve_uri``).
    ``parent_run_id`` makes this run a child of that MLflow run (an ablation cell), in the
    parent's experiment; ``tags`` are added to the run (``gfcr.variant``). ``notify`` hears, in a
    sentence, when the store goes away and when it is back (default: printed to stderr).
    """

    def __init__(self, settings: MlflowSpec | None = None, *, parent_run_id: str | None = None,
                 tags: dict[str, str] | None = None, flush_seconds: float = 5.0,
                 retry_seconds: float = RETRY_SECONDS, notify: Callable[[str], None] | None = None):
        self.settings = settings or MlflowSpec()
        self.parent_run_id, self.extra_tags, self.flush_seconds = parent_run_id, dict(tags or {}), flush_seconds
        self.retry_seconds, self.notify = retry_seconds, notify or _to_stderr
        self.outbox: Outbox | None = None
        self.away: str | None = None  # why the store cannot be reached, while it cannot
        self._retry_at = 0.0
        self.client: Any = None
        self.uri: str | None = None
        self.run_id: str | None = None
        self.experiment_id: str | None = None
        self.run: Any = None
        self._metrics: list[Any] = []
        self._lineage: list[Path] = []
        self._last_flush = 0.0
        self._finished = False

    # --- hooks of gfcr.runtime.loop.session.Run ---------------------------------------------------

    def before_run(self, event: Any) -> None:  # a gfcr.runtime.loop.events.RunEvent
        self.start(event.run)

    def step_recorded(self, event: Any) -> None:
        self._buffer(event.record)
        if time.monotonic() - self._last_flush >= self.flush_seconds:
            self.flush()

    def after_run(self, event: Any) -> None:
        from mlflow.entities import Metric

        summary = event.summary
        self.flush()
        step, now = int(summary["steps"]), _now_ms()
        final = summary.get("eval_accuracy_after")
        metrics = [Metric(f"total.{k}", float(summary[k]), now, step) for k in TOTALS if summary.get(k) is not None]
        if final is not None:
            metrics += [Metric("eval_accuracy", float(final), now, step),
                        Metric("eval_accuracy_after", float(final), now, step)]
        files = (self.run.dir.summary, self.run.dir.metrics, self.run.dir.spec)
        self._send([_metrics_op(metrics)] * bool(metrics) + [artifact_op(self.run.dir.path, path) for path in files]
                   + [{"op": "terminate", "status": "FINISHED"}])
        self._retry(force=True)  # the last chance in this process: what still waits is for `gfcr sync`
        self._finished = True

    def close(self) -> None:
        """Mark the MLflow run FAILED when the gfcr run stopped before ``after_run`` (an error, an
        interrupt), after logging what was buffered. Never raises: it runs while another error
        is on its way out."""
        if self.run_id is None or self._finished:
            return
        try:
            self.flush()
            self._send([{"op": "terminate", "status": "FAILED"}])
        except Exception:  # the disk may be the thing that failed; the first error is the one to show
            pass
        self._finished = True

    # --- starting -------------------------------------------------------------------------------

    def start(self, run: Any) -> None:
        """Open the MLflow run for ``run``: a new one, or the one ``tracking.json`` names (resume).
        Idempotent, so a caller may start it early (before the progress bar) and still pass the
        tracker as a hook."""
        if self.run is run:
            return
        self.run = run
        self.outbox = Outbox(run.dir.path)
        saved = _read_tracking_file(run.dir.path)
        if saved is None:
            self._create(run)
        else:
            self._reopen(run, saved)
        self._log_definition(run)
        self._backfill(run)
        self._last_flush = time.monotonic()

    def _create(self, run: Any) -> None:
        self.uri = resolve_uri(self.settings)
        self.client = connect(self.uri)
        tags = {**run_tags(run), **{k: fit_value(str(v), MAX_TAG_VALUE) for k, v in self.extra_tags.items()}}
        with quiet():
            if self.parent_run_id is not None:
                self.experiment_id = self._parent_experiment()
                tags["mlflow.parentRunId"] = self.parent_run_id
            else:
                self.experiment_id = experiment_id(self.client, self.uri, self.settings.experiment or run.spec.name)
            orphan = self._orphan(run)
            if orphan is None:
                self.run_id = self.client.create_run(self.experiment_id, run_name=run.dir.path.name,
                                                     tags=tags).info.run_id
        if orphan is not None:  # created by an attempt killed before it wrote tracking.json: continue it
            self._write_tracking_file(run, orphan)
            self._reopen(run, {"tracking_uri": self.uri, "mlflow_run_id": orphan})
            with quiet():
                has_inputs = bool(self.client.get_run(orphan).inputs.dataset_inputs)
            if not has_inputs:
                self._log_inputs(run)
            return
        self._write_tracking_file(run, self.run_id)
        self._log_params(spec_params(run.pipeline))
        self._log_inputs(run)

    def _log_inputs(self, run: Any) -> None:
        with quiet():
            inputs = [dataset_input(run.pool, run.pipeline.data, "training")]
            if run.eval_pool is not None and run.pipeline.eval is not None:
                inputs.append(dataset_input(run.eval_pool, run.pipeline.eval, "eval"))
            with _DATASETS:  # MLflow inserts a new dataset without a lock: parallel cells would collide
                self.client.log_inputs(self.run_id, datasets=inputs)

    def _write_tracking_file(self, run: Any, run_id: str) -> None:
        write_text(run.dir.path / TRACKING_FILE, json.dumps(
            {"mlflow_run_id": run_id, "tracking_uri": self.uri, "experiment_id": self.experiment_id},
            indent=2) + "\n")

    def _orphan(self, run: Any) -> str | None:
        """The MLflow run of this run directory that a process killed between creating it and
        writing ``tracking.json`` left behind: RUNNING, tagged with this directory and started after
        its ``run.json`` (so not a run of an older directory of the same path). None if there is none."""
        started = _started_ms(run.dir.info)
        path = str(run.dir.path.resolve())
        if started is None or "'" in path:
            return None
        found = self.client.search_runs(
            [self.experiment_id], f"tags.`gfcr.run_dir` = '{path}' and attributes.start_time >= {started} "
            "and attributes.status = 'RUNNING'",
            order_by=["attributes.start_time DESC"], max_results=1)
        return found[0].info.run_id if found else None

    def _parent_experiment(self) -> str:
        try:
            return self.client.get_run(self.parent_run_id).info.experiment_id
        except Exception as exc:
            raise GfcrError(f"parent MLflow run {self.parent_run_id} is not in {self.uri}: {exc}\n"
                            "    fix: create the parent run in the same store (gfcr.tracking.mlflow_store."
                            "create_parent_run)") from exc

    def _reopen(self, run: Any, saved: dict[str, str]) -> None:
        self.uri, self.run_id = saved["tracking_uri"], saved["mlflow_run_id"]
        self.client = connect(self.uri)
        with quiet():
            try:
                existing = self.client.get_run(self.run_id)
            except Exception as exc:
                raise GfcrError(
                    f"{run.dir.path / TRACKING_FILE} names MLflow run {self.run_id} in {self.uri}, which cannot be "
                    f"read: {exc}\n    fix: make that store reachable again, or delete {TRACKING_FILE} to track "
                    "the rest of this run as a new MLflow run") from exc
            self.experiment_id = existing.info.experiment_id
        self._retry(force=True)  # what an earlier session could not send goes first (its end status too)
        with quiet():
            self.client.update_run(self.run_id, status="RUNNING")
            resumes = int(existing.data.tags.get("gfcr.resumes", "0")) + 1
            self.client.set_tag(self.run_id, "gfcr.resumes", str(resumes))
        self._log_params(spec_params(run.pipeline), existing.data.params)

    def _log_params(self, params: dict[str, str], existing: dict[str, str] | None = None) -> None:
        """Log ``params``; with ``existing`` (a resume), only new keys, and changed values as tags."""
        from mlflow.entities import Param, RunTag

        existing = existing or {}
        new = [Param(k, v) for k, v in params.items() if k not in existing]
        changed = [RunTag(f"gfcr.resumed.{k}"[:250], fit_value(f"{existing[k]} -> {v}", MAX_TAG_VALUE))
                   for k, v in params.items() if k in existing and existing[k] != v]
        with quiet():
            for batch in batches(new, PARAMS_PER_BATCH):
                self.client.log_batch(self.run_id, params=batch)
            for batch in batches(changed, PARAMS_PER_BATCH):
                self.client.log_batch(self.run_id, tags=batch)

    def _log_definition(self, run: Any) -> None:
        """The resolved spec and the drawing of the compiled graph."""
        from gfcr.graph.draw import render

        with tempfile.TemporaryDirectory(prefix="gfcr-graph-") as tmp:
            drawing = render(run.pipeline, Path(tmp) / ("graph.svg" if shutil.which("dot") else "graph.dot"))
            with quiet():
                self.client.log_artifact(self.run_id, str(run.dir.spec))
                self.client.log_artifact(self.run_id, str(drawing))

    def _backfill(self, run: Any) -> None:
        """Log the steps ``metrics.jsonl`` has and MLflow lacks (a run killed between flushes, or
        tracked for the first time on resume)."""
        with quiet():
            logged = {m.step for m in self.client.get_metric_history(self.run_id, SENTINEL)}
        logged |= self.outbox.pending_steps(SENTINEL)  # on their way already, with their first timestamps
        for record in run.dir.read_metrics():
            if record["step"] not in logged:
                self._buffer(record)
        self.flush()

    # --- steps ----------------------------------------------------------------------------------

    def _buffer(self, record: dict[str, Any]) -> None:
        from mlflow.entities import Metric

        step, now = int(record["step"]), _now_ms()
        self._metrics += [Metric(k, v, now, step) for k, v in metric_values(record).items()]
        for lineage in (self.run.dir.lineage(step), self.run.dir.control_lineage(step)):
            if lineage.is_file():
                self._lineage.append(lineage)

    def flush(self) -> None:
        """Write the buffered metrics and lineage files to MLflow (to the outbox while it is away)."""
        metrics, lineage = self._metrics, self._lineage
        self._metrics, self._lineage = [], []
        self._send([_metrics_op(batch) for batch in batches(metrics, METRICS_PER_BATCH)]
                   + [artifact_op(self.run.dir.path, path, "lineage") for path in lineage])
        self._last_flush = time.monotonic()

    # --- sending, or keeping in the outbox while the store is away --------------------------------

    def _send(self, ops: list[dict[str, Any]]) -> None:
        """Apply ``ops`` in order; from the first that fails (and while older ones wait), append
        them to the outbox instead. Never raises for the store; a full disk raises."""
        if not ops:
            return
        if self.away is not None or self.outbox.pending():  # keep the order: behind what waits
            self.outbox.append(ops)
            self._retry()
            return
        for i, op in enumerate(ops):
            try:
                self._apply(op)
            except Exception as exc:  # any store error; what it was is kept for `gfcr sync` to say
                self._went_away(exc)
                self.outbox.append(ops[i:])
                return

    def _apply(self, op: dict[str, Any]) -> None:
        send_entry(self.client, self.run_id, op)

    def _retry(self, force: bool = False) -> None:
        """Send the outbox if the store answers again (at most every ``retry_seconds``, unless forced)."""
        if not self.outbox.pending():
            self.away = None
            return
        if not force and time.monotonic() < self._retry_at:
            return
        self._retry_at = time.monotonic() + self.retry_seconds
        try:
            probe(self.uri or "", "/health", "MLflow server", "")
            sent = self.outbox.drain(self._apply)
        except Exception as exc:
            self._went_away(exc)
            return
        if self.away is not None or sent:
            self.notify(f"the MLflow store {self.uri} answers again: sent the {sent} write(s) kept in "
                        f"{self.outbox.path.name}")
        self.away = None

    def _went_away(self, exc: Exception) -> None:
        reason = _reason(exc)
        if self.away is None:
            self.notify(f"cannot write to the MLflow store {self.uri} ({reason}); training goes on, and its "
                        f"MLflow writes are kept in {self.outbox.path} until the store answers again")
        self.away, self._retry_at = reason, time.monotonic() + self.retry_seconds

    def pending(self) -> str | None:
        """What is still waiting in the outbox, and why, in a sentence; None when nothing is."""
        if self.outbox is None or not self.outbox.pending():
            return None
        return (f"not yet in MLflow ({self.away or 'not sent yet'}): {self.outbox.describe()}, kept in "
                f"{self.outbox.path}\n    send them with: gfcr sync {self.run.dir.path}  (a `gfcr resume` sends "
                "them too)")

    def describe(self) -> str:
        """Where the run is tracked and how to look at it, for the closing summary."""
        text = (f"MLflow run {self.run_id} (experiment id {self.experiment_id}) in {self.uri}\n"
                f"    see it with: mlflow ui --backend-store-uri {self.uri}")
        waiting = self.pending()
        return text if waiting is None else f"{text}\n    {waiting}"


def start_tracking(run: Any, *, parent_run_id: str | None = None, tags: dict[str, str] | None = None,
                   notify: Callable[[str], None] | None = None) -> tuple[MlflowTracker, ...]:
    """The tracking hooks ``run``'s spec asks for, already started (none with ``tracking.mlflow: null``)."""
    settings = run.spec.tracking.mlflow
    if settings is None:
        return ()
    tracker = MlflowTracker(settings, parent_run_id=parent_run_id, tags=tags, notify=notify)
    tracker.start(run)
    return (tracker,)


def check_store(spec: Any) -> None:
    """Open the MLflow store ``spec`` tracks to (nothing when tracking is off): a GfcrError with
    the fix if it cannot be opened. Call it before writing anything for a new run."""
    if spec.tracking.mlflow is not None:
        connect(resolve_uri(spec.tracking.mlflow))


def check_run_store(run_dir: Path) -> None:
    """``check_store`` for the run in ``run_dir``, before a resume changes anything in it; nothing
    when ``run_dir`` holds no spec (the resume itself says what is wrong with the folder)."""
    spec = Path(run_dir) / "spec.yaml"
    if spec.is_file():
        from gfcr.spec import load_spec

        check_store(load_spec(spec))


def _read_tracking_file(run_dir: Path) -> dict[str, str] | None:
    path = run_dir / TRACKING_FILE
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        return {"mlflow_run_id": str(data["mlflow_run_id"]), "tracking_uri": str(data["tracking_uri"])}
    except (json.JSONDecodeError, KeyError, TypeError) as exc:
        raise GfcrError(f"{path} is not a tracking record gfcr wrote ({exc})\n"
                        f"    fix: delete {path} to track the rest of this run as a new MLflow run") from None


def _started_ms(info: Path) -> int | None:
    """When the run of ``run.json`` started, in ms since the epoch (its whole second: MLflow's start
    time is later); None if it cannot be read."""
    from datetime import datetime

    try:
        started = json.loads(info.read_text(encoding="utf-8"))["started"]
        return int(datetime.strptime(started, "%Y-%m-%dT%H:%M:%S%z").timestamp() * 1000)
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _now_ms() -> int:
    return int(time.time() * 1000)


def _metrics_op(metrics: list[Any]) -> dict[str, Any]:
    """An outbox entry of MLflow ``Metric``s, each kept with its timestamp (what makes a resend harmless)."""
    return {"op": "metrics", "metrics": [[m.key, m.value, m.timestamp, m.step] for m in metrics]}


def _reason(exc: Exception) -> str:
    """What went wrong, in a few words: the system error under an MLflow client's connection
    error (``[Errno 111] Connection refused``), else the error's first line."""
    text = str(getattr(exc, "message", None) or exc).strip()
    found = re.search(r"\[Errno -?\d+\] [^'\")]+", text) or re.search(r"Read timed out[^'\")]*", text)
    if found:
        return found.group(0).rstrip(". ")
    return text.splitlines()[0][:300] if text else type(exc).__name__


def sync_run(run_dir: Path) -> tuple[int, list[dict[str, Any]], str | None]:
    """Send what ``run_dir``'s outbox holds to its MLflow run (``gfcr sync``): ``(sent, still
    pending, why)``. A GfcrError when ``run_dir`` has no MLflow run to send to."""
    outbox = Outbox(run_dir)
    if not outbox.pending():
        return 0, [], None
    saved = _read_tracking_file(Path(run_dir))
    if saved is None:
        raise GfcrError(f"{outbox.path} holds MLflow writes, but {Path(run_dir) / TRACKING_FILE} (which MLflow run "
                        "they belong to) is missing",
                        f"restore {TRACKING_FILE} from a copy of the run directory, or delete {outbox.path.name} "
                        "(its metrics are in metrics.jsonl)")
    sent = 0

    def send(entry: dict[str, Any]) -> None:
        nonlocal sent
        send_entry(client, saved["mlflow_run_id"], entry)
        sent += 1

    try:
        client = connect(saved["tracking_uri"])
        outbox.drain(send)
    except Exception as exc:  # unreachable, or refused: what is pending says why
        return sent, outbox.pending(), _reason(exc)
    return sent, [], None


def _to_stderr(message: str) -> None:
    print(f"warning: {message}", file=sys.stderr, flush=True)
