"""Where gfcr's MLflow runs go, and talking to that store quietly.

The store is ``tracking.mlflow.uri`` when the spec sets it, else ``$MLFLOW_TRACKING_URI``,
else ``sqlite:///mlflow.db`` in the working directory. A relative SQLite path is made
absolute, so that a resumed run finds its store from any directory. The experiment is
``tracking.mlflow.experiment``, else the pipeline's name.

Artifacts: an experiment gfcr creates in a SQLite store keeps its artifacts in
``mlartifacts/<experiment>`` beside the database file, so the store is one folder (MLflow's
own default would be ``./mlruns`` under whatever directory first created the experiment).
Other stores (a tracking server, a file store) choose their artifact location themselves.

Stores that are down, and stores used for the first time by several runs at once:

- an ``http(s)://`` store is probed first (``gfcr.runtime.preflight.endpoint.probe``: a connection, and
  for plain http one request, each bounded by 5 s), so an unreachable server (refused, a
  blackholed address, a server that never answers) fails in seconds with the URI and the fix,
  instead of MLflow's 120 s timeout and retries with backoff (minutes of silence). MLflow's own
  HTTP timeout, retry count and backoff default to ``HTTP_DEFAULTS`` (a value the user has set
  wins), so a server that goes down during a run costs one write a few seconds (refused) or about
  30 s (no answer), after which the run keeps its writes in the outbox and only probes.
- a new SQLite store is created (tables and migrations) by the first run to open it; runs that
  open it at the same moment take turns under an exclusive lock (``flock``) on the database's
  folder, which writes no file; an experiment two runs create at once is created once.

MLflow and alembic log at INFO (``Creating initial MLflow database tables...``) and warn
about things a gfcr user cannot act on; every call into MLflow runs inside ``quiet()``, which
holds their loggers at ERROR and ignores warnings for the duration of the call.
"""

from __future__ import annotations

import fcntl
import logging
import os
import re
import threading
import warnings
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

from gfcr.errors import GfcrError
from gfcr.runtime.preflight.endpoint import probe
from gfcr.spec.models import MlflowSpec

DEFAULT_URI = "sqlite:///mlflow.db"
_NOISY_LOGGERS = ("mlflow", "alembic", "sqlalchemy", "urllib3")
_SQLITE = "sqlite:///"
# MLflow's defaults are a 120 s timeout and 7 retries with exponential backoff (factor 2): minutes
# of silence. A write that fails is kept in the run's outbox (gfcr.tracking.outbox) and sent
# later, so one failed write may give up early: 2 retries, backoff factor 1 (waits of 0 s, then
# 2 s, plus MLflow's jitter of up to 1 s each) cost a refused connection about 2-4 s, once per outage
HTTP_DEFAULTS = {"MLFLOW_HTTP_REQUEST_TIMEOUT": "10", "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "2",
                 "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1"}
STORE_FIX = ("set `tracking.mlflow.uri` (or MLFLOW_TRACKING_URI) to a reachable store, e.g. sqlite:///mlflow.db, "
             "or switch tracking off with `--set tracking.mlflow=null`")


def resolve_uri(settings: MlflowSpec | None = None) -> str:
    """The tracking URI for ``settings`` (see the module docstring), SQLite paths made absolute."""
    uri = (settings.uri if settings is not None else None) or os.environ.get("MLFLOW_TRACKING_URI") or DEFAULT_URI
    if uri.startswith(_SQLITE) and not uri.startswith(_SQLITE + "/") and ":memory:" not in uri:
        uri = _SQLITE + str(Path(uri[len(_SQLITE):]).resolve())
    return uri


def sqlite_path(uri: str) -> Path | None:
    """The database file of a ``sqlite:///`` URI, None for other stores."""
    return Path(uri[len(_SQLITE):]) if uri.startswith(_SQLITE) and ":memory:" not in uri else None


def artifact_location(uri: str, experiment: str) -> str | None:
    """Where a new experiment's artifacts go: beside a SQLite database, else the store's choice."""
    db = sqlite_path(uri)
    if db is None:
        return None
    folder = re.sub(r"[^A-Za-z0-9_.-]", "_", experiment) or "default"
    return (db.parent / "mlartifacts" / folder).as_uri()


