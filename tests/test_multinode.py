"""Past one machine, emulated on localhost: 2 nodes x 2 processes as torchrun, SLURM's ``srun`` and Kubeflow start them.

- (``-m slow``) two ``torchrun`` launchers (``--nnodes 2``, c10d rendezvous) form one 4-process world that logs
  what the same job logs on one node of 4 processes, every metrics.csv value row by row, under each placement;
- the placement summary names the node and host of every rank (2 nodes there, 1 on one node);
- 4 processes with the variables ``srun`` sets for 2 nodes x 2 tasks join the world Lightning's ``SLURMEnvironment``
  describes, and train the same trajectory; (``-m slow``) so do 4 "pods" with Kubeflow PyTorchJob's variables;
- ``examples/slurm/train.sbatch`` parses, and the command it runs is one the CLI accepts (so the example cannot rot);
  (``-m slow``) it trains, and a second run of it, as a requeue, resumes by itself.

Every launch has a hard time limit; when a process fails or runs out of time every process of the job (torchrun's
workers too, which run in sessions of their own) is killed and the test fails with each one's output tails.
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterable
from pathlib import Path

import psutil
import pytest
import yaml
from helpers import (
    ROOT,
    ForkedPython,
    cli_command,
    fit_demo,
    fit_demo_args,
    free_port,
    metrics_rows,
    one_thread_env,
    output_tail,
    start_python,
)

LAUNCH_TIMEOUT_S = 240
"""Hard limit of one multi-process launch (a 3-iteration demo takes about 20 s on 2 cores)."""
WALL_CLOCK = ("time/", "perf/")
"""Metrics that measure durations and rates: they differ between any two runs, so only their presence is compared."""
STEPS, MAX_NEW_TOKENS = 3, 12
"""The iterations and response length of :func:`fit_demo`'s defaults, which every run here uses."""
NODE_ROW = re.compile(r"^\W*(\d+)\W+(\S+)\W+([\d,]+)\W*$")
"""A row of the placement summary's "Ranks per node" table: node rank, host, ranks."""


# ---- launching jobs of several processes ----


LAUNCHER_VARIABLES = ("RANK", "LOCAL_RANK", "GROUP_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "NODE_RANK", "MASTER_ADDR",
                      "MASTER_PORT")
"""Variables by which Lightning recognises a launcher, with every ``SLURM_*`` and ``TORCHELASTIC_*`` one."""


def launched_environment(**variables: str) -> dict[str, str]:
    """:func:`one_thread_env` with ``tests/`` importable, without the variables of an enclosing launcher (a SLURM job
    or torchrun running pytest), then ``variables``: the launcher they describe is the only one Lightning sees."""
    inherited = {k: v for k, v in one_thread_env(tests=True).items()
                 if not k.startswith(("SLURM_", "TORCHELASTIC_")) and k not in LAUNCHER_VARIABLES}
    return {**inherited, **variables}


