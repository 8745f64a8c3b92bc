"""The replay store's embedder in a worker process (``embed_in: process``): the same vector bytes
as the in-process embedder, the worker dying with its parent (SIGKILL, from the main thread or
another) and stopping at a normal exit, and failures surfacing as ``ModelError``s."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest

from gfcr.errors import ModelError
from gfcr.stages.common.embedding import load_embedder
from gfcr.stages.replay.embed_worker import WorkerEmbedder, worker_embedder
from gfcr.stages.replay.rollout_store import ReplayStore, StoreConfig, _one_torch_thread
from tests.conftest import REPO
from tests.stages.replay.test_rollout_store import PROMPTS, _rollout

TEXTS = ["2 + 2 = 4", "Paris", "The answer is 17.", "7 - 5 =", "tokens: 3 4 5", "What is 12 + 30? 42"]


@pytest.fixture(scope="module")
def worker():
    return worker_embedder("all-MiniLM-L6-v2")


def _in_thread(texts: list[str], batch_size: int = 64) -> np.ndarray:
    """The in-process embedder as the store runs it: in a thread of its own, on one torch thread."""
    with ThreadPoolExecutor(1, initializer=_one_torch_thread) as pool:
        return pool.submit(load_embedder().encode, texts, batch_size).result()


def test_the_worker_s_vectors_are_the_in_process_embedder_s_bytes(worker):
    assert worker.dim == 384
    for texts, batch in ((TEXTS, 64), (TEXTS[:2], 64), (TEXTS, 4)):
        vectors, cpu = worker.encode_with_cpu(texts, batch)
        assert vectors.dtype == np.float32 and vectors.shape == (len(texts), 384) and cpu > 0
        assert vectors.tobytes() == _in_thread(texts, batch).tobytes()
    assert np.allclose(np.linalg.norm(worker.encode(TEXTS), axis=1), 1.0, atol=1e-5)
    assert worker.encode([]).shape == (0, 384)
    assert worker_embedder("all-MiniLM-L6-v2") is worker  # one worker per process and model


@pytest.mark.parametrize("background", [True, False])
def test_a_store_embedding_in_a_process_equals_one_embedding_in_a_thread(worker, background):
    batches = [[_rollout("p:0", [4], "four"), _rollout("p:1", [1], "Paris", i=1)],
               [_rollout("p:0", [5], "five", step=1), _rollout("p:2", [2], "2", step=1, i=1),
                _rollout("p:1", [9], "Paris", step=1, i=2)]]  # "Paris" again: its stored vector is reused
    process = ReplayStore(StoreConfig(background=background, embed_in="process"), worker)
    thread = ReplayStore(StoreConfig(background=False, embed_in="thread"), load_embedder())
    for step, batch in enumerate(batches):
        process.submit(batch, PROMPTS, step, step)
        thread.add(batch, PROMPTS, step, step)
    process.finish()
    ids = np.arange(5)
    assert process.responses.vectors(ids).tobytes() == thread.responses.vectors(ids).tobytes()
    assert process.prompt_index.vectors(np.arange(3)).tobytes() == thread.prompt_index.vectors(np.arange(3)).tobytes()
    assert process.embed_cpu_seconds > 0  # the worker's CPU time is counted
    process.close()
    assert worker.alive  # a store's close leaves the shared worker running


def _alive(pid: int) -> bool:
    """``pid`` runs (a zombie, exited but not yet reaped by whoever adopted it, counts as dead)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return False
    return "\nState:\tZ" not in status


def _wait_gone(pid: int, seconds: float = 30.0) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if not _alive(pid):
            return True
        time.sleep(0.1)
    return False


PARENT = textwrap.dedent("""\
    import sys, threading, time
    from gfcr.stages.replay.embed_worker import worker_embedder

    def start():
        worker = worker_embedder("all-MiniLM-L6-v2")
        worker.encode(["2 + 2 = 4"])
        print(worker.pid, flush=True)

    if sys.argv[1] == "thread":  # started from another thread, which ends at once: no PDEATHSIG
        t = threading.Thread(target=start)
        t.start()
        t.join()
    else:
        start()
    if sys.argv[2] == "stay":
        time.sleep(300)
    """)


def _parent(tmp_path: Path, where: str, then: str) -> tuple[subprocess.Popen, int]:
    script = tmp_path / "parent.py"
    script.write_text(PARENT)
    proc = subprocess.Popen([sys.executable, str(script), where, then], stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(REPO)})
    line = proc.stdout.readline()
    assert line.strip().isdigit(), f"the parent printed {line!r}"
    return proc, int(line)


@pytest.mark.slow
@pytest.mark.parametrize("where", ["main", "thread"])
def test_the_worker_dies_when_its_parent_is_sigkilled(tmp_path, where):
    proc, pid = _parent(tmp_path, where, "stay")
    assert _alive(pid)
    os.kill(proc.pid, signal.SIGKILL)  # the parent only, not its process group
    proc.wait()
    assert _wait_gone(pid), f"the worker {pid} outlived its SIGKILLed parent"


@pytest.mark.slow
def test_the_worker_stops_when_its_parent_exits_normally(tmp_path):
    proc, pid = _parent(tmp_path, "main", "exit")
    assert proc.wait(timeout=60) == 0
    assert _wait_gone(pid, 5.0)


def test_a_worker_killed_under_the_store_raises_a_model_error_naming_it():
    worker = WorkerEmbedder("all-MiniLM-L6-v2")
    assert worker.encode(["4"]).shape == (1, 384)
    os.kill(worker.pid, signal.SIGKILL)
    with pytest.raises(ModelError, match=rf"worker process {worker.pid} was killed by signal 9 while encoding"):
        worker.encode(["5"])
    worker.close()


def test_an_encode_that_fails_in_the_worker_raises_its_error_and_the_worker_goes_on(worker):
    with pytest.raises(ModelError, match="failed to encode 1 texts: .*Error"):
        worker.encode([12345])
    assert worker.encode(["4"]).tobytes() == _in_thread(["4"]).tobytes()


def test_a_model_the_worker_cannot_load_is_a_model_error_with_its_fix(tmp_path):
    (tmp_path / "modules.json").write_text("[]")  # looks like a model folder, holds no model
    (tmp_path / "config.json").write_text("{not json")
    worker = WorkerEmbedder(str(tmp_path))
    with pytest.raises(ModelError, match=r"worker process \d+\): .*cannot load") as err:
        worker.dim
    assert err.value.fix and "sentence-transformers folder" in err.value.fix
    worker.close()


def test_a_missing_model_fails_in_the_parent_before_any_worker_starts(tmp_path):
    with pytest.raises(ModelError, match="not a sentence-transformers folder"):
        WorkerEmbedder(str(tmp_path / "nowhere"))
