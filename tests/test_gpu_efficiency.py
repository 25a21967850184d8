"""The calibrated GPU efficiencies: each function returns its cited figure at a cited point, interpolates monotonically
between points, clamps (or extends, where documented) outside the measured range, and refuses nonsense."""

from __future__ import annotations

import itertools
import math

import pytest

from lightning_app_rlhf.planner import gpu_efficiency as ge
from lightning_app_rlhf.planner.gpu_efficiency import (
    SOURCES,
    bus_bandwidth_share,
    decode_bandwidth_share,
    forward_mfu,
    training_mfu,
)

KiB, MiB, GiB = 2**10, 2**20, 2**30
LARGEST_MICRO_BATCH = 28672  # llm-foundry H100 MPT-30B, 14 sequences of 2048: the micro-batch factor's 1.0


# ---------------------------------------------------------------- cited values at cited points


@pytest.mark.parametrize(("params", "tp", "pp", "expected"), [
    # Narayanan et al. 2021 (Megatron-LM, SC21), Table 1, "Percentage of theoretical peak FLOP/s", A100-80GB; the
    # pipelined rows without their 1F1B bubble (m micro-batches of one sequence per pipeline: batch / data-parallel)
    (1.7e9, 1, 1, 0.44),
    (7.5e9, 4, 1, 0.46),
    (18.4e9, 8, 1, 0.43),
    (39.1e9, 8, 2, 0.44 * (48 + 1) / 48),  # 512 GPUs: dp 32, batch 1536: m 48
    (76.1e9, 8, 4, 0.45 * (56 + 3) / 56),  # 1024 GPUs: dp 32, batch 1792: m 56
    (145.6e9, 8, 8, 0.47 * (96 + 7) / 96),  # 1536 GPUs: dp 24, batch 2304: m 96
    (1008.0e9, 8, 64, 0.52 * (512 + 63) / 512),  # 3072 GPUs: dp 6, batch 3072: m 512
])
def test_training_mfu_is_narayanan_table_1_at_its_rows_without_the_bubble(params, tp, pp, expected):
    """The cost model prices a pipelined call's bubble itself, so the figure it divides FLOPs by has none."""
    assert training_mfu(params, tp, pp, LARGEST_MICRO_BATCH) == pytest.approx(expected, abs=1e-12)


def test_table_1_is_kept_as_published():
    assert [row[:2] for row in ge.NARAYANAN_TABLE_1] == [
        (1.7e9, 0.44), (3.6e9, 0.44), (7.5e9, 0.46), (18.4e9, 0.43), (39.1e9, 0.44), (76.1e9, 0.45),
        (145.6e9, 0.47), (310.1e9, 0.50), (529.6e9, 0.52), (1008.0e9, 0.52)]


@pytest.mark.parametrize(("tokens", "hfu"), [
    # llm-foundry benchmarking README, "H100 80GB BF16", 30b, SeqLen 2048:
    # HFU 50.82 (micro-batch 3), 57.42 (10), 58.57 (14)
    (3 * 2048, 50.82),
    (10 * 2048, 57.42),
    (14 * 2048, 58.57),
])
def test_the_micro_batch_factor_is_llm_foundrys_30b_rows(tokens, hfu):
    assert training_mfu(1.7e9, 1, 1, tokens) == pytest.approx(0.44 * hfu / 58.57, abs=1e-12)


def test_forward_mfu_is_the_training_figure_times_korthikantis_forward_share():
    # Korthikanti et al. 2022, Table 4, "Baseline no recompute": forward 7.7 ms, forward + backward 19.6 ms (3x FLOPs)
    share = (1 / 7.7) / (3 / 19.6)
    assert share == pytest.approx(0.8485, abs=1e-4)
    assert forward_mfu(7.5e9, 4, 1, LARGEST_MICRO_BATCH) == pytest.approx(0.46 * share, abs=1e-12)
    assert forward_mfu(3e9, 2, 1, 4096) == pytest.approx(training_mfu(3e9, 2, 1, 4096) * share, abs=1e-12)


@pytest.mark.parametrize(("step_bytes", "expected"), [
    # this project, H200, compiled static decoder (docs/benchmarks.md): weights + KV GB/s x step ms = bytes a step
    (162.8e9 * 1.87e-3, 0.034),  # smollm2-135m, batch 8
    (743.4e9 * 3.87e-3, 0.155),  # llama-1b, batch 64
    (6.74e9 * 2, 1397.31 / 2039),  # gpt-fast README, A100-80GB, Llama-2-7B bf16, batch 1, 1 GPU: 1397.31 GB/s
    (69.0e9, 1481.87 / 2039),  # gpt-fast README, Llama-2-70B bf16 over 2 GPUs: 1481.87 GB/s per GPU
])
def test_decode_share_is_the_cited_figure_at_its_point(step_bytes, expected):
    assert decode_bandwidth_share(step_bytes) == pytest.approx(expected, abs=1e-12)


