"""A run directory's records as the runtime tests compare them: each step's metrics line and each
step's lineage rows, optionally without the keys that differ between two equal runs (``time``,
``run_id``)."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow.parquet as pq


def metrics(run_dir: Path, drop: tuple[str, ...] = ()) -> list[dict]:
    return [{k: v for k, v in json.loads(line).items() if k not in drop}
            for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def lineage(run_dir: Path, drop: tuple[str, ...] = ()) -> list[list[dict]]:
    return [[{k: v for k, v in row.items() if k not in drop} for row in pq.read_table(path).to_pylist()]
            for path in sorted((run_dir / "lineage").glob("step-*.parquet"))]
