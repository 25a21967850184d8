"""Runs that take turns step by step: the processes of one benchmark cell (ours, per variant, and the peer) start
together, and a turn server in the parent lets one of them run one step at a time, in a fixed order.

Why: this machine's speed drifts, by 2-4x from day to day and by up to 2x within minutes. Runs made one after
another meet different machines, and a cell's ratio moves with the drift. Steps that take turns meet the same
machine, so each step of ours has a step of the peer's beside it in time, and their ratio holds while the machine
drifts. A process that waits for its turn blocks on a socket and uses no CPU.

Standard library only: the peers' own virtual environments import this module too.
"""

from __future__ import annotations

import os
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

TURNS_ENV = "LIGHTNING_RLHF_BENCH_TURNS"
"""The turn server's ``host:port``; a process started with it set takes turns (:meth:`TurnClient.from_env`)."""
TURN_ID_ENV = "LIGHTNING_RLHF_BENCH_TURN_ID"
"""Which job of the cell this process is (its index in the turn order), sent when it connects."""
TURN_TIMEOUT_ENV = "LIGHTNING_RLHF_BENCH_TURN_TIMEOUT_S"
"""How long a process waits for its turn before it gives up (seconds)."""
GO, DONE, END = b"g", b"d", b"e"
"""Server to process: run one step (``GO``) or the run is over (``END``); process to server: the step is done."""


class TurnClient:
    """One process's side: :meth:`wait` for the turn, run one step, :meth:`done`.

    Args:
        address: The turn server's ``host:port``.
        job: This process's index in the turn order.
        timeout_s: The longest wait for a turn; past it, or when the server is gone, :meth:`wait` raises.
    """

    def __init__(self, address: str, job: int, timeout_s: float = 1800.0) -> None:
        host, port = address.rsplit(":", 1)
        self.timeout_s = timeout_s
        self._socket = socket.create_connection((host, int(port)), timeout=timeout_s)
        self._socket.sendall(f"{job}\n".encode())

    @classmethod
    def from_env(cls) -> TurnClient | None:
        """The client of the server named in :data:`TURNS_ENV`, or None when this process runs on its own."""
        address = os.environ.get(TURNS_ENV)
        if not address:
            return None
        return cls(address, int(os.environ[TURN_ID_ENV]), float(os.environ.get(TURN_TIMEOUT_ENV, "1800")))

    def wait(self) -> bool:
        """Block until this process may run its next step (True) or the server ends the run (False)."""
        try:
            message = self._socket.recv(1)
        except TimeoutError:
            raise RuntimeError(f"No turn from the benchmark's turn server within {self.timeout_s:.0f} s: another "
                               f"process of the cell is stuck; raise {TURN_TIMEOUT_ENV} if its steps are that "
                               "slow.") from None
        except ConnectionError:
            message = b""
        if message not in (GO, END):
            raise RuntimeError("The benchmark's turn server closed the connection: the parent process is gone.")
        return message == GO

    def done(self) -> None:
        """Hand the turn back: this process's step is over."""
        self._socket.sendall(DONE)


@dataclass(frozen=True)
class TurnJob:
    """A process that takes turns.

    Args:
        name: What reports call it (``ours (eager)``, ``peer``).
        command: Its command line.
        env: Its environment (the server's address is added).
        cwd: Its working folder; its stdout and stderr go to ``{cwd}/{log_name}.log``.
        log_name: The log file's stem.
    """

    name: str
    command: list[str]
    env: dict[str, str]
    cwd: Path
    log_name: str

    @property
    def log(self) -> Path:
        return self.cwd / f"{self.log_name}.log"


