"""Preemption: SIGTERM mid-run finishes the iteration, saves last.ckpt and exits cleanly; ``--ckpt_path last``
then continues exactly as the uninterrupted run (PreemptionCheckpoint, launched from the CLI as a user would). The
shipped demo config does the same with nothing added (RLHFModule adds PreemptionCheckpoint), and Lightning's own
SIGTERM handler runs no collective under the placement strategies."""

from __future__ import annotations

import csv
import logging
import os
import re
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import lightning.pytorch as pl
import pytest
import torch
from helpers import ROOT, approx_or_none, make_module, one_thread_env, run_cli, start_cli
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.demos.boring_classes import BoringModel
from lightning.pytorch.trainer.connectors.signal_connector import _SignalConnector
from lightning.pytorch.utilities.exceptions import SIGTERMException
from test_checkpoint_safety import fit as fit_in_process
from test_checkpoint_safety import small_module
from test_placements import COMPARED

from lightning_app_rlhf import RLHFModule
from lightning_app_rlhf.callbacks.preemption_checkpoint import PreemptionCheckpoint
from lightning_app_rlhf.strategies.signal_connector import PlacementSignalConnector

STEPS = 4
SIGNAL_STEP = 1  # SIGTERM arrives during iteration 1; the run stops after it, at global step 2


def command(tmp_path: Path, name: str, *args: str, steps: int) -> tuple[list[str], dict[str, str]]:
    """The CLI arguments that run the shipped CPU demo config for ``steps`` iterations with its CSV log in
    ``tmp_path / name`` (run them in ``tmp_path``), and their environment."""
    return ["fit", "--config", str(ROOT / "examples/configs/demo_cpu.yaml"), "--trainer.max_steps", str(steps),
            "--trainer.logger.init_args.save_dir", str(tmp_path), "--trainer.logger.init_args.name", name,
            *args], one_thread_env(tests=True)


def metrics(tmp_path: Path, name: str) -> list[dict[str, float]]:
    """The rows with a reward of the run's metrics.csv files, in step order."""
    rows = []
    for path in (tmp_path / name).rglob("metrics.csv"):
        rows += [{k: float(v) for k, v in row.items() if v} for row in csv.DictReader(path.open())]
    return sorted((r for r in rows if "reward/mean" in r), key=lambda r: r["step"])


def fit(tmp_path: Path, name: str, *args: str, steps: int = STEPS) -> tuple[subprocess.CompletedProcess, list[dict]]:
    """Run the CPU demo through the CLI (12 new tokens); return the finished process and its metrics rows."""
    cli, env = command(tmp_path, name, "--model.generation.max_new_tokens", "12", *args, steps=steps)
    result = run_cli(*cli, cwd=tmp_path, env=env, check=False)
    (tmp_path / f"{name}.out").write_text(result.stdout + result.stderr)
    return result, metrics(tmp_path, name)


def common(tmp_path: Path, run: str, strategy: str, devices: int) -> list[str]:
    """A ModelCheckpoint keeping last.ckpt in its own directory per run, and PreemptionCheckpoint."""
    return ["--trainer.devices", str(devices), "--trainer.strategy", strategy, "--trainer.enable_checkpointing", "true",
            "--model.ppo.kl_target", "1.0", "--model.ppo.kl_horizon", "100", "--model.ppo.reward_norm", "true",
            "--trainer.callbacks+=lightning.pytorch.callbacks.ModelCheckpoint",
            f"--trainer.callbacks.dirpath={tmp_path / run}", "--trainer.callbacks.save_last=true",
            "--trainer.callbacks.save_top_k=0",
            "--trainer.callbacks+=lightning_app_rlhf.callbacks.preemption_checkpoint.PreemptionCheckpoint"]


