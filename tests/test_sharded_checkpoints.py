"""Sharded checkpoints: FSDP2 and ZeRO-3 roles saved shard by shard into a checkpoint directory, resumed exactly,
resharded onto other placements and process counts (FSDP2; whole roles), refused where DeepSpeed cannot (ZeRO on
another number of ranks); the directory's files checked, read weights-only, replaced and removed atomically."""

from __future__ import annotations

import os
import pickle
import shutil
import subprocess
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from helpers import DEMO_CONFIG, approx_or_none, forked_ranks, metrics_rows, run_cli
from test_checkpoint_safety import RunsCode
from test_placements import COMPARED

from lightning_app_rlhf.callbacks import PlacementTuner
from lightning_app_rlhf.checkpoint.format import (
    FILES_KEY,
    LAYOUT_KEY,
    META_FILE,
    OPTIMIZERS_KEY,
    CheckpointError,
    check_checkpoint_file,
    check_shard_files,
    load_checkpoint_file,
    restore_modes,
    role_layout,
    verify,
)
from lightning_app_rlhf.core.files import replace_atomically, write_atomically
from lightning_app_rlhf.parallel.plan import flattening_plan, separation_plan
from lightning_app_rlhf.parallel.wrappers.sharded_io import (
    WeightsOnlyUnpicklingError,
    dcp_reader,
    deepspeed_load,
)
from lightning_app_rlhf.strategies.atomic_checkpoint_io import AtomicCheckpointIO
from lightning_app_rlhf.strategies.sharded_checkpoint import publish

FSDP2 = ("lightning_app_rlhf.strategies.FlatteningStrategy", "--trainer.strategy.wrapper", "fsdp2")
ZERO3 = ("lightning_app_rlhf.strategies.FlatteningStrategy", "--trainer.strategy.wrapper", "zero3")
OPTIONS = ("--model.ppo.kl_target", "1.0", "--model.ppo.kl_horizon", "100", "--model.ppo.reward_norm", "true",
           "--model.generation.max_new_tokens", "12", "--trainer.enable_checkpointing", "true")


def checkpoints(directory: Path, **settings: str) -> list[str]:
    """A ModelCheckpoint every 2 iterations, named by step, into ``directory``."""
    fields = {"dirpath": str(directory), "every_n_train_steps": "2", "save_top_k": "-1", "filename": "{step}",
              **settings}
    return ["--trainer.callbacks+=lightning.pytorch.callbacks.ModelCheckpoint",
            *(f"--trainer.callbacks.{key}={value}" for key, value in fields.items())]


def run(tmp_path: Path, name: str, strategy: tuple[str, ...], devices: int, *args: str, steps: int = 4,
        check: bool = False) -> subprocess.CompletedProcess:
    return run_cli(*forked_ranks([
        "fit", "--config", DEMO_CONFIG, "--trainer.max_steps", str(steps), "--trainer.devices", str(devices),
        "--trainer.strategy", *strategy, "--trainer.logger.init_args.save_dir", tmp_path,
        "--trainer.logger.init_args.name", name, *OPTIONS, *args]), cwd=tmp_path, check=check)


def logged(tmp_path: Path, name: str, strategy: tuple[str, ...], devices: int, *args: str) -> list[dict[str, float]]:
    """Run to step 4 and return the iterations' metrics rows."""
    run(tmp_path, name, strategy, devices, *args, check=True)
    return [row for row in metrics_rows(tmp_path / name) if "reward/mean" in row]


def assert_resumed(resumed: list[dict[str, float]], full: list[dict[str, float]], rel: float) -> None:
    assert [r["step"] for r in resumed] == [2, 3]
    for got, want in zip(resumed, full[2:], strict=True):
        for metric in (*COMPARED, "kl/coef"):
            assert got.get(metric) == approx_or_none(want.get(metric), rel=rel, abs=rel / 100), (metric, got["step"])


@pytest.fixture(scope="module")
def fsdp2_run(tmp_path_factory):
    """4 iterations, actor and critic FSDP2-sharded over 2 processes, checkpoints at steps 2 and 4 (and last.ckpt
    saved again at step 4, over the step-2 one); a second ModelCheckpoint keeps the top 1 and links last.ckpt."""
    tmp = tmp_path_factory.mktemp("fsdp2")
    full = logged(tmp, "full", FSDP2, 2, *checkpoints(tmp / "ckpt", save_last="true"),
                  *checkpoints(tmp / "top1", save_top_k="1", every_n_train_steps="1", save_last="link"))
    return tmp, full, tmp / "ckpt" / "step=2.ckpt"


