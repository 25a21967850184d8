"""``fabric.save`` / ``fabric.load`` under the Fabric placement strategies: the file holds what a Trainer checkpoint
holds (every role's weights once, every trained role's optimizer and scheduler state, taken from the ranks that own
them), sealed, read weights-only, and a run resumed from it continues exactly.

The runs are this file run as a script on 2 CPU processes (gloo): Fabric's launcher re-runs it once per rank.
"""

from __future__ import annotations

import argparse
import csv
import functools
import json
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import ROOT, make_module, one_thread_env, run_python
from lightning.fabric import Fabric
from lightning.fabric.loggers import Logger

COMPARED = ("reward/mean", "reward/std", "kl/mean", "kl/coef", "policy/loss", "policy/clipfrac", "policy/approx_kl",
            "policy/entropy", "value/loss", "value/clipfrac", "response/length_mean")


class Rows(Logger):
    """Keeps every logged row in memory (on every rank: the values are the same on all of them)."""

    def __init__(self) -> None:
        super().__init__()
        self.rows: list[dict[str, float]] = []

    @property
    def name(self) -> str:
        return "rows"

    @property
    def version(self) -> int:
        return 0

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        self.rows.append({"step": step, **metrics})

    def log_hyperparams(self, params: Any, *args: Any, **kwargs: Any) -> None:
        pass


def run(argv: list[str]) -> None:
    """One rank of a Separation run on 2 processes (or ``--fsdp2``: Flattening, each trained role sharded over
    both ranks): ``--iterations`` PPO iterations, optionally resumed from ``--resume`` and saved to ``--save``
    after ``--save-at`` iterations (each rank then dumps its live optimizer, scheduler and weights). Rank 0 writes
    the logged rows, what ``fabric.load`` returned, and the error of loading each ``--refused`` file."""
    from lightning_app_rlhf import GenerationConfig, PPOConfig, PromptDataModule, demo
    from lightning_app_rlhf.checkpoint.format import CheckpointError
    from lightning_app_rlhf.parallel.plan import flattening_plan
    from lightning_app_rlhf.strategies import FabricPlacementStrategy

    parser = argparse.ArgumentParser()
    parser.add_argument("out", type=Path)
    parser.add_argument("--iterations", type=int, required=True)
    parser.add_argument("--save")
    parser.add_argument("--save-at", type=int)
    parser.add_argument("--resume")
    parser.add_argument("--refused", nargs="*", default=[])
    parser.add_argument("--fsdp2", action="store_true", help="Flattening with FSDP2 roles instead (sharded saves)")
    args = parser.parse_args(argv)
    rows = Rows()
    strategy = FabricPlacementStrategy(plan=functools.partial(flattening_plan, wrapper="fsdp2")) if args.fsdp2 \
        else "rlhf_separation"
    fabric = Fabric(accelerator="cpu", devices=2, strategy=strategy, loggers=rows)
    fabric.launch()
    fabric.seed_everything(0)
    tokenizer = demo.build_tokenizer()
    module = make_module(
        tokenizer=tokenizer, generation=GenerationConfig(max_new_tokens=8),
        ppo=PPOConfig(ppo_epochs=2, num_minibatches=2, kl_target=1.0, kl_horizon=100, reward_norm=True),
        actor_optimizer=lambda params: torch.optim.AdamW(params, lr=1e-3),
        critic_optimizer=lambda params: torch.optim.AdamW(params, lr=1e-3),
        actor_scheduler=lambda optimizer: torch.optim.lr_scheduler.ExponentialLR(optimizer, gamma=0.5),
    )
    module = fabric.strategy.setup_rlhf(fabric, module)
    refusals = []
    for path in args.refused:
        try:
            fabric.load(path, {"model": module})
            refusals.append(None)
        except CheckpointError as err:
            refusals.append(str(err))
    remainder = None
    if args.resume:  # the module's optimizers may be passed (an empty list on rank 0): they come with the module
        remainder = fabric.load(args.resume, {"model": module, "optimizers": module.optimizers()})
    data = PromptDataModule(demo.prompts(), tokenizer, batch_size=8)
    data.setup("fit")
    loader = data.train_dataloader()
    loader.sampler.start_batch = module.iteration  # the data continues where the saved run was
    while module.iteration < args.iterations:
        for batch in loader:
            module.training_step(fabric.to_device(batch), module.iteration)
            if module.iteration == args.save_at:
                fabric.save(args.save, {"model": module, "optimizers": module.optimizers(), "note": {"run": "full"}})
                live = {
                    "optimizers": {role: module.placed_roles.wrappers[role].optimizer.state_dict()
                                   for role in module.trained_roles()},
                    "schedulers": [scheduler.state_dict() for scheduler in fabric.strategy.lr_schedulers],
                    "weights": {role: module.role_module(role).state_dict() for role in module.trained_roles()},
                }
                torch.save(live, args.out / f"live_rank{fabric.global_rank}.pt")
            if module.iteration >= args.iterations:
                break
    if fabric.is_global_zero:
        result = {"rows": rows.rows, "refusals": refusals, "remainder": remainder}
        (args.out / "result.json").write_text(json.dumps(result))


