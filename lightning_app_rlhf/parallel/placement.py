"""``Placement``: a :class:`PlacementPlan` bound to process groups on this rank. Plain torch.distributed.

It answers "does this rank run call X", splits a global batch into the shard this rank computes, gathers the
shards of a call back to every rank, and reallocates a trainable role's weights to its shadow copies.
With a world of one rank every operation is local and no process group is needed.
"""

from __future__ import annotations

import contextlib
import datetime
import io
import uuid
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from lightning_app_rlhf.core.wrapper_names import SHARDED_WRAPPERS
from lightning_app_rlhf.parallel.failures import DEFAULT_TIMEOUT, named_failure
from lightning_app_rlhf.parallel.pipeline import create_pipeline_groups
from lightning_app_rlhf.parallel.plan import CALLS, PlacementPlan, flattening_plan


def world_collective(rank: int, what: str, timeout: datetime.timedelta) -> contextlib.AbstractContextManager[None]:
    """:func:`named_failure` around a collective of the whole world that Lightning asks of a placement strategy
    (``what``: a barrier, a broadcast or a reduce, for a checkpoint, a logged metric or a callback)."""
    return named_failure(f"Rank {rank}: the {what} of the whole world (Lightning's, for a checkpoint, a logged metric "
                         "or a callback)", timeout)


@dataclass
class TensorSpec:
    """What every rank must know about a tensor that only some ranks produce."""

    dtype: torch.dtype
    ndim: int
    pad_value: float = 0


