"""Shape-dependent GPU efficiencies from published, cited measurements. Plain Python.

The analytic GPU cost model divides FLOPs by a fraction of peak FLOP/s, bytes by a fraction of peak HBM bandwidth and
collective bytes by a fraction of the link's peak bandwidth. This module gives those fractions as small pure
functions of the call's shape, each interpolated over measured points that someone else published (or, for small
decoders, that this project measured on a GPU and published in ``docs/benchmarks.md``):

- :func:`training_mfu`: forward + backward of a GPT/Llama-style transformer, fraction of peak dense bf16 FLOP/s;
- :func:`forward_mfu`: forward only (scoring, prefill), derived from the training figure;
- :func:`decode_bandwidth_share`: one decode step, fraction of peak HBM bandwidth, against the bytes it reads;
- :func:`bus_bandwidth_share`: one collective, bus bandwidth as a fraction of the link's peak bandwidth.

Every point is listed with its source in :data:`SOURCES` and in the tables of ``docs/planner.md`` ("Calibrated GPU
efficiencies"). Between points the functions interpolate piecewise-linearly in log scale of the shape argument;
outside the measured range they clamp to the end point, except where a docstring says otherwise (and why).

These are priors for a device nobody measured. A :class:`~lightning_app_rlhf.planner.profiler.Profile` taken on the
device itself (``scripts/gpu_check.sh``, the profiler) wins wherever it has the op: the cost model only falls back to
these functions for ops the profile lacks.
"""

from __future__ import annotations

import bisect
import math
import numbers
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Source:
    """One published measurement set."""

    title: str
    authors: str
    year: int
    url: str
    where: str
    """Table, figure or section the numbers come from."""
    hardware: str
    configuration: str


