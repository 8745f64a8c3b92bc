"""Which MLflow store a run goes to, and keeping MLflow quiet."""

from __future__ import annotations

import logging
import threading
import warnings

import pytest

from gfcr.errors import GfcrError
from gfcr.spec.models import MlflowSpec
from gfcr.tracking.mlflow_store import artifact_location, connect, quiet, resolve_uri


def test_the_store_is_the_spec_uri_else_the_environment_else_a_local_sqlite_file(monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    assert resolve_uri(MlflowSpec(uri="http://127.0.0.1:5000")) == "http://127.0.0.1:5000"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "sqlite:///env.db")
    assert resolve_uri(MlflowSpec()) == f"sqlite:///{tmp_path / 'env.db'}"  # made absolute, for resume
    monkeypatch.delenv("MLFLOW_TRACKING_URI")
    assert resolve_uri(None) == f"sqlite:///{tmp_path / 'mlflow.db'}"
    assert artifact_location(f"sqlite:///{tmp_path / 'mlflow.db'}", "my exp") == (tmp_path / "mlartifacts" / "my_exp").as_uri()
    assert artifact_location("http://127.0.0.1:5000", "x") is None


def test_quiet_silences_mlflow_and_restores_levels_when_blocks_overlap_across_threads():
    logger = logging.getLogger("mlflow")
    logger.setLevel(logging.INFO)
    inside, leave = threading.Event(), threading.Event()

    def other_cell():
        with quiet():
            inside.set()
            leave.wait(5)

    thread = threading.Thread(target=other_cell)
    with quiet():
        thread.start()
        inside.wait(5)
        assert logger.getEffectiveLevel() == logging.ERROR
        with warnings.catch_warnings(record=True) as seen:
            warnings.warn("from inside an MLflow call")  # ignored by quiet's filter, not recorded
        assert seen == []
    assert logger.level == logging.ERROR  # the other thread is still inside
    leave.set()
    thread.join(5)
    assert logger.level == logging.INFO


def test_a_store_that_cannot_be_opened_says_how_to_fix_it():
    with pytest.raises(GfcrError, match="cannot open the MLflow store") as info:
        connect("nosuchstore://somewhere")
    assert "tracking.mlflow=null" in str(info.value)
