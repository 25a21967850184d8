"""Parallel wrappers as objects: the registry, micro-batches, and DDP, FSDP2 and ZeRO 1-3 under every placement
on 2 and 4 CPU processes (gloo; DeepSpeed on its CPU accelerator)."""

from __future__ import annotations

import json
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from helpers import fit_demo, make_module, one_thread_env

from lightning_app_rlhf import GenerationConfig, PPOConfig, PromptDataModule, RLHFModule, demo
from lightning_app_rlhf.engine.batch_split import check_micro_batches
from lightning_app_rlhf.parallel.plan import flattening_plan, separation_plan
from lightning_app_rlhf.parallel.wrappers import (
    FROZEN_WRAPPERS,
    SHARDED_WRAPPERS,
    WRAPPERS,
    available_wrappers,
    is_available,
)

COMPARED = ("reward/mean", "reward/std", "kl/mean", "policy/loss", "policy/clipfrac", "policy/approx_kl",
            "policy/entropy", "value/loss", "value/clipfrac", "response/length_mean")
PLACEMENTS = {"flattening": "FlatteningStrategy", "interleaving": "InterleavingStrategy",
              "separation": "SeparationStrategy"}
DEFAULT_RUN = {("zero3", "separation", 4), ("zero2", "interleaving", 2), ("fsdp2", "flattening", 2)}
"""The matrix cells the default test run covers; ``pytest -m slow`` runs the rest."""
needs_deepspeed = pytest.mark.skipif(not is_available("zero1"), reason="deepspeed is not installed")


# ---- the registry ----


def test_one_registry_describes_every_wrapper():
    assert list(WRAPPERS) == ["ddp", "fsdp2", "zero1", "zero2", "zero3"]
    assert SHARDED_WRAPPERS == ("fsdp2", "zero3") and FROZEN_WRAPPERS == ("fsdp2", "zero3")
    assert [WRAPPERS[n].shards_grads for n in WRAPPERS] == [False, True, False, True, True]
    assert [WRAPPERS[n].shards_optimizer for n in WRAPPERS] == [False, True, True, True, True]
    assert set(available_wrappers()) == {n for n in WRAPPERS if is_available(n)} >= {"ddp", "fsdp2"}


def test_plans_name_the_choices_and_the_install_command(monkeypatch):
    with pytest.raises(ValueError, match=r"Role 'actor' has wrapper 'zero0'; choose one of \['ddp', 'fsdp2', 'zero1'"):
        flattening_plan(2, wrapper="zero0")
    monkeypatch.setattr("importlib.util.find_spec", lambda name, *a: None if name == "deepspeed" else object())
    with pytest.raises(ValueError, match=r"deepspeed is not installed.*pip install 'lightning-app-rlhf\[deepspeed\]'"):
        separation_plan(4, wrapper="zero2")
    assert available_wrappers() == ("ddp", "fsdp2")


# ---- micro-batches ----


def _fit(tokenizer, micro_batch_size: int | None) -> tuple[RLHFModule, list[float]]:
    pl.seed_everything(0)
    module = make_module(
        generation=GenerationConfig(max_new_tokens=10),
        ppo=PPOConfig(kl_coef=0.01, num_minibatches=2, ppo_epochs=2, micro_batch_size=micro_batch_size),
        actor_optimizer=lambda p: torch.optim.SGD(p, lr=0.5), critic_optimizer=lambda p: torch.optim.SGD(p, lr=0.5),
    )
    losses: list[float] = []

    class Record(pl.Callback):
        def on_train_start(self, trainer, pl_module):
            pl_module.initial_wte = pl_module.actor.transformer.wte.weight.detach().clone()

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            losses.append(trainer.callback_metrics["policy/loss"].item())

    trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=2, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, callbacks=[Record()])
    trainer.fit(module, PromptDataModule(demo.prompts(64), tokenizer, batch_size=12))
    return module, losses


def test_micro_batches_give_the_update_of_one_pass(tokenizer):
    """Minibatches of 6 samples in micro-batches of 2 (and of 4: uneven, 4 + 2) accumulate the gradient of one
    pass: the same weights and losses within float tolerance after two iterations of 2 epochs x 2 minibatches.
    (SGD, whose update is the gradient: Adam would blow float noise on the gradient-free attention key bias up to
    full-size steps.)"""
    whole, whole_losses = _fit(tokenizer, None)
    for size in (2, 4):
        micro, micro_losses = _fit(tokenizer, size)
        assert micro_losses == pytest.approx(whole_losses, rel=1e-5, abs=1e-7)
        for role in ("actor", "critic"):
            for (name, a), b in zip(getattr(whole, role).named_parameters(), getattr(micro, role).parameters()):
                torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=f"{role}.{name}")
    assert not torch.equal(whole.actor.transformer.wte.weight, whole.initial_wte)  # the updates moved the weights


