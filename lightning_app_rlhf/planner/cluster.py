"""The cluster a plan runs on: nodes x devices, device memory, compute and bandwidth ceilings. Plain Python.

A cluster is written by hand as ``NODESxDEVICESxTYPE`` (``1x8xA100-80GB``, ``8x8xH100-80GB``, ``1x4xcpu``) or read
from the running process (:func:`cluster_from_environment`). On the CPU a "device" is one process: when a node
runs more processes than it has cores, the processes share the cores, and the cost model slows them down.
"""

from __future__ import annotations

import os
import queue
import re
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

GiB = 2**30


@dataclass(frozen=True)
class DeviceType:
    """Ceilings of one device kind. Peak figures; the cost model applies its own efficiencies."""

    name: str
    """The name used in cluster strings, e.g. ``A100-80GB``."""
    memory_bytes: int
    """Memory of one device."""
    flops: float
    """Peak dense matmul FLOP/s in the training dtype (bf16 on GPUs, fp32 on the CPU)."""
    memory_bandwidth: float
    """Device memory bandwidth, bytes/s."""
    intra_node_bandwidth: float
    """Bytes/s one device can send to another device of the same node (NVLink, shared memory)."""
    inter_node_bandwidth: float
    """Bytes/s one device can send to a device of another node (its share of the node's network)."""
    kernel_overhead_s: float
    """Fixed cost of one transformer layer in one forward call (kernel launches, Python dispatch)."""
    collective_latency_s: float
    """Fixed cost of one collective hop."""
    dtype_bytes: int = 2
    """Bytes per weight in the dtype this device trains in."""
    all_reduce_bandwidth: float | None = None
    """Bus bytes/s of an all-reduce (and a broadcast) of large buckets within a node, where it differs from an
    all-gather's: gloo's all-reduce of a 25 MiB gradient bucket moves 2-8x the bytes/s of its 1 MB all-gathers on
    the CPU, and its broadcast is faster still. None: ``intra_node_bandwidth``."""


DEVICE_TYPES: dict[str, DeviceType] = {
    d.name.lower(): d
    for d in (
        # NVIDIA datasheets: dense bf16 FLOP/s, HBM bandwidth, NVLink (one direction) and a 200/400 Gb/s NIC per GPU.
        DeviceType("A100-40GB", 40 * GiB, 312e12, 1.555e12, 300e9, 25e9, 40e-6, 10e-6),
        DeviceType("A100-80GB", 80 * GiB, 312e12, 2.039e12, 300e9, 25e9, 40e-6, 10e-6),
        DeviceType("H100-80GB", 80 * GiB, 989e12, 3.35e12, 450e9, 50e9, 30e-6, 8e-6),
        DeviceType("H200", 141 * GiB, 989e12, 4.8e12, 450e9, 50e9, 30e-6, 8e-6),
        # One CPU process with one thread: rough single-core figures; a profile replaces them with measured ones.
        DeviceType("cpu", 8 * GiB, 60e9, 10e9, 2e9, 0.5e9, 150e-6, 150e-6, dtype_bytes=4),
    )
}
"""Known device types, by lower-case name."""


