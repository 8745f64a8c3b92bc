#!/usr/bin/env bash
# A separate environment for stock TRL (the peer baseline), so gfcr's own stays clean.
set -euo pipefail
cd "$(dirname "$0")/.."
python3.11 -m venv .bench/trl-venv
.bench/trl-venv/bin/pip install -q torch==2.13.0
.bench/trl-venv/bin/pip install -q trl datasets psutil
.bench/trl-venv/bin/python -c "import trl, transformers, torch; print('trl', trl.__version__, 'transformers', transformers.__version__, 'torch', torch.__version__)"
