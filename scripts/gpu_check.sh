#!/usr/bin/env bash
# The GPU check: everything this project measures or tests on a CUDA GPU, in one run of well under 10 minutes.
#
#   bash scripts/gpu_check.sh                    # on a CUDA machine; without CUDA it prints one line and exits 0
#   bash scripts/gpu_check.sh --download-wheels  # here (with PyPI): fill .gpu_wheels for a machine without network
#   bash scripts/gpu_check.sh --help
#
# Steps (each prints a header; a failed or timed-out step is recorded and the next one runs):
#   1. install: `pip install --no-deps --no-build-isolation --no-index -e .` (else PYTHONPATH=.), then the wheels in
#      .gpu_wheels (TRL 1.12.0, datasets, jsonargparse, ...: what a GPU image with torch, lightning, transformers
#      and peft lacks), with --no-index --no-deps so nothing preinstalled changes;
#   2. pytest: `python -m pytest -m gpu -q` over the test files that hold gpu-marked tests;
#   3. decode: `python -m lightning_app_rlhf.bench decode` on CUDA, bf16: eager, static and compiled static at
#      batch 8 on a random-init SmolLM2-135M-shaped Llama;
#   4. bandwidth: the same at batch 64 on a Llama-3.2-1B-shaped model (and the vllm backend, where vLLM is
#      installed): the decode step's weights + KV cache traffic as a share of the device's peak memory bandwidth (by torch.cuda.get_device_name(); override with
#      LIGHTNING_APP_RLHF_PEAK_BANDWIDTH_GBS=3350);
#   5. trl: `python -m lightning_app_rlhf.bench trl` (ours vs TRL 1.12.0 on the GPU); skipped, with a line saying so,
#      where TRL is not installed;
#   6. placements: `python -m lightning_app_rlhf.bench placements`: every placement on 2 processes with 2+ GPUs; on
#      one GPU only Flattening on 1 process (one process per GPU: NCCL refuses two ranks on one device);
#   then the GPU section of docs/benchmarks.md (between the gpu-check markers) and the results JSON in
#   docs/bench_results/ (gpu_check.json, decode_gpu.json, decode_gpu_bandwidth.json, trl_gpu.json,
#   placements_gpu.json), all also copied to $OUT when it is set, with the log.
#
# Exit status: 0 when every step that ran passed (a step skipped because TRL or jsonargparse is absent, or a
# placement one GPU cannot hold, does not fail the check); 1 when a step failed, timed out or had no time left.
#
# Settings (environment; defaults in brackets): PYTHON [python3]; GPU_CHECK_BUDGET_S [540] seconds for the whole
# check, each step limited to what is left; GPU_CHECK_SKIP [] steps to skip, e.g. "trl,placements";
# GPU_CHECK_NEW_TOKENS [256], GPU_CHECK_PROMPT_TOKENS [64], GPU_CHECK_WARMUP [1], GPU_CHECK_REPEATS [3] of the
# decode runs; GPU_CHECK_DECODE_MODEL [smollm2-135m], GPU_CHECK_DECODE_BATCH [8],
# GPU_CHECK_DECODERS [eager, static, static_compiled]; GPU_CHECK_BANDWIDTH_MODEL [llama-1b],
# GPU_CHECK_BANDWIDTH_BATCH [64], GPU_CHECK_BANDWIDTH_DECODERS [eager, static, static_compiled, + vllm if installed];
# GPU_CHECK_TRL_PRESETS [small, medium], GPU_CHECK_TRL_PRECISIONS [bf16-mixed], GPU_CHECK_TRL_REPEATS [1],
# GPU_CHECK_TRL_ITERATIONS [4]; GPU_CHECK_PLACEMENT_PRESET [medium], GPU_CHECK_PLACEMENT_ITERATIONS [3];
# per-step limits GPU_CHECK_PYTEST_S [150], GPU_CHECK_DECODE_S [200], GPU_CHECK_BANDWIDTH_S [170],
# GPU_CHECK_TRL_S [150], GPU_CHECK_PLACEMENTS_S [120]; GPU_CHECK_WHEELS_DIR [.gpu_wheels];
# GPU_CHECK_RESULTS_DIR [docs/bench_results]; GPU_CHECK_DOCS [docs/benchmarks.md]. GPU_CHECK_DRY_RUN=1 runs the
# flow on the CPU (float32; no CUDA check) to check the script itself: its numbers mean nothing, so point
# GPU_CHECK_RESULTS_DIR and GPU_CHECK_DOCS elsewhere, and pick tiny settings (GPU_CHECK_SKIP may name install too).
#
# On the lent GPU machine (the `device` tool, whose machine has no network): fill .gpu_wheels here first
# (`bash scripts/gpu_check.sh --download-wheels`: pure-Python wheels for Python 3.12, about 3 MiB; the tool carries
# at most 64 MiB), then run the command `bash scripts/gpu_check.sh` with carry [".gpu_wheels"]. The files come back
# from $OUT: copy the JSON files into docs/bench_results/ and run
# `python3 -m lightning_app_rlhf.bench.decode report` to write the GPU section of docs/benchmarks.md here.

