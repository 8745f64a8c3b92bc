#!/usr/bin/env bash
# Every shipped method pipeline on the arith-mix task at one token budget, 3 seeds, with
# `gfcr compare` (BENCHMARKS.md, "Every method at equal compute"). The first pipeline is the
# baseline (uniform GRPO); evaluations every 10 steps (the task says 20) for a finer
# compute-to-target. Rerun the same command to continue an interrupted comparison.
#
#   benchmarks/compare_all.sh                      # the BENCHMARKS.md figures
#   BUDGET=tokens=20000 SEEDS=0 benchmarks/compare_all.sh --out runs/compare-smoke   # a quick look
set -euo pipefail
cd "$(dirname "$0")/.."
export HF_HUB_OFFLINE=1
BUDGET=${BUDGET:-tokens=60000}
SEEDS=${SEEDS:-0,1,2}
.venv/bin/gfcr compare \
  pipelines/quickstart.yaml pipelines/greso_arith.yaml pipelines/dapo_arith.yaml pipelines/mopps_arith.yaml \
  pipelines/vade_arith.yaml pipelines/sgpo_arith.yaml pipelines/dots_rr_arith.yaml pipelines/ar3po_cache_arith.yaml \
  pipelines/rlep_arith.yaml \
  --task arith-mix --seeds "$SEEDS" --budget "$BUDGET" --set eval.every=10 "$@"