@pytest.fixture(scope="module")
def zero3_run(tmp_path_factory):
    """4 iterations, actor and critic DeepSpeed ZeRO-3 over 2 processes, checkpoints at steps 2 and 4."""
    tmp = tmp_path_factory.mktemp("zero3")
    full = logged(tmp, "full", ZERO3, 2, *checkpoints(tmp / "ckpt"))
    return tmp, full, tmp / "ckpt" / "step=2.ckpt"


def test_fsdp2_roles_are_saved_shard_by_shard_and_resume_exactly(fsdp2_run, tmp_path):
    """The checkpoint is a directory: the meta file holds no actor or critic weights nor optimizer state, each
    rank's DCP shard of them lies in actor/ and critic/, listed with its CRC-32; resumed on the same plan, the run
    logs the uninterrupted values. last.ckpt is saved again over a directory; top-k pruning removes directories."""
    root, full, step2 = fsdp2_run
    assert step2.is_dir()
    meta = load_checkpoint_file(step2)  # the directory's meta file, weights-only
    verify(meta, step2 / META_FILE)
    assert {key.split(".")[0] for key in meta["state_dict"]} == {"reference"}
    assert meta[OPTIMIZERS_KEY] == {}
    assert {role: layout["format"] for role, layout in meta[LAYOUT_KEY].items()} == {
        "actor": "dcp", "critic": "dcp", "reference": "whole", "reward": "whole"}
    assert sorted(meta[FILES_KEY]) == sorted(f"{role}/{name}" for role in ("actor", "critic")
                                             for name in (".metadata", "__0_0.distcp", "__1_0.distcp"))
    assert not [p for p in (root / "ckpt").iterdir() if p.name.startswith(".")]  # no staging left behind
    last = root / "ckpt" / "last.ckpt"
    assert last.is_dir() and load_checkpoint_file(last)["global_step"] == 4
    top1 = root / "top1"
    assert sorted(p.name for p in top1.iterdir()) == ["last.ckpt", "step=4.ckpt"]
    assert (top1 / "last.ckpt").is_symlink() and (top1 / "last.ckpt").resolve() == (top1 / "step=4.ckpt").resolve()

    resumed = logged(tmp_path, "resumed", FSDP2, 2, *checkpoints(tmp_path / "ckpt"), "--ckpt_path", str(step2))
    assert_resumed(resumed, full, rel=1e-5)


def test_fsdp2_checkpoint_reshards_onto_one_process(fsdp2_run, tmp_path):
    """Saved with FSDP2 over 2 processes, resumed on 1 process (rlhf_flattening, the roles whole): every shard is
    read into the whole role, and the run logs the uninterrupted values."""
    _, full, step2 = fsdp2_run
    resumed = logged(tmp_path, "one", ("rlhf_flattening",), 1, "--ckpt_path", str(step2))
    assert_resumed(resumed, full, rel=1e-4)


@pytest.mark.slow
def test_fsdp2_checkpoint_reshards_onto_four_processes(fsdp2_run, tmp_path):
    """Saved with FSDP2 over 2 processes, resumed on 4: Flattening (FSDP2 over 4 ranks) and Separation (FSDP2 over
    ranks 2-3, whole shadows on 0-1 refreshed by reallocation) both log the uninterrupted values."""
    _, full, step2 = fsdp2_run
    for name, strategy in (("flat4", FSDP2), ("sep4", ("lightning_app_rlhf.strategies.SeparationStrategy",
                                                       "--trainer.strategy.wrapper", "fsdp2"))):
        assert_resumed(logged(tmp_path, name, strategy, 4, "--ckpt_path", str(step2)), full, rel=1e-4)


@pytest.mark.slow
def test_a_ddp_checkpoint_resumes_under_another_placement_and_under_fsdp2(tmp_path):
    """Whole (DDP) roles are kept once per role: a checkpoint from rlhf_flattening on 2 processes resumes under
    rlhf_separation on 2 processes, and under FSDP2 (each rank keeps its shard of the whole weights and optimizer
    state), both logging the uninterrupted values."""
    full = logged(tmp_path, "full", ("rlhf_flattening",), 2, *checkpoints(tmp_path / "ckpt"))
    step2 = tmp_path / "ckpt" / "step=2.ckpt"
    assert step2.is_file()
    for name, strategy in (("separation", ("rlhf_separation",)), ("fsdp2", FSDP2)):
        assert_resumed(logged(tmp_path, name, strategy, 2, "--ckpt_path", str(step2)), full, rel=1e-4)