set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
WHEELS_DIR="${GPU_CHECK_WHEELS_DIR:-.gpu_wheels}"
# What the GPU image lacks, pinned to the versions the test suite runs with (all pure Python).
WHEELS=(trl==1.12.0 datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19 jsonargparse==4.53.0 docstring-parser==0.18.0
        typeshed-client==2.15.0)

case "${1:-}" in
  -h | --help)
    sed -n '2,/^$/p' "$0" | sed 's/^# \{0,1\}//'
    exit 0
    ;;
  --download-wheels)
    mkdir -p "$WHEELS_DIR"
    "$PYTHON" -m pip download --no-deps --only-binary=:all: --python-version "${GPU_CHECK_PYTHON_VERSION:-3.12}" \
      -d "$WHEELS_DIR" "${WHEELS[@]}"
    echo "gpu_check: $(find "$WHEELS_DIR" -name '*.whl' | wc -l) wheels, $(du -sh "$WHEELS_DIR" | cut -f1) in" \
      "$WHEELS_DIR; carry it: run(command='bash scripts/gpu_check.sh', carry=['$WHEELS_DIR'])"
    exit 0
    ;;
  "") ;;
  *)
    echo "gpu_check: unknown argument '$1': run it with no argument, --download-wheels or --help." >&2
    exit 2
    ;;
esac

DEVICE=cuda
DTYPE=bfloat16
if [[ "${GPU_CHECK_DRY_RUN:-0}" == 1 ]]; then
  DEVICE=cpu  # the flow of the script on the CPU, to check the script itself: its numbers mean nothing
  DTYPE=float32
else
  # No CUDA: one line, exit 0, before anything is installed or written.
  if ! has_cuda=$("$PYTHON" -c 'import torch; print(int(torch.cuda.is_available()))' 2>/dev/null); then
    echo "gpu_check: no CUDA device here (torch is not importable by $PYTHON); nothing to measure."
    exit 0
  fi
  if [[ "$has_cuda" != 1 ]]; then
    echo "gpu_check: no CUDA device here (torch.cuda.is_available() is False); nothing to measure."
    exit 0
  fi
fi

START=$SECONDS
BUDGET="${GPU_CHECK_BUDGET_S:-540}"
RESERVE=40  # kept for the report and the copies to $OUT
SKIP=",${GPU_CHECK_SKIP:-},"
SKIP="${SKIP// /}"
RESULTS="${GPU_CHECK_RESULTS_DIR:-docs/bench_results}"
DOCS="${GPU_CHECK_DOCS:-docs/benchmarks.md}"
NEW_TOKENS="${GPU_CHECK_NEW_TOKENS:-256}"
PROMPT_TOKENS="${GPU_CHECK_PROMPT_TOKENS:-64}"
WARMUP="${GPU_CHECK_WARMUP:-1}"
REPEATS="${GPU_CHECK_REPEATS:-3}"
RUN_DIR="$(mktemp -d "${TMPDIR:-/tmp}/gpu_check.XXXXXX")"
LOG="$RUN_DIR/gpu_check.log"
STEPS="$RUN_DIR/steps.tsv"
STEP_OUT="$RUN_DIR/step.out"
FAILED=0
TOTAL=7
export PYTHONUNBUFFERED=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_INPUT=1 TOKENIZERS_PARALLELISM=false
: >"$STEPS"

