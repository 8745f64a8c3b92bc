"""The replay store's metadata as parquet: ``entries.parquet`` (one row per stored rollout, token
ids, segments and log-probs as list columns) and ``prompts.parquet`` (one row per prompt). The
stages that keep rollouts without a store (``gfcr.stages.common.reuse``) and RLEP's experience
pool save theirs as ``entries.parquet`` too.

Parquet holds plain columns, never pickled objects, so a store from anywhere is data. A file
that cannot be read, or that lacks a column, is a ``CheckpointError`` naming it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterable

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from gfcr.errors import CheckpointError
from gfcr.records import Origin, RolloutStatus, Segment, SegmentOrigin
from gfcr.stages.common.stored import StoredRollout

ENTRIES, PROMPTS = "entries.parquet", "prompts.parquet"
_FIX = ("the replay store's checkpoint files are damaged: delete this checkpoint directory to resume from an "
        "older one, or start the run again")

ENTRY_SCHEMA = pa.schema([
    ("entry_id", pa.int64()), ("rollout_id", pa.string()), ("group_id", pa.string()), ("prompt_id", pa.string()),
    ("step", pa.int64()), ("added_step", pa.int64()), ("response_token_ids", pa.list_(pa.int32())),
    ("segment_start", pa.list_(pa.int32())), ("segment_end", pa.list_(pa.int32())),
    ("segment_policy_version", pa.list_(pa.int64())), ("segment_origin", pa.list_(pa.string())),
    ("behavior_logprobs", pa.list_(pa.float32())), ("status", pa.string()), ("origin", pa.string()),
    ("finish_reason", pa.string()), ("text", pa.string()), ("reward", pa.float64()), ("correct", pa.bool_()),
    ("priority", pa.float64()), ("nbytes", pa.int64()),
])
PROMPT_SCHEMA = pa.schema([("prompt_key", pa.int64()), ("prompt_id", pa.string()), ("text", pa.string())])


def write_entries(entries: Iterable[StoredRollout], path: Path) -> None:
    rows = list(entries)
    columns = {
        "entry_id": [e.entry_id for e in rows], "rollout_id": [e.rollout_id for e in rows],
        "group_id": [e.group_id for e in rows], "prompt_id": [e.prompt_id for e in rows],
        "step": [e.step for e in rows], "added_step": [e.added_step for e in rows],
        "response_token_ids": [e.response_token_ids for e in rows],
        "segment_start": [[s.start for s in e.segments] for e in rows],
        "segment_end": [[s.end for s in e.segments] for e in rows],
        "segment_policy_version": [[s.policy_version for s in e.segments] for e in rows],
        "segment_origin": [[s.origin.value for s in e.segments] for e in rows],
        "behavior_logprobs": [_logprobs(e) for e in rows],
        "status": [e.status.value for e in rows], "origin": [e.origin.value for e in rows],
        "finish_reason": [e.finish_reason for e in rows], "text": [e.text for e in rows],
        "reward": [e.reward for e in rows], "correct": [e.correct for e in rows],
        "priority": [e.priority for e in rows], "nbytes": [e.nbytes for e in rows],
    }
    pq.write_table(pa.table(columns, schema=ENTRY_SCHEMA), path, compression="zstd")


def _logprobs(entry: StoredRollout) -> np.ndarray:
    if not entry.segments:
        return np.zeros(0, dtype=np.float32)
    return np.concatenate([s.behavior_logprobs for s in entry.segments])


def read_entries(path: Path) -> list[StoredRollout]:
    table = _read(path, ENTRY_SCHEMA)
    return [_entry(row) for row in table.to_pylist()]


def _entry(row: dict) -> StoredRollout:
    logprobs = np.asarray(row["behavior_logprobs"], dtype=np.float32)
    segments = tuple(Segment(a, b, v, logprobs[a:b], SegmentOrigin(o)) for a, b, v, o in zip(
        row["segment_start"], row["segment_end"], row["segment_policy_version"], row["segment_origin"]))
    return StoredRollout(
        entry_id=row["entry_id"], rollout_id=row["rollout_id"], group_id=row["group_id"],
        prompt_id=row["prompt_id"], step=row["step"], added_step=row["added_step"],
        response_token_ids=np.asarray(row["response_token_ids"], dtype=np.int32), segments=segments,
        status=RolloutStatus(row["status"]), origin=Origin(row["origin"]), finish_reason=row["finish_reason"],
        text=row["text"], reward=row["reward"], correct=row["correct"], priority=row["priority"],
        nbytes=row["nbytes"])


def write_prompts(prompts: Iterable[tuple[int, str, str]], path: Path) -> None:
    rows = list(prompts)
    pq.write_table(pa.table({"prompt_key": [r[0] for r in rows], "prompt_id": [r[1] for r in rows],
                             "text": [r[2] for r in rows]}, schema=PROMPT_SCHEMA), path, compression="zstd")


def read_prompts(path: Path) -> list[tuple[int, str, str]]:
    table = _read(path, PROMPT_SCHEMA)
    return list(zip(table["prompt_key"].to_pylist(), table["prompt_id"].to_pylist(), table["text"].to_pylist()))


def _read(path: Path, schema: pa.Schema) -> pa.Table:
    try:
        table = pq.read_table(path)
    except Exception as exc:  # pyarrow's ArrowInvalid on a short or foreign file
        raise CheckpointError(f"{path} is not a readable parquet file (truncated or corrupt): {exc}", _FIX) from None
    missing = [name for name in schema.names if name not in table.column_names]
    if missing:
        raise CheckpointError(f"{path} lacks the column `{missing[0]}` of a replay store", _FIX)
    return table.select(schema.names)