def test_micro_batch_size_that_cannot_split_every_share_evenly_is_refused():
    check_micro_batches("actor", 15, 3, 1)  # shares of 5: 5 micro-batches of 1 each
    with pytest.raises(ValueError, match=r"ppo.micro_batch_size=1 .* 16-sample minibatch .* 6 micro-batches.*"
                                         r"smallest share has 5 samples. Use ppo.micro_batch_size >= 2"):
        check_micro_batches("actor", 16, 3, 1)  # shares 6, 5, 5: 6 micro-batches of 1 do not fit in 5


# ---- every wrapper under every placement ----


def run_demo(tmp_path: Path, name: str, *args: str) -> list[dict[str, float]]:
    """Three iterations of the demo config through the CLI (DeepSpeed on its CPU accelerator); its metrics.csv rows."""
    return fit_demo(tmp_path, name, *args, timeout=400, env=one_thread_env(tests=True, DS_ACCELERATOR="cpu"))


EXPORT = ("--trainer.callbacks+=lightning_app_rlhf.callbacks.ExportActor", "--trainer.callbacks.dirpath=exported")


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    """The demo on one process: the trajectory every wrapper and placement must log, and its exported actor."""
    tmp_path = tmp_path_factory.mktemp("single")
    rows = run_demo(tmp_path, "single", *EXPORT)
    return [r for r in rows if "reward/mean" in r], _exported(tmp_path)


def _exported(tmp_path: Path) -> dict[str, torch.Tensor]:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tmp_path / "exported").state_dict()


def _cells():
    for wrapper in ("fsdp2", "zero1", "zero2", "zero3"):
        for placement in PLACEMENTS:
            for devices in (2, 4):
                slow = (wrapper, placement, devices) not in DEFAULT_RUN
                marks = [pytest.mark.slow] if slow else []
                if wrapper.startswith("zero"):
                    marks.append(needs_deepspeed)
                yield pytest.param(wrapper, placement, devices, marks=marks, id=f"{wrapper}-{placement}-{devices}")


@pytest.mark.parametrize("wrapper,placement,devices", list(_cells()))
def test_every_wrapper_logs_the_one_process_trajectory(tmp_path, one_process, wrapper, placement, devices):
    """Actor and critic under ``wrapper`` log the one-process (DDP-equivalent) values step by step; under
    Separation, the shadows hold the trained weights bit for bit after every update (sharded ones gathered);
    micro-batches of 4 change nothing; the exported actor (gathered when sharded) equals the one-process one;
    the per-rank parameter, gradient and optimizer bytes logged are the planner's prediction, exactly."""
    from test_planner import demo_workload

    from lightning_app_rlhf.parallel.plan import interleaving_plan
    from lightning_app_rlhf.planner import CostModel, parse_cluster

    digests = tmp_path / "digests.json"
    extra = ["--model.ppo.micro_batch_size", "4"] if wrapper == "zero3" else []
    if placement == "separation":
        extra += ["--trainer.callbacks+=weight_check_callback.WeightCopiesEqual", f"--trainer.callbacks.path={digests}"]
    rows = run_demo(tmp_path, "run", "--trainer.devices", str(devices), "--trainer.strategy",
                    f"lightning_app_rlhf.strategies.{PLACEMENTS[placement]}", "--trainer.strategy.wrapper", wrapper,
                    *EXPORT, *extra)
    logged = [r for r in rows if "reward/mean" in r]
    reference, exported = one_process
    assert [r["step"] for r in logged] == [0, 1, 2]
    for step, (got, want) in enumerate(zip(logged, reference, strict=True)):
        for metric in COMPARED:
            assert got[metric] == pytest.approx(want[metric], rel=1e-4, abs=1e-6), (step, metric)
    for key, value in _exported(tmp_path).items():
        torch.testing.assert_close(value, exported[key], rtol=1e-3, atol=1e-4, msg=key)
    plan = {"flattening": flattening_plan, "interleaving": interleaving_plan,
            "separation": separation_plan}[placement](devices, wrapper=wrapper)
    predicted = CostModel(parse_cluster(f"1x{devices}xcpu"), demo_workload(wrappers=(wrapper,))).static_memory(plan)
    memory = next(r for r in rows if "memory/param_bytes_rank0" in r)
    for rank, row in enumerate(predicted):
        logged_bytes = [memory[f"memory/{kind}_bytes_rank{rank}"] for kind in ("param", "grad", "optimizer")]
        assert logged_bytes == [row.weights, row.grads, row.optimizer], rank
    if placement == "separation":
        records = json.loads(digests.read_text())
        assert len(records) == 3
        for ranks in records:
            for role in ("actor", "critic"):
                assert len({r[role] for r in ranks}) == 1, role
        assert len({ranks[0]["actor"] for ranks in records}) == 3  # the weights moved every iteration
        assert all(r["reallocate/bytes"] > 1_000_000 for r in logged)