say() { echo "$*" | tee -a "$LOG"; }
header() { say ""; say "== gpu_check [$1/$TOTAL] $2 =="; }
# record STEP STATUS DETAIL [KIND=FILE]: one line of the steps file the report reads.
record() {
  printf '%s\t%s\t%s\t%s\n' "$1" "$2" "${3//$'\t'/ }" "${4:--}" >>"$STEPS"
  say "gpu_check: $1: $2${3:+ ($3)}"
}
skipped() { [[ "$SKIP" == *",$1,"* ]]; }
# "eager, static" -> ["eager", "static"]
json_list() {
  local out="" item items
  IFS=',' read -ra items <<<"$1"
  for item in "${items[@]}"; do
    item="${item// /}"
    [[ -n "$item" ]] && out+="${out:+, }\"$item\""
  done
  printf '[%s]' "$out"
}

# run_step CAP_S COMMAND...: runs COMMAND with a limit of CAP_S or what the budget has left, whichever is less,
# its output on the console and in the log. Sets STEP_RC (124/137: timed out; "none": not started, no time left)
# and STEP_LIMIT.
run_step() {
  local cap=$1
  shift
  local left=$((BUDGET - (SECONDS - START) - RESERVE))
  STEP_LIMIT=$((cap < left ? cap : left))
  if ((STEP_LIMIT < 20)); then
    STEP_RC=none
    return 0
  fi
  say "\$ $* (limit ${STEP_LIMIT} s)"
  : >"$STEP_OUT"
  set +e
  timeout -k 10 "$STEP_LIMIT" "$@" 2>&1 | tee -a "$LOG" "$STEP_OUT"
  STEP_RC=${PIPESTATUS[0]}
  set -e
}

# finish STEP OK_DETAIL [KIND=FILE]: records the outcome of the last run_step.
finish() {
  local step=$1 detail=$2 result=${3:--}
  case "$STEP_RC" in
    0) record "$step" passed "$detail" "$result" ;;
    124 | 137)
      FAILED=1
      record "$step" "timed out" "after ${STEP_LIMIT} s: raise GPU_CHECK_${step^^}_S or GPU_CHECK_BUDGET_S; $detail"
      ;;
    none)
      FAILED=1
      record "$step" "not run" "too little of the ${BUDGET} s budget left (GPU_CHECK_BUDGET_S); $detail"
      ;;
    *)
      FAILED=1
      record "$step" failed "exit status $STEP_RC, see the log; $detail"
      ;;
  esac
}

