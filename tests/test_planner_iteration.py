"""The engine's iteration, as it runs, equals its description (``lightning_app_rlhf.engine.iteration``) and the cost model's
task list: real iterations on 2 forked gloo processes, with the engine's calls and the ``Placement`` collectives
wrapped (in this test only) to record what each rank ran, in order."""

from __future__ import annotations

import functools
import json
from pathlib import Path

import lightning.pytorch as pl
import pytest
from helpers import make_module

from lightning_app_rlhf import GenerationConfig, PPOConfig, PromptDataModule, RLHFModule, demo
from lightning_app_rlhf.engine.engine import FORWARD_OUTPUTS, RLHFEngine
from lightning_app_rlhf.engine.iteration import FORWARD_ROLES, iteration_steps
from lightning_app_rlhf.parallel.placement import Placement
from lightning_app_rlhf.parallel.plan import (
    PlacementPlan,
    flattening_plan,
    interleaving_plan,
    separation_plan,
)
from lightning_app_rlhf.planner import CostModel, PlanChoice, parse_cluster, workload_from_module

ITERATIONS = 3


def _module(tokenizer) -> RLHFModule:
    return make_module(tokenizer=tokenizer, generation=GenerationConfig(max_new_tokens=6),
                       ppo=PPOConfig(num_minibatches=2))


def _record_iterations(monkeypatch: pytest.MonkeyPatch, out: Path) -> None:
    """Wrap the engine's calls and the placement's collectives so that each rank writes, per iteration, the steps
    it took: ``["call", name]``, ``["gather", call]``, ``["broadcast", call, "stats" | "lr"]``,
    ``["reallocate", role]``. Forked ranks inherit the wrappers."""
    trace: list[list[str]] = []
    active = [False]

    def record(*entry: str) -> None:
        if active[0]:
            trace.append(list(entry))

    def wrap(cls, name, entry):
        original = getattr(cls, name)

        @functools.wraps(original)
        def wrapped(self, *args, **kwargs):
            step = entry(self, *args, **kwargs)
            if step is not None:
                record(*step)
            return original(self, *args, **kwargs)

        monkeypatch.setattr(cls, name, wrapped)

    wrap(RLHFEngine, "generate_shard",
         lambda self, *a, **k: ("call", "actor.generate") if self.placement.runs("actor.generate") else None)
    wrap(RLHFEngine, "forward_shard",
         lambda self, role, *a, **k: ("call", f"{role}.forward") if self.placement.runs(f"{role}.forward") else None)
    wrap(RLHFEngine, "_update", lambda self, role, *a, **k: ("call", f"{role}.train"))
    wrap(Placement, "gather_to_world", lambda self, call, *a, **k: ("gather", call))
    wrap(Placement, "broadcast_stats",
         lambda self, call, stats, names, *a, **k: ("broadcast", call,
                                                    "lr" if next(iter(names)).startswith("lr-") else "stats"))
    wrap(Placement, "reallocate_weights", lambda self, role, *a, **k: ("reallocate", role))

    original_iteration = RLHFEngine.run_iteration

    def run_iteration(self, *args, **kwargs):  # one whole iteration: its steps, then save them
        trace.clear()
        active[0] = True
        try:
            return original_iteration(self, *args, **kwargs)
        finally:
            active[0] = False
            with (out / f"trace{self.placement.rank}.jsonl").open("a") as f:
                f.write(json.dumps(trace) + "\n")

    monkeypatch.setattr(RLHFEngine, "run_iteration", run_iteration)


def _run(tmp_path: Path, tokenizer, plan: PlacementPlan) -> list[list[list[list[str]]]]:
    """Train ``plan`` for :data:`ITERATIONS` iterations on its processes; each rank's steps per iteration."""
    from lightning_app_rlhf.strategies import PlacementStrategy

    trainer = pl.Trainer(
        accelerator="cpu", devices=plan.world_size, max_steps=ITERATIONS, logger=False, enable_progress_bar=False,
        enable_model_summary=False, enable_checkpointing=False, default_root_dir=tmp_path,
        strategy=PlacementStrategy(plan=plan, start_method="fork", timeout=120),
    )
    trainer.fit(_module(tokenizer), PromptDataModule(demo.prompts(32), tokenizer, batch_size=8))
    return [[json.loads(line) for line in (tmp_path / f"trace{r}.jsonl").read_text().splitlines()]
            for r in range(plan.world_size)]


def _described(plan: PlacementPlan, rank: int, iteration: int) -> list[list[str]]:
    """What :func:`iteration_steps` says ``rank`` does in ``iteration``."""
    return [[s.kind, s.name, *([s.what] if s.what else [])]
            for s in iteration_steps(plan, first=iteration == 0) if rank in s.ranks]


def _priced(model: CostModel, plan: PlacementPlan, rank: int, iteration: int) -> list[list[str]]:
    """The cost model's tasks of ``rank`` in ``iteration``, as trace entries (communication tails of calls are part
    of their call)."""
    out = []
    for task in model.tasks(PlanChoice(plan)):
        name, number = task.name.rsplit("#", 1)
        if int(number) != iteration or rank not in task.ranks or name.endswith(":comm"):
            continue
        role, what = name.split(".", 1)
        if role == "gather":
            out.append(["gather", "actor.generate" if what == "rollout" else f"{what}.forward"])
        elif what in ("stats", "lr"):
            out.append(["broadcast", f"{role}.train", what])
        elif what == "reallocate":
            out.append(["reallocate", role])
        else:
            out.append(["call", name])
    return out


def test_the_description_names_the_engines_forward_order():
    """The forwards run in the engine's order (reference, reward, critic)."""
    assert tuple(FORWARD_OUTPUTS) == FORWARD_ROLES


@pytest.mark.parametrize("plan", [
    flattening_plan(2), interleaving_plan(2), separation_plan(2), separation_plan(2, max_staleness=1),
], ids=["flattening", "interleaving", "separation", "separation-overlap"])
def test_a_traced_iteration_equals_the_description_and_the_cost_model(tmp_path, monkeypatch, tokenizer, plan):
    """Every rank of a real run takes, in every iteration, exactly the steps of ``iteration_steps`` in that order,
    and the cost model prices the same steps for it."""
    _record_iterations(monkeypatch, tmp_path)
    traced = _run(tmp_path, tokenizer, plan)
    model = CostModel(parse_cluster(f"1x{plan.world_size}xcpu"), workload_from_module(_module(tokenizer), 8, 8))
    for rank, iterations in enumerate(traced):
        assert len(iterations) == ITERATIONS
        for i, steps in enumerate(iterations):
            assert steps == _described(plan, rank, i), (rank, i)
            assert steps == _priced(model, plan, rank, min(i, 1)), (rank, i)  # iterations >= 1 repeat the 2nd
    if plan.name == "separation" and not plan.overlap:  # what the trace shows, in full, for rank 0 (generation)
        assert traced[0][1] == [
            ["call", "actor.generate"], ["gather", "actor.generate"], ["call", "reference.forward"],
            ["call", "reward.forward"], ["call", "critic.forward"], ["gather", "reference.forward"],
            ["gather", "reward.forward"], ["gather", "critic.forward"], ["broadcast", "actor.train", "stats"],
            ["broadcast", "critic.train", "stats"], ["reallocate", "actor"], ["reallocate", "critic"],
            ["broadcast", "actor.train", "lr"], ["broadcast", "critic.train", "lr"],
        ]
