"""A picture of a placement plan: one panel per model call, the cluster's ranks as a grid (a row per node, a cell per
device), each rank of the call coloured by its data-parallel replica and labelled with its pipeline stage and
tensor-parallel rank, the ranks outside the call grey. Plain Python; matplotlib is imported only to draw, and is
optional (``pip install matplotlib``)::

    from lightning_app_rlhf.planner.plan_picture import draw_plan_picture

    draw_plan_picture(result.best.plan, devices_per_node=8, path="plan.png")

``python -m lightning_app_rlhf plan ... --picture plan.png`` draws the best plan this way.
"""

from __future__ import annotations

import importlib.util
import math
import textwrap
from dataclasses import dataclass
from pathlib import Path

from lightning_app_rlhf.core.role_table import CALLS, TRAINABLE_ROLES, role_of
from lightning_app_rlhf.parallel.pipeline_checks import check_pipeline_parallel
from lightning_app_rlhf.parallel.plan import PlacementPlan

MATPLOTLIB_FIX = "pip install matplotlib (or pip install 'lightning-app-rlhf[bench]')"
"""How to install what a picture needs."""
NOT_IN_CALL = "#d9d9d9"
"""The fill of a rank that does not run the call."""


def require_matplotlib() -> None:
    """Raise an ``ImportError`` naming the install unless matplotlib, which draws the pictures, is installed (it is
    not a dependency of the package: only pictures and benchmark plots use it)."""
    if importlib.util.find_spec("matplotlib") is None:
        raise ImportError(f"A plan picture is drawn with matplotlib, which is not installed: {MATPLOTLIB_FIX}.")


@dataclass(frozen=True)
class RankPosition:
    """Where one rank sits in a call's data x pipeline x tensor layout."""

    replica: int
    """Its data-parallel replica (``d``): the replicas split the call's batch."""
    stage: int
    """Its pipeline stage (``s``) within the replica: 0 without pipeline parallelism."""
    tp_rank: int
    """Its tensor-parallel rank (``t``) within the stage: 0 without tensor parallelism."""


def call_layout(plan: PlacementPlan, call: str) -> dict[int, RankPosition]:
    """Each rank of ``call`` -> its (replica, stage, tensor-parallel rank).

    The call's ranks, in order, fill replicas of ``t x p`` consecutive ranks (``t``, ``p``: its tensor- and
    pipeline-parallel degrees; ``Placement.replica``). Inside a replica tensor parallelism is innermost: stage ``s``
    is its ranks ``[s t, (s + 1) t)``, so a tensor-parallel group stays on consecutive ranks (one node) while a
    pipeline may cross nodes between stages; this is the layout the cost model prices. Where the engine runs the
    call it builds the same groups: a pipelined call (``t = 1``) as pipelines of ``p`` consecutive ranks with stage
    ``s`` on the ``s``-th (``placement._pipeline_groups``), a tensor-parallel call (``p = 1``) as replicas of ``t``
    consecutive ranks (``placement._tp_groups``). A call with both degrees is priced by the planner only: the engine
    runs one of the two per call (``check_pipeline_parallel`` refuses both).

    Args:
        plan: The placement plan.
        call: One of the plan's calls, e.g. ``"actor.train"``.
    """
    t, p = plan.tp_degree(call), plan.pp_degree(call)
    layout = {}
    for index, rank in enumerate(plan.ranks(call)):
        replica, within = divmod(index, t * p)
        stage, tp_rank = divmod(within, t)
        layout[rank] = RankPosition(replica, stage, tp_rank)
    return layout


def degrees_text(plan: PlacementPlan, call: str) -> str:
    """``dp2 x tp4 x pp8``: the call's data-, tensor- and pipeline-parallel degrees (their product: its ranks)."""
    t, p = plan.tp_degree(call), plan.pp_degree(call)
    return f"dp{len(plan.ranks(call)) // (t * p)} x tp{t} x pp{p}"


def weights_text(plan: PlacementPlan, call: str) -> str:
    """What the call runs on: its role's wrapper on the train ranks (``fsdp2``, with the schedule of a pipelined
    train call), ``whole`` for a frozen role without one, and for another call of a trainable role the copy it runs
    on where it does not run on the trained module (``tp copy``, ``whole copy``; ``shadow`` off the train ranks)."""
    role = role_of(call)
    wrapper = plan.wrappers.get(role, "whole")
    if call.endswith(".train"):
        return wrapper + (f", {plan.pipeline_schedule}" if plan.pp_degree(call) > 1 else "")
    if role not in TRAINABLE_ROLES or f"{role}.train" not in plan.calls:
        return wrapper
    if not set(plan.ranks(call)) & set(plan.ranks(f"{role}.train")):
        return f"{role} shadow"
    if call in plan.layout_reallocations():
        return "tp copy" if plan.tp_degree(call) > 1 else "whole copy"
    return wrapper