# The result files, the log and the report into $OUT (the device tool brings back what is there: flat, <= 8 files).
save_out() {
  [[ -n "${OUT:-}" ]] || return 0
  mkdir -p "$OUT"
  local file
  for file in "$RUN_DIR"/*.json "$RUN_DIR/gpu_check.md" "$LOG"; do
    [[ -f "$file" ]] && cp -f "$file" "$OUT/"
  done
  return 0
}

# --- 1. install ---
header 1 "install: this package without its dependencies, and the wheels in $WHEELS_DIR (no network)"
if skipped install; then
  install_detail="skipped"
elif "$PYTHON" -m pip install -q --no-deps --no-build-isolation --no-index -e . 2>&1 | tee -a "$LOG"; then
  install_detail="pip install --no-deps -e ."
else
  export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
  install_detail="pip install -e . failed: using PYTHONPATH=$PWD"
fi
shopt -s nullglob
wheels=("$WHEELS_DIR"/*.whl)
shopt -u nullglob
if skipped install; then
  :
elif ((${#wheels[@]})); then
  if "$PYTHON" -m pip install -q --no-index --no-deps --find-links "$WHEELS_DIR" "${wheels[@]}" 2>&1 \
    | tee -a "$LOG"; then
    install_detail+="; ${#wheels[@]} wheels from $WHEELS_DIR"
  else
    install_detail+="; the wheels in $WHEELS_DIR did not install (see the log)"
  fi
else
  install_detail+="; no $WHEELS_DIR folder (fill it with: bash scripts/gpu_check.sh --download-wheels)"
fi
probe=$("$PYTHON" - 2>>"$LOG" <<'EOF'
import importlib
import shlex
import sys

import torch

from lightning_app_rlhf.bench.decode import PEAK_BANDWIDTH_ENV, resolve_peak_bandwidth


def version(name: str) -> str | None:
    try:
        return getattr(importlib.import_module(name), "__version__", "?")
    except Exception:  # noqa: BLE001 - whatever stops the import: not usable here
        return None


name = torch.cuda.get_device_name() if torch.cuda.is_available() else "no GPU (GPU_CHECK_DRY_RUN on the CPU)"
try:
    peak = resolve_peak_bandwidth(name)
except ValueError as error:  # a bad override: the decode steps fail with the same message
    peak = None
    print(f"gpu_check: {error}", file=sys.stderr)
versions = {n: version(n) for n in ("torch", "lightning", "transformers", "peft", "jsonargparse", "trl", "datasets")}
values = {
    "DEVICE_NAME": name,
    "DEVICE_COUNT": torch.cuda.device_count(),
    "PEAK": f"{peak:g}" if peak else "",
    "PEAK_ENV": PEAK_BANDWIDTH_ENV,
    # LightningCLI (bench trl, bench placements, bench decode's command line) needs jsonargparse[signatures].
    "HAVE_CLI": int(all(version(n) for n in ("jsonargparse", "docstring_parser", "typeshed_client"))),
    "HAVE_TRL": int(versions["trl"] == "1.12.0" and versions["datasets"] is not None),
    "TRL_FOUND": versions["trl"] or "not installed",
    "VERSIONS": ", ".join(f"{n} {v or '-'}" for n, v in versions.items()),
}
for key, value in values.items():
    print(f"{key}={shlex.quote(str(value))}")
EOF
) || {
  FAILED=1
  record install failed "$install_detail; lightning_app_rlhf or torch.cuda did not import (see the log)"
  probe="DEVICE_NAME='?' DEVICE_COUNT=1 PEAK='' PEAK_ENV=LIGHTNING_APP_RLHF_PEAK_BANDWIDTH_GBS HAVE_CLI=0 HAVE_TRL=0"
  probe+=" TRL_FOUND='?' VERSIONS='?'"
}
eval "$probe"
say "gpu_check: $DEVICE_COUNT x $DEVICE_NAME; $VERSIONS"
if [[ -n "$PEAK" ]]; then
  say "gpu_check: peak memory bandwidth $PEAK GB/s"
else
  say "gpu_check: peak memory bandwidth of '$DEVICE_NAME' unknown: the share of it is not reported (set $PEAK_ENV=GB/s)"
fi
if ! grep -q "^install" "$STEPS"; then
  if skipped install; then record install skipped "GPU_CHECK_SKIP: the packages installed as they are"; else
    record install passed "$install_detail"; fi
fi

# --- 2. the gpu-marked tests ---
header 2 "pytest -m gpu"
mapfile -t gpu_tests < <(grep -l "pytest.mark.gpu" tests/test_*.py 2>/dev/null || true)
if skipped pytest; then
  record pytest skipped "GPU_CHECK_SKIP"
elif ((${#gpu_tests[@]} == 0)); then
  FAILED=1
  record pytest failed "no test file under tests/ holds a pytest.mark.gpu test"
else
  run_step "${GPU_CHECK_PYTEST_S:-150}" "$PYTHON" -m pytest -m gpu -q -p no:cacheprovider "${gpu_tests[@]}"
  summary=$(grep -E "[0-9]+ (passed|failed|error|skipped)|no tests ran" "$STEP_OUT" | tail -n 1 | tr -d '=' \
    | sed 's/^ *//; s/ *$//' || true)
  finish pytest "${summary:-no pytest summary line}"
fi
save_out

# run_decode STEP FILE MODEL BATCH DECODERS CHECK_TOKENS CAP_S: one `bench decode` run (CUDA, bf16) into $RUN_DIR/FILE.
run_decode() {
  local step=$1 file=$2 model=$3 batch=$4 decoders=$5 check=$6 cap=$7
  if skipped "$step"; then
    record "$step" skipped "GPU_CHECK_SKIP"
    return 0
  fi
  if ((HAVE_CLI)); then
    run_step "$cap" "$PYTHON" -m lightning_app_rlhf.bench decode --device "$DEVICE" --dtype "$DTYPE" \
      --models "[$model]" --batch_sizes "[$batch]" --decoders "$(json_list "$decoders")" \
      --new_tokens "$NEW_TOKENS" --prompt_tokens "$PROMPT_TOKENS" --warmup "$WARMUP" --repeats "$REPEATS" \
      --check_tokens "$check" --out "$RUN_DIR/$file"
  else
    say "gpu_check: jsonargparse is not installed: running decode() through python -m lightning_app_rlhf.bench.decode"
    local kwargs
    kwargs="{\"device\": \"$DEVICE\", \"dtype\": \"$DTYPE\", \"models\": [\"$model\"], \"batch_sizes\": [$batch],"
    kwargs+=" \"decoders\": $(json_list "$decoders"), \"new_tokens\": $NEW_TOKENS, \"prompt_tokens\": $PROMPT_TOKENS,"
    kwargs+=" \"warmup\": $WARMUP, \"repeats\": $REPEATS, \"check_tokens\": $check, \"out\": \"$RUN_DIR/$file\"}"
    run_step "$cap" "$PYTHON" -m lightning_app_rlhf.bench.decode measure "$kwargs"
  fi
  if [[ "$STEP_RC" == 0 && ! -f "$RUN_DIR/$file" ]]; then STEP_RC=1; fi
  finish "$step" "$model, batch $batch, $NEW_TOKENS new tokens: $decoders" "$step=$file"
  save_out
}

# --- 3. decoders: eager, static, compiled static at batch 8 on a ~135M model ---
header 3 "bench decode: eager / static / compiled static, batch ${GPU_CHECK_DECODE_BATCH:-8}"
run_decode decode decode_gpu.json "${GPU_CHECK_DECODE_MODEL:-smollm2-135m}" "${GPU_CHECK_DECODE_BATCH:-8}" \
  "${GPU_CHECK_DECODERS:-eager, static, static_compiled}" true "${GPU_CHECK_DECODE_S:-200}"

# --- 4. the decode step's share of the memory bandwidth at batch 64 on a ~1B model ---
# With vLLM installed (the GPU image may lack it: its wheel is past what the device tool carries), the vllm backend
# joins this row: its decode share of the bandwidth beside ours.
BANDWIDTH_DECODERS="eager, static, static_compiled"
if "$PYTHON" -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('vllm') is None)" 2>/dev/null; then
  BANDWIDTH_DECODERS+=", vllm"