def test_zero3_roles_are_saved_by_deepspeed_and_resume_exactly(zero3_run, tmp_path):
    """ZeRO-3 roles are written by DeepSpeed's own engine.save_checkpoint, each rank its partition; resumed on the
    same plan (engine.load_checkpoint, read weights-only), the run logs the uninterrupted values."""
    _, full, step2 = zero3_run
    meta = load_checkpoint_file(step2)
    assert {key.split(".")[0] for key in meta["state_dict"]} == {"reference"}
    assert {name.split("/")[0] for name in meta[FILES_KEY]} == {"actor", "critic"}
    assert "actor/zero/zero_pp_rank_1_mp_rank_00_optim_states.pt" in meta[FILES_KEY]
    resumed = logged(tmp_path, "resumed", ZERO3, 2, *checkpoints(tmp_path / "ckpt"), "--ckpt_path", str(step2))
    assert_resumed(resumed, full, rel=1e-5)


@pytest.mark.slow
def test_zero3_separation_resumes_exactly_with_its_shadows_refreshed(tmp_path):
    """Separation on 4 processes, actor and critic ZeRO-3 over ranks 2-3, whole shadows on ranks 0-1: resumed from
    its step-2 directory, the shadows get the loaded weights by reallocation and the run logs the uninterrupted
    values."""
    strategy = ("lightning_app_rlhf.strategies.SeparationStrategy", "--trainer.strategy.wrapper", "zero3")
    full = logged(tmp_path, "full", strategy, 4, *checkpoints(tmp_path / "ckpt"))
    step2 = tmp_path / "ckpt" / "step=2.ckpt"
    resumed = logged(tmp_path, "resumed", strategy, 4, "--ckpt_path", str(step2))
    assert_resumed(resumed, full, rel=1e-5)


@pytest.mark.slow  # restore_modes names the fix in a unit test of the default run
def test_zero3_checkpoint_on_another_number_of_ranks_is_refused_with_the_fix(zero3_run, tmp_path):
    _, _, step2 = zero3_run
    result = run(tmp_path, "one", ZERO3, 1, "--ckpt_path", str(step2))
    assert result.returncode != 0
    assert ("role 'actor' was saved by DeepSpeed zero3 over the 2 ranks of 'actor.train' (the 'flattening' plan "
            "on 2 ranks); this run has 1 rank there with wrapper zero3") in result.stderr
    assert ("Resume with the saved plan, --trainer.strategy lightning_app_rlhf.strategies.FlatteningStrategy "
            "--trainer.strategy.wrapper zero3 --trainer.devices 2") in result.stderr


# ---- how each role loads ----


def test_restore_modes_decide_how_each_role_loads_or_name_the_fix():
    def saved(plan):
        return {"rlhf_plan": {"name": plan.name, "world_size": plan.world_size, "calls": plan.calls},
                LAYOUT_KEY: role_layout(plan)}

    ddp, fsdp2, zero3 = flattening_plan(2), flattening_plan(2, "fsdp2"), flattening_plan(2, "zero3")
    whole = {"actor": "whole", "reference": "whole", "reward": "whole", "critic": "whole"}
    assert restore_modes(saved(ddp), separation_plan(4), "c") == whole
    assert restore_modes({"rlhf_plan": {}}, flattening_plan(1), "c") == whole  # saved before layouts were recorded
    into_shards = {**whole, "actor": "full_into_sharded", "critic": "full_into_sharded"}
    assert restore_modes(saved(ddp), fsdp2, "c") == into_shards
    for plan in (ddp, flattening_plan(1), flattening_plan(4, "fsdp2"), separation_plan(4, wrapper="fsdp2")):
        assert restore_modes(saved(fsdp2), plan, "c") == {**whole, "actor": "shards", "critic": "shards"}
    assert restore_modes(saved(zero3), zero3, "c") == {**whole, "actor": "shards", "critic": "shards"}
    for plan in (flattening_plan(4, "zero3"), flattening_plan(2, "zero2"), fsdp2):
        with pytest.raises(ValueError, match="DeepSpeed reads its ZeRO partitions back only with the same stage"):
            restore_modes(saved(zero3), plan, "c")
    with pytest.raises(ValueError, match=r"DeepSpeed engine loads only its own checkpoints. Resume with wrapper fsdp2"):
        restore_modes(saved(fsdp2), zero3, "c")


# ---- the directory's files ----


