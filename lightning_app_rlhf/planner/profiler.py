"""Measure what each call costs on this hardware, per role shape; cache it on disk; interpolate between points.

The profiler runs the engine's own functions (``generation.generate``, ``calls.reference_forward`` /
``critic_forward`` / ``reward_forward``, the algorithm's train loss (``Algorithm.loss``) with backward, an AdamW
step) on random-init models of the shapes of the workload's roles (no critic for a critic-free workload), over a
small grid of batch x length, plus the device's matmul and copy ceilings and the collective bandwidth of the running
process group. A workload generating on vLLM (``generation.backend: vllm``) also gets the actor's generation measured
on a vLLM engine and the sync of its weights to the engine (:func:`measure_vllm_generation`). A :class:`Profile`
answers the cost model's op times; shapes or ops it lacks fall back to the analytic model.
"""

from __future__ import annotations

import bisect
import contextlib
import functools
import gc
import hashlib
import json
import math
import os
import platform
import time
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from lightning_app_rlhf.core.files import write_atomically
from lightning_app_rlhf.core.role_table import ACTOR, CRITIC
from lightning_app_rlhf.core.upstream_warnings import ignore_upstream_warnings
from lightning_app_rlhf.generation.vllm import CPU_KV_CACHE_GIB, VllmBackend
from lightning_app_rlhf.parallel.wrappers import available_wrappers
from lightning_app_rlhf.planner.cluster import (
    DEVICE_TYPES,
    Cluster,
    DeviceType,
    cluster_from_environment,
    measure_settled_compute_shares,
)
from lightning_app_rlhf.planner.workload import RoleShape, Workload, ceil_div

if TYPE_CHECKING:
    import torch

    from lightning_app_rlhf.algorithms import Algorithm
    from lightning_app_rlhf.generation import Rollout
    from lightning_app_rlhf.models.calls import Experience

DEFAULT_CACHE = Path(
    os.environ.get("LIGHTNING_APP_RLHF_CACHE", Path.home() / ".cache" / "lightning_app_rlhf")
)
VLLM = VllmBackend.name
"""The generation backend whose ``actor.generate`` the profiler measures on its own engine (:data:`VLLM_OPS`)."""
VLLM_OPS = ("vllm_prefill", "vllm_decode")
"""The profile's ops of a generate call on a vLLM engine, points ``[batch, length, seconds]`` as ``prefill`` and
``decode``: the first token of ``batch`` prompts of ``length`` tokens (a whole call of one token: the engine's prefill,
its scheduling and its RPC), and one decode step of ``batch`` rows at ``length`` tokens of context."""
VLLM_SYNC = "vllm_sync"
"""The profile's op of sending the actor's weights to its vLLM engine (``VllmEngine.load_weights`` with a new policy
version), a point ``[parameters, 0, seconds]``: proportional to the parameters sent."""
VLLM_REPEATS = 5
"""Timed repeats of each vLLM point at most (after a warm-up): the fastest of a few wall times of an engine in its own
process, which another job on the machine slows down by up to 2x on this project's 2 cores."""
VLLM_PROFILE_FORMAT = 1
"""Bumped when :func:`measure_vllm_generation` measures otherwise, so that cached vLLM points are measured again."""


def generation_op(backend: str, op: str) -> str:
    """The profile's op of ``backend``'s ``prefill`` or ``decode``: vLLM's own (:data:`VLLM_OPS`), measured on its
    engine; for the backends that decode in the rank's process with this package's loops (``eager``, ``static``,
    ``continuous``, one of your own) the plain op, measured with ``eager``.

    Args:
        backend: A ``generation.backend`` name.
        op: ``prefill`` or ``decode``.
    """
    return f"{VLLM}_{op}" if backend == VLLM else op


class ProfileFileError(ValueError):
    """A profile file that cannot be read: truncated, not JSON, or not a profile's structure.

    Args:
        path: The file.
        reason: What is wrong with it.
    """

    def __init__(self, path: str | Path, reason: str) -> None:
        super().__init__(
            f"{path} is not a valid profile file: {reason}. Delete it and measure the profile again "
            f"(profile_workload)."
        )
        self.path = Path(path)
        self.reason = reason


@dataclass
class Profile:
    """Measured op times per role shape, and measured device ceilings."""

    hardware: str
    """What the times were measured on (CPU model, threads, torch version)."""
    device: DeviceType | None = None
    """Measured ceilings (None: use the cluster's)."""
    ops: dict[str, dict[str, list[list[float]]]] = field(default_factory=dict)
    """Shape key -> op (``forward``, ``train``, ``decode``, ``prefill``, ``optimizer``) -> ``[batch, length, seconds]``
    points; a wrapper's ``{wrapper}_step`` and ``{wrapper}_forward`` points are ``[group size, 1, seconds]``
    (:func:`measure_wrapper_steps`); a causal LM generating on vLLM has :data:`VLLM_OPS` points too, and
    :data:`VLLM_SYNC` ``[parameters, 0, seconds]``."""

    def time(self, shape: RoleShape, op: str, batch: int, length: int) -> float | None:
        """Seconds of ``op`` interpolated (bilinear in batch x length, linear beyond the grid); None if unmeasured.
        ``optimizer`` and :data:`VLLM_SYNC` take the parameters as ``batch``."""
        points = self.ops.get(shape.key, {}).get(op)
        if not points:
            return None
        if op in ("optimizer", VLLM_SYNC):  # proportional to the parameters updated, or sent
            params, _, seconds = points[0]
            return seconds * batch / params
        return interpolate(points, batch, length)

    def merge(self, other: Profile) -> Profile:
        """Both profiles' points; ``other``'s win where both measured the same op of a shape."""
        ops = {key: dict(value) for key, value in self.ops.items()}
        for key, value in other.ops.items():
            ops.setdefault(key, {}).update(value)
        return Profile(self.hardware, other.device or self.device, ops)

    def save(self, path: str | Path) -> None:
        """Write the profile as JSON, atomically (:func:`~lightning_app_rlhf.core.files.write_atomically`).

        Args:
            path: The file to write; its directory is created if missing.
        """
        data = {
            "hardware": self.hardware,
            "device": asdict(self.device) if self.device else None,
            "ops": self.ops,
        }
        text = json.dumps(data, indent=1)
        write_atomically(path, lambda file: file.write(text.encode("utf-8")))

    @classmethod
    def load(cls, path: str | Path) -> Profile:
        """Read a profile written by :meth:`save`.

        Args:
            path: The JSON file.

        Raises:
            ProfileFileError: The file is not valid JSON (e.g. truncated) or not a profile's structure; the message
                names the file.
        """
        try:
            data = json.loads(Path(path).read_text(encoding="utf-8"))
        except ValueError as err:  # JSONDecodeError, and UnicodeDecodeError for binary garbage
            raise ProfileFileError(path, f"not valid JSON, perhaps truncated ({err})") from err
        problem = _profile_problem(data)
        if problem is not None:
            raise ProfileFileError(path, problem)
        device = DeviceType(**data["device"]) if data["device"] else None
        return cls(data["hardware"], device, data["ops"])