def _label(position: RankPosition, tp: int, pp: int) -> str:
    """``d3``, ``d3 s1``, ``d3 t2``, or ``d3`` over ``s1 t2``: only the degrees above 1, two lines for three parts
    (a cell is about 0.6 inch wide at 8 devices per node)."""
    inner = ([f"s{position.stage}"] if pp > 1 else []) + ([f"t{position.tp_rank}"] if tp > 1 else [])
    return f"d{position.replica}" + ("\n" if len(inner) == 2 else " " if inner else "") + " ".join(inner)


def _replica_colours(count: int) -> list[tuple[float, ...]]:
    """``count`` fills, neighbouring replicas in different hues: tab10 up to 10 replicas; beyond, tab20's 10 dark
    then its 10 light colours, repeated (the ``d`` label tells repeats apart)."""
    from matplotlib import colormaps

    if count <= 10:
        return [colormaps["tab10"](i) for i in range(count)]
    tab20 = [colormaps["tab20"](i) for i in (*range(0, 20, 2), *range(1, 20, 2))]
    return [tab20[i % 20] for i in range(count)]


def _stage_shade(colour: tuple[float, ...], stage: int, stages: int) -> tuple[float, ...]:
    """The replica's colour, lighter for later pipeline stages (up to 60% white at the last one), so the stages of a
    replica spanning many nodes read as a gradient."""
    white = 0.6 * stage / max(stages - 1, 1)
    return tuple(c + (1 - c) * white for c in colour[:3])


