"""Against a real `prefect server` started here on 127.0.0.1: `gfcr deploy` with a short
interval schedule, then `gfcr serve`, leads to a scheduled flow run that starts and completes
(issue 4, item 3). The pipeline is the fake-engine example, so the run itself takes seconds."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from tests.conftest import BASE, REPO

pytestmark = pytest.mark.integration
GFCR = [sys.executable, "-m", "gfcr.cli.main"]
PREFECT = str(Path(sys.executable).parent / "prefect")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_healthy(url: str, server: subprocess.Popen, seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        assert server.poll() is None, "prefect server exited"
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=2) as response:
                if response.status == 200:
                    return
        except OSError:
            pass
        time.sleep(1)
    raise AssertionError(f"prefect server at {url} not healthy after {seconds} s")


def _stop(process: subprocess.Popen) -> None:
    if process.poll() is None:
        os.killpg(process.pid, signal.SIGINT)
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()


def _completed_runs(api: str, deployment: str) -> list:
    from prefect.client.orchestration import get_client
    from prefect.settings import PREFECT_API_URL, temporary_settings

    with temporary_settings({PREFECT_API_URL: api}), get_client(sync_client=True) as client:
        found = client.read_deployment_by_name(deployment)
        from prefect.client.schemas.filters import DeploymentFilter, DeploymentFilterId

        runs = client.read_flow_runs(deployment_filter=DeploymentFilter(id=DeploymentFilterId(any_=[found.id])))
    return [r for r in runs if r.state is not None and r.state.is_completed()], runs


def test_deploy_with_an_interval_and_serve_completes_a_scheduled_run(tmp_path):
    port = _free_port()
    api = f"http://127.0.0.1:{port}/api"
    env = {**os.environ, "PREFECT_HOME": str(tmp_path / "prefect"), "PREFECT_API_URL": api,
           "PREFECT_SERVER_ANALYTICS_ENABLED": "false", "PREFECT_RUNNER_POLL_FREQUENCY": "2",
           "MLFLOW_TRACKING_URI": f"sqlite:///{tmp_path / 'mlflow.db'}"}
    server = subprocess.Popen([PREFECT, "server", "start", "--host", "127.0.0.1", "--port", str(port)],
                              env=env, cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                              start_new_session=True)
    serve = None
    try:
        _wait_healthy(api, server, 180)
        deployed = subprocess.run(
            GFCR + ["deploy", str(REPO / "pipelines" / "examples" / "fake_dapo.yaml"), "--name", "every-5s",
                    "--interval", "5", "--set", "run.steps=3"],
            env=env, cwd=tmp_path, capture_output=True, text=True, timeout=300)
        assert deployed.returncode == 0, deployed.stdout + deployed.stderr
        assert "every-5s" in deployed.stdout
        serve = subprocess.Popen(GFCR + ["serve"], env=env, cwd=tmp_path, stdout=subprocess.PIPE,
                                 stderr=subprocess.STDOUT, text=True, start_new_session=True)
        deadline, completed, runs = time.monotonic() + 300, [], []
        while time.monotonic() < deadline and not completed:
            assert serve.poll() is None, serve.stdout.read()
            completed, runs = _completed_runs(api, "fake-dapo/every-5s")
            time.sleep(2)
        assert completed, f"no completed scheduled run within the wait; runs: {[(r.name, r.state) for r in runs]}"
        run_dirs = list((tmp_path / "runs").glob("fake-dapo-*"))
        assert run_dirs and any((d / "summary.json").is_file() for d in run_dirs)
    finally:
        if serve is not None:
            _stop(serve)
        _stop(server)


def test_deploy_refuses_a_pipeline_that_does_not_compile(write_spec, tmp_path):
    bad = write_spec("name: x\ndata: {source: arithmetic}\nstages: {}\nupdate: {use: update.fake}\n")
    done = subprocess.run(GFCR + ["deploy", str(bad), "--name", "n", "--interval", "5"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "stages" in done.stderr


@pytest.mark.parametrize("schedule, says, fix", [
    (["--interval", "-5"], "--interval -5 is not a positive number of seconds", "e.g. --interval 3600"),
    (["--interval", "0"], "--interval 0 is not a positive number of seconds", "e.g. --interval 3600"),
    (["--cron", "every day"], "--cron 'every day' is not a cron expression", "five fields"),
])
def test_deploy_refuses_a_schedule_that_cannot_run(schedule, says, fix, write_spec, tmp_path):
    """Found before Prefect is asked for anything: exit 2, what and the fix, no traceback."""
    spec = write_spec(BASE)
    done = subprocess.run(GFCR + ["deploy", str(spec), "--name", "n", *schedule], cwd=tmp_path,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stdout + done.stderr
    assert says in done.stderr and fix in done.stderr and "Traceback" not in done.stderr


@pytest.mark.slow  # two servers' start-up: about 60 s on 2 cores
def test_gfcr_ui_on_other_ports_serves_a_prefect_ui_that_talks_to_its_own_port(tmp_path):
    """`gfcr ui --prefect-port P`: the Prefect UI's pages call the API on P (its /ui-settings),
    not on Prefect's default 4200, and the MLflow UI answers on its port; Ctrl-C stops both."""
    prefect_port, mlflow_port = _free_port(), _free_port()
    env = {**os.environ, "PREFECT_HOME": str(tmp_path / "prefect")}
    env.pop("PREFECT_API_URL", None)
    ui = subprocess.Popen(GFCR + ["ui", "--prefect-port", str(prefect_port), "--mlflow-port", str(mlflow_port),
                                  "--mlflow-uri", f"sqlite:///{tmp_path / 'mlflow.db'}"],
                          cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                          start_new_session=True)
    try:
        _wait_healthy(f"http://127.0.0.1:{prefect_port}/api", ui, 180)
        with urllib.request.urlopen(f"http://127.0.0.1:{prefect_port}/ui-settings", timeout=10) as response:
            settings = json.loads(response.read())
        assert settings["api_url"] == f"http://127.0.0.1:{prefect_port}/api"
        deadline = time.monotonic() + 120
        while True:  # the MLflow UI on its own port
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{mlflow_port}/health", timeout=2) as response:
                    assert response.status == 200
                    break
            except OSError:
                assert time.monotonic() < deadline, "the MLflow UI did not answer in 120 s"
                time.sleep(1)
    finally:
        _stop(ui)
    assert ui.returncode == 0, ui.stderr.read()
