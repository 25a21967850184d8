"""The newest complete checkpoint under a run's directories: what ``--ckpt_path auto`` resumes from after a restart
(``torchrun --max-restarts``, a SLURM requeue, a Kubernetes pod that came back) with no path written by hand."""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path

from lightning_app_rlhf.checkpoint.format import (
    FILES_KEY,
    META_FILE,
    CheckpointError,
    check_shard_files,
    load_checkpoint_file,
    verify,
)

AUTO = "auto"
"""The ``--ckpt_path`` value that resumes from the newest complete checkpoint, or starts fresh without one."""


def checkpoint_candidates(directories: Iterable[str | os.PathLike[str]]) -> list[Path]:
    """Every checkpoint under ``directories`` (``*.ckpt`` files, and directories of sharded checkpoints), the newest
    first by modification time. Hidden paths are left out: a save in progress writes a hidden temporary beside its
    target and renames it only once complete."""
    found: set[Path] = set()
    for directory in map(Path, directories):
        if not directory.is_dir():
            continue
        sharded = {meta.parent for meta in directory.rglob(META_FILE)}
        for path in directory.rglob("*.ckpt"):
            relative = path.relative_to(directory).parts
            if any(part.startswith(".") for part in relative):
                continue
            inside = next((d for d in sharded if d in path.parents or d == path.parent), None)
            found.add(inside if inside is not None else path)
    return sorted(found, key=lambda p: (p.stat().st_mtime, str(p)), reverse=True)


def check_complete(path: Path) -> None:
    """Raise a :class:`CheckpointError` naming ``path`` unless it loads weights-only, passes its checksum, and (a
    checkpoint directory) holds every shard file with the bytes it was saved with."""
    checkpoint = load_checkpoint_file(path)
    verify(checkpoint, path)
    expected = checkpoint.get(FILES_KEY) or {}
    problem = check_shard_files(path, expected, sorted(expected)) if path.is_dir() else None
    if problem:
        raise CheckpointError(problem)


def newest_complete_checkpoint(directories: Iterable[str | os.PathLike[str]]) -> tuple[Path | None, list[str]]:
    """The newest checkpoint under ``directories`` that is complete (:func:`check_complete`), or None; and why each
    newer one was passed over (a save killed midway, a corrupted file)."""
    passed_over = []
    for path in checkpoint_candidates(directories):
        try:
            check_complete(path)
        except CheckpointError as err:
            passed_over.append(str(err))
            continue
        return path, passed_over
    return None, passed_over