class Placement:
    """A plan bound to this rank: group membership, batch sharding, gathers and weight reallocation.

    Args:
        plan: The placement plan.
        rank: This process's global rank.
        device: Where this rank's tensors live.
        groups: Call name -> process group of its ranks (None when the world has one rank).
        reallocation_groups: Trainable role -> group of its train leader plus its shadow ranks.
        tp_groups: Call name -> the group of this rank's tensor-parallel replica, for the calls with a degree above 1
            that this rank runs.
        dp_groups: Train call name -> the group of the ranks that hold this rank's tensor slice in every replica (the
            data dimension of its 2-D mesh), for the train calls with a tensor-parallel degree that this rank runs.
        pipelines: Call name -> this rank's pipeline (:class:`~lightning_app_rlhf.parallel.pipeline.PipelineGroup`),
            for the calls with a pipeline-parallel degree that this rank runs.
        stage_groups: Pipelined train call name -> the group of the ranks that hold this rank's stage in every
            pipeline (None with one pipeline): their gradients are summed over it.
        namespace: The same string on every rank, different for every placement created: a free-running plan's keys
            in the job's store start with it, so that a later fit in the same processes reads none of this one's.
    """

    def __init__(
        self,
        plan: PlacementPlan,
        rank: int = 0,
        device: torch.device | None = None,
        groups: dict[str, dist.ProcessGroup | None] | None = None,
        reallocation_groups: dict[str, dist.ProcessGroup | None] | None = None,
        timeout: datetime.timedelta = DEFAULT_TIMEOUT,
        tp_groups: dict[str, dist.ProcessGroup] | None = None,
        dp_groups: dict[str, dist.ProcessGroup] | None = None,
        namespace: str = "",
        pipelines: dict[str, Any] | None = None,
        stage_groups: dict[str, dist.ProcessGroup | None] | None = None,
    ) -> None:
        self.plan = plan
        self.namespace = namespace
        self.timeout = timeout
        self.rank = rank
        self.device = device or torch.device("cpu")
        self.groups = groups or {}
        self.reallocation_groups = reallocation_groups or {}
        self.tp_groups = tp_groups or {}
        self.dp_groups = dp_groups or {}
        self.pipelines = pipelines or {}
        self.stage_groups = stage_groups or {}

    @classmethod
    def single_process(cls, device: torch.device | None = None, roles: tuple[str, ...] | None = None) -> Placement:
        """Every call of ``roles`` (default: all) on one rank."""
        return cls(flattening_plan(1, roles=roles) if roles else flattening_plan(1), 0, device)

    @property
    def distributed(self) -> bool:
        return self.plan.world_size > 1

    def runs(self, call: str) -> bool:
        return call in self.plan.calls and self.rank in self.plan.ranks(call)

    def holds(self, role: str) -> bool:
        return self.plan.holds(role, self.rank)

    def sharded_here(self, role: str) -> bool:
        """Whether this rank holds only a shard of ``role`` (FSDP2 / ZeRO-3 over more than one rank)."""
        call = f"{role}.train"
        return self.plan.wrappers.get(role) in SHARDED_WRAPPERS and self.runs(call) and self.group_size(call) > 1

    def group_size(self, call: str) -> int:
        return len(self.plan.ranks(call))

    def group_rank(self, call: str) -> int:
        return self.plan.ranks(call).index(self.rank)

    def leader(self, call: str) -> int:
        """The global rank that speaks for a call's group (its lowest rank)."""
        return self.plan.ranks(call)[0]

    def shard(self, call: str, batch_size: int) -> slice:
        """The contiguous part of a global batch that this rank computes for ``call``: its tensor-parallel replica's
        part, the same on every rank of the replica (one part per rank without tensor parallelism)."""
        bounds = torch.linspace(0, batch_size, self.replicas(call) + 1).round().long().tolist()
        i = self.replica(call)
        return slice(bounds[i], bounds[i + 1])

    # ---- tensor parallelism (PlacementPlan.tp) ----

    def tp_degree(self, call: str) -> int:
        """Ranks per tensor-parallel replica of ``call`` (1: every rank is its own replica)."""
        return self.plan.tp_degree(call)

    def pp_degree(self, call: str) -> int:
        """Pipeline stages of ``call`` (1: not pipelined)."""
        return self.plan.pp_degree(call)

    def replica_width(self, call: str) -> int:
        """Ranks per data-parallel replica of ``call``: a tensor-parallel replica, or a whole pipeline (the plan
        refuses both on one call)."""
        return self.tp_degree(call) * self.pp_degree(call)

    def replicas(self, call: str) -> int:
        """Data-parallel replicas of ``call``: its group size over its tensor- (or pipeline-) parallel degree."""
        return self.group_size(call) // self.replica_width(call)

    def replica(self, call: str) -> int:
        """This rank's replica of ``call``: replica ``i`` is the call's ranks ``[i * w, (i + 1) * w)``, ``w`` its
        :meth:`replica_width` (a pipeline's stages are consecutive ranks)."""
        return self.group_rank(call) // self.replica_width(call)

    def replica_leaders(self, call: str) -> tuple[int, ...]:
        """The first global rank of each replica of ``call``, in replica order: the ranks whose rows are gathered (a
        pipeline's first stage holds its scoring results too: the last stage broadcasts them)."""
        return self.plan.ranks(call)[:: self.replica_width(call)]

    def tp_group(self, call: str) -> dist.ProcessGroup | None:
        """The process group of this rank's replica of ``call`` (None without tensor parallelism)."""
        return self.tp_groups.get(call)

    def collective(self, call: str, what: str) -> contextlib.AbstractContextManager[None]:
        """Turn a failed collective into an error that names this rank, the call, its role and its ranks
        (:func:`named_failure`)."""
        where = (f"Rank {self.rank}: the {what} of call {call!r} (role {call.split('.')[0]!r}, ranks "
                 f"{list(self.plan.ranks(call))}, plan {self.plan.name!r})")
        return named_failure(where, self.timeout)

    # ---- data movement ----

    def gather_to_world(
        self, call: str, local: dict[str, torch.Tensor] | None, specs: dict[str, TensorSpec], among: str | None = None
    ) -> dict[str, torch.Tensor]:
        """Concatenate the shards that ``call``'s ranks computed, in rank order, on every rank of the world (or of
        the group of the call ``among``, which holds ``call``'s ranks: a free-running plan's generation side).

        Dimensions after the first are padded to the largest shard with each spec's ``pad_value``. Ranks
        outside the call's group pass ``local=None``.
        """
        if not self.distributed:
            assert local is not None
            return local
        with self.collective(call, "gather of results"):
            return self._gather_to_world(call, local, specs, among)

    def _gather_to_world(
        self, call: str, local: dict[str, torch.Tensor] | None, specs: dict[str, TensorSpec], among: str | None
    ) -> dict[str, torch.Tensor]:
        group = self.groups[among] if among is not None else None
        ranks = list(self.plan.ranks(among)) if among is not None else list(range(self.plan.world_size))
        members = [ranks.index(r) for r in self.replica_leaders(call)]  # a replica's rows are taken once
        shapes = self._all_gather_shapes(local, specs, group, len(ranks))
        out = {}
        for i, (name, spec) in enumerate(specs.items()):
            rank_shapes = shapes[:, i, : spec.ndim]
            max_shape = rank_shapes.amax(0).tolist()
            mine = local[name] if local is not None else torch.empty(0, device=self.device, dtype=spec.dtype)
            padded = _pad_to(mine.to(spec.dtype), max_shape, spec.pad_value, self.device)
            parts = [torch.empty_like(padded) for _ in ranks]
            dist.all_gather(parts, padded, group=group)
            rows = [parts[r][: int(rank_shapes[r, 0])] for r in members]
            out[name] = torch.cat(rows)
        return out

    def _all_gather_shapes(self, local: dict[str, torch.Tensor] | None, specs: dict[str, TensorSpec],
                           group: dist.ProcessGroup | None, size: int) -> torch.Tensor:
        max_ndim = max(s.ndim for s in specs.values())
        mine = torch.zeros(len(specs), max_ndim, dtype=torch.long, device=self.device)
        if local is not None:
            for i, name in enumerate(specs):
                mine[i, : local[name].dim()] = torch.tensor(local[name].shape)
        parts = [torch.empty_like(mine) for _ in range(size)]
        dist.all_gather(parts, mine, group=group)
        return torch.stack(parts).cpu()

    def broadcast_stats(self, call: str, stats: dict[str, torch.Tensor] | None, names: Iterable[str],
                        among_call_ranks: bool = False) -> dict[str, torch.Tensor]:
        """Scalar statistics computed on ``call``'s leader, delivered to every rank (for the rank-0 logger), or with
        ``among_call_ranks`` to the call's ranks only (a free-running plan's training side)."""
        names = list(names)
        if not self.distributed:
            assert stats is not None
            return stats
        values = torch.zeros(len(names), dtype=torch.float64, device=self.device)
        if self.rank == self.leader(call):
            values = torch.stack([stats[n].detach().double().to(self.device) for n in names])
        group = self.groups[call] if among_call_ranks else None
        if group is not None or not among_call_ranks:
            with self.collective(call, "broadcast of statistics"):
                dist.broadcast(values, src=self.leader(call), group=group)
        return dict(zip(names, values.float().cpu()))

    # ---- free-running: the generation side and the training side apart (PlacementPlan.free_running) ----

    def send_payload(self, payload: dict[str, Any], dst: int, tag: int, what: str,
                     call: str) -> list[tuple[dist.Work, torch.Tensor]]:
        """Start sending ``payload`` (tensors, numbers, strings, in dicts and lists) to rank ``dst``, point to point:
        its size, then its bytes (``torch.save``). Returns the sends in flight with their buffers, which must stay
        alive until they complete (:meth:`pending_sends`, :meth:`finish_sends`); ``dst`` receives it with
        :meth:`receive_payload` and the same ``tag``. A dead ``dst`` fails the send at once: a
        :class:`~lightning_app_rlhf.parallel.failures.PlacementError` naming ``what``, ``call`` and (from the heartbeats) the dead rank."""
        buffer = io.BytesIO()
        torch.save(payload, buffer)
        data = torch.frombuffer(bytearray(buffer.getbuffer()), dtype=torch.uint8)
        size = torch.tensor([data.numel()], dtype=torch.long)
        with self.collective(call, f"send of {what} to rank {dst}"):
            return [(dist.isend(size, dst, tag=2 * tag), size), (dist.isend(data, dst, tag=2 * tag + 1), data)]

    def receive_payload(self, src: int, tag: int, what: str, call: str) -> dict[str, Any]:
        """Receive what rank ``src`` sent with :meth:`send_payload` and ``tag``, waiting at most the placement's
        timeout (a :class:`~lightning_app_rlhf.parallel.failures.PlacementError` naming ``what`` after it)."""
        size = torch.zeros(1, dtype=torch.long)
        with self.collective(call, f"receipt of {what} from rank {src}"):
            dist.irecv(size, src, tag=2 * tag).wait(self.timeout)
            data = torch.empty(int(size.item()), dtype=torch.uint8)
            dist.irecv(data, src, tag=2 * tag + 1).wait(self.timeout)
        return torch.load(io.BytesIO(data.numpy().tobytes()), weights_only=True)

    @staticmethod
    def pending_sends(sends: list[tuple[dist.Work, torch.Tensor]]) -> list[tuple[dist.Work, torch.Tensor]]:
        """The sends (or weight broadcasts) of ``sends`` still in flight, with their buffers."""
        return [(work, buffer) for work, buffer in sends if not work.is_completed()]

    def finish_sends(self, sends: list[tuple[dist.Work, torch.Tensor]], what: str,
                     call: str) -> list[tuple[dist.Work, torch.Tensor]]:
        """Wait for every send (or weight broadcast) of ``sends``, at most the placement's timeout each (an error
        naming ``what`` and ``call`` after it); returns the empty list of those still in flight."""
        with self.collective(call, what):
            for work, _ in sends:
                work.wait(self.timeout)
        return []

    def publish_weights(self, role: str, buckets: Iterable[list[torch.Tensor]]) -> list[tuple[dist.Work, torch.Tensor]]:
        """Start broadcasting ``role``'s trained weights from its train leader to its shadows, without waiting for
        them: each shadow rank joins with :meth:`reallocate_weights` when it takes the version. Returns the
        broadcasts in flight (none off the leader, whose sharded group members still draw every bucket)."""
        sends = []
        for bucket in buckets:
            if self.rank != self.leader(f"{role}.train"):
                continue  # it took part in the bucket's gather; the leader sends
            flat = torch.cat([p.detach().reshape(-1) for p in bucket])
            work = dist.broadcast(flat, src=self.rank, group=self.reallocation_groups[role], async_op=True)
            sends.append((work, flat))
        return sends

    def all_reduce_sum(self, call: str, tensor: torch.Tensor) -> torch.Tensor:
        """Sum a tensor over ``call``'s group (only members call this); with a tensor-parallel degree, over its
        replicas (the ranks of a replica computed the same values: only the replica's first rank counts); so with a
        pipeline-parallel degree, whose stages all receive the last stage's values."""
        if self.replica_width(call) > 1 and self.group_rank(call) % self.replica_width(call):
            tensor.zero_()
        if self.group_size(call) > 1:
            with self.collective(call, "all-reduce"):
                dist.all_reduce(tensor, group=self.groups[call])
        return tensor

    # ---- weight reallocation ----

    def reallocate_weights(self, role: str, buckets: Iterable[list[torch.Tensor]]) -> int:
        """Send ``role``'s trained weights from its train leader to every shadow copy; return bytes moved.

        ``buckets``: the trainable parameters, in ``parameters()`` order, cut by
        :func:`~lightning_app_rlhf.parallel.wrappers.base.parameter_buckets` (one broadcast each). Train ranks pass their
        wrapper's :meth:`~lightning_app_rlhf.parallel.wrappers.base.RoleWrapper.full_parameter_buckets` (a sharded group's
        ranks all draw them: each bucket is a gather), shadow ranks their shadow's parameters in the same buckets.
        Frozen parameters never change and never move. Ranks outside both must not call this.
        """
        group = self.reallocation_groups.get(role)
        if group is None and not self.plan.shadow_ranks(role):
            for _ in buckets:  # a sharded train group still gathers each bucket together
                pass
            return 0
        with self.collective(f"{role}.train", "weight reallocation"):
            return self._reallocate(role, buckets, group)

    def _reallocate(self, role: str, buckets: Iterable[list[torch.Tensor]], group: dist.ProcessGroup | None) -> int:
        train_leader = self.leader(f"{role}.train")
        moved = 0
        for bucket in buckets:
            if self.runs(f"{role}.train") and self.rank != train_leader:
                continue  # it took part in the bucket's gather; the leader sends
            flat = torch.cat([p.detach().reshape(-1) for p in bucket])
            dist.broadcast(flat, src=train_leader, group=group)
            if self.rank != train_leader:
                offset = 0
                with torch.no_grad():
                    for p in bucket:
                        p.copy_(flat[offset : offset + p.numel()].view_as(p))
                        offset += p.numel()
            moved += flat.numel() * flat.element_size()
        return moved


