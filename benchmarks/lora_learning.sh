#!/usr/bin/env bash
# LoRA against full fine-tuning on tiny-arith-h64 (issue 43, Must show 2; docs/lora.md):
# pipelines/grpo_lora_arith.yaml (rank 8 on the seven projections, lr 2e-3) against its full
# fine-tuning twin benchmarks/pipelines/grpo_full_arith_h64.yaml (every weight, quickstart's lr 3e-4),
# 3 seeds, 50 steps of 16 prompts x 8 rollouts each (the same sampling, so the same tokens up to the
# responses' lengths: the report shows each cell's), both on the transformers engine, eval every 10 steps.
#     bash benchmarks/lora_learning.sh [OUT]
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-benchmarks/results/compare_lora}
PY=${PY:-.venv/bin/python}
MLFLOW_TRACKING_URI=${MLFLOW_TRACKING_URI:-sqlite:////tmp/gfcr-lora-mlflow.db} "$PY" -m gfcr.cli.main compare \
  benchmarks/pipelines/grpo_full_arith_h64.yaml pipelines/grpo_lora_arith.yaml \
  --seeds 0,1,2 --budget steps=50 --executor local --out "$OUT" \
  --set policy.engine=hf --set eval.every=10 --set run.checkpoint_every=25