def run_together(jobs: dict[str, tuple[list[str], dict[str, str]]], cwd: Path,
                 timeout: float = LAUNCH_TIMEOUT_S) -> dict[str, subprocess.CompletedProcess]:
    """Start every ``name: (command, environment)`` at once, each in its own session with its output in
    ``cwd/name.stdout`` and ``cwd/name.stderr``, and wait for all of them. A ``python ...`` command forks from the
    tests' preloaded server (:func:`helpers.start_python`: as a fresh interpreter, without its ~10 s of imports);
    any other (torchrun) runs as it is.

    When one exits non-zero, or ``timeout`` seconds pass, every process of every job is killed: the commands and
    every process they started (torchrun's workers run in sessions of their own, so the commands' descendants are
    recorded while they run), and the test fails with each command's exit status and output tails. It also fails if
    a descendant outlives a job that succeeded.

    Returns:
        Each job's finished process, its output read back as text.
    """
    procs: dict[str, subprocess.Popen | ForkedPython] = {}
    files = []
    seen: dict[int, psutil.Process] = {}
    failure = None
    try:
        for name, (command, env) in jobs.items():
            if command[0] == sys.executable:
                procs[name] = start_python(*command[1:], cwd=cwd, env=env, stdout=cwd / f"{name}.stdout",
                                           stderr=cwd / f"{name}.stderr")
                continue
            out, err = (cwd / f"{name}.stdout").open("w"), (cwd / f"{name}.stderr").open("w")
            files += [out, err]
            procs[name] = subprocess.Popen(command, cwd=cwd, env=env, stdout=out, stderr=err, start_new_session=True)
        deadline = time.monotonic() + timeout
        while failure is None:
            _record_descendants(procs.values(), seen)
            codes = [proc.poll() for proc in procs.values()]
            if all(code == 0 for code in codes):
                break
            if any(code not in (None, 0) for code in codes):
                failure = "a process of the job failed"
            elif time.monotonic() > deadline:
                failure = f"the job did not finish in {timeout} s"
            else:
                time.sleep(0.5)
    finally:
        _record_descendants(procs.values(), seen)  # those started since the last look
        left = [p for p in seen.values() if _alive(p)]
        for process in left:
            process.kill()
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
            proc.wait()
        for file in files:
            file.close()
    results = {name: subprocess.CompletedProcess(proc.args, proc.returncode,
                                                 (cwd / f"{name}.stdout").read_text(),
                                                 (cwd / f"{name}.stderr").read_text())
               for name, proc in procs.items()}
    if failure is None and left:
        failure = f"processes outlived the job that started them: {left}"
    if failure is not None:
        pytest.fail(f"{failure}:\n" + "\n".join(output_tail(r, 3000) for r in results.values()), pytrace=False)
    return results


def _record_descendants(procs: Iterable[subprocess.Popen | ForkedPython], seen: dict[int, psutil.Process]) -> None:
    """Add every living descendant of ``procs`` to ``seen`` (by pid), to kill later even once orphaned."""
    for proc in procs:
        try:
            for child in psutil.Process(proc.pid).children(recursive=True):
                seen.setdefault(child.pid, child)
        except psutil.NoSuchProcess:
            continue


def _alive(process: psutil.Process) -> bool:
    try:  # psutil checks the creation time too: a reused pid is not ours
        return process.is_running() and process.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


# ---- comparing runs ----


def assert_same_log(got: list[dict[str, float]], want: list[dict[str, float]], what: str) -> None:
    """Every metrics.csv row of ``got`` has the keys of ``want``'s and its values, as tests/test_placements.py
    compares trajectories (rel 1e-4); wall-clock metrics only need to be there."""
    assert [r["step"] for r in got if "reward/mean" in r] == list(range(STEPS)), what
    assert len(got) == len(want), (what, len(got), len(want))
    for index, (mine, theirs) in enumerate(zip(got, want, strict=True)):
        assert mine.keys() == theirs.keys(), (what, index, sorted(mine.keys() ^ theirs.keys()))
        for key, value in theirs.items():
            if not key.startswith(WALL_CLOCK):
                assert mine[key] == pytest.approx(value, rel=1e-4, abs=1e-6), (what, theirs.get("step"), key)


def rank_nodes(stdout: str) -> dict[int, tuple[int, str]]:
    """Global rank -> (node rank, host), read from the "Ranks per node" table of the placement summary in
    ``stdout`` (which must hold exactly one summary)."""
    assert stdout.count("Ranks per node") == 1, stdout[-3000:]
    table = stdout.split("Ranks per node", 1)[1].split("Memory per rank", 1)[0]
    nodes = {}
    for match in filter(None, map(NODE_ROW.match, table.splitlines())):
        for rank in match[3].split(","):
            nodes[int(rank)] = (int(match[1]), match[2])
    return nodes


