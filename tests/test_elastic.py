"""Elastic restarts: under ``torchrun --max-restarts``, a killed rank makes torchrun restart the job, and the job
resumes by itself (``--ckpt_path auto``) from the newest complete checkpoint in its run directory."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
from helpers import DEMO_CONFIG, approx_or_none, metrics_rows, one_thread_env, run_cli, run_python

from lightning_app_rlhf.checkpoint.newest import checkpoint_candidates, newest_complete_checkpoint

COMPARED = ("reward/mean", "reward/std", "kl/mean", "kl/coef", "policy/loss", "policy/clipfrac", "policy/approx_kl",
            "policy/entropy", "value/loss", "value/clipfrac", "response/length_mean")
STEPS, KILL_STEP = 5, 3


def torchrun_fit(run_dir: Path, *extra: str, max_restarts: int = 0):
    """``torchrun --standalone --nproc-per-node 2 --max-restarts N`` of the demo under Separation, checkpointing every
    iteration into ``run_dir/ckpt``, its CSV log under ``run_dir``, resuming with ``--ckpt_path auto``."""
    run_dir.mkdir()
    return run_python(
        "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "--max-restarts", str(max_restarts),
        "--monitor-interval", "0.5", "-m", "lightning_app_rlhf", "fit", "--config", DEMO_CONFIG,
        "--trainer.devices", "2", "--trainer.strategy", "rlhf_separation", "--trainer.max_steps", str(STEPS),
        "--trainer.logger.init_args.save_dir", run_dir, "--trainer.logger.init_args.name", "run",
        "--trainer.default_root_dir", run_dir, "--model.generation.max_new_tokens", "8",
        "--trainer.callbacks+=lightning.pytorch.callbacks.ModelCheckpoint", f"--trainer.callbacks.dirpath={run_dir}/ckpt",
        "--trainer.callbacks.every_n_train_steps=1", "--trainer.callbacks.save_top_k=-1",
        "--trainer.callbacks.filename={step}", "--ckpt_path", "auto", *extra,
        cwd=run_dir, timeout=400, env=one_thread_env(tests=True, TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1"),
    )


@pytest.mark.slow  # torchrun's own restart around the default run's tests of auto-resume and of killed ranks
def test_torchrun_restarts_a_killed_rank_and_the_job_resumes_by_itself(tmp_path):
    """Rank 1 dies at the start of iteration 3 of the first attempt (after the step-3 checkpoint). torchrun restarts
    both ranks; they find ``step=3.ckpt`` themselves and log, from step 3 on, exactly what the uninterrupted job logs."""
    started = time.monotonic()
    elastic = torchrun_fit(tmp_path / "elastic", "--trainer.callbacks+=killrank_callback.KillRank",
                           "--trainer.callbacks.rank=1", f"--trainer.callbacks.step={KILL_STEP}",
                           "--trainer.callbacks.attempt=0", max_restarts=1)
    print(f"elastic run with one restart: {time.monotonic() - started:.0f} s")
    torchrun_fit(tmp_path / "full")
    log = elastic.stdout + elastic.stderr
    assert "failed (exitcode: 17) local_rank: 1" in log, log[-3000:]  # KillRank's exit, which torchrun restarts
    assert "no complete checkpoint under" in log and "training starts from scratch" in log, log[-3000:]
    resumed_from = tmp_path / "elastic" / "ckpt" / f"step={KILL_STEP}.ckpt"
    assert f"--ckpt_path auto: resuming from {resumed_from}, the newest complete checkpoint" in log, log[-3000:]

    first, second = (metrics_rows(tmp_path / "elastic" / "run" / f"version_{v}") for v in (0, 1))
    uninterrupted = [row for row in metrics_rows(tmp_path / "full") if "reward/mean" in row]
    resumed = [row for row in second if "reward/mean" in row]
    assert [row["step"] for row in resumed] == list(range(KILL_STEP, STEPS))
    assert [row["step"] for row in first if "reward/mean" in row] == list(range(KILL_STEP))
    for got, want in zip(resumed, uninterrupted[KILL_STEP:], strict=True):
        for metric in COMPARED:
            assert got.get(metric) == approx_or_none(want.get(metric), rel=1e-5, abs=1e-7), (metric, got["step"])


def test_auto_resume_takes_the_newest_complete_checkpoint_and_passes_over_broken_ones(tmp_path):
    """Newest first by time; a truncated newest file and hidden temporaries of saves in progress are passed over, the
    reason named; a sharded checkpoint directory counts as one checkpoint; nothing at all means None."""
    import torch

    from lightning_app_rlhf.checkpoint.format import META_FILE, seal

    assert newest_complete_checkpoint([tmp_path / "missing"]) == (None, [])
    (tmp_path / "run" / "version_0" / "checkpoints").mkdir(parents=True)
    old, new, broken = (tmp_path / "run" / "version_0" / "checkpoints" / f"step={s}.ckpt" for s in (1, 2, 3))
    for step, path in ((1, old), (2, new)):
        checkpoint = {"state_dict": {"w": torch.full((3,), float(step))}, "global_step": step}
        seal(checkpoint)
        torch.save(checkpoint, path)
    broken.write_bytes(new.read_bytes()[:100])  # a save that died midway, written in place by a foreign IO
    hidden = tmp_path / "run" / "version_0" / "checkpoints" / ".step=4.ckpt.tmp"
    hidden.write_bytes(b"partial")
    sharded = tmp_path / "ckpt" / "step=0.ckpt"  # a sharded checkpoint: a directory with its meta file
    (sharded / "actor").mkdir(parents=True)
    torch.save({"global_step": 0}, sharded / META_FILE)
    now = time.time()
    for age, path in ((40, sharded), (30, old), (20, new), (10, broken)):
        os.utime(path, (now - age, now - age))

    assert checkpoint_candidates([tmp_path]) == [broken, new, old, sharded]
    path, passed_over = newest_complete_checkpoint([tmp_path / "ckpt", tmp_path / "run"])
    assert path == new
    assert len(passed_over) == 1 and str(broken) in passed_over[0] and "not a complete" in passed_over[0]


def test_restarts_through_a_shared_rendezvous_store_are_refused_naming_the_fix():
    """torch keeps the agent's store across restarts, so a restarted attempt would connect to dead addresses."""
    from lightning_app_rlhf.strategies.placement_setup import check_elastic_restarts

    shared = {"TORCHELASTIC_MAX_RESTARTS": "3", "TORCHELASTIC_USE_AGENT_STORE": "True"}
    with pytest.raises(RuntimeError, match=r"--max-restarts 3 .* Set TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 in torchrun"):
        check_elastic_restarts(shared)
    check_elastic_restarts({**shared, "TORCHELASTIC_USE_AGENT_STORE": "False"})  # the fix: a store per attempt
    check_elastic_restarts({**shared, "TORCHELASTIC_MAX_RESTARTS": "0"})  # no restarts: nothing read twice
    check_elastic_restarts({})  # not under torchrun


def test_ckpt_path_auto_is_for_fit_only(tmp_path):
    result = run_cli("validate", "--config", DEMO_CONFIG, "--ckpt_path", "auto", cwd=tmp_path, check=False,
                     timeout=120)
    assert result.returncode != 0
    assert "--ckpt_path auto resumes training (fit), not validate" in result.stderr, result.stderr[-2000:]

