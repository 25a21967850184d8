"""Checkpoints we can trust: no unpickling of crafted files, corrupted and empty files refused with their name,
non-finite weights refused, one copy of each role per file, and a placement's checkpoint resumed on one process."""

from __future__ import annotations

import os
import zipfile
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from helpers import approx_or_none, fit_demo, run_python, run_ranks
from lightning.pytorch.callbacks import ModelCheckpoint
from test_placements import COMPARED

from lightning_app_rlhf import GenerationConfig, PPOConfig, PromptDataModule, RLHFModule
from lightning_app_rlhf.callbacks import PlacementTuner
from lightning_app_rlhf.checkpoint.format import (
    OPTIMIZERS_KEY,
    CheckpointError,
    checksum,
    load_checkpoint_file,
    recv_state,
    role_owner,
    seal,
    send_state,
    verify,
)
from lightning_app_rlhf.core.files import write_atomically
from lightning_app_rlhf.demo import prompts, topic_reward
from lightning_app_rlhf.parallel.plan import flattening_plan, interleaving_plan, separation_plan


class RunsCode:
    """Unpickling this creates a directory: proof that code from the file ran."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.makedirs, (str(self.marker),))


def crafted_checkpoint(tmp_path: Path) -> tuple[Path, Path]:
    marker = tmp_path / "code_ran"
    path = tmp_path / "crafted.ckpt"
    torch.save({"state_dict": {}, "payload": RunsCode(marker), "epoch": 0, "global_step": 0}, path)
    return path, marker


def small_module(config: dict, tokenizer) -> RLHFModule:
    return RLHFModule(actor={"config": config}, tokenizer=tokenizer, reward_fn=topic_reward,
                      generation=GenerationConfig(max_new_tokens=4), ppo=PPOConfig(num_minibatches=2))


def fit(module: RLHFModule, tokenizer, tmp_path: Path, steps: int, ckpt_path: Path | None = None,
        callbacks: list | None = None, **fit_kwargs) -> pl.Trainer:
    trainer = pl.Trainer(accelerator="cpu", devices=1, strategy="rlhf_flattening", max_steps=steps, logger=False,
                         enable_progress_bar=False, enable_model_summary=False, default_root_dir=tmp_path,
                         enable_checkpointing=True, callbacks=callbacks or [])
    threads = torch.get_num_threads()
    try:  # its group and rank variables are left to conftest.py's no_process_group_or_rank_variables_left_behind
        trainer.fit(module, PromptDataModule(prompts(), tokenizer, batch_size=4), ckpt_path=ckpt_path, **fit_kwargs)
    finally:
        torch.set_num_threads(threads)  # the strategy sized this process's threads for its one rank
    return trainer


@pytest.fixture
def saved(tmp_path, tiny_gpt2_config, tokenizer) -> Path:
    """A real checkpoint after 2 iterations under rlhf_flattening on one process."""
    checkpoint = ModelCheckpoint(dirpath=tmp_path / "ckpt", save_last=True)
    fit(small_module(tiny_gpt2_config, tokenizer), tokenizer, tmp_path, 2, callbacks=[checkpoint])
    return tmp_path / "ckpt" / "last.ckpt"


# ---- crafted pickles ----


RESUME_SCRIPT = """
import sys

import lightning.pytorch as pl

from lightning_app_rlhf import GenerationConfig, PPOConfig, PromptDataModule, RLHFModule
from lightning_app_rlhf.demo import build_tokenizer, prompts, topic_reward

