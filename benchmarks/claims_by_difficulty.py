"""Per-difficulty breakdown of the claims table's reasoning-gym rows (issue 42, Must show 3): for each
pipeline of a comparison folder, per difficulty bin (reasoning-gym task and level), the share of the
run's rollouts the bin got and the accuracy of its rollouts early and late, over every seed.

    PYTHONPATH=. HF_HUB_OFFLINE=1 python benchmarks/claims_by_difficulty.py runs/claims/rg-arith--quickstart--tokens12000--<hash> \\
        [--out benchmarks/results/claims_by_difficulty]

A difficulty-driven method acts through the first column (which prompts get rollouts, and how many)
to move the second; these are training rollouts (``gfcr.tracking.difficulty.accuracy_by_bin``), not a
held-out evaluation. "early" is the first third of a run's steps, "late" the last third. Writes
``<out>/<folder name>.md`` (the table) and ``<out>/<folder name>.png`` (late accuracy and rollout share
by bin, one bar per pipeline).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from gfcr.tracking.difficulty import accuracy_by_bin, wilson  # noqa: E402 (after the path)


def pipeline_bins(folder: Path) -> dict[str, dict[tuple, dict[str, int]]]:
    """Per pipeline (a cell folder ``<name>-seed<k>``), per bin: rollouts and correct, in all and in
    the early and late thirds of each run, summed over seeds."""
    out: dict[str, dict[tuple, dict[str, int]]] = {}
    for cell in sorted(p for p in folder.iterdir() if p.is_dir() and "-seed" in p.name):
        name = cell.name.rsplit("-seed", 1)[0]
        bins = accuracy_by_bin(cell)
        steps = sorted({p.step for points in bins.values() for p in points})
        if not steps:
            continue
        third = max(1, len(steps) // 3)
        early, late = set(steps[:third]), set(steps[-third:])
        for key, points in bins.items():
            tally = out.setdefault(name, {}).setdefault(key, dict.fromkeys(
                ("n", "c", "early_n", "early_c", "late_n", "late_c"), 0))
            for p in points:
                tally["n"] += p.rollouts
                tally["c"] += p.correct
                for part, chosen in (("early", early), ("late", late)):
                    if p.step in chosen:
                        tally[f"{part}_n"] += p.rollouts
                        tally[f"{part}_c"] += p.correct
    return out


def _rate(c: int, n: int) -> str:
    if n == 0:
        return "n/a"
    lo, hi = wilson(c, n)
    return f"{c / n:.3f} [{lo:.3f}, {hi:.3f}]"


def table(data: dict[str, dict[tuple, dict[str, int]]]) -> str:
    lines = ["| pipeline | bin | share of rollouts | accuracy early [95% Wilson] | accuracy late [95% Wilson] |",
             "|---|---|---|---|---|"]
    for name, bins in data.items():
        total = sum(t["n"] for t in bins.values()) or 1
        for key, t in bins.items():
            lines.append(f"| {name} | {'/'.join(map(str, key))} | {t['n'] / total:.3f} | "
                         f"{_rate(t['early_c'], t['early_n'])} | {_rate(t['late_c'], t['late_n'])} |")
    return "\n".join(lines)


def plot(data: dict[str, dict[tuple, dict[str, int]]], path: Path, title: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = sorted({k for bins in data.values() for k in bins})
    labels = ["/".join(map(str, k)) for k in keys]
    fig, axes = plt.subplots(1, 2, figsize=(12, 3.8))
    width = 0.8 / max(1, len(data))
    for i, (name, bins) in enumerate(data.items()):
        total = sum(t["n"] for t in bins.values()) or 1
        xs = [j + i * width for j in range(len(keys))]
        late = [bins[k]["late_c"] / bins[k]["late_n"] if k in bins and bins[k]["late_n"] else 0.0 for k in keys]
        share = [bins[k]["n"] / total if k in bins else 0.0 for k in keys]
        axes[0].bar(xs, late, width, label=name)
        axes[1].bar(xs, share, width, label=name)
    for ax, ylabel in zip(axes, ("accuracy of the late third's rollouts", "share of the run's rollouts")):
        ax.set_xticks([j + 0.4 - width / 2 for j in range(len(keys))], labels, rotation=20, fontsize=8)
        ax.set_ylabel(ylabel)
    axes[0].set_title(title, fontsize=9)
    axes[1].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("folders", nargs="+", type=Path, help="comparison folders of rg-arith rows")
    ap.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "claims_by_difficulty")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    for folder in args.folders:
        data = pipeline_bins(folder)
        (args.out / f"{folder.name}.md").write_text(table(data) + "\n")
        plot(data, args.out / f"{folder.name}.png", f"{folder.name}: all seeds")
        print(table(data))


if __name__ == "__main__":
    main()