SOURCES: dict[str, Source] = {
    "narayanan2021": Source(
        title="Efficient Large-Scale Language Model Training on GPU Clusters Using Megatron-LM",
        authors="D. Narayanan, M. Shoeybi, J. Casper, P. LeGresley, M. Patwary, V. Korthikanti, D. Vainbrand, "
        "P. Kashinkunti, J. Bernauer, B. Catanzaro, A. Phanishayee, M. Zaharia (NVIDIA, Stanford, Microsoft)",
        year=2021,
        url="https://arxiv.org/abs/2104.04473",
        where="Table 1 (weak scaling, 'Percentage of theoretical peak FLOP/s')",
        hardware="A100-80GB SXM (Selene, 8 per node, NVLink/NVSwitch, 8x200 Gb/s HDR InfiniBand), peak 312 TFLOP/s",
        configuration="GPT, sequence 2048, vocabulary 51,200, mixed precision, full activation recomputation (its "
        "FLOP count, eq. 3, includes the recomputed forward), end to end (data loading, optimizer, pipeline bubble "
        "and communication included); each row its own tensor- and pipeline-parallel degree",
    ),
    "korthikanti2022": Source(
        title="Reducing Activation Recomputation in Large Transformer Models",
        authors="V. Korthikanti, J. Casper, S. Lym, L. McAfee, M. Andersch, M. Shoeybi, B. Catanzaro (NVIDIA)",
        year=2022,
        url="https://arxiv.org/abs/2205.05198",
        where="Table 4 (forward and backward time of one transformer layer of the 22B model); Table 5 (MFU / HFU, "
        "cross-check only)",
        hardware="A100-80GB SXM (Selene)",
        configuration="22B GPT (hidden 6144, 64 heads), tensor-parallel 8, sequence 2048, micro-batch 1 (Table 4 row "
        "'Baseline no recompute': forward 7.7 ms, backward 11.9 ms, combined 19.6 ms)",
    ),
    "llm_foundry_h100": Source(
        title="MPT Training Benchmarks (llm-foundry scripts/train/benchmarking/README.md)",
        authors="MosaicML / Databricks",
        year=2023,
        url="https://github.com/mosaicml/llm-foundry/blob/main/scripts/train/benchmarking/README.md",
        where="table 'H100 80GB BF16', rows 30b at SeqLen 2048 (8, 16 and 32 GPUs; HFU column)",
        hardware="H100-80GB SXM",
        configuration="MPT-30B, FSDP FULL_SHARD, amp_bf16, activation checkpointing, sequence 2048; micro-batch 3 / "
        "10 / 14 sequences (6,144 / 20,480 / 28,672 tokens): HFU 50.82 / 57.42 / 58.57%",
    ),
    "gpt_fast": Source(
        title="gpt-fast: simple and efficient pytorch-native transformer text generation (README, Benchmarks)",
        authors="PyTorch team (pytorch-labs); blog 'Accelerating Generative AI with PyTorch II: GPT, Fast'",
        year=2023,
        url="https://github.com/pytorch-labs/gpt-fast#benchmarks",
        where="tables 'Benchmarks' and 'Tensor Parallelism', column 'Memory Bandwidth (GB/s)' (per GPU)",
        hardware="A100-80GB SXM, power-limited to 330 W (README: 'empirically peak bandwidth is about 1700 GB/s'); "
        "datasheet peak 2,039 GB/s used here",
        configuration="bf16 weights, batch 1, 5-token prompt, torch.compile; Llama-2-7B on 1 GPU 1397.31 GB/s, "
        "Llama-2-70B on 2 GPUs (tensor-parallel) 1481.87 GB/s",
    ),
    "project_h200": Source(
        title="lightning-app-rlhf docs/benchmarks.md, gpu-check section ('Decoders on the GPU', 'The decode step's "
        "share of the memory bandwidth'); docs/bench_results/decode_gpu*.json",
        authors="this project (scripts/gpu_check.sh)",
        year=2026,
        url="docs/benchmarks.md",
        where="rows `static_compiled`, column 'of peak'",
        hardware="H200 (peak 4,800 GB/s), torch 2.11, one GPU",
        configuration="our static decoder compiled (CUDA graph), random-init, bf16, 64 prompt positions, 256 new "
        "tokens; smollm2-135m (134.5M params) at batch 8: 3.4%; llama-1b (1235.8M) at batch 64: 15.5%; weights + "
        "mean KV bytes per step over the step time with the prefill charged to the steps (lower bounds)",
    ),
    "bekman_h200_allreduce": Source(
        title="all-reduce on a single 8x H200 node (Machine Learning Engineering, "
        "network/benchmarks/results/all-reduce-8xH200.md)",
        authors="S. Bekman",
        year=2026,
        url="https://github.com/stas00/ml-engineering/blob/master/network/benchmarks/results/all-reduce-8xH200.md",
        where="table 'payload / busbw / algbw', and 'Reading these numbers' (SHARP disabled: 367.61 GB/s)",
        hardware="8x H200 SXM, NVLink 4 via NVSwitch (450 GB/s per GPU per direction)",
        configuration="torch.distributed all_reduce (all_reduce_bench.py), torch 2.9.1, NCCL 2.27.7, 5 warm-up / 20 "
        "timed iterations per payload; NCCL picks Ring/LL up to 1 MiB and NVLS/SIMPLE from 2 MiB",
    ),
    "mscclpp_ndmv4": Source(
        title="NDmv4 Performance (MSCCL++ documentation, docs/performance-ndmv4.md)",
        authors="Microsoft (MSCCL++ team)",
        year=2023,
        url="https://github.com/microsoft/mscclpp/blob/main/docs/performance-ndmv4.md",
        where="section '2 nodes, 1 gpu/node', column 'NCCL AllReduce': latency at 1K and BusBW at 1G",
        hardware="Azure NDm A100 v4: 8x A100-80GB per node, one 200 Gb/s HDR InfiniBand NIC per GPU (25 GB/s)",
        configuration="nccl-tests, NCCL 2.17.1 + CUDA 11.8, in-place; all-reduce of 1 KiB: 21.27 us; of 1 GiB: "
        "busbw 18.65 GB/s",
    ),
}
"""Every source a number below comes from, by key. ``docs/planner.md`` prints them."""


# ---------------------------------------------------------------- interpolation


def _interpolate(points: Sequence[tuple[float, float]], x: float) -> float:
    """Piecewise-linear in log(x) through ``points`` (sorted by x), clamped to the end values outside."""
    xs = [p[0] for p in points]
    if x <= xs[0]:
        return points[0][1]
    if x >= xs[-1]:
        return points[-1][1]
    i = bisect.bisect_right(xs, x)
    (x0, y0), (x1, y1) = points[i - 1], points[i]
    t = (math.log(x) - math.log(x0)) / (math.log(x1) - math.log(x0))
    return y0 + t * (y1 - y0)


