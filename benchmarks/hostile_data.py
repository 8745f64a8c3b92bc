"""Hostile data files (issue 31, Build 5): seconds and peak memory of `gfcr validate` and of a
data source's ``load`` on a 50 MB row, a JSON array on one line, invalid UTF-8, a gzip blob
pasted in, a gzip file cut short and a million rows, next to the same on a good file of 7 rows
(the baseline), all in one run.

    PYTHONPATH=$PWD HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/hostile_data.py \\
        [--out benchmarks/results/hostile_data.json]

The files and the ops are the ones ``tests/stages/data/test_hostile_data.py`` checks (its
makers and its child process are reused here; the long row 50 MB where the test writes 20), plus
the whole load of a million rows. Each op
runs alone in a fresh process, so the figures are its own: ``s`` is the op's wall time once gfcr
is imported, ``CPU s`` its CPU time (what a loaded machine does not inflate); ``peak`` is the process's peak RSS during the op (VmHWM reset before it), ``grew``
that peak over the RSS just before the op; ``process peak`` is getrusage's ``ru_maxrss`` of the
whole process, the import included.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import tempfile
import time
from pathlib import Path

from tests.stages.data.test_hostile_data import GOOD, MILLION, Op, baseline, hostile_ops, jsonl, many_rows, run_child


def measure(ops: list[tuple[Op, Path]], folder: Path) -> list[dict]:
    rows = []
    for op, _ in ops:
        start = time.perf_counter()
        [result] = run_child([op.op], folder, timeout=900)
        outcome = (f"exit {result['exit']}" if "exit" in result else
                   f"{result['prompts']} prompts" if "prompts" in result else "DataError")
        rows.append({"op": op.id, "outcome": outcome, "s": result["s"], "cpu_s": result["cpu_s"], "process_s": time.perf_counter() - start,
                     "peak_mb": result["peak_mb"], "grew_mb": result["peak_mb"] - result["rss_before_mb"],
                     "process_peak_mb": result["process_peak_mb"]})
        print(json.dumps(rows[-1]), flush=True)
    return rows


def table(rows: list[dict]) -> str:
    base = {"validate": rows[0], "load": rows[1]}
    lines = ["| op | outcome | s (op) | CPU s (op) | x baseline | process s | peak RSS MB (op) | grew MB | "
             "process peak MB |", "|---|---|---|---|---|---|---|---|---|"]
    for row in rows:
        ref = base["validate" if "validate" in row["op"] else "load"]
        ratio = row["s"] / ref["s"] if ref["s"] > 0 else float("nan")
        lines.append(f"| {row['op']} | {row['outcome']} | {row['s']:.3f} | {row['cpu_s']:.3f} | {ratio:.1f} | {row['process_s']:.1f} | "
                     f"{row['peak_mb']:.0f} | {row['grew_mb']:+.0f} | {row['process_peak_mb']:.0f} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="benchmarks/results/hostile_data.json")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="gfcr-hostile-") as tmp:
        folder = Path(tmp)
        ops = baseline(folder) + [entry for entries in hostile_ops(folder, big_mb=50).values() for entry in entries]
        rows = many_rows(folder, name="whole")
        ops.append((Op("load: a million rows, whole (no limit)", {"load": "jsonl", "config": jsonl(rows)},
                       prompts=MILLION), rows))
        load = os.getloadavg()
        results = measure(ops, folder)
    print(table(results))
    info = {"machine": f"{platform.node()}, {os.cpu_count()} cores", "load_start": load[0],
            "load_end": os.getloadavg()[0], "million_row_file_mb": len(GOOD) * MILLION / 1e6, "rows": results}
    Path(args.out).write_text(json.dumps(info, indent=1))
    print(f"load average {load[0]:.1f} at the start, {info['load_end']:.1f} at the end; wrote {args.out}")


if __name__ == "__main__":
    main()