def test_a_checkpoint_directory_is_checked_by_its_meta_file(tmp_path):
    directory = tmp_path / "step=2.ckpt"
    (directory / "actor").mkdir(parents=True)
    with pytest.raises(CheckpointError, match=f"Checkpoint {directory} is a directory without its {META_FILE}"):
        check_checkpoint_file(directory)
    (directory / META_FILE).write_bytes(b"")
    with pytest.raises(CheckpointError, match=f"Checkpoint {directory / META_FILE} is empty"):
        load_checkpoint_file(directory)
    (directory / META_FILE).write_bytes(b"PK\x03\x04 not a whole archive")
    with pytest.raises(CheckpointError, match=f"Checkpoint {directory / META_FILE} is not a complete torch.save"):
        check_checkpoint_file(directory)


def test_shard_files_are_checked_against_the_checksums_of_the_meta_file(fsdp2_run, tmp_path):
    _, _, step2 = fsdp2_run
    copy = tmp_path / "copy.ckpt"
    shutil.copytree(step2, copy)
    expected = load_checkpoint_file(copy)[FILES_KEY]
    assert check_shard_files(copy, expected, sorted(expected)) is None
    shard = copy / "actor" / "__1_0.distcp"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    assert f"shard file {shard} fails its checksum" in check_shard_files(copy, expected, sorted(expected))
    shard.unlink()
    assert f"is missing its shard file {shard}" in check_shard_files(copy, expected, sorted(expected))


def test_shards_are_read_weights_only(tmp_path):
    """DCP's metadata pickle and DeepSpeed's files are read by weights-only unpicklers: a crafted one runs no code."""
    marker = tmp_path / "code_ran"
    (tmp_path / "dcp").mkdir()
    (tmp_path / "dcp" / ".metadata").write_bytes(pickle.dumps(RunsCode(marker)))
    with pytest.raises(WeightsOnlyUnpicklingError, match=r"names .*makedirs"):
        dcp_reader(tmp_path / "dcp").read_metadata()
    torch.save({"module": {}, "payload": RunsCode(marker)}, tmp_path / "mp_rank_00_model_states.pt")
    with pytest.raises(WeightsOnlyUnpicklingError):
        deepspeed_load(str(tmp_path / "mp_rank_00_model_states.pt"))
    assert not marker.exists()


def test_checkpoints_replace_and_remove_files_links_and_directories(tmp_path):
    """A new checkpoint directory replaces a file or a directory in one step, a file replaces a directory, and
    removal takes a file, a directory, or a link without what it points to."""
    target = tmp_path / "last.ckpt"
    target.write_bytes(b"old file")
    for content in ("first", "second"):
        new = tmp_path / f".staging-{content}"
        new.mkdir()
        (new / META_FILE).write_text(content)
        replace_atomically(new, target)
        assert (target / META_FILE).read_text() == content and not new.exists()
    write_atomically(target, lambda file: file.write(b"a file again"))
    assert target.read_bytes() == b"a file again"
    io = AtomicCheckpointIO()
    (tmp_path / "dir.ckpt").mkdir()
    (tmp_path / "dir.ckpt" / META_FILE).write_text("x")
    os.symlink("dir.ckpt", tmp_path / "link.ckpt")
    io.remove_checkpoint(tmp_path / "link.ckpt")
    assert not (tmp_path / "link.ckpt").exists() and (tmp_path / "dir.ckpt" / META_FILE).exists()
    io.remove_checkpoint(tmp_path / "dir.ckpt")
    io.remove_checkpoint(target)
    assert sorted(p.name for p in tmp_path.iterdir()) == []


def test_an_interrupted_sharded_save_leaves_the_previous_checkpoint(tmp_path):
    target = tmp_path / "last.ckpt"
    target.mkdir()
    (target / META_FILE).write_text("previous")
    staging = tmp_path / ".last.ckpt.partial-0"
    (staging / "actor").mkdir(parents=True)

    class Failing:
        def save_checkpoint(self, checkpoint, path):
            raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        publish(SimpleNamespace(checkpoint_io=Failing()), {"state_dict": {}}, staging, target, lambda c: None)
    assert (target / META_FILE).read_text() == "previous" and not staging.exists()


def test_placement_tuner_reads_the_plan_saved_in_a_checkpoint_directory(tmp_path):
    plan = flattening_plan(2, "fsdp2")
    directory = tmp_path / "step=2.ckpt"
    directory.mkdir()
    state = {"plan": plan.to_dict(), "prediction": {"source": "mcmc"}, "algorithm": "ppo"}
    torch.save({"callbacks": {"PlacementTuner": state}}, directory / META_FILE)
    tuner = PlacementTuner(ckpt_path=str(directory))
    assert tuner._saved_state(SimpleNamespace(ckpt_path=None)) == state