def _positive(name: str, value: float) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value) or value <= 0:
        raise ValueError(f"{name} must be a finite number > 0, got {value!r}.")
    return float(value)


def _integer(name: str, value: int, least: int) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < least:
        raise ValueError(f"{name} must be an integer >= {least}, got {value!r}.")
    return int(value)


def _degree(name: str, value: int) -> int:
    return _integer(name, value, 1)


# ---------------------------------------------------------------- training and forward


NARAYANAN_TABLE_1: tuple[tuple[float, float, int, int, int, int], ...] = (
    # (parameters, fraction of peak, tensor-parallel degree, pipeline-parallel degree, GPUs, global batch in
    # sequences): Narayanan et al. 2021, Table 1 (A100-80GB, sequence 2048); achieved TFLOP/s per GPU in the comment.
    (1.7e9, 0.44, 1, 1, 32, 512),  # 137
    (3.6e9, 0.44, 2, 1, 64, 512),  # 138
    (7.5e9, 0.46, 4, 1, 128, 512),  # 142
    (18.4e9, 0.43, 8, 1, 256, 1024),  # 135
    (39.1e9, 0.44, 8, 2, 512, 1536),  # 138
    (76.1e9, 0.45, 8, 4, 1024, 1792),  # 140
    (145.6e9, 0.47, 8, 8, 1536, 2304),  # 148
    (310.1e9, 0.50, 8, 16, 1920, 2160),  # 155
    (529.6e9, 0.52, 8, 35, 2520, 2520),  # 163
    (1008.0e9, 0.52, 8, 64, 3072, 3072),  # 163
)
"""Narayanan et al. 2021, Table 1, as published: end-to-end fraction of peak, pipeline bubble included."""


def _without_bubble(share: float, tp: int, pp: int, gpus: int, batch: int) -> float:
    """A Table 1 row's fraction of peak with its pipeline bubble taken out: times ``(m + p - 1) / m``, ``m`` the
    micro-batches per pipeline per step (the global batch over the data-parallel degree ``gpus / (tp pp)``, taking
    one sequence per micro-batch and the plain 1F1B schedule, whose bubble is ``(p - 1) / m`` of the work).

    The cost model prices a pipelined call's bubble itself (``CostModel.pipelined``), so the figure it divides the
    FLOPs by must not contain one. If Table 1's runs used Megatron's interleaved schedule (section 5.1 of the paper
    describes it as the default for the end-to-end runs, as we remember it) their bubble was smaller and the figures
    here are too high by at most the bubble removed: 2% at 39.1B, 5% at 76.1B, 12% at 1T; nothing below 39.1B (pp 1).
    """
    micro_batches = batch // (gpus // (tp * pp))
    return share * (micro_batches + pp - 1) / micro_batches


TRAINING_POINTS: tuple[tuple[float, float], ...] = tuple(
    (params, _without_bubble(share, tp, pp, gpus, batch)) for params, share, tp, pp, gpus, batch in NARAYANAN_TABLE_1
)
"""Hardware-FLOPs utilization of training against model size, pipeline bubble excluded: :data:`NARAYANAN_TABLE_1`
through :func:`_without_bubble` (0.44-0.46 up to 18.4B, 0.449 at 39.1B, 0.474 at 76.1B, 0.584 at 1T)."""

MICRO_BATCH_POINTS: tuple[tuple[float, float], ...] = (
    # (tokens per micro-batch, factor): llm-foundry 'H100 80GB BF16', MPT-30B at sequence 2048, HFU over the largest
    # micro-batch's: 50.82 / 58.57, 57.42 / 58.57, 58.57 / 58.57.
    (6144.0, 50.82 / 58.57),
    (20480.0, 57.42 / 58.57),
    (28672.0, 1.0),
)
"""Relative throughput against the tokens of one micro-batch (llm-foundry benchmark table, H100 BF16, MPT-30B)."""

