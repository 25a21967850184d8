"""The plan picture (``planner/plan_picture.py``, ``plan --picture``): which rank is which (replica, pipeline stage,
tensor-parallel rank) of a call, as the engine groups them, and the PNG of a data x tensor x pipeline plan."""

from __future__ import annotations

import datetime
import importlib.util
from dataclasses import replace
from pathlib import Path

import pytest

from lightning_app_rlhf.parallel import placement
from lightning_app_rlhf.parallel.pipeline_checks import check_pipeline_parallel
from lightning_app_rlhf.parallel.plan import PlacementPlan
from lightning_app_rlhf.planner.command import PlanOptions, run_plan_command
from lightning_app_rlhf.planner.plan_picture import (
    RankPosition,
    call_layout,
    degrees_text,
    draw_plan_picture,
    weights_text,
)

EIGHT = tuple(range(8))
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def engine_plan() -> PlacementPlan:
    """8 ranks (2 nodes of 4) with every layout the engine runs: generation tp2, actor.train pp2, the critic's train
    and forward on the same pp4 pipelines, the reference tp2 on ranks 2, 3, 6, 7, the reward pp2 on ranks 4-7."""
    return PlacementPlan(
        8,
        {"actor.generate": EIGHT, "reference.forward": (2, 3, 6, 7), "reward.forward": (4, 5, 6, 7),
         "critic.forward": EIGHT, "actor.train": EIGHT, "critic.train": EIGHT},
        {"actor": "ddp", "critic": "ddp"},
        tp={"actor.generate": 2, "reference.forward": 2},
        pp={"actor.train": 2, "critic.train": 4, "critic.forward": 4, "reward.forward": 2},
    )


def three_d_plan() -> PlacementPlan:
    """8 ranks (2 nodes of 4): actor.train dp2 x tp2 x pp2 (FSDP2), the rest as in :func:`engine_plan`."""
    plan = engine_plan()
    return replace(plan, wrappers={"actor": "fsdp2", "critic": "ddp"},
                   tp={**plan.tp, "actor.train": 2}, pp={**plan.pp, "actor.train": 2})


