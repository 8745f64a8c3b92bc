"""The run's log file (gfcr.engines.run_log): what vLLM writes by each of its ways (its loggers,
Python warnings, ``sys.stderr``, native code on descriptor 2) lands in ``run.log``, and none of it
on the terminal. Fast: real loggers, a real descriptor 2, no vLLM (the vLLM runs themselves are
in tests/cli/test_run_output.py)."""

from __future__ import annotations

import logging
import os
import subprocess
import sys

from gfcr.engines.run_log import LoggerToFile, captured, open_run_log
from tests.conftest import REPO


WRITER = """
import logging, os, sys, warnings
from gfcr.engines.run_log import LoggerToFile, captured
from pathlib import Path
log = Path(sys.argv[1])
to_log = LoggerToFile(log)
with captured(log):
    logging.getLogger("vllm.model_executor.layerwise").warning("RotaryEmbedding: Failed to load weights")
    warnings.warn("`torch.distributed.reduce_op` is deprecated", FutureWarning)
    print("Loading safetensors checkpoint shards: 100%", file=sys.stderr)
    os.write(2, b"[W utils.cpp:68] Warning: NUMA binding\\n")  # as C++ writes: the descriptor itself
logging.getLogger("vllm.worker").warning("ParallelLMHead: Failed to load weights")  # a weight sync, later
print("progress bar")  # standard output stays the terminal's
to_log.close()
logging.getLogger("vllm").warning("after the engine closed")  # back where it was: the console
"""


def test_every_way_vllm_writes_goes_to_the_log_and_none_to_the_terminal(tmp_path):
    """In a fresh interpreter (no pytest capture between it and its descriptors)."""
    log = tmp_path / "run.log"
    done = subprocess.run([sys.executable, "-c", WRITER, str(log)], capture_output=True, text=True, timeout=60,
                          env={**os.environ, "PYTHONPATH": str(REPO)})
    assert done.returncode == 0, done.stderr
    assert done.stdout == "progress bar\n" and done.stderr == "after the engine closed\n"
    text = log.read_text()
    assert text.startswith("# ") and "the output of the libraries this run drives" in text.splitlines()[0]
    for line in ["WARNING vllm.model_executor.layerwise: RotaryEmbedding: Failed to load weights",
                 "FutureWarning: `torch.distributed.reduce_op` is deprecated",
                 "Loading safetensors checkpoint shards: 100%", "[W utils.cpp:68] Warning: NUMA binding",
                 "WARNING vllm.worker: ParallelLMHead: Failed to load weights"]:
        assert line in text, (line, text)
    assert "after the engine closed" not in text


def test_closing_gives_the_vllm_logger_its_own_handlers_back(tmp_path):
    logger = logging.getLogger("vllm")
    own = logging.StreamHandler(sys.stdout)
    logger.addHandler(own)
    try:
        to_log = LoggerToFile(tmp_path / "run.log")
        assert logger.handlers == [to_log.handler] and not logger.propagate
        to_log.close()
        assert own in logger.handlers and to_log.handler not in logger.handlers
    finally:
        logger.removeHandler(own)


def test_no_log_captures_nothing_and_the_header_is_written_once(tmp_path, capfd):
    with captured(None):
        os.write(2, b"on the terminal\n")
    assert capfd.readouterr().err == "on the terminal\n"
    path = open_run_log(tmp_path / "run.log")
    open_run_log(path)
    assert len(path.read_text().splitlines()) == 1