FORWARD_TO_TRAINING = (1 / 7.7) / (3 / 19.6)
"""Efficiency of a forward pass over that of a whole forward + backward, ~0.848: Korthikanti et al. 2022 Table 4
('Baseline no recompute', 22B layer, tp 8, A100): the forward (1 unit of FLOPs) takes 7.7 ms, forward + backward
(3 units) 19.6 ms, so the forward runs at (1 / 7.7) / (3 / 19.6) of the training rate."""


def training_mfu(params: float, tp: int, pp: int, micro_batch_tokens: int) -> float:
    """Fraction of peak dense bf16 FLOP/s a forward + backward of a GPT/Llama-style model achieves.

    The fraction counts the FLOPs actually executed (hardware FLOPs utilization: a recomputed forward counts), which is
    what the cost model divides by it (train = 3 forwards, 4 with gradient checkpointing); without recomputation it
    equals the model FLOPs utilization.

    It is ``size(params) x micro_batch(micro_batch_tokens)``:

    - ``size``: Narayanan et al. 2021 Table 1 (:data:`TRAINING_POINTS`), 44-52% of peak from 1.7B to 1T parameters
      on A100-80GB as published, with each pipelined row's bubble taken out (:func:`_without_bubble`: 0.449 at
      39.1B, 0.474 at 76.1B, 0.584 at 1T), piecewise-linear in log(params), clamped below 1.7B and above 1T. The
      bubble comes out because the cost model prices it (``CostModel.pipelined``); the rows' communication (the
      tensor-parallel all-reduces, the data-parallel gradient all-reduce) stays in, and the cost model prices that
      too: a double count of the communication Megatron did not overlap, which makes these figures conservative.
    - ``micro_batch``: llm-foundry's H100 BF16 MPT-30B rows (:data:`MICRO_BATCH_POINTS`): 0.868 at 6,144 tokens per
      micro-batch, 0.980 at 20,480, 1.0 at 28,672; clamped at both ends (so micro-batches under 6,144 tokens get
      0.868: no cited point below it, optimistic there). The three rows also differ in GPUs (8, 16, 32) and
      gradient accumulation (21, 3, 3), which the factor attributes to the micro-batch; and Table 1 does not state
      its rows' micro-batch, so the product may count a small micro-batch's loss where Table 1 already had it.

    ``tp`` and ``pp`` are checked, not used: Table 1 scales them with the model (tp 1 to 8, pp 1 to 64) and shows the
    per-GPU efficiency holding at 43-52%; no cited table varies them at a fixed model size.

    Args:
        params: Parameters of the whole model (> 0).
        tp: Tensor-parallel degree (>= 1).
        pp: Pipeline-parallel degree (>= 1).
        micro_batch_tokens: Tokens in one micro-batch on one replica (sequences x length, >= 1).

    A profile measured on the device (:class:`~lightning_app_rlhf.planner.profiler.Profile`) wins over this figure.
    """
    params = _positive("params", params)
    _degree("tp", tp)
    _degree("pp", pp)
    _degree("micro_batch_tokens", micro_batch_tokens)
    return _interpolate(TRAINING_POINTS, params) * _interpolate(MICRO_BATCH_POINTS, micro_batch_tokens)


def forward_mfu(params: float, tp: int, pp: int, micro_batch_tokens: int) -> float:
    """Fraction of peak dense bf16 FLOP/s a forward-only pass (scoring, prefill) achieves.

    No cited table measures forward-only throughput against model size, so this is :func:`training_mfu` times
    :data:`FORWARD_TO_TRAINING` (~0.848), the forward's share of the training rate in Korthikanti et al. 2022 Table 4
    (a 22B layer on A100: forward 7.7 ms of a 19.6 ms forward + backward that does 3x its FLOPs). Same arguments,
    checks and clamps as :func:`training_mfu`; a profile measured on the device wins.
    """
    return training_mfu(params, tp, pp, micro_batch_tokens) * FORWARD_TO_TRAINING


# ---------------------------------------------------------------- decode


