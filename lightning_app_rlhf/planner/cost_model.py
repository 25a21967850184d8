"""Time and memory of one RLHF iteration under a placement. Plain Python.

Read top to bottom:

1. :class:`PlanChoice`: a ``PlacementPlan`` plus the batch sizes the planner picks.
2. Memory per rank: weights, gradients, optimizer state, activations, KV cache (:meth:`CostModel.memory`).
3. Per-call time: compute from a measured :class:`~lightning_app_rlhf.planner.profiler.Profile` or an analytic
   fallback (FLOPs and bytes against the device's ceilings), plus data-parallel / ZeRO communication.
4. The task graph of the engine, priced from its own recipe of an iteration
   (:func:`~lightning_app_rlhf.engine.iteration.iteration_steps`), and a discrete-event schedule of it
   (:func:`simulate`): tasks on disjoint ranks overlap, tasks sharing a rank run in program order, a free-running
   plan's two sides meet only where a task waits for another (the rollout's handoff, the published weights), and
   CPU processes that outnumber the cores share them.

``actor.generate`` is priced as the workload's ``generation.backend`` runs it: on vLLM (``vllm``) from the points the
profile measured on its engine, all of a rank's rows at once, after the sync of the new weights to the engine once
per iteration, with the engine's copy of the weights and its KV cache in memory; any other backend from the points
measured with ``eager``.

Everything iterates over the workload's roles and calls (the role table's, less the critic's for a critic-free
algorithm), and every batch is the rollout's ``samples`` (prompts x ``num_samples``).
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from dataclasses import dataclass, field

from lightning_app_rlhf.core.role_table import ACTOR, FROZEN_ROLES, REFERENCE, REWARD, calls_of, role_of
from lightning_app_rlhf.engine.iteration import Step, iteration_steps, published_roles, relayout_calls
from lightning_app_rlhf.engine.partial_rollout import POOL_GROUPS_PER_BATCH
from lightning_app_rlhf.generation.vllm import CPU_KV_CACHE_GIB, GPU_MEMORY_UTILIZATION
from lightning_app_rlhf.parallel.pipeline_checks import check_pipeline_parallel
from lightning_app_rlhf.parallel.plan import PlacementPlan
from lightning_app_rlhf.parallel.tensor_parallel import check_tensor_parallel
from lightning_app_rlhf.parallel.wrappers import WRAPPERS
from lightning_app_rlhf.parallel.wrappers.base import REALLOCATION_BUCKET_NUMEL
from lightning_app_rlhf.planner.cluster import Cluster
from lightning_app_rlhf.planner.gpu_efficiency import (
    bus_bandwidth_share,
    decode_bandwidth_share,
    forward_mfu,
    training_mfu,
)
from lightning_app_rlhf.planner.lengths import DROPS_FINISHED_ROWS, decode_steps, simulate_partial
from lightning_app_rlhf.planner.profiler import VLLM, VLLM_SYNC, Profile, generation_op, wrapper_op
from lightning_app_rlhf.planner.workload import RoleShape, Workload, ceil_div

REALLOCATION_BUCKET_BYTES = REALLOCATION_BUCKET_NUMEL * 4
"""A reallocation bucket (:data:`~lightning_app_rlhf.parallel.wrappers.base.REALLOCATION_BUCKET_NUMEL` float32 elements):
what ``Placement.reallocate_weights`` sends at once, and what a sharded train rank gathers at once."""
GPU_USABLE_MEMORY = 0.9
"""Fraction of a GPU's memory a plan may fill: 10% stays for the allocator and the CUDA context."""
COMPUTE_EFFICIENCY = 0.5
"""Fraction of peak FLOP/s a transformer forward/backward reaches: the analytic fallback on CPU processes and on
device ceilings a profile measured. GPU clusters at datasheet peaks take the cited, shape-dependent figures of
:mod:`~lightning_app_rlhf.planner.gpu_efficiency` instead."""
BANDWIDTH_EFFICIENCY = 0.7
"""Fraction of peak memory bandwidth a streaming copy reaches (the optimizer step, a local slice or serialisation
of weights, everywhere), and a decode step or a forward's weight read on CPU processes and measured ceilings (GPUs
at datasheet peaks: :func:`~lightning_app_rlhf.planner.gpu_efficiency.decode_bandwidth_share`)."""
NVLS_DEVICES = frozenset({"H100-80GB", "H200"})
"""Device types whose NVSwitch reduces in the switch (NVLink SHARP, NCCL's NVLS algorithm): their intra-node
all-reduces reach the higher bus bandwidth of
:func:`~lightning_app_rlhf.planner.gpu_efficiency.bus_bandwidth_share`."""
UNROLLED_ITERATIONS = 4
"""Iterations the schedule unrolls (a free-running plan more: :func:`unrolled_iterations`); the estimate is the
steady state between the 2nd and the last (:func:`steady_iterations`)."""
TP_ALL_REDUCES_PER_LAYER = 2
"""Megatron-style tensor parallelism all-reduces the activations twice per transformer layer in a forward (after
the attention and after the MLP), and twice more in the backward."""
SYNC_TASK = ACTOR.call("generate") + ":sync"
"""The task of a generating rank sending the actor's new weights to its vLLM engine, once per iteration before its
first generate call (the engine logs it within ``time/generate_s``)."""
SYNC_COPIES = 4
"""Copies of the actor's weights one sync to a vLLM engine makes, at memory bandwidth, where the profile did not
measure it: to bytes for the RPC, its message to the engine's process, the engine's tensors from the bytes, and its
in-place load (``VllmEngine.load_weights``)."""


@dataclass(frozen=True)
class PlanChoice:
    """A placement and the batch sizes that go with it."""

    plan: PlacementPlan
    generation_batch: int | None = None
    """Sequences (samples) one rank generates together; None: its whole shard at once (what the engine does
    today)."""
    micro_batch: int | None = None
    """Sequences per forward (and forward/backward) on one rank; None: the whole shard of a minibatch at once."""

    @property
    def key(self) -> str:
        """What the choice decides (call groups, wrappers, staleness and schedule, batches), without the plan's
        name."""
        free = " free_running" if self.plan.free_running else ""
        return self.label.split(" ", 1)[1] + f" max_staleness={self.plan.max_staleness}{free}"

    @property
    def label(self) -> str:
        """``flattening [ddp/ddp reference:fsdp2] actor.generate 0-7 reference.forward 0-7 ... gen_batch=all
        micro=all``: the plan's name, the trainable roles' wrappers (then each sharded frozen role's), every call
        with its ranks (:func:`call_ranks`), ``partial`` for partial rollouts, and the batch sizes."""
        plan = self.plan
        wrappers = "/".join(plan.wrappers[r] for r in plan.trainable_roles)
        wrappers += "".join(f" {r}:{plan.wrappers[r]}" for r in FROZEN_ROLES if r in plan.wrappers)
        batches = f"gen_batch={self.generation_batch or 'all'} micro={self.micro_batch or 'all'}"
        gather = "" if plan.unshard_for_generation else " gather-per-step"
        partial = " partial" if plan.partial_rollout else ""
        return f"{plan.name} [{wrappers}] {' '.join(call_ranks(plan))}{gather}{partial} {batches}"


def call_ranks(plan: PlacementPlan) -> list[str]:
    """``["actor.generate 0-7 tp4", "reference.forward 0-3", "actor.train 0-7 pp2 1f1b", ...]``: every call of
    ``plan`` by its full name with its ranks and its tensor- and pipeline-parallel degrees where above 1
    (:meth:`PlacementPlan.layout_text`), in phase order. The planner's tables, labels and sweep print calls this way
    (the tuner's log line and the placement summary name them the same)."""
    return [f"{call} {ranks_text(plan.ranks(call))}{plan.layout_text(call)}" for call in calls_of(plan.roles)]


def role_wrappers(wrappers: dict[str, str]) -> list[str]:
    """``["actor:ddp", "critic:fsdp2", "reward:fsdp2"]``: each wrapped role by its full name with its wrapper."""
    return [f"{role}:{wrapper}" for role, wrapper in wrappers.items()]


def ranks_text(ranks: tuple[int, ...]) -> str:
    """``0-7`` for contiguous ranks, else ``0,2,5``."""
    if len(ranks) > 1 and ranks == tuple(range(ranks[0], ranks[-1] + 1)):
        return f"{ranks[0]}-{ranks[-1]}"
    return ",".join(map(str, ranks))


# ---------------------------------------------------------------- memory


@dataclass
class RankMemory:
    """Bytes one rank holds. ``param_bytes`` and ``state_bytes`` count what ``parallel/memory.py`` logs."""

    rank: int
    weights: int = 0
    grads: int = 0
    optimizer: int = 0
    activations: int = 0
    """The largest transient of any call on this rank (activations, logits, gathered layers, buckets)."""
    kv_cache: int = 0
    roles: dict[str, str] = field(default_factory=dict)
    """Role -> how this rank holds it (``trained ddp``, ``shard 1/4 fsdp2``, ``shadow``, ``frozen``)."""

    @property
    def param_bytes(self) -> int:
        return self.weights

    @property
    def state_bytes(self) -> int:
        return self.grads + self.optimizer

    @property
    def total(self) -> int:
        return self.weights + self.grads + self.optimizer + self.activations + self.kv_cache

    def describe(self) -> str:
        parts = [
            f"{name} {gib(value)}"
            for name, value in (
                ("weights", self.weights),
                ("grads", self.grads),
                ("optimizer", self.optimizer),
                ("activations", self.activations),
                ("kv_cache", self.kv_cache),
            )
            if value
        ]
        held = ", ".join(f"{role}: {how}" for role, how in self.roles.items())
        return f"rank {self.rank}: {gib(self.total)} = " + " + ".join(parts) + f" ({held})"


def gib(n: float) -> str:
    if n >= 2**30:
        return f"{n / 2**30:.1f} GiB"
    return f"{n / 2**20:.2f} MiB"


@dataclass
class Estimate:
    """What the cost model predicts for one :class:`PlanChoice`."""

    choice: PlanChoice
    iteration_s: float
    """Steady-state seconds per iteration (predicted even when rejected, for the search's penalty)."""
    samples_per_s: float
    """Sequences (prompts x ``num_samples``) per second, as the engine's ``perf/samples_per_sec`` counts them."""
    call_s: dict[str, float]
    """Seconds of each call on its slowest rank, alone (no contention), plus ``reallocate`` and ``gather``; on vLLM
    ``weight_sync``, the sync of the new weights to each generating rank's engine (once per iteration)."""
    memory: list[RankMemory]
    capacity_bytes: int
    """Usable memory of one device."""
    rejected: str | None = None
    """Why the plan cannot run (None: it fits): out of memory, or a generation backend that cannot run its
    ``actor.generate`` (:meth:`CostModel.backend_refusal`)."""
    timeline: list[tuple[str, tuple[int, ...], float, float]] = field(default_factory=list)
    """(task, ranks, start, end) of one steady-state iteration."""
    efficiency: dict[str, dict[str, float]] = field(default_factory=dict)
    """GPU clusters: each model call's predicted efficiencies (:meth:`CostModel.efficiencies`); filled for the plans
    a search reports, empty elsewhere."""
    refused: bool = False
    """Whether its generation backend cannot run it (:meth:`CostModel.backend_refusal`, the reason in ``rejected``):
    unlike a plan out of memory, no smaller batch makes it run."""
    trainer_idle_share: float | None = None
    """The share of the steady state that the last training rank runs no task (waiting for a rollout, or for the
    other ranks of a collective): what the bench measures as ``trainer_idle_share`` on a free-running plan (its
    wait for the next rollout over its iterations' time)."""

    @property
    def fits(self) -> bool:
        return self.rejected is None

    @property
    def peak_bytes(self) -> int:
        return max(m.total for m in self.memory)


