"""Per-step lineage: one row per rollout, saying where it came from and where it went
(DESIGN.md section 7). Written as parquet, one file per step."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from gfcr.records import StepReport
from gfcr.runtime.rundir import atomic_path

SCHEMA = pa.schema([
    ("run_id", pa.string()), ("step", pa.int64()), ("rollout_id", pa.string()), ("group_id", pa.string()),
    ("prompt_id", pa.string()), ("origin", pa.string()), ("policy_version", pa.int64()),
    ("replica", pa.string()), ("status", pa.string()), ("finish_reason", pa.string()),
    ("n_tokens", pa.int64()), ("reward", pa.float64()), ("correct", pa.bool_()), ("reward_reason", pa.string()),
    ("advantage", pa.float64()), ("created_by", pa.string()), ("dropped_by", pa.string()),
    ("drop_reason", pa.string()), ("in_update", pa.bool_()),
])


def lineage_rows(report: StepReport) -> list[dict[str, Any]]:
    rows = []
    for g in report.groups:
        for r in g.rollouts:
            versions = r.policy_versions()
            advantage = r.advantage if r.advantage is None or isinstance(r.advantage, float) else float(
                sum(r.advantage) / max(len(r.advantage), 1))
            rows.append({
                "run_id": report.run_id, "step": report.step, "rollout_id": r.rollout_id, "group_id": g.group_id,
                "prompt_id": g.prompt_id, "origin": str(r.origin),
                "policy_version": int(versions.min()) if len(versions) else None,
                "replica": r.replica, "status": str(r.status), "finish_reason": r.finish_reason,
                "n_tokens": len(r), "reward": r.reward, "correct": r.correct, "reward_reason": r.reward_reason,
                "advantage": advantage, "created_by": report.created_by.get(g.group_id),
                "dropped_by": report.dropped_by.get(g.group_id, g.verdict.dropped_by),
                "drop_reason": g.verdict.reason,
                "in_update": g.group_id in report.update_group_ids,
            })
    return rows


def write_lineage(path: Path, report: StepReport) -> None:
    table = pa.Table.from_pylist(lineage_rows(report), schema=SCHEMA)
    with atomic_path(path) as tmp:
        pq.write_table(table, tmp)
