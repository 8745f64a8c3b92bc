#!/usr/bin/env bash
# Fill .whl/ with the wheels gfcr needs on a GPU machine that has torch and transformers but
# no network (Python 3.12, x86-64: this workplace's device machine), and copy GSM8K's train
# split into .gpu/gsm8k; both folders are git-ignored. scripts/gpu_check.sh says how to use them.
# The versions are this venv's, so what runs there is what the tests ran here.
# Usage: bash scripts/gpu_wheels.sh   (needs PyPI; PYTHON defaults to .venv/bin/python)
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-.venv/bin/python}
PACKAGES=(pydantic pydantic_core annotated-types typing-inspection gguf)
pins=()
for name in "${PACKAGES[@]}"; do
  pins+=("$name==$("$PYTHON" -c "import importlib.metadata as m, sys; print(m.version(sys.argv[1]))" "$name")")
done
rm -rf .whl && mkdir -p .whl
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  -d .whl "${pins[@]}"
mkdir -p .gpu/gsm8k
gsm8k=${GFCR_GSM8K_DIR:-../shared/data/gsm8k}
if [ -f "$gsm8k/train.jsonl" ]; then cp "$gsm8k/train.jsonl" .gpu/gsm8k/; else echo "note: no GSM8K at $gsm8k"; fi
du -sh .whl .gpu
ls .whl
