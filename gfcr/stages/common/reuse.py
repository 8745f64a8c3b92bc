"""What the stages that reuse rollouts share (``replay.rollout_replay``, ``replay.correct_cache``,
``control.pilot_commit``): keeping a rollout for a later step, making a reused copy of it, and
saving kept rollouts with a checkpoint.

A kept rollout is a ``StoredRollout`` (``gfcr.stages.common.stored``: token ids, segments with
policy versions and behaviour log-probs, outcome, step), without an embedding: these stages
look rollouts up by prompt id only, so they own no ``ReplayStore`` and pay for no embedder. Their
files are the store's ``entries.parquet`` format (``gfcr.stages.common.store_files``): plain
columns, no pickle.

A reused copy (``reuse``) is a new ``Rollout`` with a new id in the group it joins, the same
tokens, segments (so its staleness, ``current version - segment version``, is what the update's
off-policy corrections see), reward and correctness, ``origin`` ``replayed`` or
``cached_correct``, ``replayed_from`` the original's id and ``created_step`` its step. The
runtime counts it in no step's ``tokens_generated`` but its own (``Rollout.reused``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterable

from gfcr.records import Origin, Rollout
from gfcr.stages.common.store_files import read_entries, write_entries
from gfcr.stages.common.stored import StoredRollout, stored_from


def keep(rollout: Rollout, entry_id: int, step: int) -> StoredRollout:
    """A copy of ``rollout`` to reuse later (its update-time fields are left behind)."""
    return stored_from(rollout, entry_id, step, rollout.text or "", priority=0.0, dim=0)


def reuse(entry: StoredRollout, rollout_id: str, group_id: str, origin: Origin) -> Rollout:
    """A new rollout of group ``group_id`` copying ``entry`` (origin, lineage as above)."""
    return entry.to_rollout(rollout_id, group_id, origin=origin)


def save_entries(entries: Iterable[StoredRollout], path: Path) -> None:
    write_entries(entries, path)


def load_entries(path: Path) -> list[StoredRollout]:
    """The rollouts ``save_entries`` wrote; a missing or damaged file is a CheckpointError."""
    return read_entries(path)