strategy, ckpt_path = sys.argv[1:]
tokenizer = build_tokenizer()
config = {"model_type": "gpt2", "n_layer": 1, "n_embd": 32, "n_head": 2, "vocab_size": 512, "n_positions": 64,
          "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0}
module = RLHFModule(actor={"config": config}, tokenizer=tokenizer, reward_fn=topic_reward,
                    generation=GenerationConfig(max_new_tokens=4), ppo=PPOConfig(num_minibatches=2))
trainer = pl.Trainer(accelerator="cpu", devices=2, strategy=strategy, max_steps=1, logger=False,
                     enable_checkpointing=False, enable_progress_bar=False)
trainer.fit(module, PromptDataModule(prompts(), tokenizer, batch_size=4), ckpt_path=ckpt_path)
"""


@pytest.mark.parametrize("strategy", [
    *(pytest.param(s, marks=pytest.mark.slow) for s in ("rlhf_flattening", "rlhf_interleaving")),
    "rlhf_separation",  # the default run: Flattening's load is also checked in-process below
])
def test_a_crafted_pickle_runs_no_code_through_fit_under_any_placement(tmp_path, strategy):
    """``Trainer.fit(ckpt_path=...)`` on 2 processes: the strategy reads weights-only and names the file."""
    path, marker = crafted_checkpoint(tmp_path)
    script = tmp_path / "resume.py"
    script.write_text(RESUME_SCRIPT)
    result = run_python(script, strategy, path, cwd=tmp_path, timeout=240, check=False)
    assert result.returncode != 0
    assert f"CheckpointError: Checkpoint {path} holds objects that only a full unpickle can build" in result.stderr
    assert not marker.exists()


def test_a_crafted_pickle_runs_no_code_through_the_command_line(tmp_path):
    path, marker = crafted_checkpoint(tmp_path)
    with pytest.raises(AssertionError, match=f"Checkpoint {path} holds objects"):  # fit_demo asserts success
        fit_demo(tmp_path, "crafted", "--trainer.devices", "2", "--trainer.strategy", "rlhf_separation",
                 "--ckpt_path", str(path), steps=1)
    assert not marker.exists()


def test_a_crafted_pickle_runs_no_code_in_the_tuner_nor_through_fit(tmp_path, tiny_gpt2_config, tokenizer):
    path, marker = crafted_checkpoint(tmp_path)
    with pytest.raises(CheckpointError, match=f"Checkpoint {path} holds objects"):
        fit(small_module(tiny_gpt2_config, tokenizer), tokenizer, tmp_path, 1,
            callbacks=[PlacementTuner(ckpt_path=str(path), time_budget_s=1)])
    with pytest.raises(CheckpointError, match=f"Checkpoint {path} holds objects"):
        fit(small_module(tiny_gpt2_config, tokenizer), tokenizer, tmp_path, 1, ckpt_path=path)
    with pytest.raises(ValueError, match="weights_only=True only.*Drop weights_only=False"):
        fit(small_module(tiny_gpt2_config, tokenizer), tokenizer, tmp_path, 1, ckpt_path=path, weights_only=False)
    assert not marker.exists()


# ---- corrupted, empty, non-finite ----


def flip_tensor_bytes(path: Path) -> None:
    """Flip bytes in the middle of the largest tensor record of a torch.save archive (its zip stays valid)."""
    with zipfile.ZipFile(path) as archive:
        info = max((i for i in archive.infolist() if "/data/" in i.filename), key=lambda i: i.file_size)
    with open(path, "r+b") as f:
        f.seek(info.header_offset + 26)
        name_length, extra_length = (int.from_bytes(f.read(2), "little") for _ in range(2))
        start = info.header_offset + 30 + name_length + extra_length + info.file_size // 2
        f.seek(start)
        data = bytearray(f.read(8))
        f.seek(start)
        f.write(bytes(b ^ 0xFF for b in data))


def test_a_bit_flipped_checkpoint_is_refused_with_its_name(saved, tmp_path, tiny_gpt2_config, tokenizer):
    flip_tensor_bytes(saved)
    assert zipfile.is_zipfile(saved)
    with pytest.raises(CheckpointError, match=f"Checkpoint {saved} fails its checksum"):
        fit(small_module(tiny_gpt2_config, tokenizer), tokenizer, tmp_path, 3, ckpt_path=saved)


def test_non_finite_weights_are_refused_even_with_a_valid_checksum(saved, tmp_path, tiny_gpt2_config, tokenizer):
    checkpoint = load_checkpoint_file(saved)
    first = next(k for k, v in checkpoint["state_dict"].items() if v.is_floating_point())
    checkpoint["state_dict"][first] = torch.full_like(checkpoint["state_dict"][first], float("nan"))
    seal(checkpoint)
    write_atomically(saved, lambda file: torch.save(checkpoint, file))  # a new file: the loaded tensors map the old
    with pytest.raises(CheckpointError, match=rf"Checkpoint {saved} has NaN or infinite values in 1 weight tensors"):
        fit(small_module(tiny_gpt2_config, tokenizer), tokenizer, tmp_path, 3, ckpt_path=saved)


def test_an_empty_checkpoint_is_refused_with_its_name(tmp_path, tiny_gpt2_config, tokenizer):
    empty = tmp_path / "empty.ckpt"
    empty.write_bytes(b"")
    with pytest.raises(CheckpointError, match=f"Checkpoint {empty} is empty"):
        fit(small_module(tiny_gpt2_config, tokenizer), tokenizer, tmp_path, 1, ckpt_path=empty)
    # Without a placement strategy the module checks the file the run resumes from (RLHFCLI sets trainer.ckpt_path).
    module = small_module(tiny_gpt2_config, tokenizer)
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=1, logger=False, enable_progress_bar=False)
    trainer.ckpt_path = str(empty)
    with pytest.raises(CheckpointError, match=f"Checkpoint {empty} is empty"):
        trainer.fit(module, PromptDataModule(prompts(), tokenizer, batch_size=4))
    truncated = tmp_path / "truncated.ckpt"
    torch.save({"state_dict": {"w": torch.zeros(1000)}}, truncated)
    truncated.write_bytes(truncated.read_bytes()[:1500])
    with pytest.raises(CheckpointError, match=f"Checkpoint {truncated} is not a complete torch.save archive"):
        load_checkpoint_file(truncated)


def test_checksum_covers_weights_optimizer_state_and_plain_values():
    checkpoint = {"state_dict": {"w": torch.arange(4.0)}, "optimizer_states": [{"state": {0: {"step": 3}}}],
                  "rlhf": {"seed": 0}, "epoch": 1}
    seal(checkpoint)
    verify(checkpoint, "x.ckpt")
    for change in (lambda c: c["state_dict"]["w"].__setitem__(0, 1.0),
                   lambda c: c["optimizer_states"][0]["state"][0].__setitem__("step", 4),
                   lambda c: c["rlhf"].__setitem__("seed", 1),
                   lambda c: c["state_dict"].__setitem__("w", c["state_dict"]["w"].double())):
        copy = {**checkpoint, "state_dict": {"w": checkpoint["state_dict"]["w"].clone()},
                "optimizer_states": [{"state": {0: {"step": 3}}}], "rlhf": {"seed": 0}}
        change(copy)
        with pytest.raises(CheckpointError, match="x.ckpt fails its checksum"):
            verify(copy, "x.ckpt")
    assert checksum({**checkpoint, "epoch": 2}) == checksum(checkpoint)  # loop counters are Lightning's to check


# ---- one copy of each role ----


def _exchange(rank: int, port: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.distributed.init_process_group("gloo", rank=rank, world_size=2)
    weight = torch.arange(9.0).reshape(3, 3)
    state = {"actor": {"state_dict": {"actor.wte": weight, "actor.lm_head": weight, "actor.t": weight.T,
                                      "actor.half": torch.tensor(2.5, dtype=torch.bfloat16), "actor.none": torch.zeros(0)},
                       "optimizer": {"state": {0: {"step": torch.tensor(3.0)}}, "param_groups": [{"lr": 1e-3}]}}}
    try:
        if rank == 1:
            send_state(state, dst=0)
            return
        got = recv_state(1, torch.device("cpu"))
        weights = got["actor"]["state_dict"]
        assert weights["actor.wte"] is weights["actor.lm_head"]  # tied weights stay one tensor
        assert torch.equal(weights["actor.wte"], weight) and torch.equal(weights["actor.t"], weight.T)
        assert weights["actor.half"].dtype == torch.bfloat16 and weights["actor.half"].item() == 2.5
        assert weights["actor.none"].shape == (0,)
        assert got["actor"]["optimizer"] == {"state": {0: {"step": torch.tensor(3.0)}}, "param_groups": [{"lr": 1e-3}]}
    finally:
        torch.distributed.destroy_process_group()


def test_state_travels_between_ranks_tensor_by_tensor():
    run_ranks(_exchange, 2)


def test_each_role_is_kept_once_from_its_owner():
    assert [role_owner(flattening_plan(4), r) for r in ("actor", "critic", "reference", "reward")] == [0, 0, 0, 0]
    assert [role_owner(interleaving_plan(4), r) for r in ("actor", "critic", "reference", "reward")] == [0, 0, 0, 2]
    assert [role_owner(separation_plan(4), r) for r in ("actor", "critic", "reference", "reward")] == [2, 2, 0, 0]


def test_a_separation_checkpoint_resumes_exactly_on_one_process(tmp_path):
    """Saved under Separation on 2 processes (the actor and critic train on rank 1 only, rank 0 holds shadows), the
    file holds each role once with its optimizer state; resumed with no placement strategy on one process, the run
    logs what the uninterrupted run logged."""
    options = ["--trainer.enable_checkpointing", "true", "--model.ppo.kl_target", "1.0",
               "--model.ppo.kl_horizon", "100", "--model.ppo.reward_norm", "true",
               "--trainer.callbacks+=lightning.pytorch.callbacks.ModelCheckpoint",
               f"--trainer.callbacks.dirpath={tmp_path / 'ckpt'}", "--trainer.callbacks.every_n_train_steps=2",
               "--trainer.callbacks.save_top_k=-1", "--trainer.callbacks.filename={step}"]
    full = [r for r in fit_demo(tmp_path, "full", "--trainer.devices", "2", "--trainer.strategy", "rlhf_separation",
                                *options, steps=4) if "reward/mean" in r]
    (checkpoint_path,) = (tmp_path / "ckpt").glob("step=2*.ckpt")
    checkpoint = load_checkpoint_file(checkpoint_path)
    verify(checkpoint, checkpoint_path)
    assert set(checkpoint[OPTIMIZERS_KEY]) == {"actor", "critic"}
    assert {key.split(".")[0] for key in checkpoint["state_dict"]} == {"actor", "critic", "reference"}
    resumed = [r for r in fit_demo(tmp_path, "resumed", "--trainer.devices", "1", *options, "--ckpt_path",
                                   str(checkpoint_path), steps=4) if "reward/mean" in r]
    assert [r["step"] for r in resumed] == [2, 3]
    for got, want in zip(resumed, full[2:], strict=True):
        for metric in (*COMPARED, "kl/coef"):
            assert got.get(metric) == approx_or_none(want.get(metric), rel=1e-5, abs=1e-7), (metric, got["step"])


@pytest.mark.parametrize(("saved_kl", "resumed_kl", "match"), [
    (0.0, 0.04, "none in the checkpoint: it was saved by a run without KL"),
    (0.04, 0.0, "holds a reference model: it was saved by a run with a KL term"),
])
def test_turning_the_kl_on_or_off_between_save_and_resume_names_the_fix(saved_kl, resumed_kl, match):
    """A run without KL has no reference, so its checkpoint holds none: resuming it with a KL term, or resuming a
    KL run's checkpoint without one, is refused before any weight loads, naming the coefficients."""
    from helpers import make_module

    from lightning_app_rlhf.checkpoint.format import CheckpointError
    from lightning_app_rlhf.module_checkpoint import check_role_shapes

    def built(kl_loss_coef: float) -> RLHFModule:
        module = make_module(algorithm="grpo", generation=GenerationConfig(num_samples=2),
                             ppo=PPOConfig(kl_coef=0.0, kl_loss_coef=kl_loss_coef))
        module.configure_model()
        return module

    checkpoint = {"state_dict": built(saved_kl).state_dict()}
    with pytest.raises(CheckpointError, match=match):
        check_role_shapes(built(resumed_kl), checkpoint, "last.ckpt")
    check_role_shapes(built(saved_kl), checkpoint, "last.ckpt")  # the same coefficients resume