def create_placement(
    plan: PlacementPlan, rank: int, device: torch.device, timeout: datetime.timedelta = DEFAULT_TIMEOUT
) -> Placement:
    """Create every call's process group on every rank, in the same order, and bind the plan to this rank.

    ``torch.distributed`` must already be initialised with ``plan.world_size`` ranks.
    """
    if plan.world_size == 1:
        return Placement(plan, rank, device, timeout=timeout)
    if not dist.is_initialized() or dist.get_world_size() != plan.world_size:
        actual = dist.get_world_size() if dist.is_initialized() else 1
        raise ValueError(f"The plan covers {plan.world_size} ranks but the job has {actual}. Launch "
                         f"{plan.world_size} processes (e.g. --trainer.devices {plan.world_size}) or rebuild the plan.")
    groups: dict[str, dist.ProcessGroup | None] = {}
    for call in (c for c in CALLS if c in plan.calls):  # new_group is collective: same order on every rank
        groups[call] = dist.new_group(list(plan.ranks(call)), timeout=timeout)
    reallocation_groups: dict[str, dist.ProcessGroup | None] = {}
    for role in plan.trainable_roles:
        shadows = plan.shadow_ranks(role)
        if shadows:
            ranks = sorted({plan.ranks(f"{role}.train")[0], *shadows})
            reallocation_groups[role] = dist.new_group(ranks, timeout=timeout)
    namespace = [f"rlhf_free_running/{uuid.uuid4().hex}" if rank == 0 else None]
    if plan.free_running:
        dist.broadcast_object_list(namespace, src=0)
    tp_groups, dp_groups = _tp_groups(plan, rank, timeout), _dp_groups(plan, rank, timeout)
    pipelines, stage_groups = _pipeline_groups(plan, rank, timeout)
    return Placement(plan, rank, device, groups, reallocation_groups, timeout, tp_groups, dp_groups,
                     namespace[0] or "", pipelines, stage_groups)