fi
header 4 "bench decode: share of the peak memory bandwidth, batch ${GPU_CHECK_BANDWIDTH_BATCH:-64}"
run_decode bandwidth decode_gpu_bandwidth.json "${GPU_CHECK_BANDWIDTH_MODEL:-llama-1b}" \
  "${GPU_CHECK_BANDWIDTH_BATCH:-64}" "${GPU_CHECK_BANDWIDTH_DECODERS:-$BANDWIDTH_DECODERS}" false \
  "${GPU_CHECK_BANDWIDTH_S:-170}"

FILL_WHEELS="fill $WHEELS_DIR with bash scripts/gpu_check.sh --download-wheels and carry it"
NO_CLI="jsonargparse[signatures] is not installed (LightningCLI needs it): $FILL_WHEELS"

# --- 5. ours vs TRL ---
header 5 "bench trl: ours vs TRL 1.12.0 on the GPU"
if skipped trl; then
  record trl skipped "GPU_CHECK_SKIP"
elif ((!HAVE_CLI)); then
  record trl skipped "$NO_CLI"
elif ((!HAVE_TRL)); then
  record trl skipped "TRL 1.12.0 with datasets is not installed here (found: $TRL_FOUND; no network): $FILL_WHEELS"
else
  run_step "${GPU_CHECK_TRL_S:-150}" "$PYTHON" -m lightning_app_rlhf.bench trl \
    --presets "$(json_list "${GPU_CHECK_TRL_PRESETS:-small, medium}")" \
    --precisions "$(json_list "${GPU_CHECK_TRL_PRECISIONS:-bf16-mixed}")" --repeats "${GPU_CHECK_TRL_REPEATS:-1}" \
    --run.warmup 2 --run.iterations "${GPU_CHECK_TRL_ITERATIONS:-4}" --out "$RUN_DIR/trl_gpu.json"
  finish trl "presets ${GPU_CHECK_TRL_PRESETS:-small, medium}, ${GPU_CHECK_TRL_PRECISIONS:-bf16-mixed}" trl=trl_gpu.json
