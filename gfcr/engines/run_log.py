"""The run's log file (``run.log`` in the run directory): what the libraries a run drives write,
kept off the terminal, where ``gfcr run`` prints its progress bar and summary only.

vLLM writes through its loggers (``vllm.*``: start-up notes, and two warnings after every weight
sync, "RotaryEmbedding: Failed to load weights" and "ParallelLMHead: Failed to load weights",
which are expected: gfcr sends parameters only, vLLM recomputes the rotary table and the LM
head is tied to the embedding), through Python's warnings, through ``print``/tqdm on
``sys.stderr``, and from C++ (oneDNN, NUMA binding) straight to file descriptor 2. So, while the
engine starts, syncs, samples or stops (``captured``), file descriptor 2 and ``sys.stderr`` point
at the log, and the ``vllm`` logger writes there (``vllm_logs_to``) for the engine's whole life.
Standard output is left alone: the progress bar draws there. vLLM's engine core runs in the
trainer's process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``); worker processes it spawns (tensor
parallelism on CUDA) inherit descriptor 2 while it starts, and so write to the log too.
"""

from __future__ import annotations

import logging
import os
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

RUN_LOG = "run.log"
FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def open_run_log(path: Path) -> Path:
    """``path`` with its header line written if it is new (the header names what the file holds)."""
    if not path.exists():
        path.write_text(f"# {time.strftime('%Y-%m-%dT%H:%M:%S%z')}: the output of the libraries this run drives "
                        "(vLLM's log, warnings, messages of native code), kept off the terminal\n")
    return path


def holds_output(path: Path) -> bool:
    """Whether the run log holds anything beyond its header line (a library wrote to it)."""
    with open(path, encoding="utf-8", errors="replace") as log:
        return len(log.readlines()) > 1


@contextmanager
def captured(path: Path | None) -> Iterator[None]:
    """Descriptor 2 and ``sys.stderr`` into ``path`` (appended) for the block; nothing when ``path``
    is None (an engine started from Python, outside a run)."""
    if path is None:
        yield
        return
    open_run_log(path)
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    saved_fd, saved_stream = os.dup(2), sys.stderr
    with open(path, "a", buffering=1) as log:
        os.dup2(log.fileno(), 2)
        sys.stderr = log
        try:
            yield
        finally:
            log.flush()
            sys.stderr = saved_stream
            os.dup2(saved_fd, 2)
            os.close(saved_fd)


class LoggerToFile:
    """The ``vllm`` logger writing to the run's log instead of its own handlers, until ``close``
    (which puts them back: a later engine in the process, outside a run, logs as vLLM does)."""

    def __init__(self, path: Path, name: str = "vllm"):
        self.logger = logging.getLogger(name)
        self.saved = (list(self.logger.handlers), self.logger.propagate, self.logger.level)
        self.handler = logging.FileHandler(open_run_log(path), encoding="utf-8")
        self.handler.setFormatter(logging.Formatter(FORMAT))
        for handler in self.saved[0]:
            self.logger.removeHandler(handler)
        self.logger.addHandler(self.handler)
        self.logger.propagate = False
        self.logger.setLevel(os.environ.get("VLLM_LOGGING_LEVEL", "INFO"))

    def close(self) -> None:
        self.logger.removeHandler(self.handler)
        self.handler.close()
        handlers, propagate, level = self.saved
        for handler in handlers:
            self.logger.addHandler(handler)
        self.logger.propagate, self.logger.level = propagate, level