@pytest.fixture(scope="module")
def one_node(tmp_path_factory) -> Callable[[str], tuple[list[dict[str, float]], str]]:
    """The demo on one node of 4 processes under a placement (Lightning's own launcher): its metrics rows and stdout,
    the reference every emulated multi-node run must match. Each placement runs once per module, when first asked."""
    runs: dict[str, tuple[list[dict[str, float]], str]] = {}

    def run(strategy: str) -> tuple[list[dict[str, float]], str]:
        if strategy not in runs:
            tmp_path = tmp_path_factory.mktemp(f"one_node_{strategy}")
            rows = fit_demo(tmp_path, "one_node", "--trainer.devices", "4", "--trainer.strategy", strategy,
                            timeout=LAUNCH_TIMEOUT_S, env=launched_environment())
            runs[strategy] = rows, (tmp_path / "one_node.out").read_text()
        return runs[strategy]

    return run


# ---- torchrun ----


@pytest.mark.parametrize("strategy", [
    pytest.param("rlhf_flattening", marks=pytest.mark.slow),
    pytest.param("rlhf_interleaving", marks=pytest.mark.slow),
    # The one that moves weights between its groups, here between the nodes; slow too: the default run forms the
    # same 2-node world from srun's variables (test_srun_tasks_form_the_slurm_world_and_train).
    pytest.param("rlhf_separation", marks=pytest.mark.slow),
])
def test_two_torchrun_nodes_log_what_one_node_logs(tmp_path, strategy, one_node):
    """Two torchrun launchers on localhost (``--nnodes 2 --nproc-per-node 2``, c10d rendezvous) form one world of 4
    ranks: every value of the metrics.csv that global rank 0 writes, row by row, equals the 4-process one-node run's
    (rel 1e-4), and the placement summary puts ranks 0-1 on node 0 and ranks 2-3 on node 1, both on this host."""
    port = free_port()
    # c10d numbers the nodes in the order of its rendezvous, not by --node-rank (torchrun warns that it ignores it):
    # either launcher may host node 0. Both log to the same place, and only global rank 0 writes.
    launchers = {
        f"launcher{node}": ([sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node-rank", str(node),
                             "--nproc-per-node", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint",
                             f"127.0.0.1:{port}", "--rdzv-id", f"multinode-{port}",
                             *cli_command(*fit_demo_args(tmp_path, "two_nodes", "--trainer.num_nodes", "2",
                                                    "--trainer.devices", "2", "--trainer.strategy", strategy))[1:]],
                            launched_environment())
        for node in (0, 1)
    }
    results = run_together(launchers, tmp_path)
    want, _ = one_node(strategy)
    assert_same_log(metrics_rows(tmp_path / "two_nodes"), want, f"torchrun 2x2, {strategy}")
    (summary,) = [r.stdout for r in results.values() if "Ranks per node" in r.stdout]
    host = socket.gethostname()
    assert rank_nodes(summary) == {0: (0, host), 1: (0, host), 2: (1, host), 3: (1, host)}, summary


def test_one_node_summary_puts_every_rank_on_node_0(one_node):
    """On one node the placement summary lists a single node, this host, with all 4 ranks."""
    _, stdout = one_node("rlhf_separation")
    assert rank_nodes(stdout) == {rank: (0, socket.gethostname()) for rank in range(4)}


# ---- SLURM ----


def srun_environment(rank: int, port: int, tasks_per_node: int = 2, nodes: int = 2) -> dict[str, str]:
    """The environment ``srun`` gives task ``rank`` of a job of ``nodes`` x ``tasks_per_node`` tasks (the variables
    Lightning's SLURMEnvironment reads, and the usual others), with the job's rendezvous on this host."""
    node_list = f"node[0-{nodes - 1}]"
    return launched_environment(
        SLURM_JOB_ID="4242", SLURM_JOB_NAME="rlhf-multinode",  # not "bash"/"interactive": those opt out
        SLURM_NNODES=str(nodes), SLURM_JOB_NUM_NODES=str(nodes),
        SLURM_NTASKS=str(nodes * tasks_per_node), SLURM_NTASKS_PER_NODE=str(tasks_per_node),
        SLURM_TASKS_PER_NODE=f"{tasks_per_node}(x{nodes})", SLURM_CPUS_PER_TASK="1",
        SLURM_NODELIST=node_list, SLURM_JOB_NODELIST=node_list, SLURM_STEP_NODELIST=node_list,
        SLURM_PROCID=str(rank), SLURM_LOCALID=str(rank % tasks_per_node),
        SLURM_NODEID=str(rank // tasks_per_node), SLURMD_NODENAME=f"node{rank // tasks_per_node}",
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),  # the first node of SLURM_NODELIST, were it real
    )


