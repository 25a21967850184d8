"""``PlacementStrategy(start_method="fork")``: after ``trainer.fit(model)`` the main process's module holds the trained
roles, bit for bit what the ranks trained, whatever the plan keeps on rank 0 (a shard, or no copy at all)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch.distributed as dist
from helpers import make_module
from lightning.pytorch.callbacks import Callback

from lightning_app_rlhf import GenerationConfig, PPOConfig, PromptDataModule, RLHFModule, demo
from lightning_app_rlhf.parallel.plan import PlacementPlan, flattening_plan, separation_plan


def _digest(tensors) -> str:
    sha = hashlib.sha256()
    for t in tensors:
        sha.update(t.detach().cpu().contiguous().numpy().tobytes())
    return sha.hexdigest()


class TrainedDigests(Callback):
    """At the start and end of fit, in the ranks: a SHA-256 of each trained role's trainable weights, gathered
    through its wrapper by its train group; the group's leader writes them to ``directory``."""

    def __init__(self, directory: str) -> None:
        self.directory = directory

    def _record(self, pl_module: RLHFModule, when: str) -> None:
        placement = pl_module.placed_roles.placement
        for role in pl_module.trained_roles():
            digest = _digest(p for bucket in pl_module.placed_roles.wrappers[role].full_parameter_buckets() for p in bucket)
            if placement.rank == placement.leader(f"{role}.train"):
                Path(self.directory, f"{when}_{role}.txt").write_text(digest)
        dist.barrier()

    def on_train_start(self, trainer: pl.Trainer, pl_module: RLHFModule) -> None:
        self._record(pl_module, "start")

    def on_train_end(self, trainer: pl.Trainer, pl_module: RLHFModule) -> None:
        self._record(pl_module, "end")


@pytest.mark.parametrize("plan", [
    pytest.param(flattening_plan(2, wrapper="fsdp2"), id="flattening-fsdp2"),  # rank 0 holds shards: gathered
    pytest.param(separation_plan(2), id="separation-ddp"),  # rank 1 trains, rank 0 holds shadows: rank 1 sends
])
def test_the_main_process_gets_the_trained_roles(tmp_path, tokenizer, plan: PlacementPlan):
    from lightning_app_rlhf.strategies import PlacementStrategy

    module = make_module(generation=GenerationConfig(max_new_tokens=8), ppo=PPOConfig(num_minibatches=1))
    if dist.is_initialized():  # an earlier in-process test's 1-rank group: forked children inherit it
        dist.destroy_process_group()
    trainer = pl.Trainer(
        accelerator="cpu", devices=2, max_steps=2, logger=False, enable_progress_bar=False,
        enable_model_summary=False, enable_checkpointing=False, default_root_dir=tmp_path,
        strategy=PlacementStrategy(plan=plan, start_method="fork", timeout=120),
        callbacks=[TrainedDigests(str(tmp_path))],
    )
    assert module.actor is None  # the main process builds nothing before fit
    trainer.fit(module, PromptDataModule(demo.prompts(16), tokenizer, batch_size=8))

    for role in ("actor", "critic"):
        here = _digest(p for p in module.role_module(role).parameters() if p.requires_grad)
        assert here == (tmp_path / f"end_{role}.txt").read_text(), role
        assert here != (tmp_path / f"start_{role}.txt").read_text(), role  # it did train
    assert module.reference is not None  # built from its spec (the initial actor), as the ranks built it
    print(json.dumps({role: (tmp_path / f"end_{role}.txt").read_text()[:12] for role in ("actor", "critic")}))