DECODE_POINTS: tuple[tuple[float, float], ...] = (
    # (bytes one GPU reads per step: weights + KV cache, fraction of peak HBM bandwidth)
    (162.8e9 * 1.87e-3, 0.034),  # project, H200, smollm2-135m, batch 8: 162.8 GB/s x 1.87 ms = 304 MB (lower bound)
    (743.4e9 * 3.87e-3, 0.155),  # project, H200, llama-1b, batch 64: 743.4 GB/s x 3.87 ms = 2.88 GB (lower bound)
    (6.74e9 * 2, 1397.31 / 2039),  # gpt-fast, A100-80GB, Llama-2-7B bf16, batch 1, 1 GPU: 13.5 GB, 0.685
    (69.0e9 * 2 / 2, 1481.87 / 2039),  # gpt-fast, A100-80GB, Llama-2-70B bf16 over 2 GPUs (tensor-parallel): 69 GB, 0.727
)
"""Decode-step share of peak HBM bandwidth against the bytes one GPU reads per step (its weights and KV cache).

The cited runs report it per parameter count; the bytes are what sets it: a step pays fixed costs (kernel launches,
sampling, Python) besides its reads, and they weigh less the more it reads. Indexed by bytes, a tensor-parallel step
(1/t of the weights and KV cache per GPU) and a large batch's (more KV cache) land where their reads put them,
rather than where the model's size would."""


def decode_bandwidth_share(step_bytes: float) -> float:
    """Fraction of peak HBM bandwidth one decode step achieves: the bytes one GPU reads in it (weights + KV cache)
    over its time, against the peak.

    Piecewise-linear in log(bytes) through :data:`DECODE_POINTS`: 3.4% at 304 MB and 15.5% at 2.88 GB a step (this
    project's compiled decoder on an H200 at 134.5M and 1.24B parameters, ``docs/benchmarks.md``; lower bounds, the
    prefill charged to the steps), 68.5% at 13.5 GB (gpt-fast, Llama-2-7B on one A100-80GB, batch 1) and 72.7% at 69
    GB (gpt-fast, Llama-2-70B over two A100s, per GPU); clamped to 3.4% below 304 MB and 72.7% above 69 GB.

    Cross-check, not fitted: gpt-fast's tensor-parallel table (per GPU, all-reduces included) gives Llama-2-7B 58% /
    47% / 35% of 2,039 GB/s at 6.7 / 3.4 / 1.7 GB per GPU (tp 2 / 4 / 8); this curve gives 45% / 21% / 13% there, and
    the cost model adds the all-reduces on top: lower, as our own points (lower bounds, a less tuned decoder) pull
    the middle of the curve down. The mix of decoders is what is published: measure the device
    (``scripts/gpu_check.sh``) and its profile wins.

    Args:
        step_bytes: Bytes one GPU reads in one decode step: its weights (the model's over the tensor-parallel degree)
            plus its KV cache (> 0).
    """
    return _interpolate(DECODE_POINTS, _positive("step_bytes", step_bytes))


# ---------------------------------------------------------------- collectives

KiB, MiB, GiB = 2**10, 2**20, 2**30

NVLINK4_PEAK = 450e9
"""NVLink 4 per GPU per direction (H100/H200 SXM), bytes/s: the peak the intra-node shares are relative to."""

INTRA_NODE_POINTS: tuple[tuple[float, float], ...] = tuple(
    (size, busbw / NVLINK4_PEAK)
    for size, busbw in (
        # Bekman, all-reduce on 8x H200 (payload per rank, busbw GB/s)
        (32 * KiB, 1.44e9),
        (64 * KiB, 2.93e9),
        (128 * KiB, 5.73e9),
        (256 * KiB, 11.74e9),
        (512 * KiB, 23.94e9),
        (1 * MiB, 39.93e9),
        (2 * MiB, 64.53e9),
        (4 * MiB, 107.16e9),
        (8 * MiB, 155.53e9),
        (16 * MiB, 219.89e9),
        (32 * MiB, 275.84e9),
        (64 * MiB, 346.51e9),
        (128 * MiB, 401.93e9),
        (256 * MiB, 436.15e9),
        (512 * MiB, 450.29e9),
        (1 * GiB, 463.58e9),
        (2 * GiB, 469.17e9),
        (4 * GiB, 473.10e9),
        (8 * GiB, 477.45e9),
        (16 * GiB, 482.26e9),
    )
)
"""Intra-node all-reduce bus bandwidth over the NVLink 4 peak against the payload (8x H200, NCCL 2.27.7)."""