fi
save_out

# --- 6. the placements ---
header 6 "bench placements on $DEVICE_COUNT GPU(s)"
if ((DEVICE_COUNT >= 2)); then
  processes="2" placements="flattening, interleaving, separation, separation_overlap"
  placement_note="2 processes, one GPU each"
else
  processes="1" placements="flattening"
  placement_note="one GPU: Flattening on 1 process only; the other placements need a GPU per process"
  placement_note+=" (NCCL refuses two ranks on one device)"
fi
if skipped placements; then
  record placements skipped "GPU_CHECK_SKIP"
elif ((!HAVE_CLI)); then
  record placements skipped "$NO_CLI"
else
  run_step "${GPU_CHECK_PLACEMENTS_S:-120}" "$PYTHON" -m lightning_app_rlhf.bench placements \
    --run.preset "${GPU_CHECK_PLACEMENT_PRESET:-medium}" --processes "[$processes]" \
    --placements "$(json_list "$placements")" \
    --run.warmup 1 --run.iterations "${GPU_CHECK_PLACEMENT_ITERATIONS:-3}" --out "$RUN_DIR/placements_gpu.json"
  finish placements "$placement_note" placements=placements_gpu.json
fi
save_out

# --- 7. the report ---
header 7 "report: $DOCS (gpu-check section) and $RESULTS"
mkdir -p "$RESULTS"
# Only the files of steps that passed (named in the steps file): a stale file from an earlier run is not reported.
for file in decode_gpu.json decode_gpu_bandwidth.json trl_gpu.json placements_gpu.json; do
  if [[ -f "$RUN_DIR/$file" ]] && cut -f4 "$STEPS" | grep -qx "[a-z]*=$file"; then
    cp -f "$RUN_DIR/$file" "$RESULTS/"
  fi
done
if "$PYTHON" -m lightning_app_rlhf.bench.decode report --results "$RESULTS" --docs "$DOCS" --steps "$STEPS" \
  --seconds "$((SECONDS - START))" --section "$RUN_DIR/gpu_check.md" 2>&1 | tee -a "$LOG"; then
  cp -f "$RESULTS/gpu_check.json" "$RUN_DIR/"
  say "gpu_check: wrote the gpu-check section of $DOCS and $RESULTS/gpu_check.json"
else
  FAILED=1
  say "gpu_check: report: failed (see above); the results are in $RUN_DIR"
fi

say ""
say "== gpu_check: summary ($((SECONDS - START)) s on $DEVICE_NAME) =="
while IFS=$'\t' read -r step status detail _; do say "  $step: $status${detail:+ ($detail)}"; done <"$STEPS"
[[ -n "${OUT:-}" ]] && say "gpu_check: results, section and log copied to \$OUT ($OUT)"
save_out
exit "$FAILED"
