"""Shared helpers: a valid base pipeline and a way to write spec files."""

from __future__ import annotations

import os
import signal
import sys
import tempfile
import textwrap
from pathlib import Path

import pytest

from tests.killing import MARK_VAR, describe, marked_processes

REPO = Path(__file__).resolve().parents[1]
os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing is ever downloaded, in tests least of all
# Prefect's embedded server keeps its SQLite database here, not in ~/.prefect
os.environ["PREFECT_HOME"] = tempfile.mkdtemp(prefix="gfcr-test-prefect-")
os.environ.pop("PREFECT_API_URL", None)
# every process the suite starts (and everything those start) carries this mark: the session's
# last fixture finds by it what a killed or timed-out test process left running
SESSION_MARK = os.environ.setdefault(MARK_VAR, f"gfcr-tests-{os.getpid()}")

BASE = textwrap.dedent("""\
    name: golden
    data: {source: arithmetic, with: {n: 50}}
    stages:
      pick:    {use: control.uniform, with: {batch_size: 4}}
      budget:  {use: control.fixed_n, from: pick, with: {n: 4}}
      rollout: {use: generate.fake, from: budget}
      keep:    {use: filter.nonzero_variance, from: rollout}
    update: {use: update.fake, from: keep}
    run: {steps: 2}
    tracking: {mlflow: null}
    """)

DAPO = textwrap.dedent("""\
    name: loop
    data: {source: arithmetic, with: {n: 50}}
    stages:
      pick:    {use: control.uniform, with: {batch_size: 4}}
      budget:  {use: control.fixed_n, from: pick, with: {n: 4}}
      rollout: {use: generate.fake, from: budget}
      keep:    {use: filter.nonzero_variance, from: rollout}
      enough:  {use: filter.dynamic_sampling, from: keep, with: {target_groups: 4}}
    loops:
      collect: {stages: [pick, budget, rollout, keep, enough], until: enough, max_rounds: 3}
    update: {use: update.fake, from: collect}
    tracking: {mlflow: null}
    """)


@pytest.fixture(scope="session", autouse=True)
def mlflow_store(tmp_path_factory):
    """One temporary MLflow store (SQLite, artifacts beside it) for the whole session, so that no
    tracked test run writes mlflow.db or mlartifacts/ into the repository."""
    uri = f"sqlite:///{tmp_path_factory.mktemp('mlflow') / 'mlflow.db'}"
    before = os.environ.get("MLFLOW_TRACKING_URI")
    os.environ["MLFLOW_TRACKING_URI"] = uri
    yield uri
    if before is None:
        os.environ.pop("MLFLOW_TRACKING_URI", None)
    else:
        os.environ["MLFLOW_TRACKING_URI"] = before


@pytest.fixture(scope="session", autouse=True)
def no_orphaned_processes():
    """At the end of the session, stop the marked processes that are no longer descendants of
    pytest: what a SIGKILLed or timed-out test subprocess left behind (an embedded Prefect server,
    a Ray node). pytest's own children (its embedded server and that server's guard) stop at its
    exit. Says what it stopped, so a leak is seen, not hidden."""
    yield
    orphans = [pid for pid in marked_processes(SESSION_MARK) if not _descends_from(pid, os.getpid())]
    if orphans:
        print("\nstopping processes the tests left running:\n    " + "\n    ".join(describe(orphans)),
              file=sys.stderr)
    for pid in orphans:
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass


def _descends_from(pid: int, ancestor: int) -> bool:
    while pid > 1:
        if pid == ancestor:
            return True
        try:
            pid = int((Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            return False
    return False


@pytest.fixture
def write_spec(tmp_path):
    def write(text: str, name: str = "pipeline.yaml") -> Path:
        path = tmp_path / name
        path.write_text(text, encoding="utf-8")
        return path

    return write


def install_package(source: Path, tmp_path_factory) -> dict[str, str]:
    """pip-install the package folder ``source`` (no deps, no index) into a temporary target, as
    a user would install a third-party stage package; the environment that imports it."""
    import shutil
    import subprocess
    import sys

    target = tmp_path_factory.mktemp("site")
    copy = tmp_path_factory.mktemp("src") / source.name
    shutil.copytree(source, copy)  # setuptools builds in the source tree; keep the repo clean
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation",
                    "--no-index", "--target", str(target), str(copy)], check=True, capture_output=True)
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(target), str(REPO)])}
