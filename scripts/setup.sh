#!/usr/bin/env bash
# Install lightning-app-rlhf and its test tools into the current Python environment.
# torch goes first: pinned to 2.13.0 only when no torch is installed yet, so a CPU machine never pulls
# CUDA wheels through a bare `torch` requirement, and a GPU machine keeps (or gets) its normal build.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
if ! "$PYTHON" -c "import torch" 2>/dev/null; then
  "$PYTHON" -m pip install --quiet "torch==2.13.0"
fi
"$PYTHON" -m pip install --quiet -e ".[dev]"