def test_call_layout_by_hand():
    """TP innermost, then the stages, then the replicas, over the call's ranks in order."""
    d = RankPosition  # d(replica, stage, tp rank)
    plan = three_d_plan()
    assert call_layout(plan, "actor.train") == {
        0: d(0, 0, 0), 1: d(0, 0, 1), 2: d(0, 1, 0), 3: d(0, 1, 1),  # node 0: replica 0, its 2 stages of 2 TP ranks
        4: d(1, 0, 0), 5: d(1, 0, 1), 6: d(1, 1, 0), 7: d(1, 1, 1),  # node 1: replica 1
    }
    assert call_layout(plan, "critic.train") == {r: d(r // 4, r % 4, 0) for r in EIGHT}  # 2 pipelines of 4 stages
    assert call_layout(plan, "reference.forward") == {2: d(0, 0, 0), 3: d(0, 0, 1), 6: d(1, 0, 0), 7: d(1, 0, 1)}
    assert call_layout(plan, "reward.forward") == {4: d(0, 0, 0), 5: d(0, 1, 0), 6: d(1, 0, 0), 7: d(1, 1, 0)}
    assert degrees_text(plan, "actor.train") == "dp2 x tp2 x pp2"
    assert degrees_text(plan, "reward.forward") == "dp2 x tp1 x pp2"
    assert weights_text(plan, "actor.train") == "fsdp2, 1f1b"
    assert weights_text(plan, "actor.generate") == "tp copy"
    assert weights_text(plan, "reward.forward") == "whole"
    # The engine runs tp or pp per call, not both: the 3-D call is the planner's layout (its cost model's stages).
    with pytest.raises(ValueError, match="runs one of the two per call"):
        check_pipeline_parallel(plan)


def test_call_layout_is_the_engines_grouping(monkeypatch):
    """The engine's own group builders (``placement._tp_groups``, ``placement._pipeline_groups``), run with a
    recording ``new_group``, put every rank where :func:`call_layout` says: the i-th tensor-parallel group is replica
    i, its j-th rank TP rank j; the i-th pipeline is replica i, its s-th rank stage s."""
    plan = engine_plan()
    check_pipeline_parallel(plan)  # a plan the engine runs
    made: list[list[int]] = []
    pipelines: list[list[tuple[int, ...]]] = []

    def new_group(ranks: list[int], timeout: datetime.timedelta) -> object:
        made.append(list(ranks))
        return object()

    def create_pipeline_groups(blocks: list[tuple[int, ...]], rank: int, timeout: datetime.timedelta) -> None:
        pipelines.append([tuple(block) for block in blocks])

    monkeypatch.setattr(placement.dist, "new_group", new_group)
    monkeypatch.setattr(placement, "create_pipeline_groups", create_pipeline_groups)
    timeout = datetime.timedelta(seconds=1)
    placement._tp_groups(plan, 0, timeout)
    tp_calls = [c for c in placement.CALLS if c in plan.tp]  # the engine's order
    assert made == [[0, 1], [2, 3], [4, 5], [6, 7], [2, 3], [6, 7]]
    groups = iter(made)
    for call in tp_calls:
        for replica in range(len(plan.ranks(call)) // plan.tp_degree(call)):
            for tp_rank, rank in enumerate(next(groups)):
                assert call_layout(plan, call)[rank] == RankPosition(replica, 0, tp_rank), (call, rank)
    placement._pipeline_groups(plan, 0, timeout)
    pp_calls = [c for c in placement.CALLS if c in plan.pp]
    assert pp_calls == ["reward.forward", "critic.forward", "actor.train", "critic.train"]
    assert pipelines[0] == [(4, 5), (6, 7)]
    assert pipelines[2] == [(0, 1), (2, 3), (4, 5), (6, 7)]
    assert pipelines[3] == [(0, 1, 2, 3), (4, 5, 6, 7)]
    for call, blocks in zip(pp_calls, pipelines, strict=True):
        for replica, block in enumerate(blocks):
            for stage, rank in enumerate(block):
                assert call_layout(plan, call)[rank] == RankPosition(replica, stage, 0), (call, rank)


def test_picture_of_a_3d_plan_is_written(tmp_path):
    """A 2-node 8-rank plan with actor.train tp2 x pp2: a PNG."""
    path = draw_plan_picture(three_d_plan(), 4, tmp_path / "pictures" / "plan.png", heading="a 3-D plan")
    assert path == tmp_path / "pictures" / "plan.png"
    data = path.read_bytes()
    assert data.startswith(PNG_SIGNATURE) and len(data) > 10_000
    with pytest.raises(ValueError, match="does not divide the plan's 8 ranks"):
        draw_plan_picture(three_d_plan(), 3, tmp_path / "bad.png")


def test_plan_command_writes_the_picture_of_the_best_plan(tmp_path, capsys):
    path = tmp_path / "best.png"
    options = PlanOptions(cluster="1x4xcpu", actor="gpt2-tiny", reward="function", batch_size=8, prompt_length=8,
                          generation_length=8, num_minibatches=2, search="presets", picture=str(path))
    assert run_plan_command(options, None) == 0
    assert f"picture of the best plan written to {path}" in capsys.readouterr().out
    assert path.read_bytes().startswith(PNG_SIGNATURE)
    assert run_plan_command(replace(options, sweep=True), None) == 2
    assert "--picture draws the best plan of one workload" in capsys.readouterr().err


def test_a_picture_without_matplotlib_names_the_install(tmp_path, monkeypatch, capsys):
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *args: None if name == "matplotlib"
                        else find_spec(name, *args))
    with pytest.raises(ImportError, match="pip install matplotlib"):
        draw_plan_picture(three_d_plan(), 4, tmp_path / "plan.png")
    options = PlanOptions(cluster="1x4xcpu", actor="gpt2-tiny", search="presets", picture=str(tmp_path / "p.png"))
    assert run_plan_command(options, None) == 2  # refused before the search
    assert "pip install matplotlib" in capsys.readouterr().err
    assert not Path(tmp_path / "p.png").exists()
