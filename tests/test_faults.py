"""Fault injection: one rank of 4 is SIGKILLed at a chosen phase, under each placement.

The 4 ranks are launched as torchrun or SLURM would, one process each with ``LOCAL_RANK`` set, in a session of its own
(forked from the tests' preloaded server, :func:`helpers.start_cli`, not paying the imports again), with a short
collective timeout (``--trainer.strategy.timeout``). :mod:`fault_injection` kills rank ``RLHF_KILL_RANK`` inside
``RLHF_KILL_PHASE`` of the iteration at global step 2, just after the step-2 checkpoint. Each cell checks that

- the killed rank died of SIGKILL, and every other rank exits, non-zero, within the timeout plus a margin;
- each survivor's error is a ``PlacementError`` naming the collective, its call, role and ranks, and the dead rank
  (from the heartbeats in the store; "the store is unreachable" when rank 0, which hosts it, died);
- no process of the job is left (each rank runs in its own session, checked through psutil);
- the step-2 checkpoint on disk is intact (weights-only load and its checksum); a slow test resumes from the one
  Separation leaves when a rank dies mid-reallocation, and logs what an uninterrupted run logs.

Separation alone moves weights between groups, so the ``reallocate`` phase is Separation's only: its cells for
Flattening and Interleaving are skipped (nothing to kill in). The default run covers one cell (the reallocation under
Separation); the whole matrix and the resume (10 cells, about a
minute each on 2 cores) runs with::

    pytest -m slow tests/test_faults.py      # the 9 other cells and the resume
    pytest -m "slow or not slow" tests/test_faults.py   # all of them
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import threading
import time
from pathlib import Path

import psutil
import pytest
from helpers import ROOT, approx_or_none, free_port, metrics_rows, one_thread_env, output_tail, run_python, start_cli

from lightning_app_rlhf.checkpoint.format import load_checkpoint_file, verify
from lightning_app_rlhf.parallel.heartbeat import STUCK_EXIT_CODE

TIMEOUT_S = 20
"""The collective timeout the cells run under (``--trainer.strategy.timeout``)."""
MARGIN_S = 25
"""Allowed on top of it for every survivor to notice, name the dead rank (a few heartbeats) and exit."""
KILL_STEP = 2
STRATEGY_CLASS = {"rlhf_flattening": "FlatteningStrategy", "rlhf_interleaving": "InterleavingStrategy",
                  "rlhf_separation": "SeparationStrategy"}
KILLED = {  # (placement, phase) -> the rank that dies: one that takes part in the phase
    ("rlhf_flattening", "generate"): 0,  # rank 0 hosts the store: the survivors must say it is gone
    ("rlhf_flattening", "score_gather"): 1,
    ("rlhf_flattening", "train"): 2,
    ("rlhf_interleaving", "generate"): 1,
    ("rlhf_interleaving", "score_gather"): 2,  # a reward rank, inside the reference's gather
    ("rlhf_interleaving", "train"): 3,
    ("rlhf_separation", "generate"): 1,  # generation ranks 0-1
    ("rlhf_separation", "score_gather"): 0,
    ("rlhf_separation", "train"): 3,  # training ranks 2-3
    ("rlhf_separation", "reallocate"): 2,  # the train leader, which sends the weights to the shadows on 0-1
}
DEFAULT_CELLS = {("rlhf_separation", "reallocate")}  # the one with shadows, and the exact resume; the rest slow
ERROR = re.compile(r"PlacementError: Rank (\d): the (gather of results|broadcast of statistics|all-reduce|weight "
                   r"reallocation) of call '(\w+)\.(\w+)' \(role '(\w+)', ranks \[([\d, ]+)\]")
FREE_RUNNING = ("--trainer.strategy.free_running", "true", "--trainer.strategy.max_staleness", "1")
ANY_COLLECTIVE = re.compile(r"PlacementError: Rank (\d): the (.+?) of (?:call '(\w+)\.(\w+)' \(role '(\w+)'|the whole "
                            r"world)")
"""A survivor's error under free-running: a call's collective, a send or a wait of its side, or a collective of the
whole world that Lightning asks of the strategy (a checkpoint the generation side ran ahead to)."""
COMMON = ("--model.ppo.kl_target", "1.0", "--model.ppo.kl_horizon", "100", "--model.ppo.reward_norm", "true",
          "--model.generation.max_new_tokens", "8")
COMPARED = ("reward/mean", "reward/std", "kl/mean", "kl/coef", "policy/loss", "policy/clipfrac", "policy/approx_kl",
            "policy/entropy", "value/loss", "value/clipfrac", "response/length_mean")


def cells():
    for placement in STRATEGY_CLASS:
        for phase in ("generate", "score_gather", "train", "reallocate"):
            if (placement, phase) not in KILLED:
                yield pytest.param(placement, phase, marks=pytest.mark.skip(
                    reason=f"{placement} keeps no shadow copies: no weight reallocation to kill a rank in"))
            elif (placement, phase) in DEFAULT_CELLS:
                yield pytest.param(placement, phase)
            else:
                yield pytest.param(placement, phase, marks=pytest.mark.slow)


def command(tmp_path: Path, placement: str, steps: int, *extra: str) -> list[str | Path]:
    """The CLI's arguments of a cell's 4-rank run."""
    return ["fit", "--config", ROOT / "examples/configs/demo_cpu.yaml",
            "--trainer.devices", "4", "--trainer.strategy",
            f"lightning_app_rlhf.strategies.{STRATEGY_CLASS[placement]}",
            "--trainer.strategy.timeout", str(TIMEOUT_S), "--trainer.max_steps", str(steps),
            "--trainer.enable_checkpointing", "true", "--trainer.logger.init_args.save_dir", tmp_path,
            "--trainer.callbacks+=lightning.pytorch.callbacks.ModelCheckpoint",
            f"--trainer.callbacks.dirpath={tmp_path / 'ckpt'}", "--trainer.callbacks.every_n_train_steps=2",
            "--trainer.callbacks.save_top_k=-1", "--trainer.callbacks.filename={step}", *COMMON, *extra]


def launch_ranks(tmp_path: Path, args: list[str | Path], env: dict[str, str],
                 name: str) -> tuple[list[int], list[float]]:
    """Run the 4 ranks of ``fit ARGS`` as torchrun would (one process each with ``LOCAL_RANK`` set, own session; forked
    from the tests' preloaded server, :func:`helpers.start_cli`), their stderr in ``NAME{rank}.err``; return exit
    codes and exit times."""
    env = one_thread_env(tests=True, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), WORLD_SIZE="4",
                         NODE_RANK="0", **env)
    procs = [start_cli(*args, cwd=tmp_path, env={**env, "LOCAL_RANK": str(rank)},
                       stderr=tmp_path / f"{name}{rank}.err") for rank in range(4)]
    sessions = [p.pid for p in procs]
    ended: list[float | None] = [None] * 4
    deadline = time.monotonic() + 400
    try:
        while None in ended and time.monotonic() < deadline:
            for rank, proc in enumerate(procs):
                if ended[rank] is None and proc.poll() is not None:
                    ended[rank] = time.monotonic()
            time.sleep(0.1)
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    left = [p for p in psutil.process_iter(["pid"]) if _session(p.pid) in sessions]
    for p in left:
        p.kill()
    assert not left, f"processes of the job left behind: {left}"
    assert None not in ended, "a rank was still running after 400 s"
    return [p.returncode for p in procs], ended


def _session(pid: int) -> int | None:
    try:
        return os.getsid(pid)
    except OSError:
        return None


def metrics(tmp_path: Path, name: str) -> list[dict[str, float]]:
    return [row for row in metrics_rows(tmp_path / name) if "reward/mean" in row]


@pytest.mark.parametrize("placement,phase", list(cells()))
def test_killed_rank_stops_every_rank_with_named_errors(tmp_path, placement, phase):
    kill_a_rank(tmp_path, placement, phase)


def test_under_free_running_the_side_waiting_on_a_dead_rank_names_it(tmp_path):
    """Free-running (k=1, generation on ranks 0-1, training on 2-3): training rank 3 dies inside its update at step 2.
    Rank 2 waits on it in the train group's all-reduce; the generation side, running ahead, fails sending it the next
    rollout, waiting for the policy version it would have published, or in the next checkpoint's collectives. Every
    survivor, on either side, names rank 3 within the timeout."""
    kill_a_rank(tmp_path, "rlhf_separation", "train", killed=3, extra=FREE_RUNNING, error=ANY_COLLECTIVE)


def kill_a_rank(tmp_path: Path, placement: str, phase: str, killed: int | None = None, extra: tuple[str, ...] = (),
                error: re.Pattern[str] = ERROR) -> Path:
    """Run the cell: kill its rank (``KILLED``'s, or ``killed``) at step 2, check every rank's exit and its ``error``
    and the checkpoint it leaves. That checkpoint's path. ``extra``: more of the command line's arguments."""
    killed = KILLED[placement, phase] if killed is None else killed
    started = time.monotonic()
    cmd = command(tmp_path, placement, 5, "--trainer.logger.init_args.name", "killed",
                  "--trainer.callbacks+=fault_injection.KillAtPhase", *extra)
    env = {"RLHF_KILL_RANK": str(killed), "RLHF_KILL_PHASE": phase, "RLHF_KILL_STEP": str(KILL_STEP)}
    codes, ended = launch_ranks(tmp_path, cmd, env, "rank")
    errors = [(tmp_path / f"rank{rank}.err").read_text() for rank in range(4)]
    survivors = [r for r in range(4) if r != killed]
    print(f"{placement}/{phase}: killed rank {killed}; run {time.monotonic() - started:.1f}s; exits after the kill: "
          + ", ".join(f"rank {r} +{ended[r] - ended[killed]:.1f}s" for r in survivors))

    assert codes[killed] == -signal.SIGKILL, errors[killed][-3000:]
    assert f"SIGKILL rank {killed} in phase {phase!r} at step {KILL_STEP}" in errors[killed]
    for rank in survivors:
        assert codes[rank] != 0, errors[rank][-3000:]
        assert ended[rank] - ended[killed] < TIMEOUT_S + MARGIN_S, (rank, ended[rank] - ended[killed])
        match = error.search(errors[rank])
        assert match, errors[rank][-3000:]
        line = errors[rank][match.start():].splitlines()[0]
        print(f"  rank {rank}: {line[:400]}")
        assert int(match[1]) == rank and match[3] == match[5], line
        if killed == 0:
            assert "rank 0 hosts it" in line, line
        else:
            assert f"Heartbeats: rank {killed} stopped responding (last heartbeat " in line, line

    (checkpoint,) = (tmp_path / "ckpt").iterdir()  # step 2's, and nothing half-written beside it
    assert checkpoint.name == f"step={KILL_STEP}.ckpt"
    verify(load_checkpoint_file(checkpoint), checkpoint)
    return checkpoint


@pytest.mark.slow  # the default run kills this rank above, and resumes exactly in tests/test_placements.py
def test_the_checkpoint_a_killed_rank_leaves_resumes_as_the_uninterrupted_run(tmp_path):
    """The step-2 checkpoint of a run whose rank died mid-reallocation under Separation resumes on 4 ranks and logs
    what an uninterrupted run logs at steps 2 and 3."""
    placement = "rlhf_separation"
    checkpoint = kill_a_rank(tmp_path, placement, "reallocate")
    resumed_cmd = command(tmp_path, placement, 4, "--trainer.logger.init_args.name", "resumed",
                          "--trainer.callbacks.dirpath", str(tmp_path / "ckpt2"), "--ckpt_path", str(checkpoint))
    codes, _ = launch_ranks(tmp_path, resumed_cmd, {}, "resumed")
    assert codes == [0] * 4, (tmp_path / "resumed0.err").read_text()[-3000:]
    full_cmd = command(tmp_path, placement, 4, "--trainer.logger.init_args.name", "full",
                       "--trainer.callbacks.dirpath", str(tmp_path / "ckpt3"))
    codes, _ = launch_ranks(tmp_path, full_cmd, {}, "full")
    assert codes == [0] * 4, (tmp_path / "full0.err").read_text()[-3000:]
    resumed, full = metrics(tmp_path, "resumed"), metrics(tmp_path, "full")
    assert [r["step"] for r in resumed] == [2, 3]
    for got, want in zip(resumed, full[2:], strict=True):
        for metric in COMPARED:
            assert got.get(metric) == approx_or_none(want.get(metric), rel=1e-5, abs=1e-7), (metric, got["step"])


def test_heartbeat_names_the_rank_that_stopped():
    """In one process: the ranks whose heartbeat stopped are named, the first to stop first; a live one is not."""
    import datetime

    import torch.distributed as dist

    from lightning_app_rlhf.parallel.heartbeat import HEARTBEAT_KEY, Heartbeat

    store = dist.TCPStore("127.0.0.1", free_port(), is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=5))
    alive, me = Heartbeat(store, 2, 4, interval=0.2), Heartbeat(store, 1, 4, interval=0.2)
    try:
        beat = json.loads(store.get(f"{HEARTBEAT_KEY}1"))
        store.set(f"{HEARTBEAT_KEY}0", json.dumps({**beat, "time": time.time() - 30}))  # 30 s ago; rank 3: never
        text = me.stopped_ranks()
    finally:
        alive.stop()
        me.stop()
    assert re.fullmatch(r"Heartbeats: rank 0 stopped responding \(last heartbeat 3\d\.\ds ago\); later: rank 3 "
                        r"\(none ever\)\.", text), text


EXIT_WHILE_BEATING = """
import datetime, importlib.util, socket, sys, time
import torch.distributed as dist
# heartbeat.py needs only the standard library and torch: loaded as a file, it spares each interpreter the ~10 s
# import of the package (Lightning, transformers).
spec = importlib.util.spec_from_file_location("heartbeat", sys.argv[1])
heartbeat = sys.modules["heartbeat"] = importlib.util.module_from_spec(spec)
spec.loader.exec_module(heartbeat)
with socket.socket() as sock:
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
store = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False,
                      timeout=datetime.timedelta(seconds=5))
beats = [heartbeat.Heartbeat(store, rank, 4, interval=0.0005) for rank in range(3)]  # never stopped: the exit ends them
time.sleep(0.05)
"""


def test_a_process_exits_cleanly_while_its_heartbeats_beat():
    """A process whose heartbeat threads are inside store calls when its main thread ends exits with status 0: the
    interpreter waits for them (a daemon thread stopped mid-call at finalization aborts the process: "terminate
    called without an active exception": 9 of 15 runs of this script when they were daemons)."""
    for _ in range(3):
        run_python("-c", EXIT_WHILE_BEATING, ROOT / "lightning_app_rlhf/parallel/heartbeat.py", timeout=120,
                   fresh_interpreter=True)  # the interpreter's own exit


# ---- a rank that is alive but stuck ----

HEARTBEAT_TIMEOUT_S = 5
"""The heartbeat timeout the stuck-rank runs use (``--trainer.strategy.heartbeat_timeout``)."""
STUCK_MARGIN_S = 15
"""Allowed on top of it: a beat's interval, the verdict's round through the store, rank 0's wait for the others."""
STUCK_EXITS = (STUCK_EXIT_CODE, -signal.SIGKILL)
"""The launcher's exit: its own verdict's status, or SIGKILL from Lightning's observer of the ranks it launched,
which kills the launcher once one of them exited non-zero (here: a stuck rank that ended itself first)."""
VERDICT = re.compile(r"HungRankError: Rank (\d): Stuck rank: rank (\d) \(host (\S+), pid (\d+)\) is stuck, last in "
                     r"'([^']+)': (.+?)\. Rank \d \(host \S+\) waited \d+ s for it in a collective")


def run_until_stuck(tmp_path: Path, placement: str, *extra: str,
                    env: dict[str, str] | None = None) -> tuple[subprocess.CompletedProcess, float, int]:
    """Fit the demo on 2 processes launched as a user launches them (``--trainer.devices 2``: rank 0 starts rank 1)
    with a short heartbeat timeout, until a rank gets stuck (:mod:`stuck_rank`). The finished launcher, seconds
    from the moment the rank got stuck to the job's end, and the stuck process's pid; fails unless every process of
    the job has ended."""
    stuck_file = tmp_path / "stuck.json"
    out, err = tmp_path / "launcher.out", tmp_path / "launcher.err"
    # Rank 0 forks from the tests' preloaded server (helpers.start_cli); Lightning's launcher in it starts rank 1
    # as a fresh interpreter, as it does for users.
    launcher = start_cli("fit", "--config", ROOT / "examples/configs/demo_cpu.yaml", "--trainer.devices", "2",
                         "--trainer.strategy", f"lightning_app_rlhf.strategies.{STRATEGY_CLASS[placement]}",
                         "--trainer.strategy.heartbeat_timeout", str(HEARTBEAT_TIMEOUT_S), "--trainer.max_steps", "8",
                         "--trainer.enable_checkpointing", "false", "--trainer.logger.init_args.save_dir", tmp_path,
                         "--model.generation.max_new_tokens", "8", *extra, cwd=tmp_path,
                         env=one_thread_env(tests=True, RLHF_STUCK_FILE=str(stuck_file), **(env or {})),
                         stdout=out, stderr=err)
    job: set[psutil.Process] = set()
    try:
        deadline = time.monotonic() + 300
        while launcher.poll() is None and time.monotonic() < deadline:
            with contextlib.suppress(psutil.Error):
                job.update(psutil.Process(launcher.pid).children(recursive=True))
            time.sleep(0.2)
        ended = time.time()
    finally:
        if launcher.poll() is None:
            launcher.kill_group()
        launcher.wait()
    result = subprocess.CompletedProcess(launcher.args, launcher.returncode, out.read_text(errors="replace"),
                                         err.read_text(errors="replace"))
    assert stuck_file.exists(), "no rank got stuck\n" + output_tail(result)
    stuck = json.loads(stuck_file.read_text())
    # A rank the launcher killed may still be exiting when the launcher is gone (slower on a loaded machine): what
    # is still alive after a grace period was left behind.
    _, alive = psutil.wait_procs([p for p in job if p.is_running()], timeout=15)
    left = [p for p in alive if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    for process in left:
        process.kill()
    assert not left, f"processes of the job left behind: {left}\n{output_tail(result)}"
    return result, ended - stuck["time"], stuck["pid"]


def test_a_sigstopped_rank_is_named_within_the_heartbeat_timeout_and_no_process_is_left(tmp_path):
    """SIGSTOP freezes rank 1 (its heartbeat thread too) at the start of iteration 3: rank 0 waits in the gather of
    the generation, sees rank 1's beats stop, and the job ends within the heartbeat timeout (not the 10-minute
    collective timeout) with an error naming rank 1, its host, its pid and its last step; rank 0 kills the frozen
    rank it launched (SIGKILL: nothing else ends a stopped process)."""
    result, took, pid = run_until_stuck(tmp_path, "rlhf_separation", "--trainer.callbacks+=stuck_rank.StopRank",
                                        "--trainer.callbacks.step=3")
    print(f"SIGSTOP: the job ended {took:.1f} s after rank 1 froze")
    assert result.returncode in STUCK_EXITS, output_tail(result)
    assert took < HEARTBEAT_TIMEOUT_S + STUCK_MARGIN_S, took
    match = VERDICT.search(result.stderr)
    assert match, output_tail(result)
    assert match.groups()[:4] == ("0", "1", socket.gethostname(), str(pid)), match[0]
    assert match[5] == "iteration 2 done: outside the engine (the training loop, callbacks, checkpoints)", match[0]
    assert match[6].startswith("its heartbeats stopped "), match[0]
    assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    # Every step logged before the freeze is on disk (rank 0 also has its loggers save before it exits).
    assert [r["step"] for r in metrics_rows(tmp_path) if "reward/mean" in r] == [0, 1, 2]


def test_a_deadlocked_reward_function_is_named_with_its_stack(tmp_path):
    """The reward function never returns on rank 1 (it waits on a lock it holds): its process lives and beats, but
    its main thread stands still outside any collective. The job ends within the heartbeat timeout; the verdict
    names rank 1, its reward call and the line it is stuck at, and rank 1 prints its main thread's stack."""
    result, took, pid = run_until_stuck(tmp_path, "rlhf_flattening", "--model.reward_fn",
                                        "stuck_rank.deadlocking_reward",
                                        env={"RLHF_STUCK_RANK": "1", "RLHF_STUCK_CALL": "6"})
    print(f"deadlocked reward: the job ended {took:.1f} s after rank 1 got stuck")
    assert result.returncode in STUCK_EXITS, output_tail(result)
    assert took < HEARTBEAT_TIMEOUT_S + STUCK_MARGIN_S, took
    match = VERDICT.search(result.stderr)
    assert match, output_tail(result)
    assert match.groups()[1:4] == ("1", socket.gethostname(), str(pid)), match[0]
    assert re.fullmatch(r"iteration \d+: call reward\.forward", match[5]), match[0]
    assert re.match(r"its main thread has not moved for \d+ s outside any collective, at \S+stuck_rank\.py:\d+ in "
                    r"_hang_on_the_chosen_call", match[6]), match[0]
    stack = result.stderr[result.stderr.index("This is the stuck rank. Its main thread:"):]
    assert "in deadlocking_reward" in stack and "lock.acquire()" in stack, stack[-2000:]


@pytest.mark.slow  # the same watch as the deadlocked reward function's (default run)
def test_a_hanging_environment_is_named_with_its_stack(tmp_path):
    """A multi-turn environment's step never returns on rank 1: as a deadlocked reward function, the job ends within
    the heartbeat timeout, and the verdict names the environment's class and method and the line it hangs at."""
    agent = ("--model.tokenizer", "agent_task:tokenizer", "--model.environment", "stuck_rank.HangingEnvironment",
             "--model.agent.max_episode_tokens", "64", "--model.actor.config.n_positions", "256",
             "--model.generation.stop_token_ids", str(list(range(100, 200))))
    result, took, pid = run_until_stuck(tmp_path, "rlhf_flattening", *agent,
                                        env={"RLHF_STUCK_RANK": "1", "RLHF_STUCK_CALL": "5"})
    print(f"hanging environment: the job ended {took:.1f} s after rank 1 got stuck")
    assert result.returncode in STUCK_EXITS, output_tail(result)
    assert took < HEARTBEAT_TIMEOUT_S + STUCK_MARGIN_S, took
    match = VERDICT.search(result.stderr)
    assert match, output_tail(result)
    assert match.groups()[1:4] == ("1", socket.gethostname(), str(pid)), match[0]
    assert re.fullmatch(r"HangingEnvironment\.step \(turn \d\)", match[5]), match[0]
    assert re.match(r"its main thread has not moved for \d+ s outside any collective, at \S+stuck_rank\.py:\d+ in "
                    r"_hang_on_the_chosen_call", match[6]), match[0]
    stack = result.stderr[result.stderr.index("This is the stuck rank. Its main thread:"):]
    assert "in step" in stack and "agents/episodes.py" in stack, stack[-2000:]


def test_which_ranks_count_as_stuck():
    """Stuck: beats older than the heartbeat timeout, or a main thread standing still that long outside any
    collective. Not stuck: a rank waiting in a collective (it waits for someone else), or one that moves."""
    from lightning_app_rlhf.parallel.heartbeat import Beat, Heartbeat

    now, timeout = 1000.0, 60.0
    watcher = Heartbeat.__new__(Heartbeat)  # only its timeout is read: no store, no thread
    watcher.heartbeat_timeout = timeout

    def beat(age: float, still: float, waiting: bool) -> Beat:
        return Beat(now - age, "node3", 4242, 1, "iteration 7: call reward.forward", "reward.py:12 in score", still,
                    waiting)

    assert watcher._is_stuck(beat(age=61, still=0, waiting=True), now)  # frozen process: its last beat is old
    assert watcher._is_stuck(beat(age=1, still=61, waiting=False), now)  # alive, standing still outside collectives
    assert not watcher._is_stuck(beat(age=1, still=600, waiting=True), now)  # waits for another rank
    assert not watcher._is_stuck(beat(age=1, still=59, waiting=False), now)  # within the timeout
    assert not watcher._is_stuck(beat(age=59, still=0, waiting=False), now)


def test_time_inside_a_placement_collective_counts_as_waiting_even_while_the_thread_computes():
    """NCCL waits on the GPU while the main thread spins at a synchronisation: neither still nor in a
    torch.distributed frame. The placement's collectives mark the wait, and its length counts from their start."""
    import datetime

    import torch.distributed as dist

    from lightning_app_rlhf.parallel.heartbeat import Heartbeat

    store = dist.TCPStore("127.0.0.1", free_port(), is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=5))
    beat = Heartbeat(store, 1, 2, interval=0.2, heartbeat_timeout=None)
    try:
        assert not beat._observe().waiting
        with beat.waiting():
            spin_until = time.monotonic() + 0.5
            while time.monotonic() < spin_until:  # computing: the frame moves and CPU time grows
                pass
            seen = beat._observe()
    finally:
        beat.stop()
    assert seen.waiting and seen.waited_s >= 0.5 and seen.still_s < 0.5, seen


def test_a_main_thread_waiting_on_a_busy_helper_process_is_not_still_and_on_an_idle_one_it_is():
    """A rank whose main thread waits on a helper process (a vLLM engine's core generating, or starting) computes
    through it: the helper's CPU counts. A helper that stands still too (a hung engine) leaves the rank still: the
    heartbeat names it."""
    import datetime
    import sys

    import torch.distributed as dist

    from lightning_app_rlhf.parallel.heartbeat import Heartbeat

    store = dist.TCPStore("127.0.0.1", free_port(), is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=5))
    beat = Heartbeat(store, 0, 1, interval=10.0, heartbeat_timeout=None)  # beats by hand below
    try:
        for code, busy in (("while True: pass", True), ("import time; time.sleep(60)", False)):
            helper = subprocess.Popen([sys.executable, "-c", code])
            seen = []

            def watch() -> None:  # the heartbeat thread's part, while the main thread waits
                for pause in (0.3, 1.5, 0.0):
                    seen.append(beat._observe())
                    time.sleep(pause)

            watcher = threading.Thread(target=watch)
            try:
                watcher.start()
                time.sleep(2.2)  # the main thread stands in one frame using no CPU, as one waiting on the helper
                watcher.join()
            finally:
                helper.kill()
                helper.wait()
            assert (seen[-1].still_s < 1.0) if busy else (seen[-1].still_s >= 1.4), (code, seen)
    finally:
        beat.stop()


def test_a_heartbeat_timeout_below_a_few_beats_is_refused():
    from lightning_app_rlhf.strategies import SeparationStrategy

    with pytest.raises(ValueError, match=r"heartbeat_timeout=1 s is shorter than 3.0 s.*or None to turn the watch"):
        SeparationStrategy(heartbeat_timeout=1)
    assert SeparationStrategy(heartbeat_timeout=None)._heartbeat_timeout is None


@pytest.mark.slow
def test_a_sigstopped_rank_0_is_named_by_the_store_it_no_longer_serves(tmp_path):
    """Rank 0 hosts the store: frozen, it takes the heartbeats with it. Rank 1 (launched as torchrun would) waits
    in a collective, finds the store silent, and exits within the heartbeat timeout saying that rank 0 is frozen or
    died. Rank 0 stays stopped until its launcher (torchrun, here the test) kills it."""
    stuck_file = tmp_path / "stuck.json"
    args = ["fit", "--config", ROOT / "examples/configs/demo_cpu.yaml", "--trainer.devices", "2",
            "--trainer.strategy", "lightning_app_rlhf.strategies.SeparationStrategy",
            "--trainer.strategy.heartbeat_timeout", str(HEARTBEAT_TIMEOUT_S), "--trainer.max_steps", "8",
            "--trainer.enable_checkpointing", "false", "--trainer.logger.init_args.save_dir", tmp_path,
            "--model.generation.max_new_tokens", "8", "--trainer.callbacks+=stuck_rank.StopRank",
            "--trainer.callbacks.rank=0", "--trainer.callbacks.step=3"]
    env = one_thread_env(tests=True, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), WORLD_SIZE="2",
                         NODE_RANK="0", RLHF_STUCK_FILE=str(stuck_file))
    ranks = [start_cli(*args, cwd=tmp_path, env={**env, "LOCAL_RANK": str(rank)}, stderr=tmp_path / f"rank{rank}.err")
             for rank in range(2)]
    try:
        ranks[1].wait(timeout=300)
        ended = time.time()
    finally:
        for rank in ranks:
            rank.kill_group()
            rank.wait()
    stderr = (tmp_path / "rank1.err").read_text(errors="replace")
    took = ended - json.loads(stuck_file.read_text())["time"]
    print(f"SIGSTOP of rank 0: rank 1 ended {took:.1f} s after it")
    assert ranks[1].returncode == STUCK_EXIT_CODE, stderr[-3000:]
    assert took < HEARTBEAT_TIMEOUT_S + STUCK_MARGIN_S, took
    assert re.search(r"HungRankError: Rank 1: this rank \(host \S+\) waits in a collective, last in 'iteration 3: "
                     r"[^']+', and the store that carries the heartbeats has not answered for \d+ s: rank 0, which "
                     r"hosts it, is frozen", stderr), stderr[-3000:]
