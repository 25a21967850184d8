"""The engine's iteration, as it runs, equals its recipe (``lightning_app_rlhf.engine.iteration``) and the cost model's
task list: real iterations on 2 forked gloo processes, with the engine's calls, its free-running transport and the
``Placement`` collectives wrapped (in this test only) to record what each rank ran, in order. Every schedule:
on-policy (Flattening, Interleaving, Separation), k-stale on the fixed schedule, free-running (k = 0 and 1), and
dynamic sampling (a number of generation rounds per update that the run decides)."""

from __future__ import annotations

import functools
import json
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
from helpers import make_module

from lightning_app_rlhf import GenerationConfig, PPOConfig, PromptDataModule, RLHFModule, demo
from lightning_app_rlhf.engine.engine import RLHFEngine
from lightning_app_rlhf.engine.free_running import FreeRunningLink
from lightning_app_rlhf.engine.iteration import FORWARD_ROLES, iteration_steps
from lightning_app_rlhf.engine.role_calls import FORWARD_OUTPUTS, RoleCalls
from lightning_app_rlhf.engine.update_loop import UpdateLoop
from lightning_app_rlhf.parallel.placement import Placement
from lightning_app_rlhf.parallel.plan import (
    PlacementPlan,
    flattening_plan,
    interleaving_plan,
    separation_plan,
)
from lightning_app_rlhf.planner import CostModel, PlanChoice, parse_cluster, workload_from_module

ITERATIONS = 3
GRPO_ROLES = ("actor", "reference", "reward")


def _module(tokenizer) -> RLHFModule:
    return make_module(tokenizer=tokenizer, generation=GenerationConfig(max_new_tokens=6),
                       ppo=PPOConfig(num_minibatches=2))


def _dynamic_module(tokenizer) -> RLHFModule:
    """GRPO with dynamic sampling and a pass/fail reward that most groups of a random-init policy fail alike: the
    updates take a varying number of generation rounds (``tests/test_dynamic_sampling.py``)."""
    return make_module(tokenizer=tokenizer, algorithm="grpo", reward_fn=demo.topic_hit_reward, seed=0,
                       generation=GenerationConfig(num_samples=4, max_new_tokens=8),
                       ppo=PPOConfig(dynamic_sampling=True, max_generation_rounds=6, num_minibatches=2))


def _among(group: str | None) -> list[str]:
    """The trace's mark of a collective of a group (a free-running side), as :func:`_entry` writes a step's."""
    return [f"among {group}"] if group is not None else []


def _record_iterations(monkeypatch: pytest.MonkeyPatch, out: Path) -> None:
    """Wrap the engine's calls, its free-running transport and the placement's collectives so that each rank writes,
    per iteration, the steps it took (``["call", name]``, ``["gather", call]``, ``["broadcast", call, "stats" |
    "lr"]``, ``["reallocate", role]``, ``["take", "weights"]``, ``["send" | "receive", "experience"]``,
    ``["publish", role]``; a collective of a side's group ends with ``"among <call>"``) and the generation rounds
    of its update. Forked ranks inherit the wrappers."""
    trace: list[list[str]] = []
    active = [False]

    def record(*entry: str) -> None:
        if active[0]:
            trace.append(list(entry))

    def wrap(cls: type, name: str, entry: Callable[..., tuple[str, ...] | None]) -> None:
        original = getattr(cls, name)

        @functools.wraps(original)
        def wrapped(self, *args, **kwargs):
            step = entry(self, *args, **kwargs)
            if step is not None:
                record(*step)
            return original(self, *args, **kwargs)

        monkeypatch.setattr(cls, name, wrapped)

    def runs(self: Any, call: str) -> bool:
        return self.placement.runs(call)

    wrap(RoleCalls, "generate_shard",
         lambda self, *a, **k: ("call", "actor.generate") if runs(self, "actor.generate") else None)
    wrap(RoleCalls, "forward_shard",
         lambda self, role, *a, **k: ("call", f"{role}.forward") if runs(self, f"{role}.forward") else None)
    wrap(UpdateLoop, "update", lambda self, role, *a, **k: ("call", f"{role}.train"))
    wrap(Placement, "gather_to_world",
         lambda self, call, local, specs, among=None, *a, **k: ("gather", call, *_among(among)))
    wrap(Placement, "broadcast_stats",
         lambda self, call, stats, names, among_call_ranks=False, *a, **k: (
             "broadcast", call, "lr" if next(iter(names)).startswith("lr-") else "stats",
             *_among(call if among_call_ranks else None)))
    wrap(Placement, "reallocate_weights", lambda self, role, *a, **k: ("reallocate", role))
    # The generation leader sends to every training rank; each training rank receives (it waits for the send).
    wrap(Placement, "send_payload",
         lambda self, payload, dst, *a, **k: ("send", "experience") if dst == self.plan.training_ranks[0] else None)
    wrap(Placement, "receive_payload", lambda self, *a, **k: ("receive", "experience"))
    wrap(Placement, "publish_weights", lambda self, role, *a, **k: ("publish", role))
    _record_takes(monkeypatch, record, active)
    _save_per_iteration(monkeypatch, out, trace, active)