def test_srun_tasks_form_the_slurm_world_and_train(tmp_path, one_node):
    """4 processes with the variables ``srun`` sets for 2 nodes x 2 tasks: Lightning picks SLURMEnvironment, each
    process is the rank SLURM numbered (global rank, node, local rank, in Lightning and in torch.distributed), the
    job trains and logs the 4-process one-node run's values, and the summary shows ranks 2-3 on node 1."""
    port = free_port()
    command = cli_command(*fit_demo_args(tmp_path, "slurm", "--trainer.num_nodes", "2", "--trainer.devices", "2",
                                    "--trainer.strategy", "rlhf_separation",
                                    "--trainer.callbacks+=slurm_world_callback.PrintWorld"))
    results = run_together({f"task{rank}": (command, srun_environment(rank, port)) for rank in range(4)}, tmp_path)
    for rank in range(4):
        node, local = divmod(rank, 2)
        world = (f"WORLD global_rank={rank} world_size=4 node_rank={node} local_rank={local} dist_rank={rank} "
                 f"dist_world_size=4 environment=SLURMEnvironment")
        assert world in results[f"task{rank}"].stdout, output_tail(results[f"task{rank}"])
    want, _ = one_node("rlhf_separation")
    assert_same_log(metrics_rows(tmp_path / "slurm"), want, "SLURM 2x2")
    host = socket.gethostname()
    assert rank_nodes(results["task0"].stdout) == {0: (0, host), 1: (0, host), 2: (1, host), 3: (1, host)}


# ---- Kubernetes (PyTorchJob, one process per pod) ----


@pytest.mark.slow  # what docs/multinode.md says about PyTorchJob's variables; srun's variables run by default
def test_pytorchjob_pods_form_the_world_with_the_kubeflow_environment(tmp_path, one_node):
    """4 "pods" with the variables Kubeflow's PyTorchJob sets for one process each (MASTER_ADDR, MASTER_PORT,
    WORLD_SIZE, RANK), which Lightning does not detect by itself: with ``--trainer.plugins KubeflowEnvironment``,
    ``--trainer.num_nodes 4 --trainer.devices 1``, each pod is the rank and node of its RANK, and the job logs the
    4-process one-node run's values."""
    port = free_port()
    command = cli_command(*fit_demo_args(tmp_path, "pods", "--trainer.num_nodes", "4", "--trainer.devices", "1",
                                    "--trainer.strategy", "rlhf_separation", "--trainer.plugins",
                                    "lightning.pytorch.plugins.environments.KubeflowEnvironment",
                                    "--trainer.callbacks+=slurm_world_callback.PrintWorld"))
    pods = {f"pod{rank}": (command, launched_environment(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                                                         WORLD_SIZE="4", RANK=str(rank))) for rank in range(4)}
    results = run_together(pods, tmp_path)
    for rank in range(4):
        world = (f"WORLD global_rank={rank} world_size=4 node_rank={rank} local_rank=0 dist_rank={rank} "
                 f"dist_world_size=4 environment=KubeflowEnvironment")
        assert world in results[f"pod{rank}"].stdout, output_tail(results[f"pod{rank}"])
    want, _ = one_node("rlhf_separation")
    assert_same_log(metrics_rows(tmp_path / "pods"), want, "PyTorchJob 4x1")


# ---- examples/slurm ----


