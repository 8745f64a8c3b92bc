"""Open a run's replay store from its newest checkpoint, and summarise what it holds.

``gfcr replay inspect RUN_DIR`` uses these: the store of a ``replay.store`` stage is rebuilt
from ``checkpoints/step-N/stages/<id>/`` (its state and files, the checkpoint verified first)
with the stage's config from the run's ``spec.yaml``.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from gfcr.errors import CheckpointError, GfcrError, RunDirError
from gfcr.graph import load_pipeline
from gfcr.runtime.store.checkpoint import checkpoint_problems, latest_checkpoint, verify_checkpoint
from gfcr.runtime.store.rundir import RunDir
from gfcr.runtime.store.state_tree import read_tree
from gfcr.stages.common.embedding import load_embedder
from gfcr.stages.replay.rollout_store import ReplayStore
from gfcr.stages.replay.store import Store


@dataclass
class OpenedStore:
    stage_id: str
    checkpoint: Path
    step: int
    policy_version: int
    store: ReplayStore


def open_replay_store(run_dir: Path, stage_id: str | None = None) -> OpenedStore:
    """The store of ``stage_id`` (default: the run's only ``replay.store`` stage) at the newest checkpoint."""
    rd = RunDir(run_dir)
    if not rd.spec.is_file():
        state = "does not exist" if not Path(run_dir).exists() else "is not a gfcr run directory (no spec.yaml)"
        raise RunDirError(f"{run_dir} {state}", "pass the folder `gfcr run` printed")
    pipeline = load_pipeline(rd.spec)
    stores = [sid for sid, node in pipeline.nodes.items() if issubclass(node.info.cls, Store)]
    sid = _pick(run_dir, stores, stage_id)
    checkpoint = latest_checkpoint(rd)
    if checkpoint is None:
        problems = checkpoint_problems(rd)
        raise CheckpointError(f"{run_dir} has no complete checkpoint" + (f": {problems[0].message}" if problems else ""),
                              "the store is saved with each checkpoint: set `run.checkpoint_every`, or let the run "
                              "finish (it checkpoints at the end)")
    manifest = verify_checkpoint(checkpoint)
    config = pipeline.nodes[sid].config
    store = ReplayStore(config, load_embedder(config.embedder))
    store.load(checkpoint / "stages" / sid / "files", read_tree(checkpoint / "stages" / sid))
    return OpenedStore(sid, checkpoint, int(manifest["step"]), int(manifest["policy_version"]), store)


def _pick(run_dir: Path, stores: list[str], stage_id: str | None) -> str:
    if not stores:
        raise GfcrError(f"the pipeline of {run_dir} has no replay.store stage", "inspect a run whose spec uses one")
    if stage_id is None:
        if len(stores) > 1:
            raise GfcrError(f"the pipeline of {run_dir} has {len(stores)} replay stores: {', '.join(stores)}",
                            f"name one with --stage, e.g. --stage {stores[0]}")
        return stores[0]
    if stage_id not in stores:
        raise GfcrError(f"the pipeline of {run_dir} has no replay store `{stage_id}`",
                        f"its replay stores: {', '.join(stores)}")
    return stage_id


def summarize(store: ReplayStore, policy_version: int, top: int = 10) -> dict[str, Any]:
    """Counts by prompt (the ``top`` largest), by the step they were added, by staleness, by reward."""
    entries = store.entries()
    by_prompt = Counter(e.prompt_id for e in entries)
    rewards = [e.reward for e in entries if e.reward is not None]
    return {
        "entries": len(store), "prompts": store.prompt_count, "bytes": store.nbytes, "totals": dict(store.totals),
        "top_prompts": [(pid, n, store.prompt_text(pid) or "", _mean([e.reward for e in store.for_prompt(pid)]))
                        for pid, n in sorted(by_prompt.items(), key=lambda kv: (-kv[1], kv[0]))[:top]],
        "added_step": sorted(Counter(e.added_step for e in entries).items()),
        "staleness": sorted(Counter(e.staleness(policy_version) for e in entries).items()),
        "reward": _reward_summary(rewards),
        "unscored": len(entries) - len(rewards),
    }


def _mean(values: list[float | None]) -> float | None:
    scored = [v for v in values if v is not None]
    return sum(scored) / len(scored) if scored else None


def _reward_summary(rewards: list[float]) -> dict[str, Any]:
    if not rewards:
        return {}
    values = np.array(rewards, dtype=np.float64)
    distinct = Counter(rewards)
    summary: dict[str, Any] = {"mean": float(values.mean()), "min": float(values.min()), "max": float(values.max())}
    if len(distinct) <= 10:
        summary["counts"] = sorted(distinct.items())
    else:
        summary["quartiles"] = [float(q) for q in np.quantile(values, [0.25, 0.5, 0.75])]
    return summary
