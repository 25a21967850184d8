"""``PlacementSummary``: at fit start, rank 0 prints the plan, the node each rank runs on and the bytes each rank
holds per role, and every rank's totals go to the loggers. ``RLHFModule`` adds it by default, as the Trainer adds
``ModelSummary``."""

from __future__ import annotations

import socket
from collections.abc import Sequence
from typing import Any, NamedTuple

import lightning.pytorch as pl
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback
from rich.console import Console
from rich.table import Table
from typing_extensions import override

from lightning_app_rlhf.core.role_table import CALLS, role_of
from lightning_app_rlhf.parallel.memory import RoleMemory
from lightning_app_rlhf.parallel.placement import Placement
from lightning_app_rlhf.parallel.plan import PlacementPlan


class RankNode(NamedTuple):
    """Where one rank runs: its node rank (as the cluster environment numbers nodes) and its host's name."""

    node_rank: int
    hostname: str


class PlacementSummary(Callback):
    """Prints the placement (every call with its ranks and wrapper), the node and host of every rank, and the memory
    per rank and role, and logs ``memory/param_bytes_rank{r}``, ``memory/grad_bytes_rank{r}``,
    ``memory/optimizer_bytes_rank{r}`` and their sum of gradients and optimizer state ``memory/state_bytes_rank{r}``
    at step 0, as each wrapper accounts them (the planner predicts the same numbers).

    Args:
        print_tables: Print the tables on rank 0 (the metrics are logged either way).
    """

    def __init__(self, print_tables: bool = True) -> None:
        self.print_tables = print_tables

    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not hasattr(pl_module, "gather_memory"):
            raise TypeError(f"PlacementSummary summarises an RLHFModule; got {type(pl_module).__name__}.")
        placement = pl_module.placed_roles.placement
        rows = pl_module.gather_memory()  # collective: every rank takes part
        nodes = gather_rank_nodes(trainer.node_rank, placement.distributed)  # a collective wherever gather_memory is
        if trainer.is_global_zero and self.print_tables:
            print_placement_summary(placement, rows, nodes)
        for logger in trainer.loggers:
            logger.log_metrics(memory_metrics(rows), step=0)


def memory_metrics(rows: list[list[RoleMemory]]) -> dict[str, Any]:
    """Parameter, gradient and optimizer bytes per rank, and gradient + optimizer bytes."""
    metrics: dict[str, float] = {}
    for rank, rank_rows in enumerate(rows):
        metrics[f"memory/param_bytes_rank{rank}"] = float(sum(r.param_bytes for r in rank_rows))
        metrics[f"memory/grad_bytes_rank{rank}"] = float(sum(r.grad_bytes for r in rank_rows))
        metrics[f"memory/optimizer_bytes_rank{rank}"] = float(sum(r.optimizer_bytes for r in rank_rows))
        metrics[f"memory/state_bytes_rank{rank}"] = float(sum(r.grad_bytes + r.optimizer_bytes for r in rank_rows))
    return metrics


def gather_rank_nodes(node_rank: int, distributed: bool = True) -> list[RankNode]:
    """Every rank's node rank and hostname, on every rank, indexed by global rank (a collective when
    ``distributed``: call it on every rank).

    One object all-gather on the default process group, which the placement strategies create with their
    collective ``timeout``: a rank that never arrives fails it after that timeout instead of hanging the job.

    Args:
        node_rank: This rank's node rank (``trainer.node_rank``).
        distributed: Whether the placement spans several ranks (``Placement.distributed``); without it, or without
            a process group, this process's node alone.
    """
    mine = RankNode(node_rank, socket.gethostname())
    if not (distributed and dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return [mine]
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    return everyone


def print_placement_summary(placement: Placement, rows: list[list[RoleMemory]],
                            nodes: Sequence[RankNode] | None = None) -> None:
    """Rich tables: every call with its ranks and wrapper, the ranks of each node (when ``nodes`` is given), then
    bytes per rank and role.

    Args:
        placement: This rank's placement (its plan is printed).
        rows: Every rank's memory rows, indexed by global rank (:meth:`RLHFModule.gather_memory`).
        nodes: Every rank's node, indexed by global rank (:func:`gather_rank_nodes`).
    """
    plan = placement.plan
    calls = Table(title=f"Placement plan: {plan.name}, {plan.world_size} rank(s)")
    for column in ("call", "ranks", "wrapper"):
        calls.add_column(column)
    for call in (c for c in CALLS if c in plan.calls):
        # beside the ranks, as `plan` prints them: the tensor- and pipeline-parallel degrees (a pipelined train call
        # with its schedule); nothing for a call data parallel over its ranks
        calls.add_row(call, ",".join(map(str, plan.ranks(call))) + plan.layout_text(call), _call_wrapper(plan, call))
    memory = Table(title="Memory per rank (MB)")
    for column in ("rank", "role", "calls", "params", "grads", "optimizer"):
        memory.add_column(column, justify="right" if column in ("params", "grads", "optimizer") else "left")
    for rank, rank_rows in enumerate(rows):
        for row in rank_rows:
            role = f"{row.role} (shared)" if row.shares else row.role
            if row.tp_copy:  # a copy in a call's own layout: tensor-parallel, or whole beside a pipelined train call
                role = f"{row.role} ({f'tp{row.tp_copy}' if row.tp_copy > 1 else 'whole'} copy)"
            call_names = ", ".join(f"{row.role}.{kind}" for kind in row.calls.split("+") if kind)
            memory.add_row(str(rank), role, call_names, *(f"{b / 2**20:.2f}" for b in (
                row.param_bytes, row.grad_bytes, row.optimizer_bytes)))
    console = Console()
    console.print(calls)
    if nodes is not None:
        console.print(node_table(nodes))
    console.print(memory)
    shared = sorted({(row.role, row.shares) for rank_rows in rows for row in rank_rows if row.shares})
    for role, owner in shared:
        console.print(f"{role} (shared): runs on the {owner}'s base weights with its LoRA adapters disabled, "
                      "so it holds no parameters of its own.")


def node_table(nodes: Sequence[RankNode]) -> Table:
    """One row per node and host: the ranks that run there. Ranks that report the same node rank from different
    hosts (a misconfigured launch) get a row each, so the table shows the mismatch instead of hiding it.

    Args:
        nodes: Every rank's node, indexed by global rank.
    """
    ranks: dict[RankNode, list[int]] = {}
    for rank, node in enumerate(nodes):
        ranks.setdefault(node, []).append(rank)
    table = Table(title="Ranks per node")  # short: rich wraps a title wider than its table
    for column in ("node", "host", "ranks"):
        table.add_column(column)
    for node in sorted(ranks):
        table.add_row(str(node.node_rank), node.hostname, ",".join(map(str, ranks[node])))
    return table


def _call_wrapper(plan: PlacementPlan, call: str) -> str:
    role = role_of(call)
    if f"{role}.train" not in plan.calls:  # a frozen role: held whole, or sharded over its forward group
        return f"frozen, {plan.wrappers[role]}" if role in plan.wrappers else "frozen"
    if call.endswith(".train"):
        return plan.wrappers[role]
    if set(plan.ranks(call)) - set(plan.ranks(f"{role}.train")):
        return "shadow copy"
    return "whole copy" if plan.runs_on_whole_copy(call) else "trained copy"