def _tp_groups(plan: PlacementPlan, rank: int, timeout: datetime.timedelta) -> dict[str, dist.ProcessGroup]:
    """The group of every tensor-parallel replica, created on every rank in the same order (collective); returns
    those of this rank's replicas, by call."""
    mine: dict[str, dist.ProcessGroup] = {}
    for call in (c for c in CALLS if plan.tp_degree(c) > 1 and c in plan.calls):
        ranks, degree = plan.ranks(call), plan.tp_degree(call)
        for start in range(0, len(ranks), degree):
            replica = list(ranks[start : start + degree])
            group = dist.new_group(replica, timeout=timeout)
            if rank in replica:
                mine[call] = group
    return mine


def _dp_groups(plan: PlacementPlan, rank: int, timeout: datetime.timedelta) -> dict[str, dist.ProcessGroup]:
    """For each train call with a tensor-parallel degree ``t``: the groups of ranks ``ranks[j::t]`` (slice ``j`` of
    every replica: a 2-D mesh's data dimension), created on every rank in the same order; returns this rank's."""
    mine: dict[str, dist.ProcessGroup] = {}
    for call in (c for c in CALLS if c.endswith(".train") and plan.tp_degree(c) > 1 and c in plan.calls):
        ranks, degree = plan.ranks(call), plan.tp_degree(call)
        for j in range(degree):
            column = list(ranks[j::degree])
            group = dist.new_group(column, timeout=timeout)
            if rank in column:
                mine[call] = group
    return mine


