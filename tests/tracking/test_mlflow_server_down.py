"""An MLflow tracking server that goes away under a run (issue 31, item 3): training goes on, the
writes wait in the run directory's outbox, are sent when the server is back, or by `gfcr sync`;
nothing is lost and nothing is logged twice.

The slow test uses a real `mlflow server` (SQLite backend, artifacts served by it) on a free
port, killed by its process group id with SIGKILL and started again on the same port and
database; every server is killed in a finalizer. The fast tests use a real SQLite store."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
import urllib.request
import uuid
from pathlib import Path

import pytest
from typer.testing import CliRunner

from gfcr.cli.main import app
from gfcr.tracking.mlflow_values import metric_values
from gfcr.tracking.outbox import OUTBOX_FILE, SENT_FILE, Outbox, send_entry
from tests.conftest import BASE, REPO
from tests.killing import MARK_VAR, describe, kill_marked, left_running

cli = CliRunner()
MLFLOW = Path(sys.executable).parent / "mlflow"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class MlflowServer:
    """A real `mlflow server` on 127.0.0.1:port, SQLite backend and artifact store under ``root``."""

    def __init__(self, root: Path, mark: str):
        self.root, self.mark, self.port = root, mark, _free_port()
        self.uri = f"http://127.0.0.1:{self.port}"
        self.process: subprocess.Popen | None = None

    def start(self, timeout: float = 300) -> float:
        env = {**os.environ, MARK_VAR: self.mark, "MLFLOW_DISABLE_TELEMETRY": "true"}
        self.process = subprocess.Popen(
            [str(MLFLOW), "server", "--backend-store-uri", f"sqlite:///{self.root / 'mlflow.db'}",
             "--artifacts-destination", str(self.root / "artifacts"), "--host", "127.0.0.1",
             "--port", str(self.port), "--workers", "1"],
            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        started = time.monotonic()
        while time.monotonic() - started < timeout:
            assert self.process.poll() is None, f"mlflow server exited with {self.process.returncode}"
            try:
                urllib.request.urlopen(f"{self.uri}/health", timeout=2).read()
                return time.monotonic() - started
            except OSError:
                time.sleep(0.5)
        raise AssertionError(f"mlflow server not up in {timeout} s")

    def kill(self) -> None:
        """SIGKILL the server and its workers (its process group: `mlflow server` starts uvicorn)."""
        if self.process is not None and self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()
        self.process = None


@pytest.fixture
def mlflow_server(tmp_path):
    mark = f"mlflow-server-{uuid.uuid4().hex}"
    server = MlflowServer(tmp_path / "server", mark)
    (tmp_path / "server").mkdir()
    yield server
    server.kill()
    kill_marked(mark)


DRIVER = textwrap.dedent("""\
    import sys, time
    from pathlib import Path
    from gfcr.graph import load_pipeline
    from gfcr.runtime.loop.session import Run
    from gfcr.tracking.mlflow_tracker import MlflowTracker

    work, pauses = Path(sys.argv[3]), [int(s) for s in sys.argv[4].split(",")]

    class Pause:  # the test changes the server while the run waits here
        def step_recorded(self, event):
            record = event.record
            if record["step"] in pauses:
                (work / f"at-{record['step']}").write_text("")
                while not (work / f"go-{record['step']}").exists():
                    time.sleep(0.05)

    pipeline = load_pipeline(sys.argv[1])
    run = Run.start(pipeline, sys.argv[2])
    tracker = MlflowTracker(pipeline.spec.tracking.mlflow, flush_seconds=0, retry_seconds=0)
    tracker.start(run)
    run.hooks = (tracker, Pause())
    run.train()
    tracker.close()
    print(tracker.describe(), flush=True)
    """)


def _wait_for(path: Path, proc: subprocess.Popen, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert proc.poll() is None, f"the run ended early:\n{proc.communicate()[0]}"
        assert time.monotonic() < deadline, f"{path.name} not reached in {timeout} s"
        time.sleep(0.05)


def _assert_all_logged_once(uri: str, run_dir: Path) -> None:
    """Every metric of every metrics.jsonl line is in MLflow exactly once, with its value; every
    lineage file is an artifact; the run is FINISHED."""
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=uri)
    run_id = json.loads((run_dir / "tracking.json").read_text())["mlflow_run_id"]
    assert client.get_run(run_id).info.status == "FINISHED"
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    expected: dict[str, list[tuple[int, float]]] = {}
    for record in records:
        for key, value in metric_values(record).items():
            expected.setdefault(key, []).append((record["step"], value))
    keys = [k for k in expected if not k.startswith("time.")]  # all of them are checked; these are compared
    for key in expected:
        logged = sorted((m.step, m.value) for m in client.get_metric_history(run_id, key))
        assert len(logged) == len(expected[key]), (key, logged)  # once per step: nothing lost, nothing twice
        if key in keys:
            assert logged == sorted(expected[key]), key
    artifacts = {Path(a.path).name for a in client.list_artifacts(run_id, "lineage")}
    assert {p.name for p in (run_dir / "lineage").iterdir()} <= artifacts
    assert {"summary.json", "metrics.jsonl", "spec.yaml"} <= {a.path for a in client.list_artifacts(run_id)}


@pytest.mark.slow  # three starts of a real MLflow server: about 1-3 minutes on a busy 2-core machine
def test_a_killed_mlflow_server_loses_nothing_the_run_goes_on_and_gfcr_sync_sends_the_rest(
        mlflow_server, write_spec, tmp_path):
    print(f"mlflow server up in {mlflow_server.start():.1f} s")
    spec = write_spec(BASE.replace("run: {steps: 2}", "run: {steps: 10}").replace(
        "tracking: {mlflow: null}", f"tracking: {{mlflow: {{uri: '{mlflow_server.uri}'}}}}\nexecutor: {{kind: local}}"))
    run_dir, work = tmp_path / "run", tmp_path / "work"
    work.mkdir()
    (work / "driver.py").write_text(DRIVER)
    env = {**os.environ, "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1", MARK_VAR: mlflow_server.mark}
    proc = subprocess.Popen([sys.executable, str(work / "driver.py"), str(spec), str(run_dir), str(work), "1,4,7"],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        _wait_for(work / "at-1", proc)
        mlflow_server.kill()  # gone under the run, after steps 0-1 were sent
        went = time.monotonic()
        (work / "go-1").write_text("")
        _wait_for(work / "at-4", proc)
        stalled = time.monotonic() - went  # steps 2-4 with the server gone: the first write's retries, then probes
        outbox = Outbox(run_dir)
        assert outbox.pending_steps("rollouts_generated") == {2, 3, 4}  # kept, in the run directory
        print(f"steps 2-4 with the server gone took {stalled:.1f} s")
        assert stalled < 30, stalled
        print(f"mlflow server back in {mlflow_server.start():.1f} s")  # same port, same database
        (work / "go-4").write_text("")
        _wait_for(work / "at-7", proc)
        assert not (run_dir / OUTBOX_FILE).exists()  # sent by the run itself at step 5, and removed
        mlflow_server.kill()  # gone again, for good this time: the run ends while it is away
        (work / "go-7").write_text("")
        output = proc.communicate(timeout=300)[0]
        assert proc.returncode == 0, output
        assert "cannot write to the MLflow store" in output and "answers again: sent the" in output
        assert f"gfcr sync {run_dir}" in output
        pending = Outbox(run_dir).pending()
        assert Outbox(run_dir).pending_steps("rollouts_generated") == {8, 9}  # and the totals, at step 10
        assert pending[-1]["op"] == "terminate" and pending[-1]["status"] == "FINISHED"

        result = cli.invoke(app, ["sync", str(run_dir)])
        assert result.exit_code == 1, result.output
        assert "not sent: metrics of steps 8-10" in result.output and "Connection refused" in result.output
        assert Outbox(run_dir).pending() == pending  # nothing changed

        mlflow_server.start()
        result = cli.invoke(app, ["sync", str(run_dir)])
        assert result.exit_code == 0, result.output
        assert f"sent {len(pending)} write(s) to MLflow" in result.output
        assert not (run_dir / OUTBOX_FILE).exists() and not (run_dir / SENT_FILE).exists()
        result = cli.invoke(app, ["sync", str(run_dir)])
        assert result.exit_code == 0 and "nothing to send" in result.output, result.output
        _assert_all_logged_once(mlflow_server.uri, run_dir)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        mlflow_server.kill()
    remaining = left_running(mlflow_server.mark, within=10)
    assert remaining == [], describe(remaining)


# --- fast: a real SQLite store, no server -------------------------------------------------------

def _mlflow_run(uri: str) -> tuple[object, str]:
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=uri)
    experiment = client.create_experiment(f"outbox-{uuid.uuid4().hex[:8]}")
    return client, client.create_run(experiment).info.run_id


def test_an_outbox_entry_sent_twice_is_in_mlflow_once(mlflow_store, tmp_path):
    """A process killed after MLflow took an entry but before it was marked sent sends it again
    (at-least-once); the metric keeps its first timestamp, and MLflow keeps one copy."""
    client, run_id = _mlflow_run(mlflow_store)  # the session's SQLite store
    outbox = Outbox(tmp_path)
    outbox.append([{"op": "metrics", "metrics": [["reward_mean", 0.25 * step, 1_700_000_000_000 + step, step]]}
                   for step in range(4)])

    class Killed(Exception):
        pass

    def send_then_die_at_step_2(entry):
        send_entry(client, run_id, entry)
        if entry["metrics"][0][3] == 2:
            raise Killed  # sent, not yet marked sent

    with pytest.raises(Killed):
        outbox.drain(send_then_die_at_step_2)
    assert outbox.pending_steps("reward_mean") == {2, 3}  # step 2 is sent again
    assert outbox.drain(lambda entry: send_entry(client, run_id, entry)) == 2
    history = sorted((m.step, m.value) for m in client.get_metric_history(run_id, "reward_mean"))
    assert history == [(0, 0.0), (1, 0.25), (2, 0.5), (3, 0.75)]
    assert not (tmp_path / OUTBOX_FILE).exists() and not (tmp_path / SENT_FILE).exists()


def test_an_outbox_line_cut_by_a_kill_is_dropped_and_a_damaged_one_is_refused_with_its_line(tmp_path):
    outbox = Outbox(tmp_path)
    outbox.append([{"op": "terminate", "status": "FINISHED"}])
    with open(tmp_path / OUTBOX_FILE, "a") as f:
        f.write('{"seq": 2, "op": "metr')  # an append cut by SIGKILL
    assert [e["seq"] for e in outbox.pending()] == [1]
    (tmp_path / OUTBOX_FILE).write_text('{"seq": 1, "op": "terminate", "status": "FINISHED"}\nnot json\n')
    from gfcr.errors import GfcrError

    with pytest.raises(GfcrError, match=rf"(?s){OUTBOX_FILE}:2: not an outbox entry gfcr wrote .*fix or delete line 2"):
        outbox.pending()


def test_gfcr_sync_says_what_is_pending_and_why_and_refuses_a_folder_that_is_no_run(write_spec, tmp_path):
    """A store that cannot be reached (a real refused port): exit 1, what waits and why, nothing
    changed; no outbox: exit 0; not a run directory: exit 2."""
    result = cli.invoke(app, ["run", str(write_spec(BASE)), "--run-dir", str(tmp_path / "run"), "--executor", "local"])
    assert result.exit_code == 0, result.output
    run_dir = tmp_path / "run"
    result = cli.invoke(app, ["sync", str(run_dir)])
    assert result.exit_code == 0 and "nothing to send" in result.output, result.output
    port = _free_port()  # nothing listens there
    (run_dir / "tracking.json").write_text(json.dumps({"mlflow_run_id": "0" * 32, "tracking_uri":
                                                       f"http://127.0.0.1:{port}", "experiment_id": "1"}))
    Outbox(run_dir).append([{"op": "metrics", "metrics": [["reward_mean", 0.5, 1_700_000_000_000, 1]]},
                            {"op": "artifact", "path": "lineage/step-000001.parquet", "dest": "lineage"},
                            {"op": "terminate", "status": "FINISHED"}])
    before = (run_dir / OUTBOX_FILE).read_bytes()
    start = time.perf_counter()
    result = cli.invoke(app, ["sync", str(run_dir)])
    assert result.exit_code == 1, result.output
    assert "not sent: metrics of step 1 (1 values), 1 file(s) (lineage/step-000001.parquet), the run's end " \
           "(FINISHED) (3 write(s))" in result.output
    assert "Connection refused" in result.output and "nothing is lost" in result.output
    assert time.perf_counter() - start < 15
    assert (run_dir / OUTBOX_FILE).read_bytes() == before
    result = cli.invoke(app, ["sync", str(tmp_path)])
    assert result.exit_code == 2 and "not a gfcr run directory" in result.output, result.output


@pytest.mark.slow  # a run and its resume, tracked: 59 s on the 2 cores at load 27, a few seconds unloaded
def test_a_resume_sends_what_the_outbox_holds_first_and_logs_nothing_twice(mlflow_store, write_spec, tmp_path):
    """What an earlier session could not send (here: a metric MLflow already took, one it did not,
    and that session's end status) goes before the resumed run's own writes."""
    from mlflow import MlflowClient

    spec = write_spec(BASE.replace("tracking: {mlflow: null}", "tracking: {mlflow: {experiment: outbox-resume}}"))
    run_dir = tmp_path / "run"
    result = cli.invoke(app, ["run", str(spec), "--run-dir", str(run_dir), "--executor", "local"])
    assert result.exit_code == 0, result.output
    client = MlflowClient(tracking_uri=mlflow_store)
    run_id = json.loads((run_dir / "tracking.json").read_text())["mlflow_run_id"]
    taken = client.get_metric_history(run_id, "rollouts_generated")[-1]  # sent, as if not yet marked sent
    Outbox(run_dir).append([
        {"op": "metrics", "metrics": [["rollouts_generated", taken.value, taken.timestamp, taken.step],
                                      ["late.metric", 7.0, taken.timestamp, taken.step]]},
        {"op": "terminate", "status": "FAILED"}])
    result = cli.invoke(app, ["resume", str(run_dir), "--steps", "3", "--executor", "local"])
    assert result.exit_code == 0, result.output
    assert not (run_dir / OUTBOX_FILE).exists()
    assert sorted(m.step for m in client.get_metric_history(run_id, "rollouts_generated")) == [0, 1, 2]
    assert [(m.step, m.value) for m in client.get_metric_history(run_id, "late.metric")] == [(taken.step, 7.0)]
    assert client.get_run(run_id).info.status == "FINISHED"