def _profile_problem(data: Any) -> str | None:
    """What makes ``data`` not a saved profile (None: it is one), checked up front so that a damaged file fails
    at load, naming the file, instead of later inside the cost model.

    Args:
        data: Parsed JSON.
    """
    if not isinstance(data, dict):
        return f"expected a JSON object, got {type(data).__name__}"
    missing = {"hardware", "device", "ops"} - data.keys()
    if missing:
        return f"missing key(s) {sorted(missing)}"
    if not isinstance(data["hardware"], str):
        return "'hardware' is not a string"
    device = data["device"]
    if device is not None:
        if not isinstance(device, dict):
            return "'device' is neither null nor an object"
        try:
            DeviceType(**device)
        except TypeError as err:  # missing or unknown fields
            return f"'device' does not describe a DeviceType ({err})"
    if not isinstance(data["ops"], dict):
        return "'ops' is not an object"
    for key, ops in data["ops"].items():
        if not isinstance(ops, dict):
            return f"ops[{key!r}] is not an object"
        for op, points in ops.items():
            if not isinstance(points, list) or not points:
                return f"ops[{key!r}][{op!r}] is not a non-empty list of points"
            for point in points:
                if not (
                    isinstance(point, list)
                    and len(point) == 3
                    and all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in point)
                    and all(math.isfinite(x) for x in point)
                ):
                    return f"ops[{key!r}][{op!r}] has a point {point!r} that is not [batch, length, seconds]"
    return None


def interpolate(points: list[list[float]], batch: float, length: float) -> float:
    """Bilinear interpolation on a full grid of (batch, length) points; linear extrapolation outside it."""
    table = {(b, n): t for b, n, t in points}
    batches = sorted({b for b, _, _ in points})
    lengths = sorted({n for _, n, _ in points})

    def along(values: list[float], x: float, at: Callable[[float], float]) -> float:
        if len(values) == 1:
            return at(values[0]) * x / values[0]  # one point: proportional
        i = min(max(bisect.bisect_left(values, x) - 1, 0), len(values) - 2)
        x0, x1 = values[i], values[i + 1]
        y0, y1 = at(x0), at(x1)
        return y0 + (y1 - y0) * (x - x0) / (x1 - x0)

    value = along(lengths, length, lambda n: along(batches, batch, lambda b: table[(b, n)]))
    return max(value, 0.2 * min(t for _, _, t in points))


def hardware_key() -> str:
    """The CPU model, torch threads and torch version: a profile is only reused on the same."""
    import torch

    cpu = platform.processor() or platform.machine()
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    return f"{cpu} | threads={torch.get_num_threads()} | torch {torch.__version__}"


PROFILE_FORMAT = 3
"""Bumped when the profiled ops change (2: ``prefill``; 3: left-padded inputs), so older cached profiles are
measured again."""


def cache_path(shape: RoleShape, workload: Workload, cache_dir: Path = DEFAULT_CACHE) -> Path:
    digest = hashlib.sha1(
        f"v{PROFILE_FORMAT}|{hardware_key()}|{shape.key}|{workload.prompt_length}|{workload.generation_length}".encode()
    ).hexdigest()[:16]
    return cache_dir / "profiles" / f"{shape.key}-{digest}.json"


@contextlib.contextmanager
def _threads(n: int | None) -> Iterator[None]:
    import torch

    if n is None:
        yield
        return
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


STATISTIC = {
    "min": (min, time.perf_counter),
    "cpu": (lambda times: sorted(times)[len(times) // 2], time.process_time),
}
"""How repeated timings of one op become its time: ``min``, the fastest wall time (right on a quiet machine);
``cpu``, the median CPU time of this process (one thread): the full-speed time even while other jobs share the
cores, which the cost model then applies as measured ``compute_shares``."""


def _best_of(fn: Callable[[], Any], repeats: int, statistic: str = "min") -> float:
    fn()  # warm-up
    reduce, clock = STATISTIC[statistic]
    times = []
    for _ in range(repeats):
        start = clock()
        fn()
        times.append(clock() - start)
    return reduce(times)


def median_wall_s(call: Callable[[], Any], repeats: int) -> float:
    """Median wall time of ``call`` over ``repeats`` runs after one warm-up, every run started together on every rank
    of the running process group (a barrier before each; every rank calls it)."""
    import torch.distributed as dist

    call()
    times = []
    for _ in range(repeats):
        dist.barrier()
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]


def measure_device(threads: int | None = 1) -> DeviceType:
    """Matmul FLOP/s and copy bandwidth of one process (with ``threads`` threads), into the ``cpu`` entry."""
    import torch

    with _threads(threads):
        a, b = torch.randn(512, 512), torch.randn(512, 512)
        matmul = _best_of(lambda: a @ b, 5)
        big = torch.empty(16 << 20)  # 64 MB
        copy = _best_of(lambda: big.clone(), 3)
    return replace(
        DEVICE_TYPES["cpu"], flops=2 * 512**3 / matmul, memory_bandwidth=2 * big.numel() * 4 / copy
    )


def measure_collectives(device: DeviceType, repeats: int = 30) -> DeviceType:
    """``device`` with the collective figures of the running gloo process group (every rank must call this).

    The engine's result gathers on the CPU are small (``Placement.gather_to_world`` exchanges shapes, then rollouts
    of a few KB), so their fixed cost dominates: the median time of a 48-byte all-gather, per ring hop, becomes
    ``collective_latency_s``; a 1 MB-per-rank all-gather gives the bandwidth, and an all-reduce of a 25 MiB bucket
    (DDP's default ``bucket_cap_mb``) the gradients' ``all_reduce_bandwidth``.
    """
    import torch
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized() or dist.get_world_size() < 2:
        return device
    if dist.get_backend() != "gloo":  # CPU tensors; a GPU cluster keeps its datasheet figures
        return device
    n = dist.get_world_size()

    def all_gather(tensor: torch.Tensor) -> Callable[[], Any]:
        parts = [torch.empty_like(tensor) for _ in range(n)]
        return lambda: dist.all_gather(parts, tensor)

    shapes, rows, bucket = torch.zeros(3, 2, dtype=torch.long), torch.zeros(1 << 18), torch.zeros(25 << 18)
    figures = torch.tensor(
        [
            median_wall_s(all_gather(shapes), repeats),
            median_wall_s(all_gather(rows), repeats),
            median_wall_s(lambda: dist.all_reduce(bucket), 3),
        ],
        dtype=torch.float64,
    )
    dist.all_reduce(figures)  # the same figures on every rank
    small, gather, reduce = (figures / n).tolist()
    hops = n - 1
    bandwidth = hops * rows.numel() * 4 / max(gather - small, 1e-9)
    return replace(
        device,
        intra_node_bandwidth=bandwidth,
        inter_node_bandwidth=bandwidth,
        collective_latency_s=small / hops,
        all_reduce_bandwidth=2 * hops / n * bucket.numel() * 4 / max(reduce - 2 * small, 1e-9),
    )


def measure_collectives_in_processes(device: DeviceType, world_size: int) -> DeviceType:
    """:func:`measure_collectives` in ``world_size`` fresh gloo processes on this machine (one thread each)."""
    import tempfile

    import torch.multiprocessing as mp

    if world_size < 2:
        return device
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "collectives.json"
        mp.start_processes(
            _collective_worker,
            args=(world_size, _free_port(), device, str(out)),
            nprocs=world_size,
            start_method="spawn",
        )
        return DeviceType(**json.loads(out.read_text()))


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _collective_worker(rank: int, world_size: int, port: int, device: DeviceType, out: str) -> None:
    ignore_upstream_warnings()  # a spawned process starts without the command's warning filters
    import datetime

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world_size,
        timeout=datetime.timedelta(seconds=60),
    )
    try:
        measured = measure_collectives(device)
        if rank == 0:
            Path(out).write_text(json.dumps(asdict(measured)))
    finally:
        dist.destroy_process_group()


