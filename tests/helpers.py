"""Plain helpers shared by the tests (conftest.py makes the tokenizer and the tiny config fixtures of them).

- ``one_thread_env``: the environment of every subprocess (this checkout importable, one torch thread);
- ``run_python`` / ``run_cli`` / ``cli_command``: a script or ``python -m lightning_app_rlhf ...``, forked from a
  server with its imports done and set up as a fresh interpreter would be, failing the test with the tails of its
  stdout and stderr unless it exits 0 (``check=False`` to look yourself); ``start_python`` / ``start_cli``: one
  started the same way without waiting (a ``Popen``-like handle), for the launches a test watches and signals;
- ``fit_demo`` / ``fit_demo_args`` / ``metrics_rows``: a demo config fitted from the CLI (or its arguments, for a
  launcher of one's own), and the rows of its metrics.csv; ``forked_ranks``: the arguments that fork a placement's
  ranks instead of re-running the command per rank (what ``fit_demo`` does);
- ``run_ranks`` / ``free_port``: a function on forked (or spawned) gloo ranks, failing the test with the rank that
  raised or hung;
- ``make_module``: an ``RLHFModule`` on the tiny GPT-2 and the demo tokenizer.
"""

from __future__ import annotations

import csv
import functools
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]
TESTS = ROOT / "tests"
DEMO_CONFIG = ROOT / "examples/configs/demo_cpu.yaml"

TINY_GPT2 = {
    "model_type": "gpt2",
    "n_layer": 1,
    "n_embd": 32,
    "n_head": 2,
    "vocab_size": 512,
    "n_positions": 64,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": 0,
}
"""One layer, 32 dims: builds in milliseconds and matches the demo tokenizer's 512 tokens."""


# ---- subprocesses ----


def one_thread_env(*, tests: bool = False, one_thread: bool = True, **extra: str) -> dict[str, str]:
    """``os.environ`` for a subprocess: this checkout on ``PYTHONPATH`` (and ``tests/`` with ``tests=True``, for the
    callbacks and scripts kept there), ``OMP_NUM_THREADS=1`` (``one_thread=False`` keeps torch's default, as a
    user's run), then ``extra``."""
    path = f"{ROOT}{os.pathsep}{TESTS}" if tests else str(ROOT)
    return {**os.environ, "PYTHONPATH": path, **({"OMP_NUM_THREADS": "1"} if one_thread else {}), **extra}


def output_tail(result: subprocess.CompletedProcess, chars: int = 4000) -> str:
    """The exit status and the last ``chars`` characters of a finished process's stdout and stderr."""
    return (f"`{' '.join(map(str, result.args))}` exited with {result.returncode}\n"
            f"--- stdout (tail) ---\n{(result.stdout or '')[-chars:]}\n"
            f"--- stderr (tail) ---\n{(result.stderr or '')[-chars:]}")


def run_python(*args: str | Path, cwd: Path | None = None, timeout: float = 300, check: bool = True,
               one_thread: bool = True, env: dict[str, str] | None = None,
               fresh_interpreter: bool = False) -> subprocess.CompletedProcess:
    """``python ARGS`` (``SCRIPT ...``, ``-m MODULE ...`` or ``-c CODE ...``) in ``cwd``, in the environment ``env``
    (by default ``one_thread_env(one_thread=one_thread)``), its output captured as text. ``check``: raise an
    AssertionError with the output's tails unless it exits 0.

    It runs in a fork of a server process that imported torch, Lightning, transformers and the CLI once per session
    (multiprocessing's ``forkserver``, with them preloaded): a fresh interpreter spends ~12 s of 2 cores on those
    imports before the command's first line. The server runs no torch op, so the command's OpenMP threads start as
    in a fresh interpreter (a fork of pytest's own process would not do: GNU OpenMP's thread pool does not survive a
    fork once a multi-threaded op ran, and the forked command hangs in its first one). The fork gets the command
    line, the environment, the working directory, its own standard streams and the torch thread count a fresh
    interpreter would have; a Lightning or Fabric launcher with ``popen`` re-runs it per rank as it would re-run the
    interpreter's command. It exits as multiprocessing's processes do (it joins the threads still running, then
    ``os._exit``: no ``atexit`` handlers, no interpreter finalization), so ``fresh_interpreter=True`` runs a real
    subprocess for what an interpreter does as it starts or ends (warnings printed once per process, the
    finalization that running threads can crash)."""
    env = one_thread_env(one_thread=one_thread) if env is None else env
    args = [str(a) for a in args]
    if fresh_interpreter:
        result = subprocess.run([sys.executable, *args], cwd=cwd, env=env, capture_output=True, text=True,
                                timeout=timeout, check=False)
    else:
        result = _run_forked(args, cwd, env, timeout)
    if check and result.returncode != 0:  # an AssertionError, as the tests' own checks raise
        raise AssertionError(output_tail(result))
    return result


