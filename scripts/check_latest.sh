#!/usr/bin/env bash
# The newest-releases check: a fresh virtual environment with the newest release of every dependency (no
# constraints.txt), then the test suite. A maintainer runs it before moving constraints.txt forward, and whenever
# a dependency ships a release:
#
#   bash scripts/check_latest.sh              # the default suite on the newest releases
#   bash scripts/check_latest.sh -m slow      # extra arguments go to pytest
#   WRITE_CONSTRAINTS=1 bash scripts/check_latest.sh   # and, if it passes, make these versions the known-good set
#
# torch is the newest release too (TORCH_SPEC, default `torch`). On Linux, PyPI serves torch with its CUDA
# libraries (a few GB, also on a CPU machine); TORCH_SPEC=torch==2.13.0 keeps the tested torch and checks the rest.
# The versions it ran with are printed first and kept in $VENV/versions.txt.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
VENV="${VENV:-.venv-latest}"
TORCH_SPEC="${TORCH_SPEC:-torch}"

rm -rf "$VENV"
"$PYTHON" -m venv "$VENV"
PY="$VENV/bin/python"
"$PY" -m pip install --quiet --upgrade pip
"$PY" -m pip install --quiet --upgrade "$TORCH_SPEC"
# --upgrade-strategy eager: every dependency of ours, and theirs, at its newest release.
"$PY" -m pip install --quiet --upgrade --upgrade-strategy eager -e ".[dev]"
"$PY" -m pip list --format=freeze --exclude-editable > "$VENV/versions.txt"
echo "check_latest: newest releases in $VENV:"
grep -i -E "^(torch|lightning|transformers|tokenizers|torchmetrics|peft|deepspeed|datasets|trl|jsonargparse)==" \
  "$VENV/versions.txt" | sed 's/^/  /'

"$PY" -m pytest -q "$@"

if [ "${WRITE_CONSTRAINTS:-0}" = "1" ]; then
  "$PY" scripts/write_constraints.py constraints.txt
  echo "check_latest: constraints.txt now holds these versions; commit it with the suite's result."
fi