def measure_wrapper_steps(workload: Workload, world_size: int, wrappers: Sequence[str] = ("ddp",),
                          pipelines: bool = True, repeats: int = 10) -> Profile:
    """Seconds each wrapper adds to one optimizer step of each trainable role, and to one forward of each role it can
    shard, on groups of 2..``world_size`` fresh gloo processes (one thread each): ``{wrapper}_step`` and
    ``{wrapper}_forward`` points ``[group size, 1, seconds]`` per role shape (``ddp_step`` for DDP).

    Each is the median wall time of the call as the engine runs it through the role's wrapper (this project's
    :class:`~lightning_app_rlhf.parallel.wrappers.RoleWrapper`: ``running``, ``accumulating``, ``train_module``,
    ``backward``, ``step`` with clipping and AdamW), over the rank's shard of a minibatch, minus the same without a
    wrapper: the gradient reduction as the engine pays it, with the reducer's hooks and bucket copies, DeepSpeed's
    engine step (its flat buffers, partitions and gathers of the updated weights), FSDP2's gathers and hooks, and the
    part of it that backward does not hide. On this project's 2-core machine the demo's GPT-2 gets 2.2 ms per DDP step
    against 0.7 ms for its bare all-reduce, and more under ZeRO (docs/planner.md, "Calibration on this CPU").

    Args:
        workload: Its trainable shapes must carry their Hugging Face ``config``.
        world_size: The largest group measured.
        wrappers: The wrappers to measure (those of the search space); a forward is measured only for the ones that
            shard parameters (FSDP2, ZeRO-3: their forwards gather them).
        pipelines: Also measure a pipeline of the group's size (:func:`_pipeline_added_s`): what one stage step of a
            pipelined train or scoring call costs beyond its share of the computation, and the gather of a pipelined
            role's whole weights.
        repeats: Timed repeats per point (after one warm-up).
    """
    import tempfile

    import torch.multiprocessing as mp

    ops: dict[str, dict[str, list[list[float]]]] = {}
    for group in range(2, world_size + 1):
        with tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp) / "wrappers.json"
            mp.start_processes(
                _wrapper_step_worker,
                args=(group, _free_port(), workload, tuple(wrappers), pipelines, repeats, str(out)),
                nprocs=group,
                start_method="spawn",
            )
            for key, by_op in json.loads(out.read_text()).items():
                for op, seconds in by_op.items():
                    ops.setdefault(key, {}).setdefault(op, []).append([group, 1, seconds])
    return Profile(hardware_key(), None, ops)


def wrapper_op(wrapper: str, op: str) -> str:
    """The profile's op name of what ``wrapper`` adds to a ``step`` or a ``forward``: ``ddp_step``, ``zero1_step``,
    ``fsdp2_forward``..."""
    return f"{wrapper}_{op}"


