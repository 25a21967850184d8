"""``scripts/gpu_check.sh`` and what it adds to ``bench decode``: the one-line answer on a machine without CUDA, the
decode step's memory-bandwidth arithmetic (checked against hand-computed numbers), and the generated GPU section of
``docs/benchmarks.md``. The GPU run itself needs the lent GPU machine: ``bash scripts/gpu_check.sh`` there."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from lightning_app_rlhf.bench.decode import (
    GPU_CHECK_BEGIN,
    GPU_CHECK_END,
    PEAK_BANDWIDTH_ENV,
    build_model,
    compare_decoders,
    decode_bandwidth,
    decode_table,
    gpu_check_record,
    kv_geometry,
    kv_read_bytes_per_step,
    main,
    read_steps,
    resolve_peak_bandwidth,
    weight_read_bytes,
    write_gpu_check_report,
    write_gpu_check_section,
)

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "gpu_check.sh"


def _run_script(**env: str) -> subprocess.CompletedProcess[str]:
    """The script run as a user runs it, but with the interpreter that runs these tests (its ``PYTHON`` setting):
    the ``python3`` on ``PATH`` may be another one, without torch (scripts/check_latest.sh runs the suite with its
    virtual environment's interpreter, not activated)."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith("GPU_CHECK_")}
    return subprocess.run(["bash", str(SCRIPT)], cwd=ROOT, env={**clean, "PYTHON": sys.executable, **env},
                          capture_output=True, text=True, timeout=60, check=False)


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a CUDA machine the script runs the whole GPU check")
def test_without_cuda_the_script_prints_one_line_and_exits_0():
    result = _run_script()
    lines = (result.stdout + result.stderr).splitlines()
    assert result.returncode == 0, result.stderr
    assert lines == ["gpu_check: no CUDA device here (torch.cuda.is_available() is False); nothing to measure."]


def test_without_torch_the_script_prints_one_line_and_exits_0():
    result = _run_script(PYTHON="/nonexistent/python3")
    assert result.returncode == 0, result.stderr
    assert (result.stdout + result.stderr).splitlines() == [
        "gpu_check: no CUDA device here (torch is not importable by /nonexistent/python3); nothing to measure."]


def test_peak_bandwidth_by_device_name_explicit_value_and_environment(monkeypatch):
    monkeypatch.delenv(PEAK_BANDWIDTH_ENV, raising=False)
    names = {"NVIDIA H100 80GB HBM3": 3350.0, "NVIDIA H100 PCIe": 2000.0, "NVIDIA H100 NVL": 3900.0,
             "NVIDIA H200": 4800.0, "NVIDIA A100-SXM4-80GB": 2039.0, "NVIDIA A100-SXM4-40GB": 1555.0,
             "NVIDIA L40S": 864.0, "NVIDIA L4": 300.0, "NVIDIA GH200 480GB": None, "AMD EPYC": None}
    assert {name: resolve_peak_bandwidth(name) for name in names} == names
    assert resolve_peak_bandwidth(None) is None
    assert resolve_peak_bandwidth("NVIDIA H100 80GB HBM3", explicit=1000.0) == 1000.0
    monkeypatch.setenv(PEAK_BANDWIDTH_ENV, "2500")
    assert resolve_peak_bandwidth("NVIDIA H100 80GB HBM3") == 2500.0
    assert resolve_peak_bandwidth("NVIDIA H100 80GB HBM3", explicit=1000.0) == 1000.0
    monkeypatch.setenv(PEAK_BANDWIDTH_ENV, "fast")
    with pytest.raises(ValueError, match="in GB/s"):
        resolve_peak_bandwidth("NVIDIA H100 80GB HBM3")


def test_kv_cache_and_step_bandwidth_by_hand():
    # SmolLM2-135M's shape at batch 8, bf16: 30 layers x 3 kv heads x 64 dims, 64 prompt positions, 256 new tokens.
    # Mean context 64 + 128 = 192; 2 (K and V) x 30 x 3 x 64 x 2 bytes x 8 rows x 192 = 35,389,440 bytes.
    kv = kv_read_bytes_per_step(30, 3, 64, 2, 8, 64, 256)
    assert kv == 35_389_440
    # 270 MB of weights + that, in a 512 ms call of 256 tokens: 2 ms per step, 305,389,440 B / 2 ms = 152.69 GB/s,
    # 4.558% of an H100 SXM's 3,350 GB/s.
    out = decode_bandwidth(270_000_000, kv, 0.512, 256, 3350.0)
    assert out["step_s"] == pytest.approx(0.002)
    assert out["decode_read_gbs"] == pytest.approx(152.69472)
    assert out["bandwidth_fraction"] == pytest.approx(0.0455805, rel=1e-5)
    assert out["peak_bandwidth_gbs"] == 3350.0
    assert "bandwidth_fraction" not in decode_bandwidth(1.0, 1.0, 1.0, 1, None)
    with pytest.raises(ValueError, match="step time"):
        decode_bandwidth(1.0, 1.0, 0.0, 256)


def test_kv_geometry_of_the_presets():
    from transformers import AutoConfig

    from lightning_app_rlhf.bench.decode import DECODE_MODELS

    geometry = {name: kv_geometry(AutoConfig.for_model(**DECODE_MODELS[name]))
                for name in ("tiny", "llama-small", "smollm2-135m", "llama-1b")}
    assert geometry == {"tiny": (2, 4, 16), "llama-small": (4, 4, 32), "smollm2-135m": (30, 3, 64),
                        "llama-1b": (16, 8, 64)}


def test_weight_bytes_count_a_tied_embedding_once_and_leave_out_an_untied_input_embedding():
    from transformers import AutoConfig, AutoModelForCausalLM

    fields = {"model_type": "llama", "num_hidden_layers": 1, "hidden_size": 16, "num_attention_heads": 2,
              "num_key_value_heads": 1, "intermediate_size": 32, "vocab_size": 64}
    tied = AutoModelForCausalLM.from_config(AutoConfig.for_model(**fields, tie_word_embeddings=True))
    untied = AutoModelForCausalLM.from_config(AutoConfig.for_model(**fields, tie_word_embeddings=False))
    params = sum(p.numel() for p in tied.parameters())
    assert weight_read_bytes(tied) == params * 4
    # Untied: one more [64, 16] matrix (the LM head); the input embedding, which a step only indexes, is left out.
    assert sum(p.numel() for p in untied.parameters()) == params + 64 * 16
    assert weight_read_bytes(untied) == params * 4


def test_decode_rows_carry_the_step_traffic_and_its_share_on_the_cpu():
    rows = compare_decoders(["tiny"], [2], new_tokens=4, prompt_tokens=4, decoders=["eager", "static"], device="cpu",
                            dtype="float32", warmup=0, repeats=1, peak_bandwidth_gbs=50.0)
    model = build_model("tiny", "cpu", torch.float32)
    weights = sum(p.numel() * 4 for p in model.parameters())  # GPT-2 ties its embedding: every parameter once
    for row in rows:
        # tiny: 2 layers x 4 heads x 16 dims, float32, 2 rows, mean context 4 + 2: 2 x 2 x 4 x 16 x 4 x 2 x 6 bytes.
        assert row["kv_bytes_per_step"] == 12_288
        assert row["weight_bytes_per_step"] == weights
        assert row["step_s"] == pytest.approx(row["seconds"] / 4)
        assert row["decode_read_gbs"] == pytest.approx((weights + 12_288) / row["step_s"] / 1e9)
        assert row["bandwidth_fraction"] == pytest.approx(row["decode_read_gbs"] / 50.0)
    table = decode_table(rows)
    assert "| of peak |" in table and table.count("\n") == len(rows) + 1
    assert "of peak" not in decode_table([{k: v for k, v in r.items() if k != "bandwidth_fraction"} for r in rows])


MACHINE = {"cpu": "AMD EPYC", "cores": 16, "memory_gib": 125.0, "gpu": "NVIDIA H100 80GB HBM3", "python": "3.12.3",
           "torch": "2.11.0", "lightning": "2.6.6", "transformers": "5.17.0"}


def _decode_result(peak: float) -> dict:
    row = {"model": "smollm2-135m", "params": 134_515_008, "batch_size": 8, "decoder": "eager", "tokens": 2048,
           "tokens_per_s": 1024.0, "speedup_vs_eager": 1.0, "seconds": 2.0, "seconds_min": 1.9, "seconds_max": 2.1,
           "weight_read_gbs": 34.4, "new_tokens": 256, "prompt_tokens": 64, "dtype": "bfloat16", "device": "cuda",
           **decode_bandwidth(269_030_016, 35_389_440, 2.0, 256, peak)}
    return {"machine": MACHINE, "static_tokens_equal_eager": True, "peak_bandwidth_gbs": peak, "decode": [row]}


def test_the_gpu_section_is_written_between_its_markers_from_the_runs_record(tmp_path):
    steps = tmp_path / "steps.tsv"
    steps.write_text("install\tpassed\tpip install --no-deps -e .\t-\n"
                     "decode\tpassed\tsmollm2-135m, batch 8\tdecode=decode_gpu.json\n"
                     "bandwidth\ttimed out\tafter 170 s\t-\n"
                     "trl\tskipped\tTRL 1.12.0 is not installed\t-\n")
    record = gpu_check_record(read_steps(steps), MACHINE, 123.4)
    assert record["results"] == {"decode": "decode_gpu.json"}  # a stale decode_gpu_bandwidth.json is not named
    (tmp_path / "gpu_check.json").write_text(json.dumps(record))
    (tmp_path / "decode_gpu.json").write_text(json.dumps(_decode_result(3350.0)))
    (tmp_path / "decode_gpu_bandwidth.json").write_text("stale, never read")
    docs = tmp_path / "benchmarks.md"
    docs.write_text(f"# Benchmarks\n\nbefore\n\n{GPU_CHECK_BEGIN}\n\nNo GPU run yet.\n\n{GPU_CHECK_END}\n\nafter\n")

    body = write_gpu_check_report(tmp_path, docs)
    text = docs.read_text()
    assert text.startswith("# Benchmarks\n\nbefore\n\n") and text.endswith(f"{GPU_CHECK_END}\n\nafter\n")
    assert "No GPU run yet" not in text and body in text
    assert "Measured on: NVIDIA H100 80GB HBM3, peak memory bandwidth 3,350 GB/s" in body
    assert "- bandwidth: **timed out** (after 170 s)" in body and "- trl: **skipped**" in body
    # 2 s over 256 tokens: 7.81 ms per step; (269,030,016 + 35,389,440) B per step = 38.97 GB/s, 1.2% of 3,350.
    assert "| 7.81 | 39.0 | 1.2% |" in body
    write_gpu_check_report(tmp_path, docs)
    assert docs.read_text() == text  # rewriting changes nothing outside (or inside) the markers

    bare = tmp_path / "bare.md"
    bare.write_text("# Benchmarks\n\nonly text\n")
    write_gpu_check_section(bare, "the body")
    assert bare.read_text() == f"# Benchmarks\n\nonly text\n\n{GPU_CHECK_BEGIN}\n\nthe body\n\n{GPU_CHECK_END}\n"


def test_the_report_command_names_the_fix_when_the_record_is_missing(tmp_path):
    with pytest.raises(SystemExit, match="gpu_check.sh"):
        main(["report", "--results", str(tmp_path), "--docs", str(tmp_path / "benchmarks.md")])
    (tmp_path / "gpu_check.json").write_text(json.dumps(gpu_check_record(
        [{"step": "decode", "status": "passed", "detail": "", "result": "decode=decode_gpu.json"}], MACHINE, 1.0)))
    with pytest.raises(SystemExit, match="copy every JSON file"):
        main(["report", "--results", str(tmp_path), "--docs", str(tmp_path / "benchmarks.md")])