INTRA_NODE_RING_CEILING = 367.61e9 / NVLINK4_PEAK
"""0.817: the same 8x H200 node with SHARP (NVLS) disabled, the largest payload (Bekman, 'Reading these numbers')."""

INTER_NODE_PEAK = 25e9
"""One 200 Gb/s HDR NIC per GPU (NDm A100 v4), bytes/s: the peak the inter-node shares are relative to."""
INTER_NODE_SMALL = (1 * KiB, 21.27e-6)
"""All-reduce of 1 KiB between 2 nodes (1 GPU each): 21.27 us (MSCCL++ NDmv4 page, NCCL AllReduce)."""
INTER_NODE_LARGE = (1 * GiB, 18.65e9)
"""All-reduce of 1 GiB between 2 nodes (1 GPU each): busbw 18.65 GB/s (MSCCL++ NDmv4 page, NCCL AllReduce)."""


def _inter_node_seconds(message_bytes: float) -> float:
    """Time of an all-reduce between two nodes on the line ``a + bytes / b`` through the two cited points (with two
    ranks the bus bandwidth equals the algorithm bandwidth: bytes over time)."""
    (s0, t0), (s1, busbw1) = INTER_NODE_SMALL, INTER_NODE_LARGE
    t1 = s1 / busbw1
    b = (s1 - s0) / (t1 - t0)
    a = t0 - s0 / b
    return a + message_bytes / b


def bus_bandwidth_share(message_bytes: float, intra_node: bool, nvls: bool = True) -> float:
    """Fraction of a link's peak bandwidth a collective's bus bandwidth achieves at this message size.

    Bus bandwidth is nccl-tests' ``busbw``: for an all-reduce of ``S`` bytes over ``n`` ranks, ``2 (n - 1) / n x S``
    over the time, so a ring formula with ``peak x share`` reproduces the measured time.

    - ``intra_node``: Bekman's all-reduce sweep on 8x H200 over NVLink 4 (:data:`INTRA_NODE_POINTS`, share of 450
      GB/s), piecewise-linear in log(bytes) from 32 KiB (0.32%) to 16 GiB (107%: NCCL's NVLS reduces inside the
      NVSwitch, so more than the ring formula's bytes per link; the data says so, and the share is not capped at 1).
      Above 16 GiB: clamped. Below 32 KiB: proportional to the bytes (the sweep's first points double with each
      doubling: the time is latency only). With ``nvls=False`` (A100, or SHARP off) the share is at most 0.817, the
      same node's largest-payload figure with SHARP disabled.
    - between nodes: the latency-bandwidth line through two nccl-tests all-reduce figures between two Azure NDm A100
      v4 nodes, one GPU each (MSCCL++ docs): 21.27 us at 1 KiB and 18.65 GB/s at 1 GiB, as a share of the GPU's 25
      GB/s NIC: 0.19% at 1 KiB, 74.6% at 1 GiB; clamped to 74.6% above 1 GiB, on the line below 1 KiB.

    The small-message shares include the collective's fixed latency: a caller that also adds a fixed latency per
    collective counts it twice. A profile measured on the device (its measured collective bandwidth) wins.

    Args:
        message_bytes: Bytes each rank contributes (nccl-tests' size; > 0).
        intra_node: Whether all ranks share one node (NVLink) or not (the network).
        nvls: Intra-node only: whether NCCL can reduce in the NVSwitch (H100/H200 with NVLink SHARP).
    """
    message_bytes = _positive("message_bytes", message_bytes)
    if intra_node:
        smallest, first = INTRA_NODE_POINTS[0]
        share = (first * message_bytes / smallest if message_bytes < smallest
                 else _interpolate(INTRA_NODE_POINTS, message_bytes))
        return share if nvls else min(share, INTRA_NODE_RING_CEILING)
    size = min(message_bytes, INTER_NODE_LARGE[0])
    return size / _inter_node_seconds(size) / INTER_NODE_PEAK


def source_lines() -> list[str]:
    """``key: authors (year), title, url; where; hardware; configuration`` for every source, for docs and logs."""
    return [f"{key}: {s.authors} ({s.year}), {s.title}, {s.url}; {s.where}; {s.hardware}; {s.configuration}"
            for key, s in SOURCES.items()]
