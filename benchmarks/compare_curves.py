"""Compare two ``seed_curves`` results (e.g. before and after a change that moves the samples):
per pipeline and step, each side's mean and seed range, the difference of means, and Welch's
t-test p-value (scipy). Prints a markdown table.

    .venv/bin/python benchmarks/compare_curves.py benchmarks/results/seed_curves_before.json \\
        benchmarks/results/seed_curves_after.json
"""

from __future__ import annotations

import json
import sys

from scipy.stats import ttest_ind


def main(before_path: str, after_path: str) -> None:
    before, after = (json.load(open(p))["results"] for p in (before_path, after_path))
    print("| pipeline | step | before: mean [min, max] | after: mean [min, max] | after - before | Welch p |")
    print("|---|---|---|---|---|---|")
    for name in before:
        for step in before[name]:
            if step == "0" or step not in after.get(name, {}):
                continue
            b, a = before[name][step], after[name][step]
            p = ttest_ind(a["seeds"], b["seeds"], equal_var=False).pvalue
            print(f"| {name} | {step} | {b['mean']:.3f} [{b['min']:.3f}, {b['max']:.3f}] | "
                  f"{a['mean']:.3f} [{a['min']:.3f}, {a['max']:.3f}] | {a['mean'] - b['mean']:+.3f} | {p:.2f} |")


if __name__ == "__main__":
    main(*sys.argv[1:3])
