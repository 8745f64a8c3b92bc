"""Wall time of `gfcr validate` on one pipeline file, next to a bare interpreter start.

    .venv/bin/python benchmarks/validate_time.py [--repeats 15] [FILE]

Both are measured in the same run, alternating, as fresh processes (what an editor hook
or CI step pays). Prints the medians and the ratio.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def wall(cmd: list[str]) -> float:
    start = time.perf_counter()
    subprocess.run(cmd, check=True, capture_output=True)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("file", nargs="?", default=str(REPO / "pipelines/examples/fake_dapo.yaml"))
    parser.add_argument("--repeats", type=int, default=15)
    args = parser.parse_args()
    gfcr = str(Path(sys.executable).with_name("gfcr"))
    bare, validate = [], []
    wall([gfcr, "validate", args.file])  # warm the file cache once
    for _ in range(args.repeats):
        bare.append(wall([sys.executable, "-c", "pass"]))
        validate.append(wall([gfcr, "validate", args.file]))
    b, v = statistics.median(bare), statistics.median(validate)
    print(f"file: {Path(args.file).relative_to(REPO) if Path(args.file).is_relative_to(REPO) else args.file}")
    print(f"python -c pass      median {b:.3f} s  (min {min(bare):.3f}, max {max(bare):.3f})")
    print(f"gfcr validate FILE  median {v:.3f} s  (min {min(validate):.3f}, max {max(validate):.3f})")
    print(f"ratio validate / bare interpreter: {v / b:.1f}x; budget 1.5 s: {'met' if v < 1.5 else 'MISSED'}")


if __name__ == "__main__":
    main()