def _record_takes(monkeypatch: pytest.MonkeyPatch, record: Callable[..., None], active: list[bool]) -> None:
    """A take is one step, whatever number of published versions it joins (each a ``reallocate_weights`` of every
    published role, left out of the trace)."""
    original = FreeRunningLink.take

    @functools.wraps(original)
    def take(self, *args, **kwargs):
        record("take", "weights")
        recording, active[0] = active[0], False
        try:
            return original(self, *args, **kwargs)
        finally:
            active[0] = recording

    monkeypatch.setattr(FreeRunningLink, "take", take)


def _save_per_iteration(monkeypatch: pytest.MonkeyPatch, out: Path, trace: list[list[str]], active: list[bool]) -> None:
    """Each iteration of a rank: its steps and its generation rounds, one line of ``trace{rank}.jsonl``."""
    original = RLHFEngine.run_iteration

    def run_iteration(self, *args, **kwargs):
        trace.clear()
        active[0] = True
        rounds = None
        try:
            result = original(self, *args, **kwargs)
            rounds = int(result.stats.get("train/generation_rounds", 1))
            return result
        finally:
            active[0] = False
            with (out / f"trace{self.placement.rank}.jsonl").open("a") as f:
                f.write(json.dumps({"steps": trace, "rounds": rounds}) + "\n")

    monkeypatch.setattr(RLHFEngine, "run_iteration", run_iteration)


def _run(tmp_path: Path, module: RLHFModule, plan: PlacementPlan, tokenizer, batch_size: int) -> list[list[dict]]:
    """Train ``plan`` for :data:`ITERATIONS` iterations on its processes; each rank's steps and rounds per
    iteration."""
    from lightning_app_rlhf.strategies import PlacementStrategy

    trainer = pl.Trainer(
        accelerator="cpu", devices=plan.world_size, max_steps=ITERATIONS, logger=False, enable_progress_bar=False,
        enable_model_summary=False, enable_checkpointing=False, default_root_dir=tmp_path,
        strategy=PlacementStrategy(plan=plan, start_method="fork", timeout=120),
    )
    trainer.fit(module, PromptDataModule(demo.prompts(64), tokenizer, batch_size=batch_size))
    return [[json.loads(line) for line in (tmp_path / f"trace{r}.jsonl").read_text().splitlines()]
            for r in range(plan.world_size)]


def _described(plan: PlacementPlan, rank: int, iteration: int, rounds: int) -> list[list[str]]:
    """What the recipe (:func:`iteration_steps`, ``rounds`` generation rounds) says ``rank`` does in
    ``iteration``; the fixed schedule's first ``max_staleness`` iterations train on nothing."""
    return [[s.kind, s.name, *([s.what] if s.what else []), *_among(s.among)]
            for s in iteration_steps(plan, first=iteration < plan.max_staleness, rounds=rounds) if rank in s.ranks]


def _priced(model: CostModel, plan: PlacementPlan, rank: int, iteration: int) -> list[list[str]]:
    """The cost model's tasks of ``rank`` in ``iteration``, as trace entries (communication tails of calls are part
    of their call; a gather or broadcast on fewer ranks than the world is a collective of its side's group)."""
    out = []
    for task in model.tasks(PlanChoice(plan)):
        name, number = task.name.rsplit("#", 1)
        if int(number) != iteration or rank not in task.ranks or name.endswith(":comm"):
            continue
        role, what = name.split(".", 1)
        side = task.ranks != tuple(range(plan.world_size))
        if role == "gather":
            call = "actor.generate" if what == "rollout" else f"{what}.forward"
            assert not side or task.ranks == plan.generation_ranks, name
            out.append(["gather", call, *_among("actor.generate" if side else None)])
        elif what in ("stats", "lr"):
            assert not side or task.ranks == plan.ranks(f"{role}.train"), name
            out.append(["broadcast", f"{role}.train", what, *_among(f"{role}.train" if side else None)])
        elif what in ("reallocate", "take", "send", "receive", "publish"):
            out.append([what, role])
        else:
            out.append(["call", name])
    return out