def _pipeline_groups(plan: PlacementPlan, rank: int,
                     timeout: datetime.timedelta) -> tuple[dict[str, Any], dict[str, dist.ProcessGroup | None]]:
    """For each call with a pipeline-parallel degree ``p``: its pipelines (consecutive blocks of ``p`` of its ranks,
    stage ``s`` on the block's ``s``-th rank) and, for a train call with more than one pipeline, the groups of ranks
    ``ranks[s::p]`` holding the same stage, over which gradients are summed. Created on every rank in the same order
    (``new_group`` is collective); returns this rank's, by call."""
    pipelines: dict[str, Any] = {}
    stage_groups: dict[str, dist.ProcessGroup | None] = {}
    for call in (c for c in CALLS if plan.pp_degree(c) > 1 and c in plan.calls):
        ranks, degree = plan.ranks(call), plan.pp_degree(call)
        blocks = [ranks[start : start + degree] for start in range(0, len(ranks), degree)]
        mine = create_pipeline_groups(blocks, rank, timeout)
        if mine is not None:
            pipelines[call] = mine
        if call.endswith(".train") and len(blocks) > 1:
            for stage in range(degree):
                column = list(ranks[stage::degree])
                group = dist.new_group(column, timeout=timeout)
                if rank in column:
                    stage_groups[call] = group
        elif rank in ranks:
            stage_groups[call] = None
    return pipelines, stage_groups


def _pad_to(tensor: torch.Tensor, shape: list[int], value: float, device: torch.device) -> torch.Tensor:
    out = torch.full(shape, value, dtype=tensor.dtype, device=device)
    if tensor.numel():
        out[tuple(slice(0, s) for s in tensor.shape)] = tensor.to(device)
    return out


