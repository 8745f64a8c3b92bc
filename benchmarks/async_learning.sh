#!/usr/bin/env bash
# Issue 38, Must show 7: do the stale lifecycles learn as well as sync? Uniform GRPO on tiny-arith
# (pipelines/quickstart.yaml) under six lifecycle/correction pairs (benchmarks/pipelines/async/):
# sync; pipelined lag 1 with `tis` and with `decoupled_clip`; async max_staleness 2 with each; and
# async max_staleness 8 with `correction: none` declared (the opt-out, to see whether it collapses).
# 10 seeds, the same generated-token budget per cell, `gfcr compare` with sync as the baseline
# (final accuracy by a paired t test on the ten differences, BENCHMARKS.md).
#
# Before the runs it checks that a stale lifecycle without a declared correction is refused by
# `gfcr validate` (exit 2, with the fix).
#
#   benchmarks/async_learning.sh                                  # the BENCHMARKS.md figures
#   BUDGET=tokens=2000 SEEDS=0,1 OUT=runs/async-smoke benchmarks/async_learning.sh   # a quick look
set -euo pipefail
cd "$(dirname "$0")/.."
export HF_HUB_OFFLINE=1 OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
GFCR=${GFCR:-.venv/bin/gfcr}
BUDGET=${BUDGET:-tokens=16000}
SEEDS=${SEEDS:-0,1,2,3,4,5,6,7,8,9}
EVERY=${EVERY:-5}
OUT=${OUT:-runs/async-learning}
P=benchmarks/pipelines/async

# staleness without a declared correction: refused, exit 2, with the fix
unguarded=$(mktemp --suffix=.yaml)
grep -v '^lifecycle:' "$P/async2_tis.yaml" | sed 's/, correction: {use: tis, with: {cap: 2.0}}//' > "$unguarded"
echo 'lifecycle: {mode: async, max_staleness: 2}' >> "$unguarded"
set +e; $GFCR validate "$unguarded"; rc=$?; set -e
rm -f "$unguarded"
if [ "$rc" != 2 ]; then echo "expected validate to refuse an undeclared correction with exit 2, got $rc" >&2; exit 1; fi
echo "validate refused the undeclared correction (exit 2), as it must"

$GFCR compare "$P/sync.yaml" "$P/pipelined1_tis.yaml" "$P/pipelined1_dc.yaml" "$P/async2_tis.yaml" \
  "$P/async2_dc.yaml" "$P/async8_none.yaml" --seeds "$SEEDS" --budget "$BUDGET" --set eval.every="$EVERY" \
  --executor local --out "$OUT" "${@}"
