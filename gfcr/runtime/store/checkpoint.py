"""Checkpoints: the complete state of a run after a step, as a directory with a manifest.

    checkpoints/step-000008/
      manifest.json              format, step, policy version, gfcr version, every file's size and sha256
      runner.json                the runner's position: step, policy version, the stateful stages
      policy.safetensors         the policy's weights (tied weights stored once)
      adapter.safetensors        instead, with ``policy.lora``: the LoRA adapter alone (the base is the model's own)
      rng/torch.safetensors      torch's RNG state, a uint8 tensor
      rng/numpy.json             numpy's legacy global RNG state
      rng/python.json            Python's ``random`` state
      stages/<stage id>/state.json            a stateful stage's state tree (see state_tree.py)
      stages/<stage id>/tensors.safetensors   its tensors and arrays (an optimizer's moments)
      stages/<stage id>/files/                the files a stage owns (``save_files``), e.g. an index
      lifecycle/                 under ``lifecycle: {mode: pipelined}``: the weights of the last lag + 1 steps

Nothing is a pickle: loading a checkpoint from anyone reads JSON and safetensors and runs no
code. A listed file that is a pickle (a ``torch.save`` where safetensors belongs, say) makes the
whole directory "not a gfcr checkpoint": refused unread, with the path and the fix. The directory is built in a hidden temporary sibling, every file fsynced, then renamed,
so a kill leaves the previous checkpoints untouched and no half-written ``step-N``.
``latest_checkpoint`` takes the newest directory whose manifest reads and whose files all
exist with their sizes; ``load_checkpoint`` also checks every file's sha256.

Loading one and running on gives exactly the steps an uninterrupted run would have run (on
CPU, with a fixed seed): the engine reseeds per step from the run's seed, and the stages
derive their draws from ``(seed, step)`` or carry them in their state.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch
from safetensors.torch import load_model, save_file, save_model

from gfcr.errors import CheckpointError
from gfcr.registry import OwnsFiles, Stateful
from gfcr.runtime.store.diskspace import disk_write, tree_bytes
from gfcr.runtime.store.rundir import RunDir, gfcr_version
from gfcr.runtime.store.manifest import (  # noqa: F401  (re-exported: where checkpoints were always read)
    _DAMAGED, FORMAT, KIND, MANIFEST, POLICY, RUNNER, _sha256, checkpoint_problems, latest_checkpoint,
    read_manifest, verify_checkpoint,
)
from gfcr.runtime.store.state_tree import check_safetensors, load_tensors, read_tree, write_tree
from gfcr.stages.resources import Lent

RNG_TORCH, RNG_NUMPY, RNG_PYTHON = "rng/torch.safetensors", "rng/numpy.json", "rng/python.json"
ADAPTER = "adapter.safetensors"  # with policy.lora: the adapter's tensors, by peft's names
LIFECYCLE = "lifecycle"  # lifecycle/state.json + tensors.safetensors: the pipelined schedule's weight history


# --- writing ---------------------------------------------------------------------------------


class Checkpointed(Protocol):
    """What a checkpoint saves and loads of a runner (``gfcr.runtime.loop.local.LocalRunner``)."""

    step: int
    stages: dict[str, Any]
    schedule: Any  # a stale lifecycle's schedule (its weight history), or None

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


def save_checkpoint(run_dir: RunDir, runner: Checkpointed, lent: Lent, keep: int = 2) -> Path:
    """Write the checkpoint of ``runner.step`` atomically, then keep the newest ``keep``."""
    final = run_dir.checkpoint(runner.step)
    final.parent.mkdir(parents=True, exist_ok=True)
    newest = run_dir.checkpoints()[0][1] if run_dir.checkpoints() else None
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.", suffix=".tmp", dir=final.parent))
    try:  # a full disk: the partial copy is removed below, the older checkpoints are untouched
        with disk_write(f"checkpoint of step {runner.step}", final,
                        lambda: max(tree_bytes(tmp), tree_bytes(newest) if newest is not None else 0)):
            _write(tmp, runner, lent)
            _fsync_tree(tmp)
            _replace_dir(tmp, final)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    run_dir.prune_checkpoints(keep)
    return final


def _write(root: Path, runner: Checkpointed, lent: Lent) -> None:
    state = runner.state_dict()
    stages: dict[str, Any] = state["stages"]
    policy = lent.policy
    _write_json(root / RUNNER, {"step": state["step"], "policy_version": state["policy_version"],
                                "stages": sorted(stages)})
    if policy is not None and policy.lora is not None:  # the base weights are frozen: the model's folder has them
        save_file({k: v.cpu().contiguous() for k, v in policy.adapter_state().items()}, str(root / ADAPTER),
                  metadata={"policy_version": str(policy.version)})
    elif policy is not None:
        save_model(policy.model, str(root / POLICY), metadata={"policy_version": str(policy.version)})
    _write_rng(root)
    for sid, tree in stages.items():
        write_tree(tree, root / "stages" / sid, where=f"stage `{sid}`")
    if runner.schedule is not None:  # a stale lifecycle's weights of the last `lag + 2` steps
        write_tree(runner.schedule.state_dict(), root / LIFECYCLE, where="the pipelined lifecycle")
    for sid, stage in runner.stages.items():
        if isinstance(stage, OwnsFiles):
            (root / "stages" / sid / "files").mkdir(parents=True)
            stage.save_files(root / "stages" / sid / "files")
    _write_json(root / MANIFEST, {
        "kind": KIND, "format": FORMAT, "step": state["step"], "policy_version": state["policy_version"],
        "weights_version": None if policy is None else policy.version, "gfcr": gfcr_version(),
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "files": _file_list(root),
    })


def _write_rng(root: Path) -> None:
    (root / "rng").mkdir()
    save_file({"state": torch.get_rng_state()}, str(root / RNG_TORCH))
    name, key, pos, has_gauss, gauss = np.random.get_state()
    _write_json(root / RNG_NUMPY, {"bit_generator": name, "key": key.tolist(), "pos": int(pos),
                                   "has_gauss": int(has_gauss), "cached_gaussian": float(gauss)})
    version, internal, gauss_next = random.getstate()
    _write_json(root / RNG_PYTHON, {"version": version, "state": list(internal), "gauss_next": gauss_next})


def _write_json(path: Path, value: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(value, indent=1, allow_nan=False) + "\n", encoding="utf-8")


def _file_list(root: Path) -> list[dict[str, Any]]:
    files = sorted(p for p in root.rglob("*") if p.is_file())
    return [{"path": p.relative_to(root).as_posix(), "bytes": p.stat().st_size, "sha256": _sha256(p)} for p in files]


def _fsync_tree(root: Path) -> None:
    for path in sorted(root.rglob("*"), key=lambda p: len(p.parts), reverse=True) + [root]:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _replace_dir(tmp: Path, final: Path) -> None:
    """Rename ``tmp`` to ``final``. A directory cannot be renamed over a non-empty one, so an old
    ``final`` (a damaged checkpoint of this step, skipped on resume) is moved aside first."""
    if final.exists():
        old = Path(tempfile.mkdtemp(prefix=f".{final.name}.old-", suffix=".tmp", dir=final.parent))
        os.replace(final, old / final.name)
        os.replace(tmp, final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(tmp, final)
    fd = os.open(final.parent, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# --- reading ---------------------------------------------------------------------------------

def load_checkpoint(path: Path, runner: Checkpointed, lent: Lent) -> None:
    """Restore the run's state from checkpoint directory ``path`` (verified first: a damaged
    checkpoint fails before anything is changed)."""
    manifest = verify_checkpoint(path)
    position = _read_json(path, RUNNER)
    stage_states = _read_stages(path, runner, position)
    _load_policy(path, manifest, lent)
    runner.load_state_dict({"step": position["step"], "policy_version": position["policy_version"],
                            "stages": stage_states})
    if runner.schedule is not None:
        if not (path / LIFECYCLE).is_dir():
            raise CheckpointError(f"{path} holds no pipelined lifecycle state, and the pipeline declares "
                                  "`lifecycle: {mode: pipelined}`", "resume with the spec.yaml this checkpoint "
                                  "was saved with, or start a new run with `gfcr run`")
        runner.schedule.load_state_dict(read_tree(path / LIFECYCLE, checkpoint=path))
    for sid, stage in runner.stages.items():
        if isinstance(stage, OwnsFiles):
            stage.load_files(path / "stages" / sid / "files")
    _load_rng(path)


def _read_stages(path: Path, runner: Checkpointed, position: dict[str, Any]) -> dict[str, Any]:
    stateful = {sid for sid, s in runner.stages.items() if isinstance(s, Stateful)}
    saved = set(position["stages"])
    if missing := sorted(stateful - saved):
        raise CheckpointError(
            f"{path}: no state for stage `{missing[0]}` ({type(runner.stages[missing[0]]).__name__}), which keeps state",
            "the pipeline changed since this checkpoint was written: resume with the spec.yaml it was saved with, "
            "or start a new run with `gfcr run`")
    if extra := sorted(saved - stateful):
        raise CheckpointError(
            f"{path}: holds the state of stage `{extra[0]}`, which this pipeline has no stateful stage for",
            "resume with the spec.yaml this checkpoint was saved with, or start a new run with `gfcr run`")
    return {sid: read_tree(path / "stages" / sid, checkpoint=path) for sid in position["stages"]}


def _load_policy(path: Path, manifest: dict[str, Any], lent: Lent) -> None:
    has_weights = (path / POLICY).is_file() or (path / ADAPTER).is_file()
    if has_weights != (lent.policy is not None):
        what = "holds policy weights but the pipeline has no policy" if has_weights else \
            "holds no policy weights but the pipeline has a policy"
        raise CheckpointError(f"{path} {what}", "resume with the spec.yaml this checkpoint was saved with")
    if lent.policy is None:
        return
    if (path / ADAPTER).is_file() != (lent.policy.lora is not None):
        what = ("holds a LoRA adapter, and the pipeline trains every weight" if lent.policy.lora is None else
                "holds every weight of the policy, and the pipeline trains a LoRA adapter (`policy.lora`)")
        raise CheckpointError(f"{path} {what}", "resume with the spec.yaml this checkpoint was saved with")
    if lent.policy.lora is not None:
        _load_adapter(path, manifest, lent.policy)
        return
    check_safetensors(path / POLICY, path)  # a pickle or a foreign file is refused before the model is touched
    try:
        model = lent.policy.model
        load_model(model, str(path / POLICY), strict=True, device=str(next(model.parameters()).device))
    except RuntimeError as exc:  # missing/unexpected keys or a shape mismatch: another model's weights
        raise CheckpointError(f"{path / POLICY} does not fit the policy `{lent.policy.name}`: {exc}",
                              "resume with the policy.model this checkpoint was trained from") from None
    lent.policy.version = int(manifest["weights_version"])


def _load_adapter(path: Path, manifest: dict[str, Any], policy: Any) -> None:
    """The checkpoint's LoRA adapter into the policy (its base weights are the model folder's)."""
    tensors = load_tensors(path / ADAPTER, path)
    try:
        policy.load_adapter_state(tensors)
    except (ValueError, RuntimeError) as exc:  # other target modules, another rank, another model
        raise CheckpointError(f"{path / ADAPTER} does not fit the LoRA adapter of policy `{policy.name}`: {exc}",
                              "resume with the policy.model and policy.lora this checkpoint was trained with") from None
    policy.version = int(manifest["weights_version"])


def _load_rng(path: Path) -> None:
    torch.set_rng_state(load_tensors(path / RNG_TORCH, path)["state"])
    n = _read_json(path, RNG_NUMPY)
    np.random.set_state((n["bit_generator"], np.array(n["key"], dtype=np.uint32), n["pos"], n["has_gauss"],
                         n["cached_gaussian"]))
    p = _read_json(path, RNG_PYTHON)
    random.setstate((p["version"], tuple(p["state"]), p["gauss_next"]))


def _read_json(root: Path, name: str) -> Any:
    try:
        return json.loads((root / name).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"{root / name}: cannot read it: {exc}", _DAMAGED.format(path=root)) from None