def cli_command(*args: str | Path) -> list[str]:
    """The command line of ``python -m lightning_app_rlhf ARGS`` (for a ``subprocess.Popen`` of one's own)."""
    return [sys.executable, "-m", "lightning_app_rlhf", *map(str, args)]


def run_cli(*args: str | Path, cwd: Path | None = None, timeout: float = 300, check: bool = True,
            one_thread: bool = True, env: dict[str, str] | None = None,
            fresh_interpreter: bool = False) -> subprocess.CompletedProcess:
    """``python -m lightning_app_rlhf ARGS`` (fit, validate, plan, ...) in ``cwd``, as :func:`run_python` runs it."""
    return run_python("-m", "lightning_app_rlhf", *args, cwd=cwd, timeout=timeout, check=check,
                      one_thread=one_thread, env=env, fresh_interpreter=fresh_interpreter)


def _run_forked(args: list[str], cwd: Path | None, env: dict[str, str],
                timeout: float) -> subprocess.CompletedProcess:
    """``python ARGS`` forked from the preloaded server (:func:`run_python`); raises ``subprocess.TimeoutExpired``
    after ``timeout`` seconds, as ``subprocess.run`` does, once the command's process group is killed."""
    import tempfile

    with tempfile.TemporaryDirectory() as streams:
        out, err = Path(streams, "stdout"), Path(streams, "stderr")
        process = start_python(*args, cwd=cwd, env=env, stdout=out, stderr=err)
        try:
            process.wait(timeout)
        except subprocess.TimeoutExpired:
            pass
        process.kill_group()  # the command's own rank processes too, if it left any
        process.wait()
        stdout, stderr = (path.read_text(errors="replace") if path.exists() else "" for path in (out, err))
    if process.timed_out:
        raise subprocess.TimeoutExpired(process.args, timeout, output=stdout, stderr=stderr)
    return subprocess.CompletedProcess(process.args, process.returncode, stdout, stderr)


class ForkedPython:
    """A ``python ARGS`` that :func:`start_python` forked: what the tests use of ``subprocess.Popen`` (``pid``,
    ``args``, ``returncode``, ``poll``, ``wait``, ``send_signal``, ``kill``), and ``kill_group``. Its process is a
    session and process group of its own (``Popen(..., start_new_session=True)``)."""

    def __init__(self, process: Any, args: list[str]) -> None:
        self._process = process
        self.args = [sys.executable, *args]
        self.pid: int = process.pid
        self.timed_out = False

    @property
    def returncode(self) -> int | None:
        """The exit status (``-N``: killed by signal N), None while it runs."""
        return self._process.exitcode

    def poll(self) -> int | None:
        return self._process.exitcode

    def wait(self, timeout: float | None = None) -> int:
        """The exit status; raises ``subprocess.TimeoutExpired`` (and remembers it in ``timed_out``) if it still
        runs after ``timeout`` seconds."""
        self._process.join(timeout)
        if self._process.exitcode is None:
            self.timed_out = True
            raise subprocess.TimeoutExpired(self.args, timeout)
        return self._process.exitcode

    def send_signal(self, sig: int) -> None:
        if self._process.exitcode is None:
            os.kill(self.pid, sig)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def kill_group(self) -> None:
        """SIGKILL to its process group: it and every process it started that did not leave the group."""
        try:
            os.killpg(self.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):  # the group is gone already
            pass


def start_python(*args: str | Path, cwd: Path | None = None, env: dict[str, str] | None = None,
                 stdout: Path = Path(os.devnull), stderr: Path | None = None) -> ForkedPython:
    """Start ``python ARGS`` as :func:`run_python` runs it (a fork of the preloaded server, set up as a fresh
    interpreter) without waiting: for a launch the test watches and signals, as torchrun's ranks, SLURM's tasks or a
    scheduler's job. ``stdout`` / ``stderr``: the files its streams write to (``stderr`` None: ``stdout``'s file)."""
    import multiprocessing

    forks = multiprocessing.get_context("forkserver")
    forks.set_forkserver_preload(["lightning_app_rlhf.cli", "helpers"])  # read when the server starts (once)
    args = [str(a) for a in args]
    env = one_thread_env() if env is None else env
    process = forks.Process(target=_python_in_fork, args=(args, cwd, env, stdout, stderr), name="python")
    process.start()
    return ForkedPython(process, args)


