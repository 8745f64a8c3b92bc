#!/usr/bin/env bash
# Issue 29, Must show 3: uniform GRPO against the methods whose stage was rebuilt from the
# authors' code this round (MEDS, CoBA-RL, APRIL and CoPRIS's partial rollouts) and GRESO,
# DAPO dynamic sampling, DOTS rollout replay and RLEP, on arith-mix with 10 seeds at one
# token budget (BENCHMARKS.md, "Ten seeds after the fidelity round"). Step-GRPO is not in it:
# its truncation and step reward act on reasoning steps ("Wait"), which arith-mix's 8-token
# answers do not have.
#
# Sized for the shared 2-core machine (45 min there): 4,000 generated tokens a cell (8 uniform steps),
# evaluations every 3 steps. The seeds run as SHARDS (5) separate `gfcr compare` processes on one
# folder (cells in threads of one process share its interpreter lock, separate processes do
# not), the first started alone until the folder's manifest exists; a last command over every
# pipeline and seed then finds every cell finished and writes the report from MLflow. Rerun to
# continue an interrupted comparison: finished cells are kept.
#
#   benchmarks/compare_ten_seeds.sh                          # the BENCHMARKS.md figures
#   BUDGET=tokens=1000 SHARDS="0 1" OUT=runs/ten-smoke benchmarks/compare_ten_seeds.sh   # a quick look
#   BUDGET=tokens=60000 EVERY=10 OUT=runs/compare-ten-seeds-60k \
#     MORE="pipelines/dots_arith.yaml pipelines/dars_arith.yaml pipelines/gdro_arith.yaml" \
#     benchmarks/compare_ten_seeds.sh                        # the two-epoch run (BENCHMARKS.md)
set -euo pipefail
cd "$(dirname "$0")/.."
export HF_HUB_OFFLINE=1 OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
GFCR=${GFCR:-.venv/bin/gfcr}
BUDGET=${BUDGET:-tokens=4000}
EVERY=${EVERY:-3}
OUT=${OUT:-runs/compare-ten-seeds}
SHARDS=${SHARDS:-"0,1 2,3 4,5 6,7 8,9"}
# Each process runs its cells pipeline by pipeline, in this order: the stages that act on
# prompts seen before come first, so a comparison stopped early has them on every seed.
PIPELINES=(pipelines/quickstart.yaml pipelines/rlep_arith.yaml pipelines/dots_rr_arith.yaml
           pipelines/greso_arith.yaml pipelines/meds_arith.yaml pipelines/coba_arith.yaml
           pipelines/dapo_arith.yaml pipelines/april_arith.yaml pipelines/copris_arith.yaml ${MORE:-})
compare() {
  $GFCR compare "${PIPELINES[@]}" --task arith-mix --budget "$BUDGET" --set eval.every="$EVERY" \
    --executor local --out "$OUT" "$@"
}
mkdir -p "$OUT/logs"
pids=()
for seeds in $SHARDS; do
  compare --seeds "$seeds" > "$OUT/logs/seeds-$seeds.log" 2>&1 &
  pids+=($!)
  until [ -f "$OUT/comparison.json" ] || ! kill -0 "${pids[0]}" 2>/dev/null; do sleep 2; done
done
status=0
for pid in "${pids[@]}"; do wait "$pid" || status=1; done
[ "$status" = 0 ] || { echo "a shard failed: see $OUT/logs; rerun to continue" >&2; exit 1; }
compare --seeds "$(echo $SHARDS | tr ' ' ,)"