@pytest.mark.parametrize(("size", "busbw"), [
    # Bekman, all-reduce on 8x H200 (ml-engineering), busbw GB/s over NVLink 4's 450 GB/s
    (32 * KiB, 1.44),
    (1 * MiB, 39.93),
    (16 * MiB, 219.89),
    (256 * MiB, 436.15),
    (16 * GiB, 482.26),
])
def test_intra_node_share_is_bekmans_h200_sweep(size, busbw):
    assert bus_bandwidth_share(size, intra_node=True) == pytest.approx(busbw / 450, abs=1e-12)


def test_inter_node_share_is_the_ndmv4_figures_at_both_ends():
    # MSCCL++ docs, NDmv4, 2 nodes x 1 GPU, NCCL AllReduce: 21.27 us at 1K, busbw 18.65 GB/s at 1G; NIC 25 GB/s
    assert bus_bandwidth_share(GiB, intra_node=False) == pytest.approx(18.65 / 25, abs=1e-12)
    assert bus_bandwidth_share(KiB, intra_node=False) == pytest.approx(KiB / 21.27e-6 / 25e9, rel=1e-9)


def test_without_nvls_the_intra_node_share_stops_at_the_sharp_off_figure():
    # Bekman: the same node with SHARP disabled, 367.61 GB/s
    assert bus_bandwidth_share(16 * GiB, intra_node=True, nvls=False) == pytest.approx(367.61 / 450, abs=1e-12)
    assert bus_bandwidth_share(1 * MiB, intra_node=True, nvls=False) == pytest.approx(39.93 / 450, abs=1e-12)


# ---------------------------------------------------------------- monotone between points


def _grid(lo: float, hi: float, n: int = 200) -> list[float]:
    return [lo * (hi / lo) ** (i / (n - 1)) for i in range(n)]


def _between(points, x):
    xs = [p[0] for p in points]
    i = max(j for j in range(len(xs)) if xs[j] <= x)
    return points[i], points[min(i + 1, len(points) - 1)]


def test_every_function_stays_between_its_neighbouring_points():
    """Piecewise-linear: between two cited points the value lies between their values (monotone on each segment)."""
    cases = [
        (ge.TRAINING_POINTS, lambda x: training_mfu(x, 1, 1, LARGEST_MICRO_BATCH)),
        (ge.MICRO_BATCH_POINTS, lambda x: training_mfu(1.7e9, 1, 1, round(x)) / 0.44),
        (ge.DECODE_POINTS, decode_bandwidth_share),
        (ge.INTRA_NODE_POINTS, lambda x: bus_bandwidth_share(x, True)),
    ]
    for points, f in cases:
        for x in _grid(points[0][0], points[-1][0]):
            (_, y0), (_, y1) = _between(points, x)
            assert min(y0, y1) - 1e-9 <= f(x) <= max(y0, y1) + 1e-9


@pytest.mark.parametrize(("f", "lo", "hi"), [
    (decode_bandwidth_share, 1e8, 1e12),
    (lambda x: bus_bandwidth_share(x, True), 1.0, 64 * GiB),
    (lambda x: bus_bandwidth_share(x, True, nvls=False), 1.0, 64 * GiB),
    (lambda x: bus_bandwidth_share(x, False), 1.0, 64 * GiB),
    (lambda x: training_mfu(1e10, 2, 2, round(x)), 1.0, 1e6),
])
def test_the_shares_that_the_data_orders_never_fall(f, lo, hi):
    """Bigger decoders, bigger messages and bigger micro-batches never get a smaller share (the data rises there)."""
    values = [f(x) for x in _grid(lo, hi, 400)]
    assert all(b >= a - 1e-12 for a, b in itertools.pairwise(values))


def test_every_share_is_a_fraction_of_peak():
    for x in _grid(1e6, 1e13, 100):
        assert 0 < training_mfu(x, 8, 8, 2048) < 1
        assert 0 < forward_mfu(x, 8, 8, 2048) < 1
        assert 0 < decode_bandwidth_share(x) < 1
    for x in _grid(1.0, 1e11, 100):
        assert 0 < bus_bandwidth_share(x, False) < 1
        assert 0 < bus_bandwidth_share(x, True, nvls=False) < 1
        assert 0 < bus_bandwidth_share(x, True) <= 482.26 / 450  # NVLS: above the ring formula's peak, as measured


# ---------------------------------------------------------------- outside the measured range


