#!/usr/bin/env bash
# The prompt selectors against uniform selection on the arith-mix task at one token budget
# (BENCHMARKS.md, "Prompt selectors on arith-mix: MoPPS, VADE, sGPO"): `gfcr compare` of the
# quickstart (uniform GRPO, the baseline), MoPPS, VADE and sGPO, then the report's table and its
# zero-variance plot copied to benchmarks/results/. Rerun the same command to continue an
# interrupted comparison (finished cells are kept).
#
#   benchmarks/compare_selectors.sh                  # the BENCHMARKS.md figures (seeds 0,1)
#   SEEDS=0,1,2 benchmarks/compare_selectors.sh      # 3 seeds (a new --out folder)
set -euo pipefail
cd "$(dirname "$0")/.."
export HF_HUB_OFFLINE=1 OMP_NUM_THREADS=1
BUDGET=${BUDGET:-tokens=60000}
SEEDS=${SEEDS:-0,1}
OUT=${OUT:-runs/compare-selectors}
PY=${PY:-.venv/bin/python}
$PY -m gfcr.cli.main compare \
  pipelines/quickstart.yaml pipelines/mopps_arith.yaml pipelines/vade_arith.yaml pipelines/sgpo_arith.yaml \
  --task arith-mix --seeds "$SEEDS" --budget "$BUDGET" --executor local --out "$OUT" "$@"
cp "$OUT/report/compare.md" benchmarks/results/compare_selectors.md
cp "$OUT/report/compare.json" benchmarks/results/compare_selectors.json
for png in "$OUT"/report/*.png; do cp "$png" "benchmarks/results/compare_selectors_$(basename "$png")"; done