def start_cli(*args: str | Path, cwd: Path | None = None, env: dict[str, str] | None = None,
              stdout: Path = Path(os.devnull), stderr: Path | None = None) -> ForkedPython:
    """``python -m lightning_app_rlhf ARGS`` started as :func:`start_python` starts it."""
    return start_python("-m", "lightning_app_rlhf", *args, cwd=cwd, env=env, stdout=stdout, stderr=stderr)


def _python_in_fork(args: list[str], cwd: Path | None, env: dict[str, str], out: Path, err: Path | None) -> None:
    """The body of :func:`start_python`'s fork: set up what a fresh ``python ARGS`` would have, then run it as
    ``__main__`` (multiprocessing prints an uncaught exception's traceback and exits 1; ``SystemExit`` sets the
    status; it joins the threads still running, as the interpreter does, and runs no ``atexit`` handler)."""
    import runpy

    import torch

    os.setsid()  # a session and process group of its own: a timeout kills the ranks it started as well
    os.environ.clear()
    os.environ.update(env)
    if cwd is not None:
        os.chdir(cwd)
    for fds, path in (((1, 2), out), ((2,), err)) if err is not None else (((1, 2), out),):
        file = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)  # sys.stdout / sys.stderr write to fds 1, 2
        for fd in fds:
            os.dup2(file, fd)
        os.close(file)
    torch.set_num_threads(int(env.get("OMP_NUM_THREADS") or len(os.sched_getaffinity(0))))
    # sys.argv and __main__ as the interpreter sets them: what a popen launcher re-runs per rank.
    if args[0] == "-m":
        sys.argv = [args[1], *args[2:]]  # run_module puts the module's file in sys.argv[0]
        runpy.run_module(args[1], run_name="__main__", alter_sys=True)
    elif args[0] == "-c":
        sys.argv = ["-c", *args[2:]]
        exec(compile(args[1], "<string>", "exec"), {"__name__": "__main__"})  # noqa: S102 (the test's own code)
    else:
        sys.argv = list(args)
        sys.path.insert(0, str(Path(args[0]).resolve().parent))
        runpy.run_path(args[0], run_name="__main__")


def metrics_rows(directory: Path) -> list[dict[str, float]]:
    """The rows of the one metrics.csv below ``directory``, their non-empty values as floats."""
    (metrics,) = Path(directory).rglob("metrics.csv")
    with metrics.open() as file:
        return [{k: float(v) for k, v in row.items() if v} for row in csv.DictReader(file)]


def approx_or_none(expected: float | None, **tolerance: float) -> Any:
    """What a logged metric must equal: ``pytest.approx(expected, **tolerance)``, or None where the reference run
    did not log it (so a metric that both runs leave out compares equal, and one only the other run logs does not).
    pytest 9.2.0 refuses ``approx(None)`` with a relative tolerance (TypeError: "expected value must support
    abs(...)"); 9.1.1 and earlier compared None equal to it."""
    return None if expected is None else pytest.approx(expected, **tolerance)


def fit_demo_args(tmp_path: Path, name: str, *args: str | Path, config: Path = DEMO_CONFIG, steps: int = 3,
                  max_new_tokens: int = 12) -> list[str | Path]:
    """The ``fit`` arguments of :func:`fit_demo`, for a launch of one's own (torchrun, srun): ``--config CONFIG`` for
    ``steps`` iterations, checkpointing off, ``max_new_tokens`` new tokens, its CSV log in ``tmp_path / name``, then
    ``args``."""
    return ["fit", "--config", config, "--trainer.max_steps", str(steps), "--trainer.enable_checkpointing", "false",
            "--trainer.logger.init_args.save_dir", tmp_path, "--trainer.logger.init_args.name", name,
            "--model.generation.max_new_tokens", str(max_new_tokens), *args]