_quiet_lock = threading.Lock()
_quiet_depth = 0
_saved_levels: list[int] = []
_saved_warnings: list[Any] = []


@contextmanager
def quiet() -> Iterator[None]:
    """Hold MLflow's (and its helpers') loggers at ERROR and ignore warnings inside the block.

    Logger levels and warning filters are process-wide, and blocks may nest or overlap across
    threads (ablation cells): the first block to enter saves and silences, the last to leave
    restores."""
    global _quiet_depth
    loggers = [logging.getLogger(name) for name in _NOISY_LOGGERS]
    with _quiet_lock:
        if _quiet_depth == 0:
            _saved_levels[:] = [lg.level for lg in loggers]
            for lg in loggers:
                lg.setLevel(logging.ERROR)
            catcher = warnings.catch_warnings()
            catcher.__enter__()
            warnings.simplefilter("ignore")
            _saved_warnings[:] = [catcher]
        _quiet_depth += 1
    try:
        yield
    finally:
        with _quiet_lock:
            _quiet_depth -= 1
            if _quiet_depth == 0:
                for lg, level in zip(loggers, _saved_levels):
                    lg.setLevel(level)
                _saved_warnings.pop().__exit__(None, None, None)


@contextmanager
def store_lock(uri: str) -> Iterator[None]:
    """Exclusive, between processes, while a SQLite store is first opened or an experiment made:
    an ``flock`` on the database's folder (nothing is written). Other stores: no lock."""
    db = sqlite_path(uri)
    folder = db.parent if db is not None else None
    if folder is None or not folder.is_dir():
        yield
        return
    fd = os.open(folder, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # closing releases the lock


def connect(uri: str) -> Any:
    """An ``MlflowClient`` on ``uri``, with the store opened (and its tables made) now, so that
    a wrong URI fails before the first step rather than after it."""
    os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")  # no network calls from a training run
    for key, value in HTTP_DEFAULTS.items():
        os.environ.setdefault(key, value)
    probe(uri, "/api/2.0/mlflow/experiments/search?max_results=1", "MLflow server",
          "start the server (`mlflow server --port ...`) or correct the address; " + STORE_FIX)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from mlflow import MlflowClient  # importing mlflow sets its loggers' levels: quiet() comes after
    with quiet(), store_lock(uri):
        try:
            client = MlflowClient(tracking_uri=uri)
            client.search_experiments(max_results=1)
        except Exception as exc:  # any store error: bad scheme, unreachable server, unwritable file
            raise GfcrError(f"cannot open the MLflow store {uri}: {exc}", STORE_FIX) from exc
    return client


def experiment_id(client: Any, uri: str, name: str) -> str:
    """The id of experiment ``name``, created (artifacts beside a SQLite store) if absent."""
    with quiet(), store_lock(uri):  # two runs making the same new experiment: one creates it
        found = client.get_experiment_by_name(name)
        if found is not None:
            if found.lifecycle_stage == "deleted":
                raise GfcrError(f"MLflow experiment `{name}` in {uri} is deleted\n"
                                "    fix: restore it (`mlflow experiments restore`), or pick another name with "
                                "`--set tracking.mlflow.experiment=NAME`")
            return found.experiment_id
        return client.create_experiment(name, artifact_location=artifact_location(uri, name))


def create_parent_run(settings: MlflowSpec | None, experiment: str, name: str,
                      tags: dict[str, str] | None = None) -> tuple[str, str]:
    """Start an MLflow run to hold child runs (an ablation's cells); return ``(run_id, uri)``.
    Pass the id as ``parent_run_id`` to each cell's ``MlflowTracker``; end it with
    ``finish_run``."""
    uri = resolve_uri(settings)
    client = connect(uri)
    with quiet():
        run = client.create_run(experiment_id(client, uri, experiment), run_name=name, tags=dict(tags or {}))
    return run.info.run_id, uri


def finish_run(uri: str, run_id: str, status: str = "FINISHED") -> None:
    """Mark an MLflow run ``FINISHED`` (or ``FAILED``, ``KILLED``)."""
    client = connect(uri)
    with quiet():
        client.set_terminated(run_id, status)