def run_in_turns(
    jobs: list[TurnJob], rounds: int, step_timeout_s: float = 1800.0, start_timeout_s: float = 1800.0
) -> None:
    """Start every job, then ``rounds`` times let each run one step in the list's order, then end the run and wait
    for every job to exit 0.

    Each job must take exactly ``rounds`` turns (:class:`TurnClient`: ``wait`` before each step, ``done`` after it)
    and then ``wait`` once more, which returns False.

    Args:
        jobs: The processes, in turn order.
        rounds: Steps per job.
        step_timeout_s: The longest a job may take for one step, or to exit after the run.
        start_timeout_s: The longest a job may take to ask for its first turn (imports, building its models).

    Raises:
        RuntimeError: A job exited early or non-zero, or ran past a timeout; the message has the tail
            of its log. Every job still running is killed.
    """
    with socket.create_server(("127.0.0.1", 0)) as server:
        host, port = server.getsockname()[:2]
        processes: list[subprocess.Popen] = []
        try:
            for index, job in enumerate(jobs):
                job.cwd.mkdir(parents=True, exist_ok=True)
                with job.log.open("wb") as log:
                    env = {**job.env, TURNS_ENV: f"{host}:{port}", TURN_ID_ENV: str(index),
                           TURN_TIMEOUT_ENV: str(start_timeout_s + len(jobs) * step_timeout_s)}
                    processes.append(subprocess.Popen(job.command, cwd=job.cwd, env=env, stdout=log,
                                                      stderr=subprocess.STDOUT))
            connections = _accept_all(server, jobs, processes, start_timeout_s)
            for _ in range(rounds):
                for job, process, connection in zip(jobs, processes, connections):
                    connection.sendall(GO)
                    _expect_done(connection, job, process, step_timeout_s)
            for connection in connections:
                connection.sendall(END)
            deadline = time.monotonic() + step_timeout_s
            for job, process in zip(jobs, processes):
                try:
                    code = process.wait(timeout=max(1.0, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    raise RuntimeError(_failure(job, f"did not exit within {step_timeout_s:.0f} s of its last "
                                                     "step")) from None
                if code != 0:
                    raise RuntimeError(_failure(job, f"exited with {code}"))
            for connection in connections:
                connection.close()
        finally:
            for process in processes:
                if process.poll() is None:
                    process.kill()
                    process.wait()


def _accept_all(server: socket.socket, jobs: list[TurnJob], processes: list[subprocess.Popen],
                timeout_s: float) -> list[socket.socket]:
    """Every job's connection, in the jobs' order (each names its index); fails as soon as one job exits."""
    connections: list[socket.socket | None] = [None] * len(jobs)
    server.settimeout(1.0)
    deadline = time.monotonic() + timeout_s
    while any(c is None for c in connections):
        for job, process, connection in zip(jobs, processes, connections):
            if connection is None and process.poll() is not None:
                raise RuntimeError(_failure(job, f"exited with {process.returncode} before its first turn"))
        if time.monotonic() > deadline:
            waiting = [job.name for job, c in zip(jobs, connections) if c is None]
            raise RuntimeError(f"No connection from {', '.join(waiting)} within {timeout_s:.0f} s: does its step "
                               "timer take turns (TurnClient.from_env)?")
        try:
            connection, _ = server.accept()
        except TimeoutError:
            continue
        connection.settimeout(timeout_s)
        index = _read_index(connection)
        if not 0 <= index < len(jobs) or connections[index] is not None:
            connection.close()
            raise RuntimeError(f"A second process asked for the turns of job {index}: is a step timer running "
                               "twice, or on more than one rank?")
        connections[index] = connection
    return [c for c in connections if c is not None]


def _read_index(connection: socket.socket) -> int:
    """The job index a new connection sends first, as a line (read byte by byte: nothing past it is consumed)."""
    line = b""
    while not line.endswith(b"\n"):
        byte = connection.recv(1)
        if not byte:
            raise RuntimeError("A process connected for turns and hung up before it named itself.")
        line += byte
    return int(line)


def _expect_done(connection: socket.socket, job: TurnJob, process: subprocess.Popen, timeout_s: float) -> None:
    connection.settimeout(timeout_s)
    try:
        message = connection.recv(1)
    except TimeoutError:
        raise RuntimeError(_failure(job, f"took more than {timeout_s:.0f} s for one step")) from None
    if message != DONE:
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass
        raise RuntimeError(_failure(job, f"stopped taking turns (exit status {process.poll()})"))


def _failure(job: TurnJob, what: str) -> str:
    tail = job.log.read_text(errors="replace")[-3000:] if job.log.exists() else ""
    return f"{job.name} {what}. The end of its output ({job.log}):\n{tail}"
