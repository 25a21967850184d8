"""The bench's turn server: the processes of a cell run one step at a time, in order, and a process that fails,
hangs or never asks for turns ends the run with its name and its log instead of a stuck benchmark."""

from __future__ import annotations

import json
import socket
import sys
from pathlib import Path

import pytest
from helpers import one_thread_env

from lightning_app_rlhf.bench import turns
from lightning_app_rlhf.bench.turns import TurnClient, TurnJob, run_in_turns

STEPPER = f"""
import importlib.util, json, sys, time
spec = importlib.util.spec_from_file_location("turns", {str(Path(turns.__file__))!r})  # not the package: fast
module = sys.modules["turns"] = importlib.util.module_from_spec(spec)  # its dataclass looks itself up there
spec.loader.exec_module(module)
turns = module.TurnClient.from_env()
spans, fail_at, sleep_s = [], int(sys.argv[2]), float(sys.argv[3])
while turns.wait():
    start = time.monotonic()
    if len(spans) == fail_at:
        raise SystemExit(f"boom at step {{fail_at}}")
    time.sleep(sleep_s)
    spans.append([start, time.monotonic()])
    turns.done()
open(sys.argv[1], "w").write(json.dumps(spans))
"""
"""A stand-in for a timed run: takes turns until the server ends the run, writes its steps' time spans; fails at
step ``argv[2]`` (-1: never); each step sleeps ``argv[3]`` seconds."""


def stepper(tmp_path: Path, name: str, fail_at: int = -1, sleep_s: float = 0.02) -> TurnJob:
    return TurnJob(name, [sys.executable, "-c", STEPPER, str(tmp_path / f"{name}.json"), str(fail_at), str(sleep_s)],
                   one_thread_env(), tmp_path, name)


def test_jobs_step_one_at_a_time_in_order(tmp_path):
    run_in_turns([stepper(tmp_path, name) for name in ("a", "b", "c")], rounds=3, step_timeout_s=60)
    spans = {name: json.loads((tmp_path / f"{name}.json").read_text()) for name in "abc"}
    assert all(len(steps) == 3 for steps in spans.values())
    order = sorted((start, end, name) for name, steps in spans.items() for start, end in steps)
    assert [name for _, _, name in order] == list("abc" * 3)
    assert all(end <= next_start for (_, end, _), (next_start, _, _) in zip(order, order[1:]))  # no overlap


def test_a_failing_job_ends_the_run_with_its_log(tmp_path):
    with pytest.raises(RuntimeError, match=r"(?s)^b stopped taking turns \(exit status 1\).*boom at step 1"):
        run_in_turns([stepper(tmp_path, "a"), stepper(tmp_path, "b", fail_at=1)], rounds=3, step_timeout_s=60)


def test_a_job_that_never_asks_for_turns_is_named(tmp_path):
    silent = TurnJob("silent", [sys.executable, "-c", "print('no timer here')"], one_thread_env(), tmp_path, "silent")
    with pytest.raises(RuntimeError, match=r"(?s)^silent exited with 0 before its first turn.*no timer here"):
        run_in_turns([stepper(tmp_path, "a"), silent], rounds=2)


def test_a_step_past_the_timeout_ends_the_run(tmp_path):
    with pytest.raises(RuntimeError, match=r"^slow took more than 1 s for one step"):
        run_in_turns([stepper(tmp_path, "slow", sleep_s=30)], rounds=1, step_timeout_s=1)


def test_a_client_whose_server_is_gone_raises():
    with socket.create_server(("127.0.0.1", 0)) as server:
        host, port = server.getsockname()[:2]
        client = TurnClient(f"{host}:{port}", job=0, timeout_s=5)
        connection, _ = server.accept()
        connection.close()
    with pytest.raises(RuntimeError, match="the parent process is gone"):
        client.wait()


def test_without_a_server_nothing_takes_turns(monkeypatch):
    monkeypatch.delenv("LIGHTNING_RLHF_BENCH_TURNS", raising=False)
    assert TurnClient.from_env() is None