def draw_plan_picture(plan: PlacementPlan, devices_per_node: int, path: str | Path,
                      heading: str | None = None) -> Path:
    """Draw ``plan`` as one PNG: a panel per call, titled with the call's ``dp x tp x pp`` and what it runs on
    (:func:`weights_text`); the cluster's ranks as a grid, a row per node; each rank of the call filled with its
    replica's colour (lighter for later stages) and labelled ``d`` (replica), ``s`` (pipeline stage) and ``t``
    (tensor-parallel rank), where those degrees are above 1 (:func:`call_layout`); thick lines between replicas,
    dashed ones between stages; ranks outside the call grey. Readable up to 16 nodes of 8 devices.

    Args:
        plan: The placement plan.
        devices_per_node: Ranks per node (the grid's columns); it must divide the plan's world size.
        path: The PNG to write (its folder is created).
        heading: A line above the panels (default: the plan's name and world size).

    Returns:
        The path written.

    Raises:
        ImportError: matplotlib is not installed (the message names the install).
        ValueError: ``devices_per_node`` does not divide the plan's world size.
    """
    require_matplotlib()
    if devices_per_node < 1 or plan.world_size % devices_per_node:
        raise ValueError(f"devices_per_node={devices_per_node} does not divide the plan's {plan.world_size} ranks: "
                         "give the cluster's devices per node (e.g. 8 for --cluster 2x8xH100-80GB).")
    import matplotlib

    matplotlib.use("Agg")  # files only: no display on a cluster's login node
    import matplotlib.pyplot as plt
    from matplotlib.collections import LineCollection
    from matplotlib.patches import Rectangle

    nodes = plan.world_size // devices_per_node
    calls = [call for call in CALLS if call in plan.calls]  # the role table's order, whatever the plan's
    columns = 2 if len(calls) == 4 else min(3, len(calls))
    rows = math.ceil(len(calls) / columns)
    # Cells about 0.6 x 0.42 inch hold "d12" over "s15 t7" at 6.5 pt; a few devices or nodes get bigger cells.
    cell_w, cell_h = max(0.62, 4.0 / devices_per_node), max(0.42, 1.0 / nodes)
    font = min(10.0, max(6.0, 10.5 * cell_w))
    panel_w, panel_h = devices_per_node * cell_w + 1.3, nodes * cell_h + 0.8  # + node labels, + the title
    footer = _footer_lines(plan, width=int(columns * panel_w * 13))
    fig, axes = plt.subplots(rows, columns, squeeze=False,
                             figsize=(columns * panel_w, rows * panel_h + 0.7 + 0.17 * len(footer)))
    for ax, call in zip(axes.flat, calls, strict=False):
        layout = call_layout(plan, call)
        t, p = plan.tp_degree(call), plan.pp_degree(call)
        colours = _replica_colours(len(plan.ranks(call)) // (t * p))
        for rank in range(plan.world_size):
            node, device = divmod(rank, devices_per_node)
            position = layout.get(rank)
            fill = NOT_IN_CALL if position is None else _stage_shade(colours[position.replica], position.stage, p)
            ax.add_patch(Rectangle((device, node), 1, 1, facecolor=fill, edgecolor="white", linewidth=0.6))
            if position is not None:
                ax.text(device + 0.5, node + 0.5, _label(position, t, p), ha="center", va="center",
                        fontsize=font, linespacing=1.0)
        replica_edges, stage_edges = _boundaries(layout, nodes, devices_per_node)
        ax.add_collection(LineCollection(stage_edges, colors="#222222", linewidths=1.3, linestyles=(0, (3, 2))))
        ax.add_collection(LineCollection(replica_edges, colors="black", linewidths=2.2))
        ax.set_xlim(-0.05, devices_per_node + 0.05)
        ax.set_ylim(nodes + 0.05, -0.05)  # node 0 on top, as ranks count
        ax.set_xticks([d + 0.5 for d in range(devices_per_node)], [str(d) for d in range(devices_per_node)],
                      fontsize=font)
        ax.set_yticks([n + 0.5 for n in range(nodes)],
                      [f"node {n}: {n * devices_per_node}-{(n + 1) * devices_per_node - 1}" for n in range(nodes)],
                      fontsize=font)
        ax.tick_params(length=0)
        ax.set_xlabel("device", fontsize=font)
        for spine in ax.spines.values():
            spine.set_visible(False)
        ax.set_title(f"{call}\n{degrees_text(plan, call)}, {weights_text(plan, call)}", fontsize=font + 2)
    for ax in list(axes.flat)[len(calls):]:
        ax.set_visible(False)
    fig.suptitle(heading or f"plan {plan.name!r} on {plan.world_size} ranks", fontsize=12)
    fig.text(0.5, 0.005, "\n".join(footer), ha="center", va="bottom", fontsize=8)
    fig.tight_layout(rect=(0, (0.17 * len(footer) + 0.1) / fig.get_figheight(), 1, 1))
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def _footer_lines(plan: PlacementPlan, width: int) -> list[str]:
    """The key to the cells, and, for a plan the engine does not run yet, its refusal (with the fix)."""
    key = ("colour and d: data-parallel replica (the replicas split the batch); s: pipeline stage (lighter: later); "
           "t: tensor-parallel "
           "rank; thick lines: replica boundaries; dashed lines: stage boundaries; grey: the rank does not run "
           "the call")
    lines = textwrap.wrap(key, width)
    try:
        check_pipeline_parallel(plan)
    except ValueError as refusal:  # the planner prices layouts the engine does not run yet: say so on the picture
        lines += textwrap.wrap(f"Priced by the planner; the engine does not run this plan yet: {refusal}", width)
    return lines


def _boundaries(layout: dict[int, RankPosition], nodes: int,
                devices_per_node: int) -> tuple[list[list[tuple[int, int]]], list[list[tuple[int, int]]]]:
    """The grid edges between cells of different replicas (or between a replica and a rank outside the call, or the
    grid's border), and those between different stages of one replica: line segments in cell coordinates."""
    replica_edges: list[list[tuple[int, int]]] = []
    stage_edges: list[list[tuple[int, int]]] = []

    def at(node: int, device: int) -> RankPosition | None:
        if 0 <= node < nodes and 0 <= device < devices_per_node:
            return layout.get(node * devices_per_node + device)
        return None

    for node in range(nodes):
        for device in range(devices_per_node):
            here = at(node, device)
            if here is None:
                continue
            # Each cell draws its right and bottom edges, and its left and top ones where the neighbour is outside
            # the call: every edge between two cells is drawn once.
            for neighbour, segment in (((node, device + 1), [(device + 1, node), (device + 1, node + 1)]),
                                       ((node + 1, device), [(device, node + 1), (device + 1, node + 1)]),
                                       ((node, device - 1), [(device, node), (device, node + 1)]),
                                       ((node - 1, device), [(device, node), (device + 1, node)])):
                there = at(*neighbour)
                backward = neighbour[0] < node or neighbour[1] < device
                if there is None or there.replica != here.replica:
                    if not backward or there is None:
                        replica_edges.append(segment)
                elif there.stage != here.stage and not backward:
                    stage_edges.append(segment)
    return replica_edges, stage_edges