SBATCH = ROOT / "examples/slurm/train.sbatch"
FAKE_SRUN = """#!{python}
# srun's stand-in: record the command, drop srun's own options (--name=value) and `python`, then either run the task
# once printing its config, or start every task of the job with the variables srun gives each, and wait for them.
import json, os, socket, subprocess, sys
args = sys.argv[1:]
with open({record!r}, "w") as file:
    json.dump(args, file)
while args and args[0].startswith("-"):
    args.pop(0)
assert args[0] in ("python", "python3"), args
command = [sys.executable, *args[1:]]
if {print_config}:
    os.execv(sys.executable, [*command, "--print_config"])
nodes, per_node = int(os.environ["SLURM_NNODES"]), int(os.environ["SLURM_NTASKS_PER_NODE"])
with socket.socket() as sock:
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
tasks = [subprocess.Popen(command, env={{**os.environ, "SLURM_PROCID": str(rank), "SLURM_LOCALID": str(rank % per_node),
                                         "SLURM_NODEID": str(rank // per_node), "MASTER_ADDR": "127.0.0.1",
                                         "MASTER_PORT": str(port)}})
         for rank in range(nodes * per_node)]
sys.exit(max(task.wait() for task in tasks))
"""


def sbatch_environment(tmp_path: Path, *, print_config: bool, **variables: str) -> dict[str, str]:
    """What ``sbatch`` gives the batch script of a 2-node x 2-task job submitted from the repository root (the
    job's variables; the per-task ones come from ``srun``), with a :data:`FAKE_SRUN` first on ``PATH`` that records
    its arguments in ``tmp_path/srun_args.json``; then ``variables``."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    srun = bin_dir / "srun"
    srun.write_text(FAKE_SRUN.format(python=sys.executable, record=str(tmp_path / "srun_args.json"),
                                     print_config=print_config))
    srun.chmod(0o755)
    job = {k: v for k, v in srun_environment(0, 0).items()
           if k not in ("SLURM_PROCID", "SLURM_LOCALID", "SLURM_NODEID", "MASTER_ADDR", "MASTER_PORT")}
    return {**job, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "SLURM_SUBMIT_DIR": str(ROOT), **variables}


def test_slurm_example_parses_and_runs_a_command_the_cli_accepts(tmp_path):
    """``bash -n`` accepts train.sbatch; run under the variables sbatch sets for 2 nodes x 2 tasks, with an ``srun``
    stand-in that runs the task's command once with ``--print_config``, the command parses and configures 2 nodes x
    2 devices, the run directory for every checkpoint and log, and ``--ckpt_path auto``."""
    subprocess.run(["bash", "-n", SBATCH], check=True, timeout=30)
    run_dir = tmp_path / "shared/runs"
    env = sbatch_environment(tmp_path, print_config=True, RUN_DIR=str(run_dir))
    result = subprocess.run(["bash", SBATCH], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120,
                            check=False)
    assert result.returncode == 0, output_tail(result)
    srun_args = json.loads((tmp_path / "srun_args.json").read_text())
    assert "--kill-on-bad-exit=1" in srun_args  # one failed task ends the job step instead of leaving it hanging
    config = yaml.safe_load(result.stdout)
    trainer = config["trainer"]
    assert (trainer["num_nodes"], str(trainer["devices"])) == (2, "2")  # devices: an int, or a string Lightning reads
    assert trainer["default_root_dir"] == str(run_dir) and run_dir.is_dir()
    assert trainer["logger"]["init_args"]["save_dir"] == str(run_dir)  # ModelCheckpoint writes under the logger's
    assert config["ckpt_path"] == "auto"
    assert trainer["strategy"]["class_path"].startswith("lightning_app_rlhf.strategies.")


@pytest.mark.slow  # the default run checks the script's command line; this one trains with it, twice
def test_slurm_example_trains_and_its_requeue_resumes_by_itself(tmp_path, one_node):
    """train.sbatch for real on the CPU: an ``srun`` stand-in starts its command as the 4 tasks of 2 nodes x 2, which
    train 2 iterations (a checkpoint after each); the same script again, as SLURM runs a requeued job, resumes by
    itself (``--ckpt_path auto``) and logs iteration 2 as the uninterrupted 4-process run does."""
    run_dir = tmp_path / "shared/runs"
    checkpoints = ("--model.generation.max_new_tokens", str(MAX_NEW_TOKENS),
                   "--trainer.callbacks+=lightning.pytorch.callbacks.ModelCheckpoint",
                   "--trainer.callbacks.every_n_train_steps=1", "--trainer.callbacks.save_top_k=-1")
    for attempt, steps in enumerate((2, 3)):
        env = sbatch_environment(tmp_path, print_config=False, RUN_DIR=str(run_dir), ACCELERATOR="cpu",
                                 SLURM_RESTART_COUNT=str(attempt))
        results = run_together({f"attempt{attempt}": (["bash", str(SBATCH), "--trainer.max_steps", str(steps),
                                                       *checkpoints], env)}, tmp_path)
    (stdout,) = [r.stdout + r.stderr for r in results.values()]
    assert "--ckpt_path auto: resuming from" in stdout, stdout[-3000:]
    first = [r for r in metrics_rows(run_dir / "demo/version_0") if "reward/mean" in r]
    resumed = [r for r in metrics_rows(run_dir / "demo/version_1") if "reward/mean" in r]
    assert [r["step"] for r in first] == [0, 1] and [r["step"] for r in resumed] == [2]
    want, _ = one_node("rlhf_separation")
    (uninterrupted,) = [r for r in want if r.get("step") == 2 and "reward/mean" in r]
    for key, value in uninterrupted.items():
        if not key.startswith(WALL_CLOCK):
            assert resumed[0][key] == pytest.approx(value, rel=1e-4, abs=1e-6), key


# ---- the node table itself ----


def test_node_table_groups_ranks_by_node_and_shows_a_node_rank_on_two_hosts():
    """One row per (node, host) with its ranks in order; a node rank reported from two hosts (a misconfigured launch)
    gets a row per host instead of one that hides it."""
    from rich.console import Console

    from lightning_app_rlhf.callbacks.placement_summary import RankNode, node_table

    console = Console(width=120, record=True)
    console.print(node_table([RankNode(0, "a"), RankNode(1, "b"), RankNode(0, "a"), RankNode(1, "c")]))
    rows = [NODE_ROW.match(line) for line in console.export_text().splitlines()]
    assert [(m[1], m[2], m[3]) for m in rows if m] == [("0", "a", "0,2"), ("1", "b", "1"), ("1", "c", "3")]


def test_a_tensor_parallel_replica_across_nodes_is_refused_naming_the_fix():
    """Nodes hold consecutive ranks: a degree-2 replica on ranks 1-2 of 2 nodes x 2 would all-reduce every layer
    across the nodes' link; on ranks 0-1 and 2-3 each replica stays inside its node."""
    from lightning_app_rlhf.parallel.plan import PlacementPlan
    from lightning_app_rlhf.parallel.tensor_parallel import check_node_boundaries

    calls = {"actor.generate": (0, 1, 2, 3), "reward.forward": (0, 1, 2, 3), "actor.train": (0, 1, 2, 3)}
    check_node_boundaries(PlacementPlan(4, calls, tp={"actor.generate": 2}), ranks_per_node=2)
    across = PlacementPlan(4, {**calls, "actor.generate": (1, 2)}, tp={"actor.generate": 2})
    with pytest.raises(ValueError, match=r"'actor.generate': the tensor-parallel replica on ranks \[1, 2\] spans "
                                         r"nodes \[0, 1\] \(2 ranks per node\)\. Keep each replica inside a node"):
        check_node_boundaries(across, ranks_per_node=2)
    check_node_boundaries(across, ranks_per_node=4)  # one node


def test_the_tuner_plans_a_multi_node_job_on_its_nodes():
    """Without ``cluster=`` the PlacementTuner describes the running job by ``trainer.num_nodes``: 2 nodes of 2
    processes each (each process's share of a node's memory), whose cross-node collectives the cost model prices
    at the inter-node bandwidth."""
    from lightning_app_rlhf.planner.cluster import cluster_from_environment

    one, two = cluster_from_environment(4, cores=2), cluster_from_environment(4, cores=2, nodes=2)
    assert (one.nodes, one.devices_per_node, two.nodes, two.devices_per_node) == (1, 4, 2, 2)
    assert two.device.memory_bytes == 2 * one.device.memory_bytes
    with pytest.raises(ValueError, match="trainer.num_nodes must divide the world size"):
        cluster_from_environment(4, nodes=3)