@pytest.mark.parametrize("strategy,devices,every_rank", [
    # SIGTERM to the launcher (rank 0), which forwards it; the default run stops the shipped demo config this way
    pytest.param("rlhf_separation", 2, False, marks=pytest.mark.slow),
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
            assert got.get(metric) == approx_or_none(want.get(metric), rel=1e-5, abs=1e-7), (metric, got["step"])


@pytest.mark.slow  # the queue's save and exact resume also run in the default test_placements resume test
def test_sigterm_mid_queue_saves_the_queue_and_the_resumed_run_trains_on_it(tmp_path):
    """``max_staleness=2``: SIGTERM during iteration 1, when the queue holds two scored rollouts and nothing has been
    trained yet. The checkpoint keeps both; the resumed run trains on them at steps 2 and 3 and logs the
    uninterrupted run's values."""
    strategy = ("lightning_app_rlhf.strategies.SeparationStrategy", "--trainer.strategy.max_staleness", "2")
    full_result, full = fit(tmp_path, "full", *common(tmp_path, "full_ckpt", strategy[0], 2), *strategy[1:])
    assert full_result.returncode == 0, full_result.stderr[-4000:]
    args = [*common(tmp_path, "ckpt", strategy[0], 2), *strategy[1:]]
    stopped, before = fit(tmp_path, "stopped", *args, "--trainer.callbacks+=sigterm_callback.SendSigterm",
                          f"--trainer.callbacks.step={SIGNAL_STEP}")
    assert stopped.returncode == 0, (stopped.stdout + stopped.stderr)[-4000:]
    assert [r.get("policy/loss") for r in before] == [None, None]  # two rollouts queued, none trained on yet
    resumed_result, resumed = fit(tmp_path, "resumed", *args, "--ckpt_path", "last")
    assert resumed_result.returncode == 0, resumed_result.stderr[-4000:]
    assert [r["step"] for r in resumed] == [2, 3] and [r["rollout/staleness_max"] for r in resumed] == [0, 1]
    for got, want in zip(resumed, full[SIGNAL_STEP + 1:], strict=True):
        for metric in (*COMPARED, "kl/coef"):
            assert got.get(metric) == approx_or_none(want.get(metric), rel=1e-5, abs=1e-7), (metric, got["step"])


class _Signal(Callback):
    def __init__(self, signum: int, step: int) -> None:
        self.signum, self.step = signum, step
        self.connector = None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if trainer.global_step == self.step:
            self.connector = trainer._signal_connector  # whose handler Lightning registered for this run
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


# ---- the default: PreemptionCheckpoint without asking, and Lightning's handler without its collective ----

DEMO_STEPS = 8
SEPARATION_2 = ("--trainer.devices", "2", "--trainer.strategy", "rlhf_separation")
STOP_SECONDS = 30  # a hang is minutes; a stop is one iteration, the save and the exit (~3 s on 2 loaded cores)


@dataclass
class DemoStop:
    """The shipped demo config run as shipped on 2 processes under Separation, sent SIGTERM, and resumed."""

    tmp_path: Path
    iterations_seen: int  # iterations logged when SIGTERM was sent
    returncode: int
    seconds: float  # SIGTERM -> the launcher's exit
    output: str
    before: list[dict[str, float]]  # the stopped run's metrics
    left: bool  # a process of the job still running after the launcher exited
    resumed: subprocess.CompletedProcess | None = None
    after: list[dict[str, float]] | None = None  # the resumed run's metrics


def logged_iterations(tmp_path: Path, name: str) -> int:
    try:
        return len(metrics(tmp_path, name))
    except ValueError:  # a row being written
        return 0


@pytest.fixture(scope="module")
def demo_stop(tmp_path_factory) -> DemoStop:
    """Run the shipped demo config (only the iterations and the log directory changed), SIGTERM its launcher after 2
    logged iterations, as a scheduler would, and resume from the checkpoint its message names."""
    tmp_path = tmp_path_factory.mktemp("demo_stop")
    cli, env = command(tmp_path, "stopped", *SEPARATION_2, steps=DEMO_STEPS)
    # A session of its own: every rank is in the launcher's process group, to check for and kill leftovers. The
    # launcher forks from the tests' preloaded server; Lightning's launcher in it starts rank 1 as a fresh interpreter.
    process = start_cli(*cli, cwd=tmp_path, env=env, stdout=tmp_path / "stopped.out")
    try:
        deadline = time.monotonic() + 240
        while (seen := logged_iterations(tmp_path, "stopped")) < 2 and process.poll() is None:
            assert time.monotonic() < deadline, "the demo logged no 2 iterations in 240 s"
            time.sleep(0.05)
        sent = time.monotonic()
        process.send_signal(signal.SIGTERM)
        try:
            returncode = process.wait(timeout=STOP_SECONDS)
        except subprocess.TimeoutExpired:
            returncode = -1
        seconds = time.monotonic() - sent
        left = True
        for _ in range(100):  # the other rank ends right after the launcher
            try:
                os.killpg(process.pid, 0)
            except ProcessLookupError:
                left = False
                break
            time.sleep(0.1)
    finally:
        process.kill_group()
        process.wait()
    stop = DemoStop(tmp_path, seen, returncode, seconds, (tmp_path / "stopped.out").read_text(errors="replace"),
                    metrics(tmp_path, "stopped"), left)
    saved = re.search(r"SIGTERM received at iteration \d+: saved \S+; resume with --ckpt_path (\S+)", stop.output)
    if returncode == 0 and saved is not None:
        cli, env = command(tmp_path, "resumed", *SEPARATION_2, "--ckpt_path", saved.group(1), steps=DEMO_STEPS)
        stop.resumed = run_cli(*cli, cwd=tmp_path, env=env, check=False)
        (tmp_path / "resumed.out").write_text(stop.resumed.stdout + stop.resumed.stderr)
        stop.after = metrics(tmp_path, "resumed")
    return stop


def test_the_shipped_demo_config_stops_cleanly_on_sigterm(demo_stop):
    """The demo config as shipped, on 2 processes under Separation, SIGTERM to the launcher: every rank finishes the
    iteration (at most one more if the signal came as the next began), one checkpoint, exit 0 within seconds, no
    process left; the message's resume command continues from there to the end."""
    stop = demo_stop
    assert stop.returncode == 0, f"exit {stop.returncode} {stop.seconds:.1f} s after SIGTERM\n{stop.output[-4000:]}"
    assert stop.seconds < STOP_SECONDS and not stop.left
    message = re.search(r"SIGTERM received at iteration (\d+): saved (\S+); resume with --ckpt_path (\S+)", stop.output)
    assert message is not None, stop.output[-4000:]
    iteration, path = int(message.group(1)), Path(message.group(2))
    assert stop.iterations_seen + 1 <= iteration <= stop.iterations_seen + 2 < DEMO_STEPS
    # Lightning's ModelCheckpoint here has no dirpath: the next run's `last` would look in version_1, so the
    # message names the file.
    assert path == stop.tmp_path / "stopped/version_0/checkpoints/last.ckpt" and message.group(3) == str(path)
    assert [p.name for p in path.parent.iterdir()] == ["last.ckpt"]
    assert torch.load(path, weights_only=True)["global_step"] == iteration
    assert [r["step"] for r in stop.before] == list(range(iteration))
    # The progress bar (RLHFProgressBar in the config) counts iterations, not "Epoch 0/-2".
    assert f"Iteration {iteration}/{DEMO_STEPS}, epoch 0" in stop.output and "Epoch 0/-2" not in stop.output

    assert stop.resumed is not None, "no resumed run"
    assert stop.resumed.returncode == 0, stop.resumed.stderr[-4000:]
    assert [r["step"] for r in stop.after] == list(range(iteration, DEMO_STEPS))


def test_the_shipped_demo_config_resumes_as_the_uninterrupted_run(demo_stop):
    """The resumed demo logs the uninterrupted demo's values at every step after the stop."""
    stop = demo_stop
    assert stop.after, "no resumed run (see test_the_shipped_demo_config_stops_cleanly_on_sigterm)"
    cli, env = command(stop.tmp_path, "full", *SEPARATION_2, steps=DEMO_STEPS)
    full_result = run_cli(*cli, cwd=stop.tmp_path, env=env, check=False)
    assert full_result.returncode == 0, full_result.stderr[-4000:]
    full = metrics(stop.tmp_path, "full")
    assert [r["step"] for r in full] == list(range(DEMO_STEPS))
    first = int(stop.after[0]["step"])
    for got, want in zip(stop.after, full[first:], strict=True):
        for metric in COMPARED:
            assert got.get(metric) == approx_or_none(want.get(metric), rel=1e-5, abs=1e-7), (metric, got["step"])


def test_lightnings_sigterm_handler_runs_no_collective_under_a_placement(monkeypatch):
    """Lightning's own handler broadcasts inside the signal handler, wherever each rank was interrupted (the hang);
    the placement strategies' connector forwards the signal to the launched ranks once and sets the flag."""
    broadcasts, killed = [], []
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.distributed, "broadcast", lambda *args, **kwargs: broadcasts.append(args))
    trainer = SimpleNamespace(local_rank=0, world_size=2, strategy=SimpleNamespace(
        launcher=SimpleNamespace(kill=killed.append), root_device=torch.device("cpu")))

    _SignalConnector(trainer)._sigterm_notifier_fn(signal.SIGTERM, None)
    # When this fails, Lightning no longer runs a collective in its handler and PlacementSignalConnector may go.
    assert len(broadcasts) == 1

    broadcasts.clear()
    killed.clear()
    connector = PlacementSignalConnector(trainer)
    connector._sigterm_notifier_fn(signal.SIGTERM, None)
    connector._sigterm_notifier_fn(signal.SIGTERM, None)
    assert broadcasts == [] and killed == [signal.SIGTERM] and connector.received_sigterm


def test_a_failed_agreement_leaves_the_dead_rank_to_the_next_collective(monkeypatch):
    """A rank that died before the end-of-iteration check: the check does not raise (the iteration's next collective
    with that rank does, naming the call and the rank under a placement) and does not stop to save (a save needs every
    rank)."""
    def closed(*args, **kwargs):
        raise RuntimeError("Connection closed by peer")

    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.distributed, "all_reduce", closed)
    callback = PreemptionCheckpoint()
    callback._flags = [True, False]  # SIGTERM noted here
    trainer = SimpleNamespace(world_size=2, strategy=SimpleNamespace(root_device=torch.device("cpu")))
    assert callback._agree(trainer) == (False, False)


