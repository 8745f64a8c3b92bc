"""The MLflow outbox: the writes a tracking store could not take, kept in the run directory until it can.

When the MLflow server goes away during a run, training goes on and every MLflow write it makes
(a step's metrics, a lineage file, the run's totals and final status) is appended, in order, to
``<run dir>/mlflow-outbox.jsonl``, one JSON object a line::

    {"seq": 7, "op": "metrics", "metrics": [["reward_mean", 0.5, 1796299537763, 4], ...]}
    {"seq": 8, "op": "artifact", "path": "lineage/step-000004.parquet", "dest": "lineage"}
    {"seq": 9, "op": "terminate", "status": "FINISHED"}

``mlflow-outbox.sent`` holds the ``seq`` of the last line MLflow accepted (replaced by a rename).
Lines are sent in order, and a line is marked sent only after MLflow accepted it, so a process
killed between the two sends that line again. That is harmless: a metric keeps the timestamp it
was first logged with, and MLflow's SQL store keeps one row per (key, step, timestamp, value)
(``SqlAlchemyStore._log_metrics`` drops a duplicate); an artifact is overwritten; a status is
set again. When every line is sent, both files are removed.

A line cut by a kill in the middle of an append (no newline at its end) was never acknowledged
to anyone and its data is in ``metrics.jsonl`` (a resume logs the steps MLflow lacks): it is
dropped. Any other line that is not an entry is a damaged file: a ``GfcrError`` with file:line.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Callable, Iterable

from gfcr.errors import GfcrError
from gfcr.runtime.store.rundir import write_text

OUTBOX_FILE = "mlflow-outbox.jsonl"
SENT_FILE = "mlflow-outbox.sent"
OPS = ("metrics", "artifact", "terminate")


class Outbox:
    """The outbox of one run directory (see the module docstring)."""

    def __init__(self, run_dir: Path):
        self.run_dir = Path(run_dir)
        self.path = self.run_dir / OUTBOX_FILE
        self.sent_path = self.run_dir / SENT_FILE

    def pending(self) -> list[dict[str, Any]]:
        """The entries not yet sent, in order."""
        sent = self._sent()
        return [entry for entry in self._entries() if entry["seq"] > sent]

    def append(self, ops: Iterable[dict[str, Any]]) -> None:
        """Append ``ops`` (each ``{"op": ..., ...}``) after the entries already there."""
        entries = self._entries()
        seq = max(self._sent(), entries[-1]["seq"] if entries else 0)
        lines = []
        for op in ops:
            seq += 1
            stored = {k: v for k, v in op.items() if k != "file"}  # derived from path on reading
            lines.append(json.dumps({"seq": seq, **stored}, sort_keys=True) + "\n")
        if not lines:
            return
        with open(self.path, "a", encoding="utf-8") as f:
            f.write("".join(lines))
            f.flush()
            os.fsync(f.fileno())

    def drain(self, send: Callable[[dict[str, Any]], None]) -> int:
        """Call ``send`` on each pending entry in order, marking each sent once it returns;
        remove both files when all are sent. Returns how many were sent; ``send``'s exception
        (the store went away again) stops it, with the rest still pending."""
        done = 0
        for entry in self.pending():
            send(entry)
            write_text(self.sent_path, f"{entry['seq']}\n")
            done += 1
        self.path.unlink(missing_ok=True)
        self.sent_path.unlink(missing_ok=True)
        return done

    def pending_steps(self, key: str) -> set[int]:
        """The steps whose metric ``key`` waits here (a resume must not log them again)."""
        return {int(m[3]) for e in self.pending() if e["op"] == "metrics" for m in e["metrics"] if m[0] == key}

    def describe(self, entries: list[dict[str, Any]] | None = None) -> str:
        """What ``entries`` (default: the pending ones) hold, in a line: ``metrics of steps 3-7
        (412 values), 10 files, the run's end (FINISHED)``."""
        entries = self.pending() if entries is None else entries
        metrics = [m for e in entries if e["op"] == "metrics" for m in e["metrics"]]
        steps = sorted({int(m[3]) for m in metrics})
        parts = []
        if metrics:
            span = f"step {steps[0]}" if len(steps) == 1 else f"steps {steps[0]}-{steps[-1]}"
            parts.append(f"metrics of {span} ({len(metrics)} values)")
        files = [e["path"] for e in entries if e["op"] == "artifact"]
        if files:
            parts.append(f"{len(files)} file(s) ({', '.join(files[:3])}{', ...' if len(files) > 3 else ''})")
        parts += [f"the run's end ({e['status']})" for e in entries if e["op"] == "terminate"]
        return ", ".join(parts) or "nothing"

    # --- reading ------------------------------------------------------------------------------

    def _sent(self) -> int:
        if not self.sent_path.is_file():
            return 0
        text = self.sent_path.read_text(encoding="utf-8").strip()
        if not text.isdigit():
            raise GfcrError(f"{self.sent_path}:1: not a line number gfcr wrote ({text[:40]!r})",
                            f"delete {self.sent_path} to send the whole outbox again (MLflow keeps one copy "
                            "of a metric sent twice)")
        return int(text)

    def _entries(self) -> list[dict[str, Any]]:
        if not self.path.is_file():
            return []
        raw = self.path.read_bytes()
        lines = raw.split(b"\n")
        if lines[-1]:  # cut in the middle of an append by a kill: never acknowledged, in metrics.jsonl
            lines = lines[:-1]
        entries = []
        for number, line in enumerate(lines, 1):
            if line:
                entries.append(self._entry(line, number))
        return entries

    def _entry(self, line: bytes, number: int) -> dict[str, Any]:
        try:
            entry = json.loads(line)
            if not isinstance(entry, dict) or entry.get("op") not in OPS or not isinstance(entry.get("seq"), int):
                raise ValueError(f"needs an integer `seq` and an `op` of {', '.join(OPS)}")
        except ValueError as exc:
            raise GfcrError(f"{self.path}:{number}: not an outbox entry gfcr wrote ({exc})",
                            f"this file holds MLflow writes gfcr could not send; fix or delete line {number} "
                            "(its metrics are in metrics.jsonl, which `gfcr resume` logs again)") from None
        if entry["op"] == "artifact":
            entry["file"] = entry["path"] if os.path.isabs(entry["path"]) else str(self.run_dir / entry["path"])
        return entry


def send_entry(client: Any, run_id: str, entry: dict[str, Any]) -> None:
    """Make the MLflow write ``entry`` describes, on MLflow run ``run_id``."""
    from mlflow.entities import Metric

    from gfcr.tracking.mlflow_store import quiet

    with quiet():
        if entry["op"] == "metrics":
            client.log_batch(run_id, metrics=[Metric(k, v, ts, step) for k, v, ts, step in entry["metrics"]])
        elif entry["op"] == "artifact":
            if Path(entry["file"]).is_file():  # else cut back by a resume, which writes (and logs) it anew
                client.log_artifact(run_id, entry["file"], entry.get("dest"))
        elif entry["op"] == "terminate":
            client.set_terminated(run_id, entry["status"])


def artifact_op(run_dir: Path, path: Path, dest: str | None = None) -> dict[str, Any]:
    """The outbox entry that logs the file ``path`` (named relative to ``run_dir`` when inside it;
    ``file`` is its full path, which the outbox does not store)."""
    full = Path(path).resolve()
    try:
        name = str(full.relative_to(Path(run_dir).resolve()))
    except ValueError:
        name = str(full)
    return {"op": "artifact", "path": name, "dest": dest, "file": str(full)}
