"""Preemption: SIGTERM mid-run finishes the iteration, saves last.ckpt and exits cleanly; ``--ckpt_path last``
then continues exactly as the uninterrupted run (PreemptionCheckpoint, launched from the CLI as a user would)."""

from __future__ import annotations

import csv
import logging
import os
import signal
import subprocess
import sys
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.demos.boring_classes import BoringModel
from test_placements import COMPARED, ROOT

from lightning_app_rlhf.callbacks.preemption_checkpoint import PreemptionCheckpoint

STEPS = 4
SIGNAL_STEP = 1  # SIGTERM arrives during iteration 1; the run stops after it, at global step 2


def fit(tmp_path: Path, name: str, *args: str, steps: int = STEPS) -> tuple[subprocess.CompletedProcess, list[dict]]:
    """Run the CPU demo through the CLI; return the finished process and its metrics.csv rows with a reward."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": f"{ROOT}{os.pathsep}{ROOT / 'tests'}"}
    result = subprocess.run(
        [sys.executable, "-m", "lightning_app_rlhf", "fit", "--config", str(ROOT / "examples/configs/demo_cpu.yaml"),
         "--trainer.max_steps", str(steps), "--trainer.logger.init_args.save_dir", str(tmp_path),
         "--trainer.logger.init_args.name", name, "--model.generation.max_new_tokens", "12", *args],
        check=False, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300,
    )
    (tmp_path / f"{name}.out").write_text(result.stdout + result.stderr)
    rows = []
    for metrics in (tmp_path / name).rglob("metrics.csv"):
        rows += [{k: float(v) for k, v in row.items() if v} for row in csv.DictReader(metrics.open())]
    return result, [r for r in rows if "reward/mean" in r]


def common(tmp_path: Path, run: str, strategy: str, devices: int) -> list[str]:
    """A ModelCheckpoint keeping last.ckpt in its own directory per run, and PreemptionCheckpoint."""
    return ["--trainer.devices", str(devices), "--trainer.strategy", strategy, "--trainer.enable_checkpointing", "true",
            "--model.ppo.kl_target", "1.0", "--model.ppo.kl_horizon", "100", "--model.ppo.reward_norm", "true",
            "--trainer.callbacks+=lightning.pytorch.callbacks.ModelCheckpoint",
            f"--trainer.callbacks.dirpath={tmp_path / run}", "--trainer.callbacks.save_last=true",
            "--trainer.callbacks.save_top_k=0",
            "--trainer.callbacks+=lightning_app_rlhf.callbacks.preemption_checkpoint.PreemptionCheckpoint"]


@pytest.mark.parametrize("strategy,devices,every_rank", [
    ("rlhf_separation", 2, False),  # SIGTERM to the launcher (rank 0), which forwards it
    pytest.param("rlhf_separation", 2, True, marks=pytest.mark.slow),  # to every rank, as SLURM and Kubernetes do
    pytest.param("auto", 1, False, marks=pytest.mark.slow),
])
def test_sigterm_saves_and_resume_continues_as_the_uninterrupted_run(tmp_path, strategy, devices, every_rank):
    """SIGTERM during iteration 1: the run finishes it, saves last.ckpt once, says so and exits with 0; resumed with
    ``--ckpt_path last`` it logs the values of the uninterrupted run at steps 2 and 3."""
    full_result, full = fit(tmp_path, "full", *common(tmp_path, "full_ckpt", strategy, devices))
    assert full_result.returncode == 0, full_result.stderr[-4000:]
    assert [r["step"] for r in full] == list(range(STEPS))
    assert "SIGTERM" not in full_result.stdout + full_result.stderr

    args = common(tmp_path, "ckpt", strategy, devices)
    stopped, before = fit(tmp_path, "stopped", *args, "--trainer.callbacks+=sigterm_callback.SendSigterm",
                          f"--trainer.callbacks.step={SIGNAL_STEP}", f"--trainer.callbacks.every_rank={every_rank}")
    output = stopped.stdout + stopped.stderr
    assert stopped.returncode == 0, output[-4000:]
    last = tmp_path / "ckpt" / "last.ckpt"
    assert f"SIGTERM received at iteration {SIGNAL_STEP + 1}: saved {last}; resume with --ckpt_path last" in output
    assert [r["step"] for r in before] == list(range(SIGNAL_STEP + 1))  # the current iteration finished
    assert [p.name for p in (tmp_path / "ckpt").iterdir()] == ["last.ckpt"]  # one checkpoint, no second save

    resumed_result, resumed = fit(tmp_path, "resumed", *args, "--ckpt_path", "last")
    assert resumed_result.returncode == 0, resumed_result.stderr[-4000:]
    assert [r["step"] for r in resumed] == list(range(SIGNAL_STEP + 1, STEPS))
    for got, want in zip(resumed, full[SIGNAL_STEP + 1:], strict=True):
        for metric in (*COMPARED, "kl/coef"):
            assert got.get(metric) == pytest.approx(want.get(metric), rel=1e-5, abs=1e-7), (metric, got["step"])


class _Signal(Callback):
    def __init__(self, signum: int, step: int) -> None:
        self.signum, self.step = signum, step

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if trainer.global_step == self.step:
            os.kill(os.getpid(), self.signum)


def boring_fit(tmp_path: Path, signum: int, **trainer_args) -> pl.Trainer:
    """Lightning's BoringModel on one process, signalled at step 1: the callback on its own, in-process."""
    before = signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGUSR1)
    trainer = pl.Trainer(default_root_dir=tmp_path, max_steps=5, logger=False, enable_progress_bar=False,
                         enable_model_summary=False, accelerator="cpu", devices=1,
                         callbacks=[PreemptionCheckpoint(), _Signal(signum, step=1)], **trainer_args)
    trainer.fit(BoringModel())
    assert (signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGUSR1)) == before  # handlers restored
    assert trainer.global_step == 2 and not trainer.received_sigterm  # stopped after the iteration, by us
    return trainer