@pytest.mark.parametrize("preemption_checkpoint", [True, False])
def test_a_placement_run_stops_cleanly_on_sigterm_by_default(tmp_path, tiny_gpt2_config, tokenizer,
                                                             preemption_checkpoint):
    """RLHFModule adds PreemptionCheckpoint (rlhf_flattening, 1 process, in-process): SIGTERM during iteration 1
    saves last.ckpt at step 2 and fit returns. ``preemption_checkpoint=False`` leaves Lightning's stop
    (``SIGTERMException``, no checkpoint), through the placement strategies' connector."""
    module = small_module(tiny_gpt2_config, tokenizer)
    module.preemption_checkpoint = preemption_checkpoint  # what RLHFModule(preemption_checkpoint=...) sets
    sender = _Signal(signal.SIGTERM, step=1)
    before = signal.getsignal(signal.SIGTERM)
    if preemption_checkpoint:
        trainer = fit_in_process(module, tokenizer, tmp_path, steps=5, callbacks=[sender])
        assert trainer.global_step == 2 and any(isinstance(c, PreemptionCheckpoint) for c in trainer.callbacks)
        assert torch.load(tmp_path / "checkpoints/last.ckpt", weights_only=True)["global_step"] == 2
    else:
        with pytest.raises(SIGTERMException):
            fit_in_process(module, tokenizer, tmp_path, steps=5, callbacks=[sender])
        assert not list(tmp_path.rglob("*.ckpt"))
    assert isinstance(sender.connector, PlacementSignalConnector)
    assert signal.getsignal(signal.SIGTERM) == before  # Lightning restored the handler


def test_rlhf_module_adds_preemption_checkpoint_unless_the_trainer_has_one_or_it_is_off(tiny_gpt2_config, tokenizer):
    """The default is a PreemptionCheckpoint; a user's own (here with a dirpath) is kept, not replaced; the config
    key ``model.preemption_checkpoint: false`` adds none."""
    def added(module: RLHFModule, *callbacks: Callback) -> list[PreemptionCheckpoint]:
        module.trainer = SimpleNamespace(callbacks=list(callbacks))
        return [c for c in module.configure_callbacks() if isinstance(c, PreemptionCheckpoint)]

    module = small_module(tiny_gpt2_config, tokenizer)
    assert module.hparams["preemption_checkpoint"] is True and len(added(module)) == 1
    assert added(module, PreemptionCheckpoint(dirpath="mine")) == []
    off = make_module(preemption_checkpoint=False)
    assert off.hparams["preemption_checkpoint"] is False and added(off) == []