def test_the_description_names_the_engines_forward_order():
    """The forwards run in the engine's order (reference, reward, critic)."""
    assert tuple(FORWARD_OUTPUTS) == FORWARD_ROLES


CELLS = {
    "flattening": (flattening_plan(2), _module, 8),
    "interleaving": (interleaving_plan(2), _module, 8),
    "separation": (separation_plan(2), _module, 8),
    "separation-overlap": (separation_plan(2, max_staleness=1), _module, 8),
    "separation-free-k0": (separation_plan(2, max_staleness=0, free_running=True), _module, 8),
    "separation-free-k1": (separation_plan(2, max_staleness=1, free_running=True), _module, 8),
    "grpo-dynamic-sampling": (separation_plan(2, roles=GRPO_ROLES), _dynamic_module, 4),
}


@pytest.mark.parametrize("cell", list(CELLS))
def test_a_traced_iteration_equals_the_description_and_the_cost_model(tmp_path, monkeypatch, tokenizer, cell):
    """Every rank of a real run takes, in every iteration, exactly the steps of its recipe in that order (with the
    generation rounds the update took), and the cost model prices the same steps for it."""
    plan, make, batch_size = CELLS[cell]
    _record_iterations(monkeypatch, tmp_path)
    traced = _run(tmp_path, make(tokenizer), plan, tokenizer, batch_size)
    workload = workload_from_module(make(tokenizer), batch_size, 8)
    cluster = parse_cluster(f"1x{plan.world_size}xcpu")
    for rank, iterations in enumerate(traced):
        assert len(iterations) == ITERATIONS
        for i, iteration in enumerate(iterations):
            steps, rounds = iteration["steps"], iteration["rounds"]
            assert steps == _described(plan, rank, i, rounds), (rank, i)
            model = CostModel(cluster, replace(workload, generation_rounds=rounds))
            assert steps == _priced(model, plan, rank, min(i, 1)), (rank, i)  # iterations >= 1 repeat the 2nd
    _check_the_cell(cell, traced)


def _check_the_cell(cell: str, traced: list[list[dict]]) -> None:
    """What each cell shows beyond the comparison: the full trace of a generating rank, the rounds that happened."""
    if cell == "separation":  # rank 0 generates, rank 1 trains: world gathers, a blocking reallocation
        assert traced[0][1]["steps"] == [
            ["call", "actor.generate"], ["gather", "actor.generate"], ["call", "reference.forward"],
            ["call", "reward.forward"], ["call", "critic.forward"], ["gather", "reference.forward"],
            ["gather", "reward.forward"], ["gather", "critic.forward"], ["broadcast", "actor.train", "stats"],
            ["broadcast", "critic.train", "stats"], ["broadcast", "actor.train", "lr"],
            ["broadcast", "critic.train", "lr"], ["reallocate", "actor"], ["reallocate", "critic"],
        ]
    if cell == "separation-free-k1":  # the two sides meet only through the handoff and the published weights
        among = "among actor.generate"
        assert traced[0][1]["steps"] == [
            ["take", "weights"], ["call", "actor.generate"], ["gather", "actor.generate", among],
            ["call", "reference.forward"], ["call", "reward.forward"], ["call", "critic.forward"],
            ["gather", "reference.forward", among], ["gather", "reward.forward", among],
            ["gather", "critic.forward", among], ["send", "experience"],
        ]
        assert traced[1][1]["steps"] == [
            ["receive", "experience"], ["call", "actor.train"],
            ["broadcast", "actor.train", "stats", "among actor.train"], ["call", "critic.train"],
            ["broadcast", "critic.train", "stats", "among critic.train"],
            ["broadcast", "actor.train", "lr", "among actor.train"],
            ["broadcast", "critic.train", "lr", "among critic.train"], ["publish", "actor"], ["publish", "critic"],
        ]
    if cell == "grpo-dynamic-sampling":  # refill rounds happened, and every rank counted the same ones
        rounds = [[iteration["rounds"] for iteration in rank] for rank in traced]
        assert rounds[0] == rounds[1] and max(rounds[0]) >= 2, rounds