def launch(out: Path, *args: str) -> dict[str, Any]:
    out.mkdir(parents=True, exist_ok=True)
    run_python(__file__, out, *args, cwd=out, timeout=240, env=one_thread_env(PYTHONFAULTHANDLER="1"))
    return json.loads((out / "result.json").read_text())


def assert_same_state(saved: Any, live: Any, where: str) -> None:
    """Equal nested states: tensors bit for bit, plain values equal."""
    if isinstance(live, dict):
        assert isinstance(saved, dict) and set(saved) == set(live), (where, sorted(saved), sorted(live))
        for key in live:
            assert_same_state(saved[key], live[key], f"{where}/{key}")
    elif isinstance(live, (list, tuple)):
        assert len(saved) == len(live), where
        for i, (got, want) in enumerate(zip(saved, live)):
            assert_same_state(got, want, f"{where}/{i}")
    elif isinstance(live, torch.Tensor):
        assert torch.equal(saved, live), where
    else:
        assert saved == live, where


def test_fabric_save_under_separation_holds_every_role_and_resumes_exactly(tmp_path):
    """Separation on 2 processes: the actor and critic train on rank 1 only, rank 0 holds their shadows and the
    reference. ``fabric.save`` of the module (with its optimizers, an empty list on rank 0, and a plain entry)
    after 2 iterations writes one sealed file with each role's weights once and the actor's and critic's optimizer
    (and the actor's scheduler) state equal to rank 1's live state; a fresh run loaded from it logs at iteration 3
    what the uninterrupted run logged. A bit-flipped copy and a crafted pickle are refused, naming the file, before
    anything is loaded."""
    from test_checkpoint_safety import crafted_checkpoint, flip_tensor_bytes

    from lightning_app_rlhf.checkpoint.format import (
        OPTIMIZERS_KEY,
        SCHEDULERS_KEY,
        load_checkpoint_file,
        verify,
    )

    checkpoint_path = tmp_path / "iteration=2.ckpt"
    full = launch(tmp_path / "full", "--iterations", "3", "--save", str(checkpoint_path), "--save-at", "2")

    checkpoint = load_checkpoint_file(checkpoint_path)  # weights-only
    verify(checkpoint, checkpoint_path)
    assert "rlhf_checksum" in checkpoint
    live = torch.load(tmp_path / "full" / "live_rank1.pt", weights_only=True)  # rank 1 trains both roles
    assert sorted(checkpoint.get(OPTIMIZERS_KEY, {})) == ["actor", "critic"]
    for role in ("actor", "critic"):
        assert live["optimizers"][role]["state"], role  # Adam moments exist after 2 iterations
        assert_same_state(checkpoint[OPTIMIZERS_KEY][role], live["optimizers"][role], f"{role} optimizer")
        weights = {k[len(role) + 1:]: v for k, v in checkpoint["state_dict"].items() if k.startswith(f"{role}.")}
        assert_same_state(weights, live["weights"][role], f"{role} weights")
    assert_same_state(checkpoint[SCHEDULERS_KEY], {"actor": live["schedulers"][0]}, "schedulers")
    assert {key.split(".")[0] for key in checkpoint["state_dict"]} == {"actor", "critic", "reference"}
    assert checkpoint["global_step"] == 2 and checkpoint["rlhf"]["seed"] == 0
    assert checkpoint["note"] == {"run": "full"} and "optimizers" not in checkpoint  # a user entry; no empty list

    corrupted = tmp_path / "corrupted.ckpt"
    corrupted.write_bytes(checkpoint_path.read_bytes())
    flip_tensor_bytes(corrupted)
    crafted, marker = crafted_checkpoint(tmp_path)
    resumed = launch(tmp_path / "resumed", "--iterations", "3", "--resume", str(checkpoint_path),
                     "--refused", str(corrupted), str(crafted))
    assert resumed["refusals"][0] is not None and f"Checkpoint {corrupted} fails its checksum" in resumed["refusals"][0]
    assert resumed["refusals"][1] is not None and "only a full unpickle can build" in resumed["refusals"][1]
    assert not marker.exists()
    assert resumed["remainder"] == {"note": {"run": "full"}}
    assert_third_iteration_equal(resumed, full)


