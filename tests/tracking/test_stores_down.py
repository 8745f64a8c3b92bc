"""Stores that are down or new (issue 16): an unreachable MLflow server or Prefect API fails in
seconds with what and the fix, before the run directory is written; three runs started at once
on a new SQLite MLflow store and a new Prefect home all finish."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from gfcr.cli.main import app
from gfcr.errors import GfcrError
from gfcr.runtime.preflight.endpoint import probe
from tests.conftest import BASE, REPO

cli = CliRunner()


@pytest.fixture
def silent_server():
    """A TCP server that accepts connections and never answers (a hung or blackholed server)."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(8)
    held: list[socket.socket] = []
    stop = threading.Event()

    def accept():
        server.settimeout(0.2)
        while not stop.is_set():
            try:
                held.append(server.accept()[0])
            except OSError:
                continue

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.getsockname()[1]}"
    stop.set()
    thread.join(2)
    for conn in held:
        conn.close()
    server.close()


def _run(spec: Path, run_dir: Path, *extra: str):
    start = time.perf_counter()
    result = cli.invoke(app, ["run", str(spec), "--run-dir", str(run_dir), *extra])
    return result, time.perf_counter() - start


@pytest.mark.parametrize("where", ["refused", "silent"])
def test_an_unreachable_mlflow_server_fails_in_seconds_before_the_run_dir_is_written(
        where, silent_server, write_spec, tmp_path):
    uri = "http://127.0.0.1:1" if where == "refused" else silent_server
    spec = write_spec(BASE.replace("tracking: {mlflow: null}", f"tracking: {{mlflow: {{uri: '{uri}'}}}}"))
    result, seconds = _run(spec, tmp_path / "run", "--executor", "local")
    assert result.exit_code == 2, result.output
    says = "Connection refused" if where == "refused" else "no answer within 5 s"
    assert f"cannot reach the MLflow server {uri}: {says}" in result.output
    assert "fix: start the server" in result.output and "tracking.mlflow=null" in result.output
    assert "Traceback" not in result.output and not (tmp_path / "run").exists()
    assert seconds < 15, seconds  # MLflow's own client: a 120 s timeout, 7 retries with backoff


def test_a_resume_whose_mlflow_server_went_down_fails_in_seconds_and_changes_nothing(write_spec, tmp_path):
    result, _ = _run(write_spec(BASE), tmp_path / "run", "--executor", "local")
    assert result.exit_code == 0, result.output
    spec = tmp_path / "run" / "spec.yaml"  # tracked to a server that has gone down since
    spec.write_text(spec.read_text().replace("mlflow: null", "mlflow: {uri: 'http://127.0.0.1:1'}"))
    def state():  # the run's files; the `.lock` names its last holder (the refused resume held it a moment)
        return {p: p.read_bytes() for p in sorted((tmp_path / "run").rglob("*")) if p.is_file() and p.name != ".lock"}

    before = state()
    start = time.perf_counter()
    result = cli.invoke(app, ["resume", str(tmp_path / "run"), "--steps", "4", "--executor", "local"])
    assert result.exit_code == 2, result.output
    assert "cannot reach the MLflow server http://127.0.0.1:1: Connection refused" in result.output
    assert "Traceback" not in result.output and time.perf_counter() - start < 15
    assert state() == before  # spec.yaml (--steps 4) and metrics.jsonl untouched


def test_an_unreachable_prefect_api_fails_in_seconds_before_the_run_dir_is_written(silent_server, write_spec,
                                                                                   tmp_path):
    from prefect.settings import PREFECT_API_URL, temporary_settings

    from gfcr.runtime.loop.prefect_runner import check_prefect_api

    spec = write_spec(BASE.replace("tracking: {mlflow: null}\n", ""))  # the Prefect executor, its default
    with temporary_settings({PREFECT_API_URL: "http://127.0.0.1:1/api"}):
        result, seconds = _run(spec, tmp_path / "run")
    assert result.exit_code == 2, result.output
    assert "cannot reach the Prefect API http://127.0.0.1:1/api: Connection refused" in result.output
    assert "unset it to use the embedded server" in result.output and not (tmp_path / "run").exists()
    assert seconds < 15, seconds  # Prefect's client: retries for tens of seconds, then a traceback
    start = time.perf_counter()
    with temporary_settings({PREFECT_API_URL: silent_server + "/api"}):
        with pytest.raises(GfcrError, match="no answer within 5 s"):
            check_prefect_api()
    assert time.perf_counter() - start < 15


def test_a_server_that_answers_passes_the_probe_whatever_its_status(tmp_path):
    from http.server import BaseHTTPRequestHandler, HTTPServer

    class NotFound(BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_error(404)

        def log_message(self, *args):
            pass

    server = HTTPServer(("127.0.0.1", 0), NotFound)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        probe(f"http://127.0.0.1:{server.server_port}", "/health", "Prefect API", "fix")
    finally:
        server.shutdown()
        server.server_close()


_OPEN_STORE = """\
import sys
from gfcr.tracking.mlflow_store import connect, experiment_id
client = connect(sys.argv[1])
print(experiment_id(client, sys.argv[1], "golden"))
"""


def test_three_processes_opening_a_new_mlflow_db_at_once_make_one_store_and_one_experiment(tmp_path):
    """Each process creates the tables and the experiment if it finds none: without the lock two
    of three failed with `table ... already exists` or `duplicate column name: step`."""
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    procs = [subprocess.Popen([sys.executable, "-c", _OPEN_STORE, uri], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for _ in range(3)]
    outputs = [p.communicate(timeout=120)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0, 0], "\n".join(outputs)
    assert len({out.strip().splitlines()[-1] for out in outputs}) == 1, outputs  # one experiment id
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mlflow.db"]  # the lock writes no file


@pytest.mark.slow  # three whole runs with their Prefect servers: about a minute on a busy machine
def test_three_runs_started_at_once_on_a_new_mlflow_db_and_prefect_home_all_finish(tmp_path):
    """Each run creates the store's tables and the experiment if it finds none: without a lock
    two of three failed with `table ... already exists` / `duplicate column name`."""
    db = tmp_path / "store" / "mlflow.db"
    db.parent.mkdir()
    spec = tmp_path / "spec.yaml"
    spec.write_text(BASE.replace("tracking: {mlflow: null}", f"tracking: {{mlflow: {{uri: 'sqlite:///{db}'}}}}"))
    env = {**os.environ, "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1", "PREFECT_HOME": str(tmp_path / "prefect")}
    env.pop("MLFLOW_TRACKING_URI", None)
    procs = [subprocess.Popen([sys.executable, "-m", "gfcr.cli.main", "run", str(spec), "--run-dir",
                               str(tmp_path / f"run{i}")], env=env, cwd=tmp_path, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True, start_new_session=True) for i in range(3)]
    outputs = [p.communicate(timeout=300)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0, 0], "\n".join(outputs)
    from mlflow import MlflowClient

    client = MlflowClient(f"sqlite:///{db}")
    experiment = client.get_experiment_by_name("golden")
    runs = client.search_runs([experiment.experiment_id])
    assert sorted(r.info.run_name for r in runs) == ["run0", "run1", "run2"]
    assert {r.info.status for r in runs} == {"FINISHED"}