def forked_ranks(args: Sequence[str | Path]) -> list[str | Path]:
    """``fit`` arguments ``args`` whose placement, when it runs on more than one process, is started by Lightning's
    ``fork`` launcher: the ranks fork from the CLI's process instead of re-running the command, so none pays again
    the ~10 s import of torch, Lightning and transformers that a fresh interpreter costs on 2 cores. What the ranks
    train does not depend on how they were started: the trajectory tests compare them with one-process runs
    either way. ``popen``, the users' default, stays in the default run: Lightning re-runs the command per rank in
    tests/test_preemption.py (the shipped demo on 2 processes) and test_lightning_native.py, and
    tests/test_faults.py and test_multinode.py start every rank themselves, as torchrun and SLURM do.

    The devices and the strategy are read as the CLI reads them, the last one given winning: from each ``--config``
    file and from ``--trainer.devices`` / ``--trainer.strategy``. A strategy of this package (an ``rlhf_*`` name,
    whose class then takes its place, or a class path) gets ``--trainer.strategy.start_method fork``; any other,
    or one process, leaves the arguments as they are."""
    import yaml
    from lightning.pytorch.strategies import StrategyRegistry

    import lightning_app_rlhf.strategies  # noqa: F401  (registers the rlhf_* names)

    args = [str(a) for a in args]
    devices, strategy, strategy_at = 1, None, None
    for i, arg in enumerate(args[:-1]):
        if arg == "--config":
            trainer = (yaml.safe_load(Path(args[i + 1]).read_text()) or {}).get("trainer") or {}
            devices = trainer.get("devices", devices)
            if "strategy" in trainer:
                given = trainer["strategy"]
                strategy, strategy_at = (given.get("class_path") if isinstance(given, dict) else given), None
        elif arg == "--trainer.devices":
            devices = args[i + 1]
        elif arg == "--trainer.strategy":
            strategy, strategy_at = args[i + 1], i + 1
    if int(devices) < 2 or strategy is None or "--trainer.strategy.start_method" in args:
        return list(args)
    if strategy.startswith("rlhf_") and strategy_at is not None:
        entry = StrategyRegistry[strategy]
        if entry["init_params"]:  # a preset registered with its plan: only its name builds it
            return list(args)
        args[strategy_at] = f"{entry['strategy'].__module__}.{entry['strategy'].__qualname__}"
    elif not strategy.startswith("lightning_app_rlhf."):
        return list(args)
    return [*args, "--trainer.strategy.start_method", "fork"]


def fit_demo(tmp_path: Path, name: str, *args: str | Path, config: Path = DEMO_CONFIG, steps: int = 3,
             max_new_tokens: int = 12, timeout: float = 300,
             env: dict[str, str] | None = None) -> list[dict[str, float]]:
    """:func:`fit_demo_args` run from the CLI in ``tmp_path``, its stdout kept in ``name.out``, a placement on
    several processes forking its ranks (:func:`forked_ranks`). Its metrics rows."""
    args = fit_demo_args(tmp_path, name, *args, config=config, steps=steps, max_new_tokens=max_new_tokens)
    result = run_cli(*forked_ranks(args), cwd=tmp_path, timeout=timeout, env=env)
    (tmp_path / f"{name}.out").write_text(result.stdout)
    return metrics_rows(tmp_path / name)


# ---- ranks in processes ----


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (for a gloo group's rendezvous)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run_ranks(fn: Callable[..., None], world_size: int, *args: Any, timeout: float = 240.0,
              start_method: str = "fork") -> None:
    """``fn(rank, port, *args)`` in ``world_size`` processes (``port``: a free one for their gloo group). Fails the
    test naming the rank that raised (with its traceback) or died, or when they have not all finished after
    ``timeout`` seconds; no process is left running."""
    import torch.distributed as dist
    import torch.multiprocessing as mp

    if dist.is_available() and dist.is_initialized():  # an earlier in-process test's group: children inherit it
        dist.destroy_process_group()
    context = mp.start_processes(fn, args=(free_port(), *args), nprocs=world_size, join=False,
                                 start_method=start_method)
    deadline = time.monotonic() + timeout
    try:
        while not context.join(timeout=1):
            if time.monotonic() > deadline:
                pytest.fail(f"The {world_size} ranks of {fn.__name__} did not finish in {timeout} s.", pytrace=False)
    except mp.ProcessRaisedException as error:
        pytest.fail(f"Rank {error.error_index} of {world_size} ({fn.__name__}) raised:\n{error}", pytrace=False)
    except mp.ProcessExitedException as error:
        pytest.fail(f"Rank {error.error_index} of {world_size} ({fn.__name__}) died: {error}", pytrace=False)
    finally:
        for process in context.processes:
            if process.is_alive():
                process.kill()


# ---- modules ----


@functools.cache
def demo_tokenizer():
    """The demo byte-level BPE tokenizer (<pad>=0, <bos>=1, <eos>=2, 512 tokens, left padding), built once. Do not
    mutate."""
    from lightning_app_rlhf.demo import build_tokenizer

    return build_tokenizer()


def make_module(**overrides: Any):
    """An ``RLHFModule`` with actor ``{"config": <a copy of TINY_GPT2>}``, the demo tokenizer and
    ``demo.topic_reward`` (none when ``reward_model`` is given); ``overrides`` replace these and add the rest."""
    from lightning_app_rlhf import RLHFModule
    from lightning_app_rlhf.demo import topic_reward

    defaults: dict[str, Any] = {"actor": {"config": dict(TINY_GPT2)}, "tokenizer": demo_tokenizer()}
    if "reward_model" not in overrides:
        defaults["reward_fn"] = topic_reward
    return RLHFModule(**{**defaults, **overrides})