def test_outside_the_measured_range_the_end_points_hold():
    assert training_mfu(1e8, 1, 1, LARGEST_MICRO_BATCH) == pytest.approx(0.44)  # below 1.7B
    assert training_mfu(1e13, 8, 64, LARGEST_MICRO_BATCH) == pytest.approx(0.52 * 575 / 512)  # above 1T
    assert training_mfu(1.7e9, 1, 1, 2048) == pytest.approx(0.44 * 50.82 / 58.57)  # below 6,144 tokens
    assert training_mfu(1.7e9, 1, 1, 10**6) == pytest.approx(0.44)  # above 28,672 tokens
    assert decode_bandwidth_share(1e6) == pytest.approx(0.034)
    assert decode_bandwidth_share(1e13) == pytest.approx(1481.87 / 2039)
    assert bus_bandwidth_share(1 << 40, True) == pytest.approx(482.26 / 450)
    assert bus_bandwidth_share(1 << 40, False) == pytest.approx(18.65 / 25)


def test_below_the_smallest_message_the_share_is_latency_bound():
    """Under 32 KiB (intra) the time no longer shrinks: the share falls in proportion to the bytes, as the sweep's
    first points do (1.44, 2.93, 5.73 GB/s at 32, 64, 128 KiB)."""
    assert bus_bandwidth_share(16 * KiB, True) == pytest.approx(bus_bandwidth_share(32 * KiB, True) / 2)
    assert bus_bandwidth_share(8, True) == pytest.approx(1.44 / 450 * 8 / (32 * KiB))
    tiny = bus_bandwidth_share(8, False)
    assert tiny == pytest.approx(8 / ge._inter_node_seconds(8) / 25e9)
    assert tiny < bus_bandwidth_share(KiB, False)


def test_tp_and_pp_are_checked_but_do_not_move_the_training_figure():
    """No cited table varies them at a fixed model size (the docstring says so)."""
    assert training_mfu(7e9, 1, 1, 4096) == training_mfu(7e9, 8, 4, 4096)


def test_the_decode_share_follows_the_bytes_a_step_reads():
    """Tensor parallelism reads 1/t of the bytes per GPU: a lower share, as gpt-fast's TP table shows (Llama-2-7B:
    68.5% on one A100, 58% / 47% / 35% per GPU at tp 2 / 4 / 8, all-reduces included); a larger batch's KV cache
    raises it."""
    weights = 6.74e9 * 2
    shares = [decode_bandwidth_share(weights / t) for t in (1, 2, 4, 8)]
    assert shares == sorted(shares, reverse=True)
    assert [round(x, 3) for x in shares] == [0.685, 0.447, 0.209, 0.126]
    assert decode_bandwidth_share(weights / 4 + 6e9) > decode_bandwidth_share(weights / 4)


# ---------------------------------------------------------------- nonsense in, a clear error out


@pytest.mark.parametrize("call", [
    lambda: training_mfu(0, 1, 1, 2048),
    lambda: training_mfu(-7e9, 1, 1, 2048),
    lambda: training_mfu(math.nan, 1, 1, 2048),
    lambda: training_mfu(math.inf, 1, 1, 2048),
    lambda: training_mfu("7e9", 1, 1, 2048),
    lambda: training_mfu(7e9, 0, 1, 2048),
    lambda: training_mfu(7e9, 1, 0, 2048),
    lambda: training_mfu(7e9, 1.5, 1, 2048),
    lambda: training_mfu(7e9, True, 1, 2048),
    lambda: training_mfu(7e9, 1, 1, 0),
    lambda: forward_mfu(0, 1, 1, 2048),
    lambda: decode_bandwidth_share(0),
    lambda: decode_bandwidth_share(-1e9),
    lambda: decode_bandwidth_share(math.inf),
    lambda: bus_bandwidth_share(0, True),
    lambda: bus_bandwidth_share(-1, False),
    lambda: bus_bandwidth_share(math.nan, False),
])
def test_nonsense_is_refused_with_the_argument_named(call):
    with pytest.raises(ValueError, match=r"(params|tp|pp|micro_batch_tokens|step_bytes|message_bytes) must be"):
        call()


# ---------------------------------------------------------------- sources


def test_every_source_is_complete_and_printable():
    assert set(SOURCES) == {"narayanan2021", "korthikanti2022", "llm_foundry_h100", "gpt_fast", "project_h200",
                            "bekman_h200_allreduce", "mscclpp_ndmv4"}
    for key, source in SOURCES.items():
        for field in ("title", "authors", "url", "where", "hardware", "configuration"):
            assert getattr(source, field).strip(), (key, field)
        assert 2019 <= source.year <= 2030
    lines = ge.source_lines()
    assert len(lines) == len(SOURCES) and all(line.startswith(key + ": ") for line, key in zip(lines, SOURCES))