@pytest.mark.slow  # the Trainer's sharded checkpoints are tested in test_sharded_checkpoints.py; this is the same code
def test_fabric_save_of_fsdp2_roles_writes_their_shards_and_resumes_exactly(tmp_path):
    """FSDP2 roles over 2 ranks: ``fabric.save`` writes a checkpoint directory (each rank its shards, rank 0 the
    meta file) and a fresh run loaded from it logs at iteration 3 what the uninterrupted run logged."""
    checkpoint_path = tmp_path / "iteration=2.ckpt"
    full = launch(tmp_path / "full", "--fsdp2", "--iterations", "3", "--save", str(checkpoint_path), "--save-at", "2")
    assert sorted(p.name for p in checkpoint_path.iterdir()) == ["actor", "critic", "meta.ckpt"]
    resumed = launch(tmp_path / "resumed", "--fsdp2", "--iterations", "3", "--resume", str(checkpoint_path))
    assert_third_iteration_equal(resumed, full)


def assert_third_iteration_equal(resumed: dict[str, Any], full: dict[str, Any]) -> None:
    assert [row["step"] for row in resumed["rows"]] == [2]
    (want,) = [row for row in full["rows"] if row["step"] == 2]
    for metric in COMPARED:
        assert resumed["rows"][0][metric] == pytest.approx(want[metric], rel=1e-5, abs=1e-7), metric


@pytest.mark.slow  # the same fabric.save / fabric.load calls as above, through the example's options
def test_fabric_demo_saves_and_resumes(tmp_path):
    """examples/fabric_demo.py: ``--save`` after its iterations, ``--resume`` continues from the next one."""
    checkpoint = tmp_path / "last.ckpt"
    for steps, option in (("1", "--save"), ("2", "--resume")):
        result = run_python(ROOT / "examples/fabric_demo.py", "--strategy", "rlhf_separation", "--devices", "2",
                            "--steps", steps, "--max-new-tokens", "4", "--log-dir", tmp_path / option[2:], option,
                            checkpoint, cwd=tmp_path, timeout=240)
        assert f"rlhf_separation on 2 processes, {steps} PPO iterations" in result.stdout
    (metrics,) = (tmp_path / "resume").rglob("metrics.csv")
    assert [row["step"] for row in csv.DictReader(metrics.open())] == ["1"]


if __name__ == "__main__":
    run(sys.argv[1:])
