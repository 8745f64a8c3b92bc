"""Checkpoints: the complete state of a run after a step, in one atomically written file.

A checkpoint holds the runner's position and every stateful stage's state (optimizer
included), the policy's weights and version, and the RNG states of torch, numpy and
Python. Loading one and running on gives exactly the steps an uninterrupted run would
have run (on CPU, with a fixed seed): the engine reseeds per step from the run's seed,
and the stages derive their draws from ``(seed, step)`` or carry them in their state.
"""

from __future__ import annotations

import random
import zipfile
from pathlib import Path
from typing import Any

import numpy as np
import torch

from gfcr.runtime.local import LocalRunner
from gfcr.runtime.rundir import RunDir, atomic_path
from gfcr.stages.resources import Resources

FORMAT = 1


def save_checkpoint(run_dir: RunDir, runner: LocalRunner, resources: Resources, keep: int = 2) -> Path:
    path = run_dir.checkpoint(runner.step)
    state = {
        "format": FORMAT,
        "runner": runner.state_dict(),
        "policy": None if resources.policy is None else {
            "version": resources.policy.version, "weights": resources.policy.model.state_dict()},
        "rng": {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()},
    }
    with atomic_path(path) as tmp:
        torch.save(state, tmp)
    run_dir.prune_checkpoints(keep)
    return path


def load_checkpoint(path: Path, runner: LocalRunner, resources: Resources) -> None:
    state: dict[str, Any] = torch.load(path, map_location="cpu", weights_only=False)
    if state.get("format") != FORMAT:
        raise ValueError(f"{path}: checkpoint format {state.get('format')!r}, this gfcr reads format {FORMAT}")
    if state["policy"] is not None:
        if resources.policy is None:
            raise ValueError(f"{path} holds policy weights but the pipeline has no policy")
        resources.policy.model.load_state_dict(state["policy"]["weights"])
        resources.policy.version = int(state["policy"]["version"])
    runner.load_state_dict(state["runner"])
    torch.set_rng_state(state["rng"]["torch"])
    np.random.set_state(state["rng"]["numpy"])
    random.setstate(state["rng"]["python"])


def latest_checkpoint(run_dir: RunDir) -> Path | None:
    """The newest complete checkpoint. Writes are atomic (a killed write leaves only a hidden
    temporary file), so a final name is complete; the zip check guards against a copy cut short."""
    for _, path in run_dir.checkpoints():
        if zipfile.is_zipfile(path):
            return path
    return None