# ---------------------------------------------------------------- the cost model


class CostModel:
    """Predicts time and memory of placements of one workload on one cluster.

    Args:
        cluster: Where it runs.
        workload: What one iteration computes; the plans it is asked about must place exactly its roles.
        profile: Measured per-op times and ceilings; ops it lacks fall back to the analytic model.
    """

    def __init__(self, cluster: Cluster, workload: Workload, profile: Profile | None = None) -> None:
        self.cluster = cluster
        self.workload = workload
        self.profile = profile
        self.device = profile.device if profile is not None and profile.device is not None else cluster.device
        self.collective_latency = self.device.collective_latency_s
        # The cited GPU efficiencies are fractions of datasheet peaks: they price a GPU cluster whose ceilings are the
        # datasheet's, not CPU processes (calibrated against measured runs with the constants) nor ceilings a
        # profile measured (already what the device reaches).
        self.cited_gpu = cluster.cores_per_node is None and (profile is None or profile.device is None)
        self.nvls = self.device.name in NVLS_DEVICES
        usable = 1.0 if cluster.cores_per_node is not None else GPU_USABLE_MEMORY
        self.capacity = int(cluster.device.memory_bytes * usable)
        self._role_bytes: dict[tuple[str, str, int, int], tuple[int, int, int]] = {}
        self.vllm = workload.generation_backend == VLLM
        """Whether ``actor.generate`` runs on a vLLM engine per generating rank."""
        self._partial: dict[tuple, PartialPrice] = {}

    # ---- memory

    def memory(self, choice: PlanChoice) -> list[RankMemory]:
        """Bytes every rank holds under ``choice``: static (weights, grads, optimizer) plus its largest transient."""
        plan = choice.plan
        rows = self.static_memory(plan)
        calls = calls_of(plan.roles)  # table order: the first of equal transients wins, whatever the plan's order
        transients = {call: self.transient(choice, call) for call in calls}
        buffer_ranks = self._bucket_ranks(plan)
        for rank, row in enumerate(rows):
            activations, kv = max((transients[c] for c in calls if rank in plan.ranks(c)), key=sum)
            row.activations, row.kv_cache = activations, kv
            if rank in buffer_ranks:
                row.activations += REALLOCATION_BUCKET_BYTES
        for rank, held in self._in_flight_bytes(plan).items():
            rows[rank].activations += held
        return rows

    def _in_flight_bytes(self, plan: PlacementPlan) -> dict[int, int]:
        """Free-running: what a rank holds for the other side until it takes it. A train leader keeps each version
        it publishes (flat buckets of the trainable weights) until the generation side has taken it: up to
        ``run_ahead + 1`` versions; the generation leader keeps each rollout it sends (one payload per training
        rank) until it is received: up to ``run_ahead``. Empty for the fixed schedule."""
        if not plan.free_running:
            return {}
        held: dict[int, int] = {}
        for role in published_roles(plan):
            shape = self.workload.shape(role)
            if shape is not None:
                leader = plan.ranks(f"{role}.train")[0]
                moved = self.workload.trainable_params(role) * shape.dtype_bytes
                held[leader] = held.get(leader, 0) + (plan.run_ahead + 1) * moved
        leader = plan.generation_ranks[0]
        held[leader] = held.get(leader, 0) + plan.run_ahead * len(plan.training_ranks) * self.experience_bytes()
        return held

    def static_memory(self, plan: PlacementPlan) -> list[RankMemory]:
        """Weights, gradients and optimizer state of every rank: on the ranks where a role is wrapped (a trainable
        role's train group, a frozen role's forward group when the plan gives it a wrapper) exactly what its
        wrapper's ``memory_bytes`` measures there (:meth:`role_bytes`); elsewhere whole weights (shadow copies,
        frozen roles held whole)."""
        w = self.workload
        self.check_plan(plan)
        rows = [RankMemory(rank) for rank in range(plan.world_size)]
        for role in w.roles:
            shape = w.shape(role)
            if shape is None:
                continue
            trainable = role in w.trainable
            if trainable:
                group = plan.ranks(f"{role}.train")
                wrapper = plan.wrappers.get(role, "ddp")
            else:  # a frozen role lives on its forward group: whole, or sharded there by its wrapper
                group = plan.ranks(f"{role}.forward") if role in plan.wrappers else ()
                wrapper = plan.wrappers.get(role)
            group = tuple(sorted(group))  # a process group numbers its ranks in order
            n = len(group)
            holders = {r for c in plan.calls if role_of(c) == role for r in plan.ranks(c)}
            reference_on_actor = role == REFERENCE.name and self._reference_on_actor(plan)
            whole = w.held_params(role) * shape.dtype_bytes
            # The call that lays the role out on its group: DP x TP x PP training, a frozen role's forward.
            home = f"{role}.train" if trainable else f"{role}.forward"
            t = plan.tp_degree(home) if trainable else 1  # DP x TP training: FSDP2 over n / t replicas
            p = plan.pp_degree(home) if home in plan.calls else 1  # a pipeline stage holds 1/p of the layers
            for rank in sorted(holders):
                row = rows[rank]
                if reference_on_actor:
                    row.roles[role] = "actor base, adapters off"
                elif rank in group:
                    dp, dp_rank = n // (t * p), group.index(rank) // (t * p)
                    weights, grads, optimizer = self.role_bytes(role, wrapper, dp, dp_rank)
                    row.weights += weights // (t * p)
                    row.grads += grads // (t * p)
                    row.optimizer += optimizer // (t * p)
                    sharded = _shards_params(wrapper) and dp > 1
                    layout = (f" tp{t}" if t > 1 else "") + (f" stage 1/{p}" if p > 1 else "")
                    if trainable:
                        row.roles[role] = (f"shard 1/{dp} {wrapper}" if sharded else f"trained {wrapper}") + layout
                    else:
                        row.roles[role] = (f"frozen shard 1/{dp} {wrapper}" if sharded else "frozen") + layout
                else:
                    # A frozen role held whole by a pipelined forward holds its stage only; shadows stay whole.
                    stage = p if not trainable and rank in plan.ranks(home) else 1
                    row.weights += whole // stage
                    row.roles[role] = ("shadow" if trainable else "frozen") + (f" stage 1/{stage}" if stage > 1 else "")
                # A generate / forward call with a degree runs on a tensor-parallel copy of its own, beside the
                # role's module (which a shadow's refresh and the wrapper still need): 1/t of the weights more.
                for call in plan.tp:
                    if role_of(call) == role and not call.endswith(".train") and rank in plan.ranks(call):
                        row.weights += whole // plan.tp_degree(call)
                        row.roles[role] += f" +tp{plan.tp_degree(call)} copy"
        if self.vllm:
            weights, kv_cache = self.engine_bytes()
            for rank in plan.ranks(ACTOR.call("generate")):
                rows[rank].weights += weights
                rows[rank].kv_cache += kv_cache
                rows[rank].roles[ACTOR.name] += " +vllm engine"
        return rows

    def engine_bytes(self) -> tuple[int, int]:
        """``(weights, KV cache)`` bytes of the vLLM engine of a generating rank: its own whole copy of the actor (a
        LoRA actor's adapters merged in) and the KV cache it reserves: ``VLLM_CPU_KVCACHE_SPACE`` GiB on CPU processes
        (:data:`~lightning_app_rlhf.generation.vllm.CPU_KV_CACHE_GIB` unless set), on a GPU the rest of the
        :data:`~lightning_app_rlhf.generation.vllm.GPU_MEMORY_UTILIZATION` share of its memory the engine takes (the
        backend's default; a run's ``generation.vllm_engine_args`` may set another)."""
        weights = self.workload.actor.param_bytes
        if self.cluster.cores_per_node is not None:
            return weights, int(float(os.environ.get("VLLM_CPU_KVCACHE_SPACE", CPU_KV_CACHE_GIB)) * 2**30)
        return weights, max(int(GPU_MEMORY_UTILIZATION * self.cluster.device.memory_bytes) - weights, 0)

    def role_bytes(self, role: str, wrapper: str, group_size: int, group_rank: int) -> tuple[int, int, int]:
        """``(weights, gradients, optimizer)`` bytes of ``role`` on the rank ``group_rank`` of a group of
        ``group_size`` ranks wrapped with ``wrapper``: the registry class's ``predicted_bytes`` over the role's
        parameter shapes (gradients and optimizer state for a trainable role only)."""
        key = (role, wrapper, group_size, group_rank)
        if key not in self._role_bytes:  # the searches ask for the same few groups thousands of times
            w = self.workload
            shape = w.shape(role)
            if shape is None:
                return 0, 0, 0
            shapes, trainable = w.parameters(role)
            self._role_bytes[key] = WRAPPERS[wrapper].predicted_bytes(
                shapes, trainable, shape.dtype_bytes, group_size, group_rank, w.optimizer_slots, role in w.trainable
            )
        return self._role_bytes[key]

    def check_plan(self, plan: PlacementPlan) -> None:
        """Raise a ``ValueError`` naming the fix unless ``plan`` places exactly the workload's roles, is one the engine
        runs (its tensor- and pipeline-parallel rules), cuts pipelined calls into at most one stage per layer, and
        keeps every tensor-parallel replica within a node (its all-reduces
        run at every layer: NVLink, not the network). A pipeline may span nodes: it sends one micro-batch's
        activations per stage boundary, the way ReaLHF grows a call past a node."""
        plan.check_roles(self.workload.roles, self.workload.algorithm)
        check_tensor_parallel(plan)  # what the engine runs: TP training only over FSDP2
        check_pipeline_parallel(plan)  # and pipelines: one of tp and pp per call, DDP over a train call's stages
        for call, p in plan.pp.items():
            shape = self.workload.shape(role_of(call))
            if shape is None:
                raise ValueError(f"Call {call!r} has a pipeline-parallel degree, but its role is a Python function.")
            if p > shape.layers:
                raise ValueError(f"Call {call!r} has pipeline-parallel degree {p}, more than the {shape.layers} "
                                 "decoder layers it is cut at: use pp <= the number of layers.")
        for call, t in plan.tp.items():
            if self.workload.shape(role_of(call)) is None:
                raise ValueError(f"Call {call!r} has a tensor-parallel degree, but its role is a Python function.")
            ranks = plan.ranks(call)
            for i in range(0, len(ranks), t):
                replica = ranks[i : i + t]
                if not self.cluster.on_one_node(replica):
                    raise ValueError(f"Call {call!r} has a tensor-parallel replica on ranks {list(replica)}, which "
                                     "span nodes: keep tensor parallelism within a node (a smaller degree, or "
                                     "node-aligned ranks).")

    @staticmethod
    def _bucket_ranks(plan: PlacementPlan) -> set[int]:
        """Ranks that hold a reallocation bucket: shadows and the train leader that sends to them, and every train
        rank of a sharded role whose weights go to shadows or tensor-parallel copies (it gathers them a bucket at a
        time)."""
        ranks: set[int] = set()
        for role in plan.trainable_roles:
            shadows, train = plan.shadow_ranks(role), plan.ranks(f"{role}.train")
            if shadows:
                ranks |= {*shadows, train[0]}
            if CostModel._split_training(plan, role) and (shadows or relayout_calls(plan, role)):
                ranks |= set(train)
        return ranks

    @staticmethod
    def _split_training(plan: PlacementPlan, role: str) -> bool:
        """Whether ``role``'s training layout splits its weights over its train ranks (FSDP2 / ZeRO-3 shards, tensor
        parallelism, pipeline stages): its other layouts then need the full weights gathered first."""
        train = f"{role}.train"
        return ((_shards_params(plan.wrappers.get(role)) and len(plan.ranks(train)) > 1)
                or plan.tp_degree(train) > 1 or plan.pp_degree(train) > 1)

    def transient(self, choice: PlanChoice, call: str) -> tuple[int, int]:
        """(activation bytes, KV-cache bytes) one rank needs while it runs ``call``."""
        w, plan = self.workload, choice.plan
        shape = w.shape(role_of(call))
        if shape is None:
            return 0, 0
        t, p = plan.tp_degree(call), plan.pp_degree(call)
        n = len(plan.ranks(call)) // (t * p)  # data-parallel replicas: each shards the batch, t x p ranks per replica
        s, db = w.sequence_length, shape.dtype_bytes
        gathered = 2 * shape.param_bytes // shape.layers if self._sharded_call(plan, call) else 0
        if call == ACTOR.call("generate") and self.vllm:  # the engine decodes: the rank holds the weights' message
            return shape.param_bytes, 0
        if call == ACTOR.call("generate"):
            if self.unshards_once(plan):  # the whole weights, gathered once for the rollout (less the own shard)
                gathered = w.held_params(ACTOR.name) * db - self.role_bytes(ACTOR.name, plan.wrappers[ACTOR.name],
                                                                             n, 0)[0]
            # Partial rollouts decode the pool's unfinished rows: up to POOL_GROUPS_PER_BATCH times the rollout's.
            rows = ceil_div(w.samples * (POOL_GROUPS_PER_BATCH if plan.partial_rollout else 1), n)
            g = min(choice.generation_batch or rows, rows)
            prefill = w.turn_context(w.turns - 1)  # the longest prefill: the last turn's (the prompt, single-turn)
            logits = (
                2 * g * shape.vocab * 4 + g * prefill * shape.vocab * db
            ) // t  # prefill logits, fp32 softmax; vocab-parallel under TP
            return (
                logits + 4 * g * prefill * shape.hidden * db + gathered,
                shape.kv_bytes_per_token * g * s // t,  # TP splits the KV heads
            )
        if call.endswith(".forward"):
            b = self._micro(choice, ceil_div(w.samples, n))
            head = 2 * b * w.response_length * shape.head_outputs * 4 // t if shape.kind == "causal_lm" else 0
            attention = 0 if w.flash_attention else shape.heads * s * s * b * db // t
            return 4 * b * s * shape.hidden * db + attention + head + gathered, 0
        local = ceil_div(w.samples // w.num_minibatches, n)
        b = self._micro(choice, local)
        scores = 0 if w.flash_attention else 2.5 * shape.heads * s * s * b / t
        # Korthikanti et al. 2022, without recompute: 10 sbh bytes replicated, 24 sbh split by tensor parallelism.
        per_layer = ((5 + 12 / t) * s * b * shape.hidden + scores) * db
        head = 3 * b * w.response_length * shape.head_outputs * 4 // t if shape.kind == "causal_lm" else 0
        # A pipeline stage holds 1/p of the layers, for the micro-batches in flight: 1F1B's first stage keeps p of
        # them (Narayanan et al. 2021, section 2.2.2), GPipe every micro-batch of the minibatch.
        layers = ceil_div(shape.layers, p)
        if p > 1:
            micro = ceil_div(local, b)
            layers *= min(micro, p) if plan.pipeline_schedule == "1f1b" else micro
        if w.gradient_checkpointing:  # every layer's input, plus one layer recomputed in full
            return int(layers * s * b * shape.hidden * db + per_layer + head) + gathered, 0
        return int(layers * per_layer + head) + gathered, 0

    @staticmethod
    def _micro(choice: PlanChoice, shard: int) -> int:
        return min(choice.micro_batch or shard, shard)

    @staticmethod
    def _pipelined_micro(choice: PlanChoice, call: str, shard: int) -> int | None:
        """Rows per micro-batch of a pipelined ``call`` over a pipeline's ``shard`` rows, as the engine cuts them
        (None: not pipelined). A train call: the smallest divisor of the shard that gives at least the micro-batches
        the micro-batch size asks for and, under 1F1B, one per stage (``PipelineDDPWrapper.micro_batches``). A
        scoring call: a generation batch each, at least one per stage (``RoleCalls._pipelined_forward``)."""
        p = choice.plan.pp_degree(call)
        if p <= 1 or shard <= 0:
            return None
        if call.endswith(".train"):
            wanted = ceil_div(shard, choice.micro_batch) if choice.micro_batch else 1
            floor = max(wanted, p if choice.plan.pipeline_schedule == "1f1b" else 1)
            count = next((c for c in range(floor, shard + 1) if shard % c == 0), shard)
            return shard // count
        g = choice.generation_batch
        count = min(max(p, ceil_div(shard, g) if g else 1), shard)
        return ceil_div(shard, count)

    def _sharded_call(self, plan: PlacementPlan, call: str) -> bool:
        """A call whose weights are sharded over its group (FSDP2 / ZeRO-3): it gathers them for every forward.

        That is a call on its trainable role's sharded train group, a frozen role sharded over its forward group,
        or with LoRA a reference forward on the ranks of a sharded actor (it runs the actor's base)."""
        role = role_of(call)
        ranks = set(plan.ranks(call))
        if plan.tp_degree(call) > 1 and not call.endswith(".train"):
            return False  # it runs on a tensor-parallel copy of its own, not on the wrapper's shards
        if role in FROZEN_ROLES:
            if role == REFERENCE.name and self._reference_on_actor(plan):
                actor_train = ACTOR.call("train")
                return self._sharded_call(plan, actor_train) and ranks == set(plan.ranks(actor_train))
            return _shards_params(plan.wrappers.get(role)) and len(ranks) > 1
        if not _shards_params(plan.wrappers.get(role)):
            return False
        train = plan.ranks(f"{role}.train")
        return len(train) // plan.tp_degree(f"{role}.train") > 1 and ranks == set(train)

    def unshards_once(self, plan: PlacementPlan) -> bool:
        """Whether the actor generates on its own sharded (FSDP2 / ZeRO-3) train group with its weights gathered once
        per rollout (``plan.unshard_for_generation``) rather than once per decoding step. Never for multi-turn
        episodes (``turns`` > 1): the episode loop generates through the sharded module, a gather per forward."""
        return (plan.unshard_for_generation and self.workload.turns == 1
                and self._sharded_call(plan, ACTOR.call("generate")))

    def _reference_on_actor(self, plan: PlacementPlan) -> bool:
        """With LoRA: the reference forward runs the actor's own base (adapters off), so it holds no weights. That
        needs the actor on those ranks: whole (trained with DDP, or a shadow), or sharded over exactly them."""
        if not self.workload.reference_is_actor_base:
            return False
        ranks = set(plan.ranks(REFERENCE.call("forward")))
        if not ranks <= {r for c in plan.calls if role_of(c) == ACTOR.name for r in plan.ranks(c)}:
            return False
        train = set(plan.ranks(ACTOR.call("train")))
        sharded = _shards_params(plan.wrappers[ACTOR.name]) and len(train) > 1
        return not sharded or not ranks & train or ranks == train

    def check_memory(self, rows: list[RankMemory]) -> str | None:
        """None when every rank fits, else a message with the breakdown of the fullest rank."""
        worst = max(rows, key=lambda m: m.total)
        if worst.total <= self.capacity:
            return None
        return (
            f"out of memory: {worst.describe()} > {gib(self.capacity)} usable on a {self.cluster.device.name}"
        )

    # ---- per-op compute time (one rank, full speed)

    def op_time(self, shape: RoleShape, op: str, batch: int, length: int, tp: int = 1, pp: int = 1) -> float:
        """Seconds of ``op`` (``forward``, ``train``, ``decode``, ``optimizer``) of the whole model on one rank.

        ``forward``/``train``: ``batch`` sequences of ``length`` tokens (train = forward + backward); ``prefill``: the
        forward of ``batch`` prompts of ``length`` tokens as generation runs it (last position's logits). ``decode``: one
        step of ``batch`` sequences with ``length`` tokens of context. ``optimizer``: ``batch`` is the parameter count.
        ``tp`` and ``pp``: the call's tensor- and pipeline-parallel degrees, which set the GPU efficiencies (a caller
        divides the time by ``tp x pp`` itself). A measured profile's time wins where it has the op; vLLM's
        ``vllm_prefill`` and ``vllm_decode`` (:func:`~lightning_app_rlhf.planner.profiler.generation_op`) are else
        priced as the ``prefill`` and ``decode`` they are.
        """
        if self.profile is not None:
            measured = self.profile.time(shape, op, batch, length)
            if measured is not None:
                return measured
        return self.analytic_time(shape, op.removeprefix(f"{VLLM}_"), batch, length, tp, pp)

    def analytic_time(self, shape: RoleShape, op: str, batch: int, length: int, tp: int = 1, pp: int = 1) -> float:
        """FLOPs against the compute ceiling, bytes against the bandwidth ceiling: on a GPU cluster at datasheet peaks
        each at its cited share for this shape (:meth:`compute_share`, :meth:`memory_share`), elsewhere at
        :data:`COMPUTE_EFFICIENCY` and :data:`BANDWIDTH_EFFICIENCY` plus a per-layer overhead.

        Args:
            shape: The role's model.
            op: ``forward``, ``prefill``, ``train``, ``decode`` or ``optimizer`` (see :meth:`op_time`).
            batch: Sequences (the parameter count for ``optimizer``).
            length: Tokens per sequence (the context of a decode step).
            tp: The call's tensor-parallel degree.
            pp: The call's pipeline-parallel degree.
        """
        if op not in ("forward", "prefill", "train", "decode", "optimizer"):
            raise ValueError(f"Unknown op {op!r}: use forward, prefill, train, decode or optimizer.")
        # The cited GPU figures are end to end (launches, Python and sampling included): no per-layer overhead on top.
        overhead = 0.0 if self.cited_gpu else shape.layers * self.device.kernel_overhead_s
        if op == "optimizer":  # read/write weights and both moments, read grads: bandwidth-bound
            bytes_per_s = self.device.memory_bandwidth * BANDWIDTH_EFFICIENCY
            return batch * (3 * shape.dtype_bytes + 2 * self.workload.optimizer_bytes_per_param) / bytes_per_s
        flops_per_s = self.device.flops * self.compute_share(shape, op, batch, length, tp, pp)
        # A decode step reads the weights and the KV cache; a forward's floor is its read of the weights alone.
        read_length = length if op == "decode" else 0
        bytes_per_s = self.device.memory_bandwidth * self.memory_share(shape, batch, read_length, tp)
        if op == "decode":
            flops = decode_flops(shape, batch, length)
            moved = shape.param_bytes + shape.kv_bytes_per_token * length * batch
            return max(flops / flops_per_s, moved / bytes_per_s) + overhead
        flops = forward_flops(shape, batch, length)
        if op in ("forward", "prefill"):  # prefill: the prompt's forward (logits of its last position only)
            return max(flops / flops_per_s, shape.param_bytes / bytes_per_s) + overhead
        # train: backward = 2 forwards (1 with LoRA: no weight gradients of the frozen base), plus a recomputed
        # forward with gradient checkpointing. The cited training figure counts the recomputed forward too (hardware
        # FLOPs), so dividing all these passes by it is consistent.
        passes = (2 if self.workload.lora_rank is not None else 3) + self.workload.gradient_checkpointing
        return passes * flops / flops_per_s + passes * overhead

    def compute_share(self, shape: RoleShape, op: str, batch: int, length: int, tp: int = 1, pp: int = 1) -> float:
        """Fraction of peak FLOP/s an op reaches. GPU cluster at datasheet peaks: ``train``
        :func:`~lightning_app_rlhf.planner.gpu_efficiency.training_mfu`, the others
        :func:`~lightning_app_rlhf.planner.gpu_efficiency.forward_mfu`, at the whole model's parameters and the op's
        tokens (a decode step's: one per sequence). Both are bubble-free: the cost model prices a pipelined call's
        bubble itself (:meth:`pipelined`). Else :data:`COMPUTE_EFFICIENCY`.

        Args:
            shape: The role's model.
            op: ``forward``, ``prefill``, ``train`` or ``decode``.
            batch: Sequences.
            length: Tokens per sequence (a decode step's context: one new token each).
            tp: The call's tensor-parallel degree.
            pp: The call's pipeline-parallel degree.
        """
        if not self.cited_gpu:
            return COMPUTE_EFFICIENCY
        tokens = batch if op == "decode" else batch * length
        share = training_mfu if op == "train" else forward_mfu
        return share(shape.params, tp, pp, max(tokens, 1))

    def memory_share(self, shape: RoleShape, batch: int, length: int, tp: int = 1) -> float:
        """Fraction of peak memory bandwidth a decode step (or a forward's read of the weights) reaches. GPU cluster at
        datasheet peaks: :func:`~lightning_app_rlhf.planner.gpu_efficiency.decode_bandwidth_share` at the bytes one GPU
        reads in a decode step of ``batch`` sequences with ``length`` tokens of context (its ``1/tp`` of the weights
        and of the KV cache). Else :data:`BANDWIDTH_EFFICIENCY`.

        Args:
            shape: The role's model.
            batch: Sequences decoded together.
            length: Tokens of context.
            tp: The call's tensor-parallel degree.
        """
        if not self.cited_gpu:
            return BANDWIDTH_EFFICIENCY
        return decode_bandwidth_share((shape.param_bytes + shape.kv_bytes_per_token * length * batch) / tp)

    # ---- communication

    def bus_bandwidth(self, ranks: tuple[int, ...], message_bytes: float, reduces: bool = False) -> float:
        """GPU cluster at datasheet peaks: bytes/s per link one collective of ``message_bytes`` (nccl-tests' size)
        over ``ranks`` reaches: the link's peak (NVLink within a node, the NIC across nodes) times
        :func:`~lightning_app_rlhf.planner.gpu_efficiency.bus_bandwidth_share`, whose small-message shares include
        the collective's fixed latency (so the callers add none). In-switch reduction (NVLS, :data:`NVLS_DEVICES`)
        only speeds up a reduction past the link's peak (``reduces``); a gather, broadcast or send is capped at it.

        Args:
            ranks: The collective's ranks.
            message_bytes: Its size (an empty message: one byte, the latency only).
            reduces: Whether it reduces (an all-reduce).
        """
        intra_node = self.cluster.on_one_node(ranks)
        share = bus_bandwidth_share(max(message_bytes, 1.0), intra_node, nvls=self.nvls and intra_node)
        return self.cluster.bandwidth(ranks) * (share if reduces else min(share, 1.0))

    def all_gather_s(self, ranks: tuple[int, ...], total_bytes: float) -> float:
        """Ring all-gather (or reduce-scatter) of ``total_bytes`` over ``ranks``: ``(n - 1) / n`` of them over each
        link; on GPUs at the cited bus bandwidth for that size (:meth:`bus_bandwidth`), elsewhere at the link's
        bandwidth plus a latency per hop."""
        n = len(ranks)
        if n <= 1:
            return 0.0
        if self.cited_gpu:
            total_bytes = max(total_bytes, 1.0)
            return (n - 1) / n * total_bytes / self.bus_bandwidth(ranks, total_bytes)
        return (n - 1) / n * total_bytes / self.cluster.bandwidth(ranks) + (n - 1) * self.collective_latency

    def all_reduce_s(self, ranks: tuple[int, ...], nbytes: float) -> float:
        """Ring all-reduce: a reduce-scatter then an all-gather; on GPUs at the cited all-reduce bus bandwidth for
        ``nbytes`` (:meth:`bus_bandwidth`), elsewhere at the device's measured all-reduce bandwidth within a node
        (DDP's gradient buckets) plus a latency per hop."""
        n = len(ranks)
        if n <= 1:
            return 0.0
        if self.cited_gpu:
            nbytes = max(nbytes, 1.0)
            return 2 * (n - 1) / n * nbytes / self.bus_bandwidth(ranks, nbytes, reduces=True)
        return 2 * ((n - 1) / n * nbytes / self.bucket_bandwidth(ranks) + (n - 1) * self.collective_latency)

    def bucket_bandwidth(self, ranks: tuple[int, ...]) -> float:
        """Bytes/s of an all-reduce or broadcast of large buckets over ``ranks``: the device's measured
        ``all_reduce_bandwidth`` within a node, else the cluster's bandwidth."""
        if ranks and self.cluster.on_one_node(ranks) and self.device.all_reduce_bandwidth is not None:
            return self.device.all_reduce_bandwidth
        return self.cluster.bandwidth(ranks)

    def sharded_gather_s(self, ranks: tuple[int, ...], shape: RoleShape, tp: int = 1) -> float:
        """Gather a sharded (FSDP2 / ZeRO-3) role's weights for one pass: one all-gather per wrapped unit (each
        transformer block, then the root), so ``layers + 1`` collectives' latency for the whole model's bytes (its
        ``1 / tp`` under tensor parallelism, gathered over one TP rank's data-parallel group ``ranks``)."""
        if len(ranks) <= 1:
            return 0.0
        if self.cited_gpu:  # each unit's all-gather at the bus bandwidth of its own size (its latency included)
            units = shape.layers + 1
            return units * self.all_gather_s(ranks, shape.param_bytes / tp / units)
        return (
            self.all_gather_s(ranks, shape.param_bytes / tp)
            + shape.layers * (len(ranks) - 1) * self.collective_latency
        )

    def tp_all_reduce_s(self, replica: tuple[int, ...], nbytes: float) -> float:
        """One tensor-parallel all-reduce of ``nbytes`` of activations over a replica's ranks (one node): ring
        bandwidth at the intra-node bandwidth, tree latency (small messages: NCCL's LL / tree protocols); on GPUs the
        cited all-reduce bus bandwidth for ``nbytes`` (:meth:`bus_bandwidth`: latency included)."""
        t = len(replica)
        if t <= 1:
            return 0.0
        if self.cited_gpu:
            return 2 * (t - 1) / t * nbytes / self.bus_bandwidth(replica, nbytes, reduces=True)
        return 2 * (t - 1) / t * nbytes / self.bucket_bandwidth(replica) + _log2(t) * self.collective_latency

    def tp_pass_s(self, plan: PlacementPlan, call: str, shape: RoleShape, tokens: int, passes: int = 1) -> float:
        """Tensor-parallel communication of ``passes`` forward passes over ``tokens`` tokens (all sequences of the
        micro-batch together): :data:`TP_ALL_REDUCES_PER_LAYER` all-reduces of the activations per layer (of a
        pipeline stage's layers, for a pipelined call)."""
        t = plan.tp_degree(call)
        if t <= 1:
            return 0.0
        replica = plan.ranks(call)[:t]
        per_layer = TP_ALL_REDUCES_PER_LAYER * self.tp_all_reduce_s(replica, tokens * shape.hidden * shape.dtype_bytes)
        return passes * ceil_div(shape.layers, plan.pp_degree(call)) * per_layer

    def pipeline_send_s(self, plan: PlacementPlan, call: str, shape: RoleShape, tokens: int) -> float:
        """One stage boundary's send of a micro-batch of ``tokens`` tokens' activations (or their gradients) between
        two consecutive stages of the call's first pipeline (stage ``s`` is ranks ``[s * t, (s + 1) * t)`` of it,
        each tensor-parallel rank sending its own ``1/t``), at the slowest boundary's bandwidth."""
        t, p = plan.tp_degree(call), plan.pp_degree(call)
        if p <= 1:
            return 0.0
        stages = plan.ranks(call)[: t * p : t]
        nbytes = tokens * shape.hidden * shape.dtype_bytes / t
        if self.cited_gpu:  # a send's bandwidth for its size, latency included (:meth:`bus_bandwidth`)
            return nbytes / self.bus_bandwidth(stages, nbytes)
        return nbytes / self.cluster.bandwidth(stages) + self.collective_latency

    def pipelined(self, plan: PlacementPlan, call: str, shape: RoleShape, micro_tokens: list[int],
                  passes: int) -> tuple[float, float, float]:
        """(bubble factor, send seconds, stage-step seconds of compute) of a pipelined call over micro-batches of
        ``micro_tokens`` tokens each.

        Both schedules (GPipe, 1F1B) run ``m`` micro-batches over ``p`` stages in the time of ``m + p - 1`` stage
        steps: the bubble is ``(p - 1) / m`` of the work (Narayanan et al. 2021, "Efficient Large-Scale Language
        Model Training on GPU Clusters Using Megatron-LM", section 2.2). Each step sends a micro-batch's activations
        forward (and, in training, their gradients back: ``passes`` = 2) over a stage boundary. (1.0, 0.0) for an
        unpipelined call. Where the profile measured a stage step on a pipeline of ``p`` processes, the steps cost
        that instead of the sends, as compute: the schedule's own work on each stage (Python, copies, its waits for
        them), which slows down as the processes share cores (with 4 processes on 2 cores the demo's pipelines ran
        about a third slower than their price as communication).

        The bubble is counted here only: the cited GPU figures the stage steps are priced with are bubble-free
        (``gpu_efficiency.TRAINING_POINTS`` takes it out of Narayanan et al.'s end-to-end Table 1)."""
        p, m = plan.pp_degree(call), len(micro_tokens)
        if p <= 1 or m == 0:
            return 1.0, 0.0, 0.0
        # A stage step as the profile measured it on a pipeline of p processes (measure_wrapper_steps: the sends,
        # the schedule's own work and its waits), else the activations' send over the slowest boundary.
        op = "pipeline_train_step" if passes == 2 else "pipeline_forward_step"
        measured = self.profile.time(shape, op, p, 1) if self.profile is not None else None
        if measured is not None:
            return (m + p - 1) / m, 0.0, (m + p - 1) * measured
        largest = max(micro_tokens)
        return (m + p - 1) / m, (m + p - 1) * passes * self.pipeline_send_s(plan, call, shape, largest), 0.0

    def broadcast_s(self, ranks: tuple[int, ...], nbytes: float) -> float:
        """A broadcast of ``nbytes`` from the first of ``ranks``: pipelined over a tree, each link carries them once;
        on GPUs at the cited bus bandwidth for that size (:meth:`bus_bandwidth`), elsewhere at the bucket bandwidth
        plus a latency per level of the tree."""
        if len(ranks) <= 1:
            return 0.0
        if self.cited_gpu:
            nbytes = max(nbytes, 1.0)
            return nbytes / self.bus_bandwidth(ranks, nbytes)
        return nbytes / self.bucket_bandwidth(ranks) + _log2(len(ranks)) * self.collective_latency

    # ---- predicted efficiencies (GPU clusters), for the plan's report

    def efficiencies(self, choice: PlanChoice) -> dict[str, dict[str, float]]:
        """Each model call's predicted efficiency on a GPU cluster at datasheet peaks (empty elsewhere), for a reader
        to check against the cited ranges (docs/planner.md, "Calibrated GPU efficiencies"):

        - train and forward calls: ``mfu``, the fraction of peak FLOP/s the cost model prices its largest micro-batch
          at (:meth:`compute_share`), and ``achieved_mfu``, the FLOPs one rank executes in the call (a recomputed
          forward counted, as Narayanan et al.'s Table 1 counts it) over the call's seconds (compute, bubble and
          communication: :meth:`call_time`) at peak FLOP/s;
        - ``actor.generate``: ``decode_bandwidth_share``, the fraction of peak memory bandwidth its decode steps
          are priced at (:meth:`memory_share`, largest generation batch), and ``achieved_decode_share``, the bytes
          its decode steps read (weights and KV cache, this rank's ``1/tp``) over their seconds with their
          tensor-parallel all-reduces, at peak bandwidth.

        Args:
            choice: The plan and its batch sizes.
        """
        if not self.cited_gpu:
            return {}
        w, plan = self.workload, choice.plan
        out: dict[str, dict[str, float]] = {}
        for call in w.calls:
            shape = w.shape(role_of(call))
            if shape is None:
                continue
            t, p = plan.tp_degree(call), plan.pp_degree(call)
            n = len(plan.ranks(call)) // (t * p)
            if call == ACTOR.call("generate"):
                out[call] = self._decode_efficiency(choice, shape, ceil_div(w.samples, n))
                continue
            train = call.endswith(".train")
            local = ceil_div(w.samples // w.num_minibatches if train else w.samples, n)
            b = self._micro(choice, local)
            sizes = [min(b, local - i) for i in range(0, local, b)]
            passes = ((2 if w.lora_rank is not None else 3) + w.gradient_checkpointing) if train else 1
            flops = sum(passes * forward_flops(shape, size, w.sequence_length) for size in sizes)
            if train:
                flops *= w.ppo_epochs * w.num_minibatches
                if call == ACTOR.call("train") and w.recompute_old_logprobs:
                    share = ceil_div(w.samples, n)
                    flops += sum(forward_flops(shape, min(b, share - i), w.sequence_length)
                                 for i in range(0, share, b))
            seconds = sum(self.call_time(choice, call))
            out[call] = {
                "mfu": self.compute_share(shape, "train" if train else "forward", b, w.sequence_length, t, p),
                "achieved_mfu": flops / (t * p) / (seconds * self.device.flops),
            }
        return out

    def _decode_efficiency(self, choice: PlanChoice, shape: RoleShape, local: int) -> dict[str, float]:
        """``actor.generate``'s entry of :meth:`efficiencies` over a rank's ``local`` samples, its decode steps
        chunked and placed as :meth:`generate_time` does."""
        w, call = self.workload, ACTOR.call("generate")
        t, p = choice.plan.tp_degree(call), choice.plan.pp_degree(call)
        g = self.generation_rows(choice, local)
        decode = generation_op(w.generation_backend, "decode")
        moved, seconds = 0.0, 0.0
        for start in range(0, local, g):
            b = min(g, local - start)
            for turn in range(w.turns):
                context = w.turn_context(turn) + (w.generation_length + 1) // 2
                steps = w.generation_length - 1
                moved += steps * (shape.param_bytes + shape.kv_bytes_per_token * context * b) / t
                seconds += steps * (self.op_time(shape, decode, b, context, tp=t, pp=p) / t
                                    + self.tp_pass_s(choice.plan, call, shape, b))
        middle = w.turn_context(0) + (w.generation_length + 1) // 2
        return {
            "decode_bandwidth_share": self.memory_share(shape, g, middle, t),
            "achieved_decode_share": moved / seconds / self.device.memory_bandwidth if seconds else 0.0,
        }

    # ---- call times (one rank of the call's group; compute, then communication)

    def call_time(self, choice: PlanChoice, call: str) -> tuple[float, float]:
        """(compute seconds, communication seconds) of ``call`` on one of its ranks."""
        w, plan = self.workload, choice.plan
        ranks = plan.ranks(call)
        t = plan.tp_degree(call)
        # Data-parallel replicas; each of a replica's t x p ranks computes 1/t of 1/p of the layers of every op.
        n = len(ranks) // (t * plan.pp_degree(call))
        role = role_of(call)
        shape = w.shape(role)
        local = ceil_div(w.samples, n)
        sharded = shape is not None and self._sharded_call(plan, call)
        # A call's chunks of one size cost the same: price each size once (the sums below still add every chunk).
        op_time = functools.cache(functools.partial(self.op_time, shape, tp=t, pp=plan.pp_degree(call)))
        tp_pass_s = functools.cache(functools.partial(self.tp_pass_s, plan, call, shape))
        if call == ACTOR.call("generate"):
            compute, tp_comm, forwards = self.generate_time(choice, local, op_time, tp_pass_s)
            # The engine's own work per generate call: per round with partial rollouts (each round is a call).
            rounds = self.partial_price(choice, op_time, tp_pass_s).rounds if plan.partial_rollout else 1
            compute += rounds * self.engine_s("generate")
            if not sharded:
                return compute, tp_comm
            if self.unshards_once(plan):  # the hybrid engine: one gather of the weights for the whole rollout
                return compute, tp_comm + self.sharded_gather_s(ranks, shape)
            # Otherwise it gathers its weights for every forward (FSDP2's lockstep decode in generation.py).
            return compute, tp_comm + forwards * self.sharded_gather_s(ranks, shape)
        if call == REWARD.call("forward") and shape is None:
            measured = self.profile.ops.get("reward_fn") if self.profile is not None else None
            per_sample = measured["sample"][0][2] if measured else w.reward_fn_s_per_sample
            return local * per_sample, 0.0
        if call.endswith(".forward"):
            b = self._pipelined_micro(choice, call, local) or self._micro(choice, local)
            p = plan.pp_degree(call)
            micro_tokens = [min(b, local - i) * w.sequence_length for i in range(0, local, b)]
            bubble, sends, stage_steps = self.pipelined(plan, call, shape, micro_tokens, passes=1)
            compute = stage_steps + bubble * sum(
                op_time("forward", min(b, local - i), w.sequence_length) / (t * p)
                for i in range(0, local, b)
            )
            comm = sends + sum(tp_pass_s(tokens) for tokens in micro_tokens)
            if p > 1:  # the last stage's results (a float per response token) to the pipeline's other stages
                comm += self.broadcast_s(ranks[: t * p : t], 4 * local * w.response_length)
            if sharded:
                wrapper = plan.wrappers.get(role)  # none: a reference that runs the sharded actor's base (LoRA)
                measured = (self._measured_wrapper(wrapper, "forward", shape, len(ranks))
                            if wrapper is not None and t == p == 1 else None)
                per_forward = measured if measured is not None else self.sharded_gather_s(ranks[:: t * p], shape,
                                                                                            t * p)
                comm += ceil_div(local, b) * per_forward
            return compute, comm
        return self._train_time(choice, call, shape, ranks)

    def generate_time(self, choice: PlanChoice, local: int, op_time: Callable[..., float],
                      tp_pass_s: Callable[..., float]) -> tuple[float, float, int]:
        """(compute seconds, tensor-parallel seconds, forwards) of ``actor.generate`` over a rank's ``local`` samples,
        in chunks of the generation batch: per turn, the prefill of the turn's whole context
        (:meth:`~lightning_app_rlhf.planner.workload.Workload.turn_context`; no KV cache is kept across turns) and
        ``generation_length - 1`` decode steps at its middle context; then the environment's Python time per episode
        and turn (``environment_s_per_turn``). Single-turn: one prefill of the prompt, and no environment. The ops
        are the workload's backend's (:func:`~lightning_app_rlhf.planner.profiler.generation_op`), over
        :meth:`generation_rows` rows at a time.

        With ``mean_response_length`` each chunk decodes until its longest row (on the slowest replica:
        :func:`~lightning_app_rlhf.planner.lengths.decode_steps`), at the whole chunk per step or, on a backend that
        drops finished rows, at the rows still generating. With partial rollouts the simulated pool's rounds
        (:meth:`partial_price`).

        Args:
            choice: The plan and its generation batch.
            local: Samples this rank generates.
            op_time: ``(op, batch, length) -> seconds`` of one rank (the role's :meth:`op_time`).
            tp_pass_s: ``(tokens) -> seconds`` of the call's tensor-parallel communication (:meth:`tp_pass_s`).
        """
        w, t = self.workload, choice.plan.tp_degree(ACTOR.call("generate"))
        if choice.plan.partial_rollout:
            price = self.partial_price(choice, op_time, tp_pass_s)
            return price.compute, price.tp_comm, price.forwards
        g = self.generation_rows(choice, local)
        prefill, decode = (generation_op(w.generation_backend, op) for op in ("prefill", "decode"))
        compute, forwards, tp_comm = 0.0, 0, 0.0
        for start in range(0, local, g):
            b = min(g, local - start)
            for turn in range(w.turns):
                context = w.turn_context(turn)
                compute += op_time(prefill, b, context) / t
                tp_comm += tp_pass_s(b * context)
                if w.mean_response_length is not None:  # uneven lengths (single-turn): until the longest row
                    steps = 0.0
                    for weight, rows, offset in decode_steps(w.mean_response_length, w.generation_length, b,
                                                             self.generate_replicas(choice.plan),
                                                             w.generation_backend in DROPS_FINISHED_ROWS):
                        compute += weight * op_time(decode, rows, context + round(offset)) / t
                        tp_comm += weight * tp_pass_s(rows)
                        steps += weight
                    forwards += 1 + round(steps)
                    continue
                mid_context = context + (w.generation_length + 1) // 2
                compute += (w.generation_length - 1) * op_time(decode, b, mid_context) / t
                tp_comm += (w.generation_length - 1) * tp_pass_s(b)
                forwards += w.generation_length
        if w.environment_s_per_turn:  # each episode's environment steps after each of its turns
            compute += local * w.turns * w.environment_s_per_turn
        return compute, tp_comm, forwards

    def generate_replicas(self, plan: PlacementPlan) -> int:
        """Data-parallel replicas of ``actor.generate``: each generates its share of the rows."""
        call = ACTOR.call("generate")
        return max(1, len(plan.ranks(call)) // (plan.tp_degree(call) * plan.pp_degree(call)))

    def partial_price(self, choice: PlanChoice, op_time: Callable[..., float],
                      tp_pass_s: Callable[..., float]) -> PartialPrice:
        """``actor.generate`` with partial rollouts, per call in the steady state: the mean over the simulated calls
        (:func:`~lightning_app_rlhf.planner.lengths.simulate_partial`, the engine's pool driven by seeded geometric
        lengths, or every row to ``generation_length`` without ``mean_response_length``) of their rounds, each priced
        on its slowest replica (a round ends in a gather): per chunk a prefill of the prompt and the longest tokens
        so far, then decode steps until its longest row of the round, at the whole chunk or, on a backend that drops
        finished rows, at the rows still generating. Cached per replicas, degrees and generation batch.

        Args:
            choice: A partial-rollout plan and its generation batch.
            op_time: ``(op, batch, length) -> seconds`` of one rank (the actor's :meth:`op_time` for the call).
            tp_pass_s: ``(tokens) -> seconds`` of the call's tensor-parallel communication.
        """
        w, plan, call = self.workload, choice.plan, ACTOR.call("generate")
        t, n = plan.tp_degree(call), self.generate_replicas(plan)
        key = (plan.ranks(call), t, plan.pp_degree(call), choice.generation_batch)
        if key in self._partial:
            return self._partial[key]
        chunk = None if self.vllm else choice.generation_batch
        calls = simulate_partial(w.batch_size, w.num_samples, n, chunk, w.generation_length, w.partial_segment,
                                 w.mean_response_length)
        prefill, decode = (generation_op(w.generation_backend, op) for op in ("prefill", "decode"))
        drops = w.generation_backend in DROPS_FINISHED_ROWS
        compute = tp_comm = forwards = 0.0
        for rounds in calls:
            for r in rounds:
                context = w.prompt_length + r.carried
                slowest = (0.0, 0.0, 0)
                for replica in r.replicas:
                    priced = [0.0, 0.0, 0]
                    for tokens in replica:
                        b, steps = len(tokens), max(tokens)
                        mid = context + (steps + 1) // 2
                        priced[0] += op_time(prefill, b, context) / t
                        priced[1] += tp_pass_s(b * context)
                        priced[2] += steps
                        active = [sum(x > s for x in tokens) for s in range(1, steps)] if drops else [b] * (steps - 1)
                        priced[0] += sum(op_time(decode, a, mid) for a in active) / t
                        priced[1] += sum(tp_pass_s(a) for a in active)
                    slowest = max(slowest, tuple(priced), key=lambda p: p[0] + p[1])
                compute, tp_comm, forwards = compute + slowest[0], tp_comm + slowest[1], forwards + slowest[2]
        gathers = tuple((ceil_div(r.rows, n), r.max_new) for rounds in calls for r in rounds)
        price = PartialPrice(compute / len(calls), tp_comm / len(calls), round(forwards / len(calls)),
                             sum(map(len, calls)) / len(calls), gathers, len(calls))
        self._partial[key] = price
        return price

    def partial_gather_s(self, choice: PlanChoice, among: str | None) -> float:
        """Seconds per call of a partial rollout's gathers (``RoleCalls.generate_round``): after each round, its
        tokens, mask, log-probabilities and stop flags (4 tensors), ``max_new`` columns of each of a replica's rows,
        averaged over the simulated calls (:meth:`partial_price`)."""
        call = ACTOR.call("generate")
        shape = self.workload.actor
        p = choice.plan
        op_time = functools.cache(functools.partial(self.op_time, shape, tp=p.tp_degree(call), pp=p.pp_degree(call)))
        price = self.partial_price(choice, op_time, functools.cache(functools.partial(self.tp_pass_s, p, call, shape)))
        return sum(self.world_gather_s(p, call, width * (8 + 8 + 4) + 1, 4, among, rows=rows)
                   for rows, width in price.gathers) / price.calls

    def generation_rows(self, choice: PlanChoice, local: int) -> int:
        """Rows a generating rank decodes together, of its ``local`` samples: all of them on vLLM, whose engine
        schedules every request of the call itself (``generation.batch_size`` does not chunk them); else the
        choice's generation batch (None: all of them).

        Args:
            choice: The plan and its generation batch.
            local: Samples the rank generates.
        """
        return local if self.vllm else min(choice.generation_batch or local, local)

    def weight_sync_s(self) -> float:
        """Seconds a generating rank spends sending the actor's new weights to its vLLM engine (0 for the other
        backends): the profile's measured :data:`~lightning_app_rlhf.planner.profiler.VLLM_SYNC` for the actor's
        parameters, else :data:`SYNC_COPIES` copies of its weights at memory bandwidth."""
        if not self.vllm:
            return 0.0
        shape = self.workload.actor
        measured = self.profile.time(shape, VLLM_SYNC, shape.params, 0) if self.profile is not None else None
        if measured is not None:
            return measured
        return SYNC_COPIES * shape.param_bytes / (self.device.memory_bandwidth * BANDWIDTH_EFFICIENCY)

    def backend_refusal(self, plan: PlacementPlan) -> str | None:
        """Why the workload's generation backend cannot run ``plan``'s ``actor.generate`` (None: it can). A vLLM
        engine takes the actor's whole weights on each generating rank, so it refuses a tensor-parallel generate call
        and an actor sharded (FSDP2, ZeRO-3) over the ranks it generates on: it generates on DDP or ZeRO-1/2 train
        ranks, or on shadow copies.

        Args:
            plan: The placement.
        """
        if not self.vllm:
            return None
        generate = ACTOR.call("generate")
        if plan.tp_degree(generate) > 1:
            return ("generation.backend vllm runs a whole copy of the actor per generating rank, not a "
                    f"tensor-parallel one (actor.generate tp{plan.tp_degree(generate)})")
        if self._sharded_call(plan, generate):
            return (f"generation.backend vllm takes the actor's whole weights, and this plan generates on the ranks "
                    f"that shard it ({plan.wrappers[ACTOR.name]})")
        return None

    def _train_time(
        self, choice: PlanChoice, call: str, shape: RoleShape, ranks: tuple[int, ...]
    ) -> tuple[float, float]:
        plan = choice.plan
        t, p = plan.tp_degree(call), plan.pp_degree(call)
        # DP x TP x PP: n replicas of t x p ranks (TP innermost, then the stages); the wrapper works over the n.
        w, n = self.workload, len(ranks) // (t * p)
        dp_ranks = ranks[:: t * p]  # one (TP rank, stage)'s data-parallel group
        wrapper = WRAPPERS[plan.wrappers[role_of(call)]]
        local = ceil_div(w.samples // w.num_minibatches, n)
        b = self._pipelined_micro(choice, call, local) or self._micro(choice, local)
        steps = w.ppo_epochs * w.num_minibatches
        micro_steps = ceil_div(local, b)
        op_time = functools.cache(functools.partial(self.op_time, shape, tp=t, pp=p))  # as in call_time: per size
        tp_pass_s = functools.cache(functools.partial(self.tp_pass_s, plan, call, shape))
        micro_tokens = [min(b, local - i) * w.sequence_length for i in range(0, local, b)]
        bubble, sends, stage_steps = self.pipelined(plan, call, shape, micro_tokens, passes=2)
        compute = stage_steps + bubble * sum(
            op_time("train", min(b, local - i), w.sequence_length) / (t * p) for i in range(0, local, b)
        )
        # Forward and backward (and the recomputed forward with gradient checkpointing) all-reduce activations.
        passes = 2 + w.gradient_checkpointing
        tp_comm = sends + sum(tp_pass_s(tokens, passes) for tokens in micro_tokens)
        trained = ceil_div(w.trainable_params(role_of(call)), t * p)
        local_params = ceil_div(trained, n) if wrapper.shards_optimizer and n > 1 else trained
        compute += op_time("optimizer", local_params, 0)
        trained_bytes = trained * shape.dtype_bytes
        # What the wrapper adds to a step of one micro-batch, where the profile measured it on a group of n
        # (measure_wrapper_steps: its gathers, reductions, hooks and engine step as they run here).
        measured = self._measured_wrapper(wrapper.name, "step", shape, n) if t == p == 1 else None
        if wrapper.shards_params:  # gather for forward and backward, reduce-scatter grads, per micro-batch
            per_micro = 2 * self.sharded_gather_s(dp_ranks, shape, t * p) + self.all_gather_s(dp_ranks, trained_bytes)
            if measured is not None:
                comm = measured + (micro_steps - 1) * per_micro
            else:
                comm = micro_steps * per_micro
                comm += self.all_reduce_s(ranks, 8)  # the gradient norm of sharded gradients (clip_grad_norm_)
        else:  # DDP all-reduce; ZeRO-1/2 reduce-scatter + all-gather of updated weights: the same volume
            comm = measured if measured is not None else self.all_reduce_s(dp_ranks, trained_bytes)
        stats = self.all_reduce_s(ranks, 64)  # once per call: the sum of the statistics over the group
        compute, comm = steps * (compute + self.engine_s("train_step")), steps * (comm + tp_comm) + stats
        if call == ACTOR.call("train") and w.recompute_old_logprobs:  # before the update: the trainer's log-probs
            share = ceil_div(w.samples, n)
            forward_tokens = [min(b, share - i) * w.sequence_length for i in range(0, share, b)]
            forward_bubble, forward_sends, forward_steps = self.pipelined(plan, call, shape, forward_tokens, passes=1)
            compute += forward_steps + forward_bubble * sum(
                op_time("forward", min(b, share - i), w.sequence_length) / (t * p) for i in range(0, share, b))
            comm += forward_sends
            if wrapper.shards_params:
                comm += ceil_div(share, b) * self.sharded_gather_s(dp_ranks, shape, t * p)
            comm += self.all_reduce_s(ranks, 4 * w.samples * w.response_length)
        return compute, comm

    def engine_s(self, phase: str) -> float:
        """Seconds of the engine's own work (Python, bookkeeping, small tensor ops) beyond the priced calls, per
        ``generate`` call, per rollout on each rank (``score``) or per optimizer step (``train_step``): what
        :func:`calibrate_engine` measured on one process; 0 without that measurement."""
        engine = self.profile.ops.get(ENGINE_OPS) if self.profile is not None else None
        return engine[phase][0][2] if engine and phase in engine else 0.0

    def _measured_wrapper(self, wrapper: str, op: str, shape: RoleShape, group: int) -> float | None:
        """Seconds ``wrapper`` adds to one optimizer step (``op="step"``) or one forward (``"forward"``) of
        ``shape`` on ``group`` ranks, where the profile measured it
        (:func:`~lightning_app_rlhf.planner.profiler.measure_wrapper_steps`: full fine-tuning only)."""
        if self.profile is None or group < 2 or self.workload.lora_rank is not None:
            return None
        return self.profile.time(shape, wrapper_op(wrapper, op), group, 1)

    def reallocate_time(self, plan: PlacementPlan, role: str) -> tuple[tuple[int, ...], float]:
        """(ranks involved, seconds) to bring a trained role's new weights to its other layouts, as the engine does
        after every update: the shadow copies get a broadcast from the train leader (after a gather of the full
        weights when the training layout shards them: FSDP2, ZeRO-3 or tensor parallel); then every tensor-parallel
        copy (:func:`~lightning_app_rlhf.engine.iteration.relayout_calls`) takes its ``1/t`` slice, on the train ranks from
        the full weights (gathered again when sharded), elsewhere from the shadow (a local copy). No ranks when every
        call runs on the trained weights as they are."""
        shape = self.workload.shape(role)
        shadows = plan.shadow_ranks(role)
        relayout = relayout_calls(plan, role)
        if (not shadows and not relayout) or shape is None:
            return (), 0.0
        train = plan.ranks(f"{role}.train")
        moved = self.workload.trainable_params(role) * shape.dtype_bytes  # only trainable parameters move
        sharded = self._split_training(plan, role)
        local_copy_bandwidth = self.device.memory_bandwidth * BANDWIDTH_EFFICIENCY
        seconds, ranks = 0.0, set()
        gather_s = self._full_weights_gather_s(plan, role, shape, moved)
        if shadows:
            seconds += self._shadow_broadcast_s(plan, role, shape)
            ranks |= {train[0], *shadows}
            if sharded:
                seconds += gather_s  # full_tensor() of every trainable shard, or the stages' tensors by name
                ranks |= set(train)
        for call in relayout:
            on_train = set(plan.ranks(call)) & set(train)
            if on_train and sharded:
                seconds += gather_s
                ranks |= set(train)
            seconds += moved / plan.tp_degree(call) / local_copy_bandwidth  # each rank keeps its slice
            ranks |= set(plan.ranks(call))
        return tuple(sorted(ranks)), seconds

    def _full_weights_gather_s(self, plan: PlacementPlan, role: str, shape: RoleShape, moved: float) -> float:
        """Seconds to gather ``role``'s whole trained weights (``moved`` bytes) on its train ranks: a pipelined role's
        stages broadcast their tensors by name over each pipeline (``gather_full_state_dict``, as the profile measured
        it on a pipeline of that size), a sharded one all-gathers its shards."""
        train, p = plan.ranks(f"{role}.train"), plan.pp_degree(f"{role}.train")
        measured = self.profile.time(shape, "pipeline_gather", p, 1) if self.profile is not None and p > 1 else None
        return measured if measured is not None else self.all_gather_s(train, moved)

    def world_gather_s(self, plan: PlacementPlan, call: str, bytes_per_row: int, tensors: int = 1,
                       among: str | None = None, rows: int | None = None) -> float:
        """``Placement.gather_to_world``: every rank of the world (or of the group of the call ``among``: a
        free-running generation side) all-gathers the shapes, then each of the call's ``tensors`` result tensors,
        padded to the largest shard (one collective each) of ``rows`` rows (None: the rollout's share of a rank of
        the call)."""
        group = plan.ranks(among) if among is not None else tuple(range(plan.world_size))
        rows = ceil_div(self.workload.samples, len(plan.ranks(call))) if rows is None else rows
        payload = self.all_gather_s(group, len(group) * rows * bytes_per_row)
        return payload + tensors * self.all_gather_s(group, 0)

    def publish_time(self, plan: PlacementPlan, role: str) -> float:
        """Free-running: seconds the train ranks spend posting ``role``'s new weights (``Placement.publish_weights``):
        the gather of the full trainable weights where the training layout shards them, and the leader's copy of
        them into flat buckets. The broadcast itself runs in the background; the generation side pays for it when it
        takes the version (:meth:`take_time`)."""
        shape = self.workload.shape(role)
        if shape is None:
            return 0.0
        train = plan.ranks(f"{role}.train")
        moved = self.workload.trainable_params(role) * shape.dtype_bytes
        sharded = self._split_training(plan, role)
        gather = self.all_gather_s(train, moved) if sharded else 0.0
        return gather + moved / (self.device.memory_bandwidth * BANDWIDTH_EFFICIENCY)

    def take_time(self, plan: PlacementPlan) -> float:
        """Free-running: seconds the generation ranks spend taking one published version (they join the train
        leaders' bucketed broadcasts of every published role, in turn): the shadows' part of
        :meth:`reallocate_time`. The schedule's steady state takes one version per iteration."""
        seconds = 0.0
        for role in published_roles(plan):
            shape = self.workload.shape(role)
            if shape is not None:
                seconds += self._shadow_broadcast_s(plan, role, shape)
        return seconds

    def _shadow_broadcast_s(self, plan: PlacementPlan, role: str, shape: RoleShape) -> float:
        """The bucketed broadcast of ``role``'s trainable weights from its train leader to its shadow copies."""
        moved = self.workload.trainable_params(role) * shape.dtype_bytes  # only trainable parameters move
        leader = plan.ranks(f"{role}.train")[0]
        ranks = (leader, *plan.shadow_ranks(role))
        buckets = ceil_div(moved, REALLOCATION_BUCKET_BYTES)
        if self.cited_gpu:  # one broadcast per bucket, each at the bandwidth of its size (latency included)
            return buckets * self.broadcast_s(ranks, moved / buckets)
        return self.broadcast_s(ranks, moved) + buckets * self.collective_latency

    def experience_bytes(self) -> int:
        """Bytes of the payload a free-running generation leader sends each training rank per iteration
        (``torch.save`` of the experience, the rollout and the scores), per sample: the sequences and their
        attention mask (int64) twice (the experience's and the rollout's), the response mask (int64) and the
        behaviour log-probabilities twice, the reference log-probabilities, values, advantages and returns (float32
        per response token), the stop flag and the score."""
        w = self.workload
        per_sample = 2 * (16 * w.sequence_length + 12 * w.response_length) + 16 * w.response_length + 5
        return w.samples * per_sample

    def receive_s(self, plan: PlacementPlan) -> float:
        """Free-running: a training rank's receipt of the experience (``Placement.receive_payload``): the leader sends
        it to every training rank, point to point (its size, then its bytes), over its one link."""
        leader, train = plan.generation_ranks[0], plan.training_ranks
        if self.cited_gpu:  # each payload and its size message at the bandwidth of their sizes (latency included)
            payload, size = self.experience_bytes(), 8.0
            ranks = (leader, *train)
            return (len(train) * payload / self.bus_bandwidth(ranks, payload)
                    + 2 * size / self.bus_bandwidth(ranks, size))
        link = self.cluster.bandwidth((leader, *train))
        return len(train) * self.experience_bytes() / link + 2 * self.collective_latency

    # ---- the schedule

    def tasks(self, choice: PlanChoice) -> list[Task]:
        """The engine's task graph for :func:`unrolled_iterations` iterations, in each rank's program order: the
        steps of :func:`~lightning_app_rlhf.engine.iteration.iteration_steps` (the engine's recipe, checked against
        traced runs) with the workload's generation rounds, each priced by :meth:`step_tasks` and named ``...#i`` in
        iteration ``i``. A free-running plan's two sides meet only through dependencies (:attr:`Task.after`): the
        training side's receipt of rollout ``i`` waits for its send, and the generation side's take at iteration
        ``i`` for the publishing of version ``i - k`` (by training iteration ``i - k - 1``). On vLLM each iteration's
        first ``actor.generate`` is preceded by the sync of the new weights to the engines (:data:`SYNC_TASK`,
        :meth:`weight_sync_s`): once per iteration, whatever its generation rounds or turns."""
        plan = choice.plan
        self.check_plan(plan)
        priced: dict[Step, list[Task]] = {}  # a step costs the same in every iteration: price it once
        tasks: list[Task] = []
        named: dict[tuple[int, str], list[str]] = {}  # (iteration, step kind) -> its tasks' names, for dependencies
        for i in range(unrolled_iterations(plan)):
            synced = not self.vllm  # a vLLM engine takes the new weights before the iteration's first generate call
            for step in iteration_steps(plan, first=i == 0, rounds=self.workload.generation_rounds):
                if not synced and step.kind == "call" and step.name == ACTOR.call("generate"):
                    tasks.append(Task(f"{SYNC_TASK}#{i}", step.ranks, self.weight_sync_s()))
                    synced = True
                if step not in priced:
                    priced[step] = self.step_tasks(choice, step)
                if step.kind == "receive":
                    after = tuple(named.get((i, "send"), ()))
                elif step.kind == "take":
                    after = tuple(named.get((i - plan.schedule_staleness - 1, "publish"), ()))
                else:
                    after = ()
                for t in priced[step]:
                    tasks.append(Task(f"{t.name}#{i}", t.ranks, t.seconds, t.compute, after))
                    named.setdefault((i, step.kind), []).append(tasks[-1].name)
        return tasks

    def step_tasks(self, choice: PlanChoice, step: Step) -> list[Task]:
        """The tasks of one step: a call's compute (then its communication, on the same ranks), a gather of a call's
        result, a statistics or learning-rate broadcast (each a collective of the step's ranks: the world, or a
        free-running side's group), a reallocation; free-running: a role's publishing (the train ranks post it) and
        taking (the shadows receive it), and the experience's send (posted) and receipt (the transfer)."""
        plan, w = choice.plan, self.workload
        if step.kind == "call":
            compute, comm = self.call_time(choice, step.name)
            tasks = [Task(step.name, step.ranks, compute)]
            return tasks + [Task(f"{step.name}:comm", step.ranks, comm, compute=False)] if comm else tasks
        if step.kind == "gather":
            # Bytes per sample of each call's gathered result: the rollout's responses, response mask (int64),
            # logprobs and stop flag (4 tensors); multi-turn also the prompts the environments rendered and their
            # mask (int64), the response's attention (int64), the per-token turn rewards and 5 episode statistics
            # (float32): 9 tensors. One float per token for the reference's logprobs and the critic's values; one
            # score.
            t_gen = w.response_length
            rollout = ((t_gen * (8 + 8 + 4) + 1, 4) if w.turns == 1
                       else (t_gen * (8 + 8 + 4 + 8 + 4) + 16 * w.prompt_length + 1 + 5 * 4, 9))
            per_row = {ACTOR.call("generate"): rollout, REWARD.call("forward"): (4, 1)}
            nbytes, tensors = per_row.get(step.name, (t_gen * 4, 1))
            name = "gather.rollout" if step.name == ACTOR.call("generate") else f"gather.{role_of(step.name)}"
            if step.name == ACTOR.call("generate") and plan.partial_rollout:  # a gather after each round
                seconds = self.partial_gather_s(choice, step.among)
            else:
                seconds = self.world_gather_s(plan, step.name, nbytes, tensors, step.among)
            tasks = [Task(name, step.ranks, seconds, compute=False)]
            if step.name == ACTOR.call("generate") and self.engine_s("score"):
                # The engine's own work on the rollout, on every rank that gathers it (the Python and small tensor
                # ops of selecting, shaping and estimating), as measured on one process.
                tasks.append(Task("engine.rollout", step.ranks, self.engine_s("score")))
            return tasks
        if step.kind == "broadcast":
            nbytes = 64 if step.what == "stats" else 24  # a few float64 statistics; three learning-rate values
            name = f"{role_of(step.name)}.{step.what}"
            return [Task(name, step.ranks, self.broadcast_s(step.ranks, nbytes), compute=False)]
        if step.kind == "reallocate":
            ranks, seconds = self.reallocate_time(plan, step.name)
            return [Task(f"{step.name}.reallocate", ranks, seconds, compute=False)] if ranks else []
        if step.kind in ("publish", "take", "send", "receive"):  # free-running: a task even where free, so that
            # the other side's dependencies find it
            return [Task(f"{step.name}.{step.kind}", step.ranks, self.free_running_s(plan, step), compute=False)]
        raise ValueError(f"Unknown step kind {step.kind!r}.")

    def free_running_s(self, plan: PlacementPlan, step: Step) -> float:
        """Seconds of a free-running step on its ranks: a role's ``publish`` (:meth:`publish_time`) or ``take``
        (:meth:`take_time`), the experience's ``send`` (the leader serialises it, at memory bandwidth, and posts the
        sends) or ``receive`` (:meth:`receive_s`).

        Args:
            plan: A free-running plan.
            step: One of its ``publish``, ``take``, ``send`` or ``receive`` steps.
        """
        if step.kind == "publish":
            return self.publish_time(plan, step.name)
        if step.kind == "take":
            return self.take_time(plan)
        if step.kind == "send":
            return self.experience_bytes() / (self.device.memory_bandwidth * BANDWIDTH_EFFICIENCY)
        return self.receive_s(plan)

    def evaluate(self, choice: PlanChoice) -> Estimate:
        """Predict time and memory of ``choice``; a plan that does not fit is rejected with its breakdown."""
        rows = self.memory(choice)
        call_s = {}
        for name in self.workload.calls:
            compute, comm = self.call_time(choice, name)
            call_s[name] = compute + comm
        call_s["reallocate"] = sum(self.reallocate_time(choice.plan, r)[1] for r in self.workload.trainable)
        if self.vllm:
            call_s["weight_sync"] = self.weight_sync_s()
        refusal = self.backend_refusal(choice.plan)
        rejected = refusal or self.check_memory(rows)
        tasks = self.tasks(choice)
        spans = simulate(tasks, self.cluster)
        iteration = [int(t.name.rsplit("#", 1)[1]) for t in tasks]
        first, last = steady_iterations(choice.plan)
        ends = [max(e for k, (_, e) in zip(iteration, spans) if k == i) for i in range(last + 1)]
        steady = (ends[last] - ends[first]) / (last - first)
        timeline = [
            (t.name.rsplit("#", 1)[0], t.ranks, s - ends[last - 1], e - ends[last - 1])
            for t, k, (s, e) in zip(tasks, iteration, spans)
            if k == last
        ]
        return Estimate(choice, steady, self.workload.samples / steady, call_s, rows, self.capacity, rejected, timeline,
                        refused=refusal is not None,
                        trainer_idle_share=idle_share(tasks, spans, choice.plan.training_ranks[-1],
                                                      (ends[first], ends[last])))


@dataclass(frozen=True)
class PartialPrice:
    """``actor.generate`` with partial rollouts, per call in the steady state (:meth:`CostModel.partial_price`)."""

    compute: float
    """Compute seconds of the slowest replica, summed over the rounds."""
    tp_comm: float
    """Tensor-parallel seconds."""
    forwards: int
    """Forwards (prefills and decode steps) of the slowest replica."""
    rounds: float
    """Rounds per call (each a generate call of the engine and a gather)."""
    gathers: tuple[tuple[int, int], ...]
    """``(rows of the largest shard, columns)`` of every simulated round's gather."""
    calls: int
    """Calls simulated (the gathers' count is over all of them)."""


def idle_share(tasks: list[Task], spans: list[tuple[float, float]], rank: int, window: tuple[float, float]) -> float:
    """The share of ``window`` in which ``rank`` runs none of ``tasks`` (their ``spans``): its waits, for a rollout
    or for the other ranks of a collective."""
    start, end = window
    if end <= start:
        return 0.0
    busy = sum(max(0.0, min(e, end) - max(s, start)) for t, (s, e) in zip(tasks, spans) if rank in t.ranks)
    return max(0.0, 1.0 - busy / (end - start))


ENGINE_OPS = "engine"
"""The profile's entry of the engine's own work per phase (:func:`calibrate_engine`): ``generate``, ``score`` and
``train_step`` points ``[1, 1, seconds]``."""


def calibrate_engine(profile: Profile, cluster: Cluster, workload: Workload, plan: PlacementPlan,
                     measured: dict[str, float]) -> Profile:
    """``profile`` with the engine's own work per phase: what a few iterations of this workload under ``plan`` took on
    ``cluster`` (this machine's processes) beyond the cost model's price of that plan, in each phase the engine logs on
    rank 0 (``time/generate_s``, ``time/score_s``, ``time/train_s``): its Python and small tensor ops, and what the
    processes lose to each other beyond the compute shares. Generation's is charged per generate call, scoring's per
    rollout on every rank that gathers it, training's per optimizer step (of every trained role, epoch and minibatch);
    never below 0. One plan measured prices every plan: these are costs per call, rollout and step, not per plan.

    On this project's 2-core machine the demo's tiny GPT-2 on 2 processes spends about half of its scoring phase and a
    sixth of its training outside what the profile and the collectives price (docs/planner.md, "Calibration on this
    CPU"); on one process the profile prices every phase within a millisecond.

    Args:
        profile: The ops of this machine (:func:`~lightning_app_rlhf.planner.profiler.profile_machine`).
        cluster: The processes the plan ran on, with their measured compute shares.
        workload: The workload of the run that was measured.
        plan: The plan it ran.
        measured: Median seconds per iteration of each phase on rank 0: ``generate``, ``score``, ``train``.
    """
    bare = Profile(profile.hardware, profile.device, {k: v for k, v in profile.ops.items() if k != ENGINE_OPS})
    predicted = predicted_phases(CostModel(cluster, workload, bare).evaluate(PlanChoice(plan)))
    steps = len(workload.trainable) * workload.ppo_epochs * workload.num_minibatches
    # The residual is work at full speed: the reference's ranks computed it beside each other, each at its node's
    # share of the cores (the cost model slows it down by the same share wherever it prices it).
    share = min(cluster.compute_share(sum(1 for r in range(plan.world_size) if cluster.node_of(r) == node))
                for node in range(cluster.nodes))
    residual = {
        "generate": (measured["generate"] - predicted["generate"]) * share,
        "score": (measured["score"] - predicted["score"]) * share,
        "train_step": (measured["train"] - predicted["train"]) / max(steps, 1) * share,
    }
    ops = {**bare.ops, ENGINE_OPS: {phase: [[1, 1, max(seconds, 0.0)]] for phase, seconds in residual.items()}}
    return Profile(profile.hardware, profile.device, ops)


PHASES = ("generate", "score", "train", "reallocate")
"""The phases of an iteration the engine logs as ``time/{phase}_s`` on rank 0."""


def phase_of(task: str) -> str:
    """The engine's logged phase a cost-model task belongs to."""
    if task.startswith("actor.generate"):
        return "generate"
    if task.endswith((".reallocate", ".publish", ".take")):  # free-running: the weights published and taken
        return "reallocate"
    if ".train" in task or task.endswith((".stats", ".lr")):  # the update, its statistics and its schedulers
        return "train"
    return "score"  # the rollout gather, the engine's work on it, the forwards and their gathers


def predicted_phases(estimate: Estimate, rank: int = 0) -> dict[str, float]:
    """Seconds of each phase on ``rank`` in the predicted steady-state iteration: from the end of the previous
    phase (waits included, as the engine measures them) to the end of its last task on that rank."""
    mine = sorted((t for t in estimate.timeline if rank in t[1]), key=lambda t: t[2])
    phases, previous = {}, mine[0][2] if mine else 0.0
    for phase in PHASES:
        ends = [end for name, _, _, end in mine if phase_of(name) == phase]
        phases[phase] = max(ends) - previous if ends else 0.0
        previous = max(ends, default=previous)
    return phases


def unrolled_iterations(plan: PlacementPlan) -> int:
    """Iterations :meth:`CostModel.tasks` unrolls for ``plan``: :data:`UNROLLED_ITERATIONS`, and for a free-running
    plan twice its run-ahead more (:func:`steady_iterations`)."""
    return UNROLLED_ITERATIONS + 2 * plan.run_ahead


def steady_iterations(plan: PlacementPlan) -> tuple[int, int]:
    """``(first, last)``: the unrolled iterations whose ends bound the steady state of ``plan``'s schedule, whose
    time per iteration is ``(end of last - end of first) / (last - first)``.

    The fixed schedule is lockstep: from the 2nd iteration's end (the first one trains nothing with a staleness
    bound) to the last's. A free-running plan is a pipeline of two sides, the generation side up to ``r =
    run_ahead`` iterations ahead: its first ``r`` iterations fill the pipeline (the generation side runs alone, then
    beside the training side, until it waits for the weights), and its training side's last ``r`` iterations drain
    it (no generation beside them: faster than the steady state); both are left out."""
    r = plan.run_ahead
    return 1 + r, UNROLLED_ITERATIONS - 1 + r


def forward_flops(shape: RoleShape, batch: int, length: int) -> float:
    """Matmul FLOPs of a forward pass over ``batch`` sequences of ``length`` tokens (causal attention)."""
    return (
        2 * shape.matmul_params * batch * length + 2 * shape.layers * shape.hidden * length * length * batch
    )


def decode_flops(shape: RoleShape, batch: int, context: int) -> float:
    """FLOPs of one decode step: every weight once per sequence, attention over ``context`` cached tokens."""
    return 2 * shape.matmul_params * batch + 4 * shape.layers * shape.hidden * context * batch


def _shards_params(wrapper: str | None) -> bool:
    """Whether the registry's ``wrapper`` (None: none) leaves no rank the full parameters (FSDP2, ZeRO-3)."""
    return wrapper is not None and WRAPPERS[wrapper].shards_params


def _log2(n: int) -> int:
    return (n - 1).bit_length()


# ---------------------------------------------------------------- discrete-event schedule


@dataclass(frozen=True)
class Task:
    """Work one group of ranks does together."""

    name: str
    ranks: tuple[int, ...]
    seconds: float
    """Duration at full speed."""
    compute: bool = True
    """Whether it computes (its seconds are one rank's alone, at full speed) or communicates (its seconds are the
    collective's, measured with its own ranks busy); either way its ranks share a CPU node's cores with the other
    busy ranks (:func:`_shared_speeds`)."""
    after: tuple[str, ...] = ()
    """Names of tasks it also waits for, on other ranks (a free-running plan's two sides meet only this way)."""


def simulate(tasks: list[Task], cluster: Cluster) -> list[tuple[float, float]]:
    """(start, end) of every task. Each rank runs its tasks in list order; a task starts when all its ranks reach
    it (so tasks on disjoint ranks overlap and tasks sharing a rank serialise) and the tasks it names in
    :attr:`Task.after` have ended. While more ranks of a node are busy than it has cores, tasks slow down
    (processor sharing, :func:`_shared_speeds`)."""
    queues: dict[int, list[int]] = {}
    for i, task in enumerate(tasks):
        if not task.ranks:
            raise ValueError(f"Task {task.name!r} has no ranks.")
        for r in task.ranks:
            queues.setdefault(r, []).append(i)
    heads = dict.fromkeys(queues, 0)
    # A task starts once each of its ranks has it next and each task it comes after has ended: count down both.
    waiting_for = [len(set(t.ranks)) for t in tasks]
    dependents = _dependents(tasks, waiting_for)
    ready: list[int] = []
    for queue in queues.values():
        waiting_for[queue[0]] -= 1
        if not waiting_for[queue[0]]:
            ready.append(queue[0])
    remaining = [t.seconds for t in tasks]
    spans: list[tuple[float, float]] = [(0.0, 0.0)] * len(tasks)
    running: set[int] = set()
    done = 0
    now = 0.0
    while done < len(tasks):
        for i in ready:
            running.add(i)
            spans[i] = (now, now)
        ready = []
        if not running:
            raise RuntimeError(
                "The schedule deadlocked: tasks wait for each other in a different order on different ranks."
            )
        if cluster.cores_per_node is None:  # a core per rank (GPUs): every task runs at full speed
            speed = dict.fromkeys(running, 1.0)
        else:
            speed = _shared_speeds(tasks, running, cluster)
        step = min(remaining[i] / speed[i] for i in running)
        now += step
        for i in sorted(running):
            remaining[i] -= step * speed[i]
            if remaining[i] <= 1e-12 * max(1.0, tasks[i].seconds):
                running.discard(i)
                spans[i] = (spans[i][0], now)
                done += 1
                for following in dependents.get(i, ()):
                    waiting_for[following] -= 1
                    if not waiting_for[following]:
                        ready.append(following)
                for r in tasks[i].ranks:
                    heads[r] += 1
                for r in dict.fromkeys(tasks[i].ranks):  # each rank moves on to its next task
                    if heads[r] < len(queues[r]):
                        following = queues[r][heads[r]]
                        waiting_for[following] -= 1
                        if not waiting_for[following]:
                            ready.append(following)
    return spans


def _shared_speeds(tasks: list[Task], running: set[int], cluster: Cluster) -> dict[int, float]:
    """Speed of each running task on CPU nodes. A rank waiting for a task's other ranks is idle (gloo does not
    spin), but a running task's ranks are all busy: a computing one at its node's share of the cores for that many
    busy ranks; a collective in progress copies and reduces on the CPU too (DDP's bucket all-reduce, the result
    gathers), and its time was measured with just its own ranks busy (the latency of fresh processes, a DDP step on
    its group), so it slows only by the ranks beyond them: its share for all busy ranks over its share for its own.
    On the lockstep schedule collectives mostly run alone (world gathers, one group waiting for another); a
    free-running side's gathers and updates run beside the other side's computing, and take about twice as long on
    4 processes and 2 cores (the generation side's scoring: 50 ms predicted, 47-50 ms measured)."""
    busy: dict[int, int] = {}
    for i in running:
        for r in tasks[i].ranks:
            busy[cluster.node_of(r)] = busy.get(cluster.node_of(r), 0) + 1
    speed = {}
    for i in running:
        task = tasks[i]
        if task.compute:
            speed[i] = min(cluster.compute_share(busy[cluster.node_of(r)]) for r in task.ranks)
            continue
        own: dict[int, int] = {}
        for r in task.ranks:
            own[cluster.node_of(r)] = own.get(cluster.node_of(r), 0) + 1
        # (at most full speed: measured shares can rise by a little with more busy ranks)
        speed[i] = min(min(1.0, cluster.compute_share(busy[node]) / cluster.compute_share(n))
                       for node, n in own.items())
    return speed


def _dependents(tasks: list[Task], waiting_for: list[int]) -> dict[int, list[int]]:
    """Task index -> the tasks that name it in :attr:`Task.after`; adds each such dependency to ``waiting_for``."""
    after = [i for i, t in enumerate(tasks) if t.after]
    if not after:  # the common case: ranks alone order the tasks
        return {}
    index: dict[str, int] = {}
    for i, task in enumerate(tasks):
        if index.setdefault(task.name, i) != i:
            index[task.name] = -1  # ambiguous: only an error if a task depends on it
    dependents: dict[int, list[int]] = {}
    for i in after:
        for name in dict.fromkeys(tasks[i].after):
            j = index.get(name)
            if j is None or j < 0:
                raise ValueError(f"Task {tasks[i].name!r} waits for {name!r}, which "
                                 f"{'is no task' if j is None else 'names several tasks'}.")
            dependents.setdefault(j, []).append(i)
            waiting_for[i] += 1
    return dependents