# ---- the tuner runs the planner's batch sizes ----


def test_tuner_applies_the_planners_generation_batch_and_micro_batch(tokenizer, monkeypatch):
    """When the planner's best plan fits only with a generation batch of 4 and micro-batches of 2, the run
    samples and scores in chunks of 4 and trains in micro-batches of 2; a smaller size the user gave stays."""
    import dataclasses

    from lightning_app_rlhf import planner
    from lightning_app_rlhf.callbacks import PlacementTuner
    from lightning_app_rlhf.models import calls

    real = planner.plan_placement

    def plan_with_batches(*args, **kwargs):
        result = real(*args, **kwargs)
        best = result.best
        estimate = dataclasses.replace(best.estimate, choice=dataclasses.replace(best.choice, generation_batch=4,
                                                                                 micro_batch=2))
        result.best = dataclasses.replace(best, estimate=estimate)
        return result

    monkeypatch.setattr(planner, "plan_placement", plan_with_batches)
    chunks: list[int] = []
    real_chunks = calls.row_chunks
    monkeypatch.setattr(calls, "row_chunks", lambda n, size, *a, **k: chunks.append(size) or real_chunks(n, size, *a, **k))
    seen: list[tuple] = []

    class Record(pl.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            seen.append((pl_module.generation.batch_size, pl_module.ppo.micro_batch_size))

    module = make_module(generation=GenerationConfig(max_new_tokens=8), ppo=PPOConfig(num_minibatches=2))
    tuner = PlacementTuner(search="presets", profile=False, cluster="1x1xcpu")
    trainer = pl.Trainer(accelerator="cpu", devices=1, strategy="rlhf_flattening", max_steps=2, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         callbacks=[tuner, Record()])
    trainer.fit(module, PromptDataModule(demo.prompts(32), tokenizer, batch_size=8))
    assert tuner.batch_sizes == {"generation.batch_size": 4, "ppo.micro_batch_size": 2}
    assert seen == [(4, 2), (4, 2)]
    assert tuner.state_dict()["batch_sizes"] == tuner.batch_sizes  # a resume runs them too
    assert chunks and set(chunks) == {4}  # the scoring forwards ran in chunks of 4


# ---- the planner proposes only what the strategies run ----


@pytest.mark.parametrize("wrapper", [pytest.param(w, marks=[needs_deepspeed] if WRAPPERS[w].package else [])
                                     for w in WRAPPERS])
def test_the_planners_choice_with_each_wrapper_runs(tmp_path, tokenizer, wrapper):
    """``plan`` restricted to one wrapper returns a plan that the strategy accepts and trains for 2 iterations
    on 2 processes, with the planner's batch sizes, checkpoints on."""
    import dataclasses

    from lightning.pytorch.callbacks import ModelCheckpoint

    from lightning_app_rlhf.planner import parse_cluster, plan_placement, workload_from_module
    from lightning_app_rlhf.strategies import PlacementStrategy

    def module() -> RLHFModule:
        return make_module(generation=GenerationConfig(max_new_tokens=8), ppo=PPOConfig(num_minibatches=2))

    workload = dataclasses.replace(workload_from_module(module(), 8, 8), wrappers=(wrapper,))
    best = plan_placement(parse_cluster("1x2xcpu"), workload, search="both", time_budget_s=1.0,
                          mcmc_steps=200).best
    assert {best.plan.wrappers[r] for r in best.plan.trainable_roles} == {wrapper}
    rlhf = module()
    rlhf.generation.batch_size, rlhf.ppo.micro_batch_size = best.choice.generation_batch, best.choice.micro_batch
    if torch.distributed.is_initialized():  # an earlier in-process test's 1-rank group: forked children inherit it
        torch.distributed.destroy_process_group()
    trainer = pl.Trainer(
        accelerator="cpu", devices=2, max_steps=2, logger=False, enable_progress_bar=False,
        enable_model_summary=False, default_root_dir=tmp_path,
        strategy=PlacementStrategy(plan=best.plan, start_method="fork", timeout=120),
        callbacks=[ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=2)],
    )
    trainer.fit(rlhf, PromptDataModule(demo.prompts(32), tokenizer, batch_size=8))
    (saved,) = (tmp_path / "ckpt").iterdir()  # the fork launcher keeps the children's loop state to them
    assert saved.name == "epoch=0-step=2.ckpt"
