#!/usr/bin/env bash
# The benchmark: installs the package and its `bench` extra (TRL 1.12.0, matplotlib), runs ours vs TRL's PPOTrainer
# and (in a cached environment of its own, made on first use) TRL 1.16's GRPOTrainer, the placement comparison, and
# rewrites docs/benchmarks.md. Arguments go to `python -m lightning_app_rlhf.bench run`.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
bash scripts/setup.sh
"$PYTHON" -m pip install --quiet -e ".[bench]"
"$PYTHON" -m lightning_app_rlhf.bench run "$@"
