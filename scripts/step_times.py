"""Print the step times of one or more runs side by side (``scripts/gpu_check.sh`` reads them).

Usage: python scripts/step_times.py RUN_DIR/metrics.jsonl [RUN_DIR/metrics.jsonl ...]

One table a run: per step its wall, each stage's, the eval's, the reward and the eval accuracy;
then, for two runs or more, each run's median step wall over the steps after the first (which
carries start-up) and its ratio to the first run's.
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path


def read(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def table(path: Path, rows: list[dict]) -> None:
    print(f"{path}:")
    for r in rows:
        stages = " ".join(f"{k}={v:.3f}s" for k, v in r["time"]["stages_s"].items())
        accuracy = r.get("eval_accuracy")
        print(f"  step {r['step']}: {r['time']['step_s']:.3f} s ({stages}); eval {r['time'].get('eval_s', 0):.2f} s; "
              f"reward {r['reward_mean']:.3f}; eval accuracy {accuracy if accuracy is None else f'{accuracy:.3f}'}")


def steady(rows: list[dict]) -> float:
    walls = [r["time"]["step_s"] for r in rows[1:]] or [r["time"]["step_s"] for r in rows]
    return statistics.median(walls)


def main(paths: list[str]) -> int:
    if not paths:
        print(__doc__)
        return 2
    runs = []
    for p in map(Path, paths):
        if not p.is_file():
            print(f"{p}: missing (the run failed before its first step?)")
            continue
        rows = read(p)
        table(p, rows)
        runs.append((p, rows))
    if len(runs) > 1:
        first = steady(runs[0][1])
        for p, rows in runs:
            print(f"median step after the first: {steady(rows):.3f} s ({steady(rows) / first:.2f}x of {runs[0][0]}) "
                  f"for {p}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