@dataclass(frozen=True)
class Cluster:
    """``nodes`` x ``devices_per_node`` devices of one type; ranks are numbered node by node."""

    nodes: int
    """Number of nodes."""
    devices_per_node: int
    """Devices (ranks) per node."""
    device: DeviceType
    """The device type of every rank."""
    cores_per_node: int | None = None
    """CPU only: cores a node's processes share. None: every device computes on its own."""
    compute_shares: tuple[float, ...] | None = None
    """CPU only, measured (:func:`measure_compute_shares`): entry ``k - 1`` is the fraction of one core's speed each
    of ``k`` processes computing at once gets on this machine now, other jobs included. Overrides the processor
    sharing formula for up to ``len(compute_shares)`` busy processes."""

    def __post_init__(self) -> None:
        if self.nodes < 1 or self.devices_per_node < 1:
            raise ValueError(
                f"A cluster needs at least one node and one device per node, got {self.nodes} x "
                f"{self.devices_per_node}. Write it as NODESxDEVICESxTYPE, e.g. 1x8xA100-80GB."
            )
        if self.cores_per_node is not None and self.cores_per_node < 1:
            raise ValueError(f"cores_per_node must be >= 1 or None, got {self.cores_per_node}.")
        if self.compute_shares is not None and not all(0 < x <= 1 for x in self.compute_shares):
            raise ValueError(f"compute_shares must lie in (0, 1], got {self.compute_shares}.")

    @property
    def world_size(self) -> int:
        return self.nodes * self.devices_per_node

    @property
    def name(self) -> str:
        return f"{self.nodes}x{self.devices_per_node}x{self.device.name}"

    def node_of(self, rank: int) -> int:
        return rank // self.devices_per_node

    def on_one_node(self, ranks: tuple[int, ...] | list[int]) -> bool:
        """Whether ``ranks`` (none counts as one node) all sit on one node. Nodes hold consecutive ranks, so the lowest
        and the highest rank tell (a search asks this about a million times)."""
        return not ranks or self.node_of(min(ranks)) == self.node_of(max(ranks))

    def bandwidth(self, ranks: tuple[int, ...] | list[int]) -> float:
        """Per-device bandwidth of a collective over ``ranks``: intra-node unless they span nodes."""
        return self.device.intra_node_bandwidth if self.on_one_node(ranks) else self.device.inter_node_bandwidth

    def compute_share(self, busy_ranks_on_node: int) -> float:
        """Fraction of a device's compute a rank gets while ``busy_ranks_on_node`` ranks of its node compute.

        Measured ``compute_shares`` where given, else processor sharing: the busy ranks split the node's cores
        evenly, and no rank gets more than one core.
        """
        if self.cores_per_node is None:
            return 1.0
        if self.compute_shares and 1 <= busy_ranks_on_node <= len(self.compute_shares):
            return self.compute_shares[busy_ranks_on_node - 1]
        if busy_ranks_on_node <= self.cores_per_node:
            return 1.0
        return self.cores_per_node / busy_ranks_on_node


