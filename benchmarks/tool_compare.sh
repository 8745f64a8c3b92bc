#!/usr/bin/env bash
# Issue 41, Must show 6: `gfcr compare` of single-turn GRPO against multi-turn GRPO with the
# calculator tool, on the tool task's prompts, at equal generated tokens (the multi-turn arm counts
# the model's tokens only; environment turns are not generated), 5 seeds. Both are evaluated the
# same way: greedy single-turn answers on 200 held-out problems.
#
#   benchmarks/tool_compare.sh                                   # the BENCHMARKS.md figures
#   BUDGET=tokens=1000 SEEDS=0 OUT=runs/tool-smoke benchmarks/tool_compare.sh   # a quick look
set -euo pipefail
cd "$(dirname "$0")/.."
export HF_HUB_OFFLINE=1 OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
GFCR=${GFCR:-.venv/bin/gfcr}
P=benchmarks/pipelines/tool
$GFCR compare "$P/single_turn.yaml" "$P/multi_turn.yaml" --seeds "${SEEDS:-0,1,2,3,4}" --budget "${BUDGET:-tokens=12000}" \
  --executor local --out "${OUT:-runs/tool-compare}" "$@"
