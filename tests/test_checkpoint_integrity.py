"""Checkpoints that survive a kill mid-save, refuse a damaged file with its name and the fix, and refuse a model of
another shape with what changed.

Faults, what happens, and the test:

* SIGKILL while a save writes over the previous checkpoint: the previous file stays whole (the save writes a
  hidden temporary file and renames it), loads, passes its checksum and resumes; the leftover temporary file is
  not taken for a checkpoint and the next save removes it
  (``test_a_save_killed_mid_write_leaves_the_previous_checkpoint_usable``,
  ``test_only_stale_temporary_files_of_killed_saves_are_removed``).
* A truncated or corrupted file: a :class:`CheckpointError` naming the file and what to resume from
  (``test_a_truncated_checkpoint_is_refused_by_fit_with_its_name_and_the_fix``, and in
  ``test_checkpoint_safety.py``: empty, truncated, bit-flipped, non-finite).
* A model of another shape: a :class:`CheckpointError` before any weight loads, naming the role, the parameters
  and the fix (``test_a_changed_model_shape_is_refused_naming_what_changed``).
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import time
import zipfile
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from helpers import run_python
from lightning.pytorch.callbacks import ModelCheckpoint
from test_checkpoint_safety import small_module

from lightning_app_rlhf import PromptDataModule, RLHFModule
from lightning_app_rlhf.checkpoint.format import (
    CheckpointError,
    check_checkpoint_file,
    load_checkpoint_file,
    seal,
    verify,
)
from lightning_app_rlhf.core.files import TEMPORARY_NAME, remove_stale_temporaries, write_atomically
from lightning_app_rlhf.demo import prompts
from lightning_app_rlhf.strategies.atomic_checkpoint_io import AtomicCheckpointIO

WTE = "actor.transformer.wte.weight"


def fit(module: RLHFModule, tokenizer, root: Path, steps: int, strategy: str = "rlhf_flattening",
        ckpt_path: Path | str | None = None, callbacks: list | None = None, plugins: list | None = None
        ) -> pl.Trainer:
    trainer = pl.Trainer(accelerator="cpu", devices=1, strategy=strategy, max_steps=steps, logger=False,
                         plugins=plugins, enable_progress_bar=False, enable_model_summary=False,
                         default_root_dir=root, enable_checkpointing=bool(callbacks), callbacks=callbacks or [])
    threads = torch.get_num_threads()
    try:  # its group and rank variables are left to conftest.py's no_process_group_or_rank_variables_left_behind
        trainer.fit(module, PromptDataModule(prompts(), tokenizer, batch_size=4), ckpt_path=ckpt_path)
    finally:
        torch.set_num_threads(threads)  # the strategy sized this process's threads for its one rank
    return trainer


def every_step(directory: Path) -> ModelCheckpoint:
    """``last.ckpt`` rewritten at every step: each save goes over the previous checkpoint."""
    return ModelCheckpoint(dirpath=directory, save_last=True, save_top_k=0, every_n_train_steps=1)


def temporaries(directory: Path) -> list[Path]:
    return sorted(p for p in directory.iterdir() if TEMPORARY_NAME.match(p.name))


# ---- a kill during the save ----


class Stalls:
    """The temporary checkpoint file, in the child: once 64 KiB are on disk, it tells the parent (which kills the
    child) and waits."""

    def __init__(self, file, name: str, root: Path) -> None:
        self.file, self.name, self.root, self.written = file, name, root, 0

    def write(self, data) -> int:
        n = self.file.write(data)
        self.written += n
        if self.written >= 65536:
            self.file.flush()
            os.fsync(self.file.fileno())
            (self.root / "writing.tmp").write_text(f"{self.name}\n{self.written}")
            os.replace(self.root / "writing.tmp", self.root / "writing")
            time.sleep(600)
        return n

    def __getattr__(self, name: str):
        return getattr(self.file, name)


def killed_save(root: Path, config: dict, tokenizer) -> None:
    """The child: 2 steps under rlhf_flattening, ``last.ckpt`` saved at each; the step-1 save (A) is written
    whole, the step-2 save (B) stalls mid-write for the parent to kill."""
    try:
        real_save, saves = torch.save, []

        def save(obj, f, *args, **kwargs):
            name = os.readlink(f"/proc/self/fd/{f.fileno()}") if hasattr(f, "fileno") else ""
            if os.path.basename(name).startswith(".last.ckpt."):  # AtomicCheckpointIO's temporary file
                saves.append(obj["global_step"])
                if len(saves) == 1:  # A: its actor embedding kept aside for the parent to compare
                    real_save(obj["state_dict"][WTE].clone(), root / "a_wte.pt")
                else:
                    f = Stalls(f, name, root)
            return real_save(obj, f, *args, **kwargs)

        torch.save = save
        fit(small_module(config, tokenizer), tokenizer, root, 2, callbacks=[every_step(root / "ckpt")])
        (root / "error").write_text("the second save was not stalled")
    except BaseException as err:  # noqa: BLE001 - the parent reads it
        (root / "error").write_text(repr(err))
    finally:
        os._exit(1)


def test_a_save_killed_mid_write_leaves_the_previous_checkpoint_usable(tmp_path, tiny_gpt2_config, tokenizer):
    """A run under a placement strategy (whose checkpoints ``AtomicCheckpointIO`` writes) saves ``last.ckpt`` at
    step 1 (A), and is SIGKILLed while its step-2 save (B) is writing the same path. ``last.ckpt`` is still A,
    whole: it loads weights-only, passes its checksum, is what ``ckpt_path="last"`` finds, and resumes. The
    half-written temporary file is hidden, not a ``.ckpt``, refused as a checkpoint, and the resumed run's first
    save removes it."""
    process = multiprocessing.get_context("fork").Process(target=killed_save,
                                                          args=(tmp_path, tiny_gpt2_config, tokenizer))
    process.start()  # forked: the child has torch and Lightning imported already
    try:
        deadline = time.monotonic() + 120
        while not (tmp_path / "writing").exists():
            assert process.is_alive(), (tmp_path / "error").read_text() if (tmp_path / "error").exists() else ""
            assert time.monotonic() < deadline, "the save never started writing"
            time.sleep(0.02)
        os.kill(process.pid, signal.SIGKILL)
    finally:
        process.kill()
        process.join()
    assert process.exitcode == -signal.SIGKILL
    directory, path = tmp_path / "ckpt", tmp_path / "ckpt" / "last.ckpt"
    temporary_name, written = (tmp_path / "writing").read_text().split("\n")
    (temporary,) = temporaries(directory)
    assert str(temporary) == temporary_name and temporary.name.startswith(".last.ckpt.")
    assert temporary.stat().st_size >= int(written) > 0  # killed with part of B on disk
    assert sorted(p.name for p in directory.iterdir()) == sorted(["last.ckpt", temporary.name])

    # The previous checkpoint, whole and exactly A.
    checkpoint = load_checkpoint_file(path)
    verify(checkpoint, path)
    assert checkpoint["global_step"] == 1
    assert torch.equal(checkpoint["state_dict"][WTE], torch.load(tmp_path / "a_wte.pt", weights_only=True))

    # The half-written file is no checkpoint: hidden, not *.ckpt, refused with its name.
    with pytest.raises(CheckpointError, match=f"Checkpoint {temporary} is not a complete torch.save archive"):
        check_checkpoint_file(temporary)
    callback = every_step(directory)
    assert callback._find_last_checkpoints(pl.Trainer(logger=False)) == {str(path)}

    # Resume from what ModelCheckpoint finds ("last"): one more step, whose save removes the leftover.
    trainer = fit(small_module(tiny_gpt2_config, tokenizer), tokenizer, tmp_path, 2, ckpt_path="last",
                  callbacks=[callback])
    assert trainer.ckpt_path == str(path) and trainer.global_step == 2
    assert temporaries(directory) == []
    assert load_checkpoint_file(path)["global_step"] == 2


def test_only_stale_temporary_files_of_killed_saves_are_removed(tmp_path):
    """A successful atomic save removes the temporary files that killed writes left beside it: ours by name, last
    written before this save began, by a process that no longer runs. A write in progress keeps its file."""
    dead = run_python("-c", "import os; print(os.getpid())")
    dead_pid = int(dead.stdout)
    old = time.time() - 3600
    stale = [tmp_path / f".last.ckpt.{dead_pid}.0123abcd.tmp", tmp_path / f".step=2.ckpt.{dead_pid}.89abcdef.tmp"]
    kept = [tmp_path / f".last.ckpt.{os.getpid()}.00000000.tmp",  # a live process may still be writing it
            tmp_path / ".last.ckpt.old-0123abcd",  # not a temporary file of write_atomically
            tmp_path / "notes.tmp", tmp_path / "step=1.ckpt"]
    for file in (*stale, *kept):
        file.write_bytes(b"partial")
        os.utime(file, (old, old))
    recent = tmp_path / f".other.ckpt.{dead_pid}.fedcba98.tmp"  # written since the save began: left alone
    recent.write_bytes(b"partial")
    os.utime(recent, (time.time() + 3600, time.time() + 3600))

    write_atomically(tmp_path / "plain.txt", lambda file: file.write(b"x"))  # no cleanup unless asked
    assert all(file.exists() for file in stale)
    write_atomically(tmp_path / "last.ckpt", lambda file: file.write(b"new"), remove_stale=True)
    assert (tmp_path / "last.ckpt").read_bytes() == b"new"
    assert not any(file.exists() for file in stale)
    assert all(file.exists() for file in (*kept, recent))
    assert remove_stale_temporaries(tmp_path / "missing", time.time()) == []


# ---- truncated and corrupted files ----


@pytest.fixture
def saved(tmp_path, tiny_gpt2_config, tokenizer) -> Path:
    """A real checkpoint after 1 iteration under rlhf_flattening on one process."""
    fit(small_module(tiny_gpt2_config, tokenizer), tokenizer, tmp_path, 1, callbacks=[every_step(tmp_path / "ckpt")])
    return tmp_path / "ckpt" / "last.ckpt"


@pytest.mark.parametrize("strategy", [
    "rlhf_flattening",
    "auto+AtomicCheckpointIO",  # Lightning's strategy with this package's checkpoint writer as a plugin
    "auto",  # Lightning's strategy: RLHFModule.setup swaps its default writer for AtomicCheckpointIO
])
def test_a_truncated_checkpoint_is_refused_by_fit_with_its_name_and_the_fix(saved, tmp_path, tiny_gpt2_config,
                                                                            tokenizer, strategy):
    """A checkpoint cut short (a copy interrupted, a disk full) is refused by ``fit`` before any weight loads,
    naming the file and where to resume from."""
    truncated = tmp_path / "truncated.ckpt"
    truncated.write_bytes(saved.read_bytes()[: saved.stat().st_size // 2])
    plugins = [AtomicCheckpointIO()] if strategy.endswith("+AtomicCheckpointIO") else []
    with pytest.raises(CheckpointError, match=rf"Checkpoint {truncated} is not a complete torch.save archive "
                                              rf"\(truncated or corrupted, \d+ bytes\)\. Resume from an earlier "
                                              rf"checkpoint in {tmp_path}\."):
        fit(small_module(tiny_gpt2_config, tokenizer), tokenizer, tmp_path, 2, strategy=strategy.split("+")[0],
            ckpt_path=truncated, plugins=plugins)


def test_a_corrupted_record_is_refused_with_its_name(saved, tmp_path):
    """Damage inside the archive's pickled record (its zip directory intact) is refused naming the file, as
    corruption: not as a file that needs a full unpickle, which is what weights-only loading first makes of it."""
    with zipfile.ZipFile(saved) as archive:
        info = next(i for i in archive.infolist() if i.filename.endswith("/data.pkl"))
    with open(saved, "r+b") as f:
        f.seek(info.header_offset + 26)
        name_length, extra_length = (int.from_bytes(f.read(2), "little") for _ in range(2))
        f.seek(info.header_offset + 30 + name_length + extra_length + 2)
        f.write(b"\xff" * 16)
    with pytest.raises(CheckpointError, match=rf"Checkpoint {saved} is corrupted: its record \S+/data.pkl fails "
                                              rf"its CRC-32 \(disk or copy corruption\)\. Resume from an earlier "
                                              rf"checkpoint in {saved.parent}"):
        load_checkpoint_file(saved)


# ---- a model of another shape ----


@pytest.mark.parametrize("strategy", ["rlhf_flattening", "auto"])
def test_a_changed_model_shape_is_refused_naming_what_changed(saved, tmp_path, tiny_gpt2_config, tokenizer, strategy):
    """Resuming with another ``n_embd`` names the role and each changed shape, saved and now; with another
    ``n_layer``, the parameters missing from the checkpoint. Both before any weight loads, with the fix."""
    wider = {**tiny_gpt2_config, "n_embd": 64}
    with pytest.raises(CheckpointError) as error:
        fit(small_module(wider, tokenizer), tokenizer, tmp_path, 2, strategy=strategy, ckpt_path=saved)
    message = str(error.value)
    assert message.startswith(f"Checkpoint {saved} does not fit this run's model: role 'actor'")
    assert "actor.transformer.wte.weight saved [512, 32], now [512, 64]" in message
    assert "Resume with the model config it was saved with" in message and "start a new run" in message
    assert "model.actor.config.n_embd saved 32, now 64" in message  # the setting that changed

    deeper = {**tiny_gpt2_config, "n_layer": 2}
    with pytest.raises(CheckpointError) as error:
        fit(small_module(deeper, tokenizer), tokenizer, tmp_path, 2, strategy=strategy, ckpt_path=saved)
    message = str(error.value)
    assert message.startswith(f"Checkpoint {saved} does not fit this run's model: role 'actor': ")
    assert "missing from the checkpoint (e.g. actor.transformer.h.1." in message
    assert "changed shape" not in message and "model.actor.config.n_layer saved 1, now 2" in message


def test_the_shape_check_names_parameters_the_checkpoint_has_and_the_model_lacks(saved, tmp_path,
                                                                                  tiny_gpt2_config, tokenizer):
    """Resuming a 2-layer checkpoint with 1 layer names the extra parameters."""
    checkpoint = load_checkpoint_file(saved)
    extra = {k.replace(".h.0.", ".h.1."): v.clone() for k, v in checkpoint["state_dict"].items() if ".h.0." in k}
    checkpoint["state_dict"].update(extra)
    seal(checkpoint)
    deeper = tmp_path / "deeper.ckpt"
    write_atomically(deeper, lambda file: torch.save(checkpoint, file))
    with pytest.raises(CheckpointError, match=r"role 'actor': \d+ in the checkpoint but not in this "
                                              r"model \(e\.g\. actor\.transformer\.h\.1\."):
        fit(small_module(tiny_gpt2_config, tokenizer), tokenizer, tmp_path, 2, ckpt_path=deeper)