def parse_cluster(text: str) -> Cluster:
    """Read ``NODESxDEVICESxTYPE``, e.g. ``1x8xA100-80GB``, ``8x8xH100-80GB`` or ``1x4xcpu``.

    A ``cpu`` cluster takes this machine's cores and memory (split over the processes of a node).
    """
    match = re.fullmatch(r"\s*(\d+)\s*x\s*(\d+)\s*x\s*([A-Za-z0-9_.-]+)\s*", text)
    if match is None:
        raise ValueError(
            f"Cannot read the cluster {text!r}: write it as NODESxDEVICESxTYPE, e.g. 1x8xA100-80GB, "
            f"8x8xH100-80GB or 1x4xcpu. Known device types: {known_devices()}."
        )
    nodes, devices, kind = int(match[1]), int(match[2]), match[3].lower()
    if kind not in DEVICE_TYPES:
        raise ValueError(
            f"Unknown device type {match[3]!r} in cluster {text!r}. Known device types: "
            f"{known_devices()}. Pick one of them, or build a Cluster with your own DeviceType."
        )
    device = DEVICE_TYPES[kind]
    if kind == "cpu":
        device = replace(device, memory_bytes=_ram_bytes() // devices)
        return Cluster(nodes, devices, device, cores_per_node=_cores())
    return Cluster(nodes, devices, device)


def known_devices() -> list[str]:
    return [d.name for d in DEVICE_TYPES.values()]


def cluster_from_environment(
    world_size: int | None = None,
    device: DeviceType | None = None,
    cores: int | None = None,
    compute_shares: tuple[float, ...] | None = None,
    nodes: int = 1,
) -> Cluster:
    """The cluster this process runs in: ``nodes`` nodes (machines like this one), each of ``world_size / nodes`` CPU
    processes sharing its cores.

    Args:
        world_size: Processes in the job. Default: ``WORLD_SIZE`` from the environment, else 1.
        device: Device ceilings, e.g. ``profile.device`` measured by the profiler. Default: the ``cpu`` entry of
            :data:`DEVICE_TYPES` with this machine's memory split over the processes.
        cores: Cores the processes share. Default: the cores this process may run on.
        compute_shares: Measured share of a core per busy process (:func:`measure_compute_shares`); None: the
            cores are ours alone, shared evenly.
        nodes: Machines in the job (``trainer.num_nodes``); ``world_size`` must be a multiple.
    """
    world_size = world_size or int(os.environ.get("WORLD_SIZE", "1"))
    if nodes < 1 or world_size % nodes:
        raise ValueError(f"A job of {world_size} processes on {nodes} nodes: trainer.num_nodes must divide the world "
                         "size (devices x num_nodes).")
    per_node = world_size // nodes
    if device is None:
        device = replace(DEVICE_TYPES["cpu"], memory_bytes=_ram_bytes() // per_node)
    return Cluster(nodes, per_node, device, cores_per_node=cores or _cores(), compute_shares=compute_shares)


def measure_compute_shares(
    processes: int, seconds: float = 1.0, work: Callable[[], object] | None = None, repeats: int = 3
) -> tuple[float, ...]:
    """Fraction of one core's full speed each of ``k`` concurrently computing processes gets, ``k = 1..processes``.

    ``k`` forked processes each run ``work`` over and over for ``seconds`` of wall time. A process's share is the
    CPU time the kernel gave it over that wall time (our own processes and the other jobs' load), times its
    efficiency: the median CPU time of a unit of work alone over the same with ``k`` busy, at most 1. Time-slicing
    costs the work itself: a process switched out finds its caches cold (a small model's generate costs about 25%
    more CPU time with 4 processes on 2 cores), and virtual cores may share one physical core. Medians keep a spike
    of the other jobs out of the efficiency. The unit is the profile's: CPU seconds per op at full speed. Each
    ``k`` is measured ``repeats`` times and the median kept, and a share is never above the one for fewer busy
    processes (one more cannot make the others faster): one burst of the other jobs would otherwise decide the
    plan.

    Args:
        processes: Largest number of busy processes to measure.
        seconds: Wall time of each measurement.
        work: One unit of representative work, e.g. :func:`~lightning_app_rlhf.planner.profiler.model_work`
            (a forward and backward of the workload's actor). Default: a pure-Python loop, which sees the CPU time
            and little of the cache cost.
        repeats: Measurements per ``k``; the median is kept.
    """
    import multiprocessing

    global _WORK
    _WORK = work or _python_loop
    context = multiprocessing.get_context("fork")  # the children inherit ``_WORK``: it need not pickle
    runs = {
        k: [_run_concurrently(context, k, seconds) for _ in range(repeats)] for k in range(1, processes + 1)
    }
    alone = statistics.median(run[0][1] for run in runs[1])
    shares: list[float] = []
    for k in range(1, processes + 1):
        # Contention cannot make a unit cheaper: an efficiency above 1 is timer noise.
        measured = [sum(share * min(1.0, alone / unit) for share, unit in run) / k for run in runs[k]]
        shares.append(min(1.0, statistics.median(measured), *shares[-1:]))
    return tuple(shares)


def measure_settled_compute_shares(processes: int, work: Callable[[], object] | None = None, seconds: float = 1.0,
                                   tolerance: float = 0.2, tries: int = 4) -> tuple[float, ...]:
    """:func:`measure_compute_shares` as a plan should be decided with it: after ``seconds`` of idle (the profile's
    and the collectives' processes settle), twice, and again while two measurements in a row differ by more than
    ``tolerance`` (relative, for any k), at most ``tries`` times; the mean of the two that agree (the last one when
    none do). Measured once right after
    a profile, 2 busy processes on 2 idle cores read 0.66-0.75 in 3 of 8 cases, against 0.96-1.00 around every run
    (docs/planner.md, "Calibration on this CPU").

    Args:
        processes: Largest number of busy processes to measure.
        work: One unit of representative work (:func:`~lightning_app_rlhf.planner.profiler.model_work`).
        seconds: Wall time of each measurement, and of the idle before it.
        tolerance: Largest relative change between two measurements that counts as settled.
        tries: Most measurements.
    """
    previous: tuple[float, ...] | None = None
    for _ in range(max(tries, 2)):
        time.sleep(seconds)
        shares = measure_compute_shares(processes, seconds, work)
        if previous is not None and all(abs(a - b) <= tolerance * max(a, b) for a, b in zip(previous, shares)):
            return tuple((a + b) / 2 for a, b in zip(previous, shares))
        previous = shares
    return previous


_WORK: Callable[[], object] | None = None


def _python_loop() -> None:
    for _ in range(1000):
        pass


def _run_concurrently(context: Any, k: int, seconds: float) -> list[tuple[float, float]]:
    """``k`` processes, released together by a barrier, each run :func:`_run_work` once (a pool could hand two
    runs to one worker, one after the other, and measure less contention than ``k``)."""
    barrier, results = context.Barrier(k), context.Queue()
    workers = [
        context.Process(target=_run_work, args=(seconds, barrier, results), daemon=True) for _ in range(k)
    ]
    for w in workers:
        w.start()
    try:
        return [results.get(timeout=60 + 10 * seconds) for _ in range(k)]
    except queue.Empty:
        raise RuntimeError(
            f"A compute-share measurement process did not report within {60 + 10 * seconds:.0f} s (exit codes "
            f"{[w.exitcode for w in workers]}): the unit of work failed or the machine is overloaded."
        ) from None
    finally:
        for w in workers:
            w.join(timeout=5)
            if w.is_alive():
                w.kill()


def _run_work(seconds: float, barrier: Any, results: Any) -> None:
    """After one warm-up and the barrier, run ``_WORK`` for ``seconds`` of wall time; report (CPU time / wall time,
    median CPU seconds of one unit)."""
    # One thread, as a profiled process runs; and a forked child must not enter the parent's OpenMP pool (libgomp
    # is not fork-safe: a parent that ran torch ops on 2+ threads left a pool the child would wait on forever).
    import torch

    torch.set_num_threads(1)
    work = _WORK or _python_loop
    work()
    barrier.wait(timeout=60)
    units: list[float] = []
    wall, cpu = time.perf_counter(), time.process_time()
    end = wall + seconds
    while time.perf_counter() < end:
        start = time.process_time()
        work()
        units.append(time.process_time() - start)
    share = (time.process_time() - cpu) / (time.perf_counter() - wall)
    results.put((share, sorted(units)[len(units) // 2]))


def measure_background_cores(seconds: float = 1.0) -> float:
    """Cores the machine's other jobs keep busy, sampled from ``/proc/stat`` over ``seconds`` (call it while this
    job is idle). 0.0 where ``/proc/stat`` cannot be read. A diagnostic: how busy the machine was, not a term of
    the cost model (:func:`measure_compute_shares` is)."""
    first = _cpu_jiffies()
    if first is None:
        return 0.0
    time.sleep(seconds)
    second = _cpu_jiffies()
    if second is None:
        return 0.0
    (busy0, total0, cpus), (busy1, total1, _) = first, second
    return cpus * (busy1 - busy0) / max(total1 - total0, 1)


def _cpu_jiffies() -> tuple[int, int, int] | None:
    """(busy, total) jiffies summed over all CPUs since boot, and the number of CPUs."""
    try:
        lines = Path("/proc/stat").read_text().splitlines()
    except OSError:
        return None
    fields = [int(x) for x in lines[0].split()[1:]]
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
    cpus = sum(1 for line in lines if re.match(r"cpu\d+ ", line))
    return sum(fields[:8]) - idle, sum(fields[:8]), max(cpus, 1)


def _cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def _ram_bytes() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 16 * GiB