def test_sigterm_without_model_checkpoint_saves_to_the_root_dir(tmp_path, monkeypatch, caplog):
    """No ModelCheckpoint: last.ckpt goes to default_root_dir and the message names its path."""
    monkeypatch.setattr(logging.getLogger("lightning.pytorch"), "propagate", True)  # for caplog
    boring_fit(tmp_path, signal.SIGTERM, enable_checkpointing=False)
    path = tmp_path / "last.ckpt"
    assert torch.load(path, weights_only=True)["global_step"] == 2
    assert f"SIGTERM received at iteration 2: saved {path}; resume with --ckpt_path {path}" in caplog.text


def test_slurm_requeue_signal_saves_an_hpc_checkpoint_and_requeues(tmp_path, monkeypatch, caplog):
    """SLURMEnvironment(auto_requeue=True): the requeue signal saves hpc_ckpt_1.ckpt at the end of the iteration
    (where Lightning's ckpt_path="hpc" finds it) and runs ``scontrol requeue`` (a stand-in here)."""
    from lightning.fabric.plugins.environments import SLURMEnvironment

    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "scontrol").write_text(f'#!/bin/sh\necho "$@" > {tmp_path / "scontrol.args"}\n')
    (bin_dir / "scontrol").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    for name, value in {"SLURM_NTASKS": "1", "SLURM_NTASKS_PER_NODE": "1", "SLURM_PROCID": "0", "SLURM_LOCALID": "0",
                        "SLURM_NODEID": "0", "SLURM_NODELIST": "127.0.0.1", "SLURM_JOB_ID": "1234",
                        "SLURM_JOB_NAME": "preemption-test"}.items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("SLURM_ARRAY_JOB_ID", raising=False)
    monkeypatch.setattr(logging.getLogger("lightning.pytorch"), "propagate", True)  # for caplog
    boring_fit(tmp_path / "root", signal.SIGUSR1, enable_checkpointing=False,
               plugins=[SLURMEnvironment(auto_requeue=True)])
    path = tmp_path / "root" / "hpc_ckpt_1.ckpt"
    assert torch.load(path, weights_only=True)["global_step"] == 2
    assert (tmp_path / "scontrol.args").read_text().split() == ["requeue", "1234"]
    assert f"SLURM requeue signal SIGUSR1 received at iteration 2: saved {path}; the requeued job resumes from it" \
        in caplog.text