def _wrapper_step_worker(rank: int, group: int, port: int, workload: Workload, wrappers: tuple[str, ...],
                         pipelines: bool, repeats: int, out: str) -> None:
    ignore_upstream_warnings()  # a spawned process starts without the command's warning filters (DeepSpeed's)
    import datetime

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    # What torch's launcher sets, and DeepSpeed's engine asserts.
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(group), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=group,
        timeout=datetime.timedelta(seconds=300),
    )  # fmt: skip
    try:
        batch = ceil_div(workload.samples // workload.num_minibatches, group)
        added: dict[str, dict[str, float]] = {}
        for role in workload.roles:
            shape = workload.shape(role)
            if shape is None or shape.config is None or shape.key in added:
                continue
            trainable = role in workload.trainable
            added[shape.key] = _wrapper_added_s(shape, workload, batch, repeats, wrappers, trainable)
            if pipelines:
                added[shape.key].update(_pipeline_added_s(shape, workload, batch, repeats, trainable))
        keys = sorted(added)
        names = sorted({op for key in keys for op in added[key]})
        figures = torch.tensor([[added[k].get(op, 0.0) for op in names] for k in keys], dtype=torch.float64)
        dist.all_reduce(figures)  # the same figures on every rank
        if rank == 0:
            means = (figures / group).tolist()
            Path(out).write_text(json.dumps({k: {op: means[i][j] for j, op in enumerate(names) if op in added[k]}
                                             for i, k in enumerate(keys)}))
        dist.barrier()
    except BaseException:
        dist.destroy_process_group()
        raise
    # DeepSpeed's engines keep groups and threads that a normal interpreter exit may tear down out of order
    # (a C++ "terminate called without an active exception", 1 run in 2 here): the figures are written, so leave.
    os._exit(0)


def _wrapper_added_s(shape: RoleShape, workload: Workload, batch: int, repeats: int, wrappers: tuple[str, ...],
                     trainable: bool) -> dict[str, float]:
    """What each of ``wrappers`` adds to a train step (``trainable``) and to a forward (the wrappers that shard
    parameters), in seconds: the median wall time through the wrapper minus the same on the bare module (every rank
    of the group calls it, in the same order)."""
    import torch
    import torch.distributed as dist

    from lightning_app_rlhf.core.wrapper_names import FROZEN_WRAPPERS, SHARDED_WRAPPERS
    from lightning_app_rlhf.generation import position_ids_from_mask
    from lightning_app_rlhf.models.roles import ModelSpec, build_causal_lm, build_critic, default_optimizer
    from lightning_app_rlhf.parallel.wrappers import WRAPPERS

    def build() -> torch.nn.Module:
        torch.manual_seed(0)
        return (build_causal_lm if shape.kind == "causal_lm" else build_critic)(ModelSpec(config=dict(shape.config)))

    mask = left_padded_mask(batch, workload.prompt_length, workload.sequence_length)
    inputs = {"input_ids": torch.randint(3, shape.vocab, mask.shape), "attention_mask": mask}
    if shape.kind != "causal_lm":  # a critic or a reward model: build_critic's ValueModel takes its positions
        inputs["position_ids"] = position_ids_from_mask(mask)

    def loss_of(module: torch.nn.Module) -> torch.Tensor:
        out = module(**inputs)
        return (out if shape.kind != "causal_lm" else out.logits).float().mean()

    median_s = functools.partial(median_wall_s, repeats=repeats)
    def bare_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
        loss_of(model).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    def wrapped_step(wrapper: Any) -> None:
        with wrapper.running():
            with wrapper.accumulating(last=True):
                loss = loss_of(wrapper.train_module)
            wrapper.backward(loss)
            wrapper.step()

    def wrapped_forward(wrapper: Any) -> None:
        with wrapper.running(), torch.no_grad():
            loss_of(wrapper.train_module if trainable else wrapper.module)

    bare_model = build()
    bare_optimizer = default_optimizer(bare_model.parameters())
    added: dict[str, float] = {}
    bare_train = median_s(lambda: bare_step(bare_model, bare_optimizer)) if trainable else 0.0
    with torch.no_grad():
        bare_forward = median_s(lambda: loss_of(bare_model))
    device = torch.device("cpu")
    for name in wrappers:
        sharded = name in SHARDED_WRAPPERS
        if not trainable and name not in FROZEN_WRAPPERS:
            continue
        wrapper = WRAPPERS[name](build(), dist.group.WORLD, dist.get_world_size(), dist.get_rank(), device)
        if trainable:
            wrapper.wrap()
            wrapper.attach_optimizer(default_optimizer(wrapper.module.parameters()), max_grad_norm=1.0)
            added[wrapper_op(name, "step")] = max(median_s(lambda: wrapped_step(wrapper)) - bare_train, 0.0)
        else:
            wrapper.wrap_frozen()
        if sharded:
            added[wrapper_op(name, "forward")] = max(median_s(lambda: wrapped_forward(wrapper)) - bare_forward, 0.0)
        wrapper = None  # one wrapped copy (with its optimizer state) at a time beside the bare one
        gc.collect()
    return added


def profile_workload(
    workload: Workload,
    *,
    batches: tuple[int, ...] = (1, 4, 16),
    threads: int | None = 1,
    repeats: int = 2,
    cache_dir: Path | None = DEFAULT_CACHE,
    reward_fn: Callable[[list[str], list[str]], Any] | None = None,
    tokenizer: Any = None,
    prompts: list[str] | None = None,
    statistic: str = "min",
    device: DeviceType | None = None,
    fields: Sequence[Mapping[str, Any]] | None = None,
    generation_backends: Sequence[str] | None = None,
    vllm_engine_args: Mapping[str, Any] | None = None,
) -> Profile:
    """Measure the shape of every role of ``workload`` (cached per hardware and shape; a critic-free workload has no
    critic to measure) and this device's ceilings; with ``vllm`` among the generation backends, the actor's
    generation on a vLLM engine too (:func:`profile_vllm`: one engine start, cached).

    Args:
        workload: Its shapes must carry their Hugging Face ``config`` (from :func:`role_shape`).
        batches: Batch sizes of the grid; lengths are the workload's sequence length and half of it.
        threads: Torch threads while measuring (1: one thread per process, as multi-process CPU runs use).
        repeats: Timed repeats per point.
        cache_dir: Where profiles are cached; None disables the cache.
        reward_fn: A Python reward function to time per sample (with ``tokenizer``).
        tokenizer: Decodes responses for ``reward_fn``.
        prompts: Real prompts for ``reward_fn`` (some functions read them); default random tokens.
        fields: Each prompt's row fields (aligned with ``prompts``), which ``reward_fn`` receives by name (e.g.
            ``answer``); None: none.
        statistic: ``min`` (the fastest wall time counts) or ``cpu`` (the median CPU time; use it on a shared
            machine, with ``threads=1``).
        device: This device's ceilings, already measured (e.g. with :func:`measure_collectives`); None: measure
            them here.
        generation_backends: The ``generation.backend`` names whose ``actor.generate`` the cost model will price
            (:func:`generation_op`); None: the workload's own.
        vllm_engine_args: ``generation.vllm_engine_args``, the options the run starts its vLLM engines with.
    """
    if statistic not in STATISTIC:
        raise ValueError(f"statistic={statistic!r}: choose one of {sorted(STATISTIC)}.")
    profile = Profile(hardware_key(), device or measure_device(threads))
    seen = set()
    for role in workload.roles:
        shape = workload.shape(role)
        if shape is None or shape.key in seen:
            continue
        seen.add(shape.key)
        path = cache_path(shape, workload, cache_dir) if cache_dir is not None else None
        if path is not None and path.exists():
            cached = _load_cached(path)
            if cached is not None:
                profile = profile.merge(cached)
                continue
        with _threads(threads):
            measured = Profile(
                profile.hardware,
                None,
                {shape.key: measure_shape(shape, workload, batches, repeats, statistic)},
            )
        if path is not None:
            measured.save(path)
        profile = profile.merge(measured)
    if reward_fn is not None and tokenizer is not None:
        with _threads(threads):
            per_sample = measure_reward_fn(reward_fn, tokenizer, workload, prompts, statistic, fields)
        profile.ops["reward_fn"] = {"sample": [[1, 1, per_sample]]}
    if VLLM in (generation_backends if generation_backends is not None else (workload.generation_backend,)):
        profile = profile.merge(profile_vllm(workload, batches, repeats, cache_dir, vllm_engine_args))
    return profile


WRAPPER_FORMAT = 2
"""Bumped when :func:`measure_wrapper_steps` measures other ops (2: the pipeline's), so that cached wrapper costs are
measured again."""

PIPELINE_OPS = ("pipeline_train_step", "pipeline_forward_step", "pipeline_gather")
"""The profile's ops of a pipeline of ``p`` stages, points ``[p, 1, seconds]``: one stage step of a train schedule
(a micro-batch's forward and backward through a stage boundary) and of a forward-only one beyond the stage's share of
the computation, and the gather of the whole role from its stages (``gather_full_state_dict``)."""


def _pipeline_added_s(shape: RoleShape, workload: Workload, batch: int, repeats: int,
                      trainable: bool) -> dict[str, float]:
    """:data:`PIPELINE_OPS` of ``shape`` on a pipeline of every rank of the group (one stage each, ``p`` micro-batches:
    1F1B's least), measured as the engine runs them (:class:`~lightning_app_rlhf.parallel.pipeline.PipelinedRole`).
    A stage step's cost is what the schedule takes beyond ``(m + p - 1) / m`` of the unpipelined call over ``p``
    stages, per each of its ``m + p - 1`` steps: the activation sends, the schedule's own work and the waits. Empty
    for a model family the pipeline cannot split."""
    import datetime

    import torch
    import torch.distributed as dist

    from lightning_app_rlhf.models.roles import ModelSpec, build_causal_lm, build_critic, default_optimizer
    from lightning_app_rlhf.parallel.pipeline import PipelinedRole, PipelineInputs, create_pipeline_groups
    from lightning_app_rlhf.parallel.pipeline_weights import gather_full_state_dict

    p = dist.get_world_size()
    m = next((c for c in range(p, batch + 1) if batch % c == 0), batch)  # as PipelineDDPWrapper.micro_batches

    def build() -> torch.nn.Module:
        torch.manual_seed(0)
        return (build_causal_lm if shape.kind == "causal_lm" else build_critic)(ModelSpec(config=dict(shape.config)))

    pipeline = create_pipeline_groups([list(range(p))], dist.get_rank(), timeout=datetime.timedelta(seconds=300))
    call = "x.train" if trainable else "x.forward"
    try:
        piped = PipelinedRole(build(), pipeline, dist.get_rank(), torch.device("cpu"), call)
    except ValueError:  # a family the pipeline does not split: the cost model keeps its analytic sends
        return {}
    mask = left_padded_mask(batch, workload.prompt_length, workload.sequence_length)
    inputs = PipelineInputs.from_mask(torch.randint(3, shape.vocab, mask.shape), mask)
    model = build()

    def unpipelined(*args: Any) -> Any:
        out = model(input_ids=inputs.input_ids, attention_mask=inputs.attention_mask,
                    position_ids=inputs.position_ids)
        return out if shape.kind != "causal_lm" else out.logits  # build_critic for a reward model too

    median_s = functools.partial(median_wall_s, repeats=repeats)
    bubble, steps = (m + p - 1) / m, m + p - 1
    added: dict[str, float] = {}
    with torch.no_grad():
        forward = median_s(unpipelined)
        piped_forward = median_s(lambda: piped.forward(inputs, m))
    added["pipeline_forward_step"] = max(piped_forward - bubble * forward / p, 0.0) / steps
    if trainable:
        optimizer = default_optimizer(model.parameters())
        stage_optimizer = default_optimizer(piped.parameters())

        def bare_step() -> None:
            unpipelined().float().mean().backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

        def piped_step() -> None:
            piped.backward(inputs, lambda out, rows: out.float().mean() / m, m)
            piped.clip_and_step(stage_optimizer, 1.0)
            stage_optimizer.zero_grad(set_to_none=True)

        train, piped_train = median_s(bare_step), median_s(piped_step)
        added["pipeline_train_step"] = max(piped_train - bubble * train / p, 0.0) / steps
        added["pipeline_gather"] = median_s(lambda: gather_full_state_dict(piped))
    return added


def profile_machine(
    workload: Workload,
    world_size: int,
    *,
    reward_fn: Callable[..., Any] | None = None,
    tokenizer: Any = None,
    prompts: list[str] | None = None,
    fields: Sequence[Mapping[str, Any]] | None = None,
    cache_dir: Path | None = DEFAULT_CACHE,
    generation_backends: Sequence[str] | None = None,
    vllm_engine_args: Mapping[str, Any] | None = None,
) -> tuple[Profile, Cluster]:
    """Everything the cost model needs of this machine to price a job of ``world_size`` CPU processes on it: what
    ``plan`` measures before it searches, and ``benchmarks/planner_calibration.py`` before it decides.

    - the CPU seconds of each op of each role (:func:`profile_workload` with ``statistic="cpu"``: the median process
      CPU time on one thread, the op's cost at full speed however busy the machine is; cached per shape);
    - what each searched wrapper adds to a train step and to a sharded forward on groups of 2..``world_size``
      processes (:func:`measure_wrapper_steps`; cached per workload, group sizes and wrappers);
    - the gloo collectives of ``world_size`` fresh processes (:func:`measure_collectives_in_processes`);
    - the share of a core each of 1..``world_size`` busy processes gets now
      (:func:`~lightning_app_rlhf.planner.cluster.measure_settled_compute_shares`, with :func:`model_work`);
    - with ``vllm`` among ``generation_backends``, the actor's generation on a vLLM engine and the sync of its weights
      (:func:`profile_vllm`: wall times; cached per shape and engine options).

    Args:
        workload: Its shapes must carry their Hugging Face ``config``; its ``wrappers`` are measured.
        world_size: Processes of the job, all on this machine.
        reward_fn: A Python reward function to time per sample (with ``tokenizer``).
        tokenizer: Decodes responses for ``reward_fn``.
        prompts: Real prompts for ``reward_fn``.
        fields: Each prompt's row fields, which ``reward_fn`` receives by name.
        cache_dir: Where the op and wrapper measurements are cached; None: measure everything now.
        generation_backends: The generation backends the cost model will price (None: the workload's own).
        vllm_engine_args: ``generation.vllm_engine_args`` of the run, for its vLLM engine.

    Returns:
        The profile (ops and the measured device) and the cluster of ``world_size`` processes on this machine with
        its measured compute shares.
    """
    profile = profile_workload(workload, batches=(1, 4, 16, 32), repeats=7, statistic="cpu", cache_dir=cache_dir,
                               reward_fn=reward_fn, tokenizer=tokenizer, prompts=prompts, fields=fields,
                               generation_backends=generation_backends, vllm_engine_args=vllm_engine_args)
    wrappers = tuple(w for w in available_wrappers() if w in workload.wrappers)
    # LoRA: the cost model prices the adapters' small updates analytically (CostModel._measured_wrapper), so the full
    # models' wrapper costs are not measured.
    if world_size > 1 and wrappers and workload.lora_rank is None:
        shapes = "|".join(sorted({s.key for r in workload.roles if (s := workload.shape(r)) is not None}))
        digest = hashlib.sha1(
            f"v{PROFILE_FORMAT}.{WRAPPER_FORMAT}|{hardware_key()}|{shapes}|{workload.samples}|{workload.num_minibatches}|"
            f"{workload.prompt_length}|{workload.sequence_length}|{world_size}|{','.join(wrappers)}".encode()
        ).hexdigest()[:16]
        path = cache_dir / "profiles" / f"wrappers-{digest}.json" if cache_dir is not None else None
        steps = _load_cached(path) if path is not None and path.exists() else None
        if steps is None:
            steps = measure_wrapper_steps(workload, world_size, wrappers)
            if path is not None:
                steps.save(path)
        profile = profile.merge(steps)
    device = measure_collectives_in_processes(profile.device or DEVICE_TYPES["cpu"], world_size)
    # One process too: on a busy machine even it gets less than a core, and the engine's calibration must know.
    shares = measure_settled_compute_shares(world_size, model_work(workload))
    # This machine's memory split over the processes, as a cluster of it without a device reads it.
    device = replace(device, memory_bytes=cluster_from_environment(world_size).device.memory_bytes)
    measured = Profile(profile.hardware, device, profile.ops)
    return measured, cluster_from_environment(world_size, device, compute_shares=shares)


def _load_cached(path: Path) -> Profile | None:
    """The cached profile at ``path``, or None with a warning if the file is damaged (truncated, not JSON, not a
    profile's structure): the cache is only an optimisation, so the caller measures the shape again and rewrites
    the file instead of failing every later tuned run.

    Args:
        path: A file under the profile cache (:func:`cache_path`).
    """
    try:
        return Profile.load(path)
    except ProfileFileError as err:
        warnings.warn(
            f"Ignoring the damaged profile cache file {path} ({err.reason}); it will be re-measured and "
            f"rewritten. To clear the whole cache, delete {path.parent}.",
            UserWarning,
            stacklevel=3,
        )
        return None


def measure_shape(
    shape: RoleShape, workload: Workload, batches: tuple[int, ...], repeats: int, statistic: str = "min"
) -> dict[str, list[list[float]]]:
    """Op times of one role shape over ``batches`` x (sequence length, half of it)."""
    from lightning_app_rlhf.algorithms import build_algorithm
    from lightning_app_rlhf.core.config import GenerationConfig, PPOConfig

    model = _shape_model(shape)
    p, g = workload.prompt_length, workload.generation_length
    lengths = sorted({max(2, (p + g) // 2), p + g})
    ops: dict[str, list[list[float]]] = {"forward": [], "train": [], "decode": [], "prefill": []}
    # PPO's losses: every algorithm's actor loss is the same clipped surrogate on the same forward and backward (its
    # aggregation costs nothing beside them), and profiles are cached per shape, shared by every algorithm.
    algorithm = build_algorithm("ppo", PPOConfig(), GenerationConfig(max_new_tokens=g))
    for b in batches:
        for n in lengths:
            rollout, experience = _random_batch(shape.vocab, b, n, p, g)
            ops["forward"].append([b, n, _best_of(_forward_call(model, shape.kind, rollout), repeats, statistic)])
            if shape.kind != "classifier":
                train = lambda e=experience: _train_step(model, shape.kind, algorithm, e, g)
                ops["train"].append([b, n, _best_of(train, repeats, statistic)])
        if shape.kind == "causal_lm":
            prefill, decode = _measure_generation(model, shape.vocab, b, p, g, repeats, statistic)
            ops["prefill"].append(prefill)
            ops["decode"].append(decode)
    if shape.kind == "classifier":
        del ops["train"]
    if shape.kind != "causal_lm":
        del ops["decode"], ops["prefill"]
    else:  # a second point along the length, so both interpolate along it too
        ops["decode"] += [[b, 2 * n, t] for b, n, t in ops["decode"]]
        ops["prefill"] += [[b, 2 * n, 2 * t] for b, n, t in ops["prefill"]]
    if shape.kind != "classifier":
        ops["optimizer"] = [[shape.params, 0, _measure_optimizer_step(model, repeats, statistic)]]
    return ops


def _shape_model(shape: RoleShape) -> torch.nn.Module:
    """A random-init model of ``shape``: a causal LM, a value model or a reward classifier, in its dtype."""
    from lightning_app_rlhf.models.roles import ModelSpec, build_causal_lm, build_critic, build_reward_model

    if shape.config is None:
        raise ValueError(
            f"Shape {shape.name!r} has no Hugging Face config to build a model from: make it with "
            "role_shape()."
        )
    spec = ModelSpec(config=dict(shape.config), dtype="bfloat16" if shape.dtype_bytes == 2 else "float32")
    return {
        "causal_lm": build_causal_lm,
        "value": build_critic,
        "classifier": lambda s: build_reward_model(s, pad_token_id=0),
    }[shape.kind](spec)


def _random_batch(vocab: int, batch: int, length: int, prompt_length: int,
                  generation_length: int) -> tuple[Rollout, Experience]:
    """``batch`` random sequences of ``length`` tokens, left-padded prompts taking the workload's share of them, as
    the rollout a forward call reads and the experience a train call reads."""
    import torch

    from lightning_app_rlhf.generation import Rollout
    from lightning_app_rlhf.models.calls import Experience

    prompt = max(1, round(length * prompt_length / (prompt_length + generation_length)))
    sequences = torch.randint(3, vocab, (batch, length))
    mask = left_padded_mask(batch, prompt, length)
    rollout = Rollout(
        sequences, mask, torch.ones(batch, length - prompt, dtype=torch.long), torch.zeros(batch, length - prompt),
        prompt
    )
    zeros = torch.zeros(batch, length - prompt)
    return rollout, Experience(
        sequences, mask, rollout.response_mask, zeros, zeros, torch.randn(batch, length - prompt), zeros, prompt, 0
    )


def _forward_call(model: torch.nn.Module, kind: str, rollout: Rollout) -> Callable[[], Any]:
    """The engine's forward call of a model of ``kind`` on ``rollout``: reference (log-probabilities), critic
    (values) or reward classifier (scores)."""
    from lightning_app_rlhf.models.calls import critic_forward, reference_forward

    if kind == "causal_lm":
        return lambda: reference_forward(model, rollout, 1.0, inference_mode=True)
    if kind == "value":
        return lambda: critic_forward(model, rollout, inference_mode=True)
    return lambda: model(input_ids=rollout.sequences, attention_mask=rollout.attention_mask)


def _train_step(model: torch.nn.Module, kind: str, algorithm: Algorithm, experience: Experience,
                generation_length: int) -> None:
    """One forward and backward of ``algorithm``'s actor loss (``kind`` ``causal_lm``) or value loss (``value``)."""
    from lightning_app_rlhf.algorithms import LossScale
    from lightning_app_rlhf.models.calls import critic_values, policy_logprobs

    role = ACTOR.name if kind == "causal_lm" else CRITIC.name
    scale = LossScale(experience.response_mask.sum().float(), len(experience.sequences), generation_length)
    if role == CRITIC.name:
        loss, _ = algorithm.value_loss(critic_values(model, experience), experience, scale)
    else:
        logprobs, entropy = policy_logprobs(model, experience, algorithm.generation.temperature,
                                            entropy_grad=algorithm.config.entropy_coef != 0)
        loss, _ = algorithm.policy_loss(logprobs, entropy, experience, scale)
    loss.backward()


def _measure_generation(model: torch.nn.Module, vocab: int, batch: int, prompt_length: int,
                        generation_length: int, repeats: int, statistic: str) -> tuple[list[float], list[float]]:
    """The prefill point ``[batch, prompt length, seconds]`` and the decode-step point ``[batch, mid context,
    seconds]`` of a causal LM: a decode step = (generate - prefill) / (steps - 1), at the mid context."""
    import torch

    from lightning_app_rlhf.core.config import GenerationConfig
    from lightning_app_rlhf.generation import generate, position_ids_from_mask

    p, g = prompt_length, generation_length
    prompts, prompt_mask = torch.randint(3, vocab, (batch, p)), left_padded_mask(batch, p, p)
    config = GenerationConfig(max_new_tokens=g)
    keys = torch.arange(batch)
    # As the engine runs an unwrapped model's generate: under inference mode.
    gen = _best_of(lambda: generate(model, prompts, prompt_mask, config, keys, -1, 0, inference_mode=True), repeats,
                   statistic)

    @torch.inference_mode()
    def prefill_of() -> Any:
        # The prefill as generate() runs it: positions that skip the padding, last position's logits only.
        return model(input_ids=prompts, attention_mask=prompt_mask, position_ids=position_ids_from_mask(prompt_mask),
                     use_cache=True, logits_to_keep=1)

    prefill = _best_of(prefill_of, repeats, statistic)
    return [batch, p, prefill], [batch, p + (g + 1) // 2, max(gen - prefill, 0.0) / max(g - 1, 1)]


def measure_vllm_generation(shape: RoleShape, workload: Workload, batches: tuple[int, ...], repeats: int,
                            engine_args: Mapping[str, Any] | None = None) -> dict[str, list[list[float]]]:
    """:data:`VLLM_OPS` and :data:`VLLM_SYNC` of a causal LM of ``shape`` on one vLLM engine, as the ``vllm`` backend
    runs it (:class:`~lightning_app_rlhf.generation.vllm.VllmBackend`: one request per row, every row of the call at
    once): per batch of ``batches``, the prefill point (a call of one token on the workload's prompts) and the decode
    step ``(generate - prefill) / (tokens - 1)`` at the mid context, as :func:`_measure_generation`; then the sync of
    the weights to the engine.

    Wall times, the fastest of ``min(repeats, VLLM_REPEATS)`` after a warm-up: the engine computes in its own process,
    which this process's CPU time does not see, and its processes poll while they wait (a quarter of a core while
    idle, measured here), so their CPU time is no measure of the work either. Every call takes new random prompts, so
    vLLM's prefix cache reuses nothing (the rollout's prompts are new each iteration). The engine starts once, outside
    every timed region (30-100 s on this project's 2 cores), and is stopped at the end.

    Args:
        shape: The actor's shape, with its Hugging Face ``config``.
        workload: Its prompt and generation lengths.
        batches: Rows per call.
        repeats: Timed repeats per point (at most :data:`VLLM_REPEATS`).
        engine_args: ``generation.vllm_engine_args``: the engine's options, as the run starts it.
    """
    import torch

    from lightning_app_rlhf.core.config import GenerationConfig
    from lightning_app_rlhf.generation import DecodeRequest, stop_condition

    model = _shape_model(shape)
    p, g = workload.prompt_length, workload.generation_length
    config = GenerationConfig(max_new_tokens=g, backend=VLLM, vllm_engine_args=dict(engine_args or {}))
    repeats = min(repeats, VLLM_REPEATS)
    backend = VllmBackend()  # an engine of its own, stopped below: never one the registered backend serves a run with

    def call(batch: int, tokens: int) -> Any:
        request = DecodeRequest(torch.randint(3, shape.vocab, (batch, p)), left_padded_mask(batch, p, p),
                                replace(config, max_new_tokens=tokens), torch.arange(batch), stop_condition(config, -1),
                                0, weights_version=0)
        return backend.decode(model, request)

    ops: dict[str, list[list[float]]] = {op: [] for op in VLLM_OPS}
    try:
        # Started and given its weights (version 0) outside the timed calls.
        call(1, 1)
        for b in batches:
            # No stop id: a row stops at g tokens, unless vLLM ends it earlier (then its steps are counted).
            steps = int(call(b, g).response_mask.sum(1).max())
            generated = _best_of(lambda b=b: call(b, g), repeats)
            prefill = _best_of(lambda b=b: call(b, 1), repeats)
            ops["vllm_prefill"].append([b, p, prefill])
            ops["vllm_decode"].append([b, p + (steps + 1) // 2, max(generated - prefill, 0.0) / max(steps - 1, 1)])
        engine, versions = backend.engines[model], iter(range(1, repeats + 2))
        sync = _best_of(lambda: engine.load_weights(model, next(versions)), repeats)
    finally:
        backend.close()
    # A second point along the length, so both interpolate along it too (as measure_shape's).
    ops["vllm_decode"] += [[b, 2 * n, t] for b, n, t in ops["vllm_decode"]]
    ops["vllm_prefill"] += [[b, 2 * n, 2 * t] for b, n, t in ops["vllm_prefill"]]
    return {**ops, VLLM_SYNC: [[shape.params, 0, sync]]}


def vllm_cache_path(shape: RoleShape, workload: Workload, batches: tuple[int, ...],
                    engine_args: Mapping[str, Any] | None, cache_dir: Path = DEFAULT_CACHE) -> Path:
    """Where :func:`measure_vllm_generation`'s points of ``shape`` are cached: per hardware, installed vLLM, shape,
    lengths, batches, engine options and CPU KV cache size.

    Args:
        shape: The actor's shape.
        workload: Its prompt and generation lengths.
        batches: Rows per call.
        engine_args: ``generation.vllm_engine_args``.
        cache_dir: The profile cache.
    """
    import importlib.metadata

    installed = [f"{name} {importlib.metadata.version(name)}"
                 for name in importlib.metadata.packages_distributions().get("vllm", [])]
    digest = hashlib.sha1(
        f"v{VLLM_PROFILE_FORMAT}|{','.join(installed)}|{hardware_key()}|{shape.key}|{workload.prompt_length}|"
        f"{workload.generation_length}|{batches}|{json.dumps(engine_args or {}, sort_keys=True, default=str)}|"
        f"{os.environ.get('VLLM_CPU_KVCACHE_SPACE', CPU_KV_CACHE_GIB)}".encode()
    ).hexdigest()[:16]
    return cache_dir / "profiles" / f"vllm-{shape.key}-{digest}.json"


def profile_vllm(workload: Workload, batches: tuple[int, ...], repeats: int, cache_dir: Path | None,
                 engine_args: Mapping[str, Any] | None = None) -> Profile:
    """The actor's :func:`measure_vllm_generation` points, read from the cache where measured before.

    Args:
        workload: Its actor must carry its Hugging Face ``config``.
        batches: Rows per call.
        repeats: Timed repeats per point.
        cache_dir: Where profiles are cached; None disables the cache.
        engine_args: ``generation.vllm_engine_args``.
    """
    shape = workload.actor
    path = vllm_cache_path(shape, workload, batches, engine_args, cache_dir) if cache_dir is not None else None
    cached = _load_cached(path) if path is not None and path.exists() else None
    if cached is not None:
        return cached
    measured = Profile(hardware_key(), None,
                       {shape.key: measure_vllm_generation(shape, workload, batches, repeats, engine_args)})
    if path is not None:
        measured.save(path)
    return measured


def _measure_optimizer_step(model: torch.nn.Module, repeats: int, statistic: str) -> float:
    """Seconds of the engine's optimizer step on ``model``: gradient clipping and an AdamW step, on zero gradients
    (the time does not depend on their values)."""
    import torch

    from lightning_app_rlhf.models.roles import default_optimizer

    optimizer = default_optimizer(model.parameters())
    for param in model.parameters():
        param.grad = torch.zeros_like(param)

    def step() -> None:
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=False)

    return _best_of(step, repeats, statistic)


def model_work(workload: Workload, batch: int = 2) -> Callable[[], None]:
    """One unit of work like one engine iteration, for :func:`~lightning_app_rlhf.planner.cluster.measure_compute_shares`.

    The workload's actor, critic (where it has one) and reference models, each built once: a 4-token generate of the
    actor, forwards of the reference and the critic, then a forward, backward and AdamW step of the actor and of the
    critic, over
    ``batch`` left-padded sequences of the workload's length. Cycling through the engine's models gives the unit the
    engine's working set, so its efficiency counts the cache that concurrent processes take from each other (one
    model repeated stays in a core's own cache: 2 busy processes read 0.99 of a core while the engine's calls on 2
    processes ran 20-30% slower than alone). Build it before forking.
    """
    import torch

    from lightning_app_rlhf.core.config import GenerationConfig
    from lightning_app_rlhf.generation import generate, position_ids_from_mask
    from lightning_app_rlhf.models.roles import ModelSpec, build_causal_lm, build_critic, default_optimizer

    def build(shape: RoleShape | None, builder: Callable[[ModelSpec], torch.nn.Module]) -> torch.nn.Module | None:
        if shape is None:
            return None
        if shape.config is None:
            raise ValueError(
                f"Shape {shape.name!r} has no Hugging Face config to build a model from: make it with role_shape()."
            )
        return builder(ModelSpec(config=dict(shape.config)))

    actor, reference = build(workload.actor, build_causal_lm), build(workload.reference, build_causal_lm)
    critic = build(workload.critic, build_critic)
    trained = [(m, default_optimizer(m.parameters())) for m in (actor, critic) if m is not None]
    p, n, vocab = workload.prompt_length, workload.sequence_length, workload.actor.vocab
    tokens, mask = torch.randint(3, vocab, (batch, n)), left_padded_mask(batch, p, n)
    positions = position_ids_from_mask(mask)
    config, keys = GenerationConfig(max_new_tokens=4), torch.arange(batch)

    def output(model: torch.nn.Module) -> torch.Tensor:
        if model is critic:
            return model(input_ids=tokens, attention_mask=mask, position_ids=positions)
        return model(input_ids=tokens, attention_mask=mask).logits

    def work() -> None:
        generate(actor, tokens[:, :p], mask[:, :p], config, keys, -1, 0)
        with torch.no_grad():
            for model in (reference, critic):
                if model is not None:
                    output(model)
        for model, optimizer in trained:
            output(model).float().mean().backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

    return work


def left_padded_mask(batch: int, prompt: int, length: int) -> torch.Tensor:
    """An attention mask like the engine's batches: every other row's prompt is left-padded by a quarter.

    Prompts of different lengths are left-padded to the longest, and a mask with zeros takes the model's slower
    masked-attention path (measured here: generation about 10% slower than with an all-ones mask).
    """
    import torch

    mask = torch.ones(batch, length, dtype=torch.long)
    mask[::2, : prompt // 4] = 0
    return mask


def measure_reward_fn(
    reward_fn: Callable[[list[str], list[str]], Any],
    tokenizer: Any,
    workload: Workload,
    prompts: list[str] | None,
    statistic: str = "min",
    fields: Sequence[Mapping[str, Any]] | None = None,
) -> float:
    """Seconds per sample of decoding and scoring with a Python reward function; row ``i`` reads prompt
    ``i % len(prompts)`` and that prompt's ``fields``."""
    import torch

    from lightning_app_rlhf.generation import Rollout
    from lightning_app_rlhf.models.calls import reward_forward

    b, p, g = 32, workload.prompt_length, workload.generation_length
    sequences = torch.randint(3, len(tokenizer), (b, p + g))
    if prompts:  # real prompts, left-padded: some reward functions read them
        for row in range(b):
            ids = tokenizer.encode(prompts[row % len(prompts)], add_special_tokens=False)[-p:]
            sequences[row, :p] = tokenizer.pad_token_id
            sequences[row, p - len(ids) : p] = torch.tensor(ids)
    mask = torch.ones_like(sequences)
    rollout = Rollout(sequences, mask, mask[:, p:], torch.zeros(b, g), p)
    rows = [fields[row % len(fields)] for row in range(b)] if fields else []
    row_fields = {name: [row[name] for row in rows] for name in rows[0]} if rows else None
    return _best_of(lambda: reward_forward(reward_fn, rollout, tokenizer, row_fields), 3, statistic) / b
