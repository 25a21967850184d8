"""Writing files atomically. Plain Python."""

from __future__ import annotations

import contextlib
import ctypes
import os
import re
import secrets
import shutil
import sys
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO

TEMPORARY_NAME = re.compile(r"^\..+\.(?P<pid>\d+)\.[0-9a-f]{8}\.tmp$")
"""The name :func:`write_atomically` gives its temporary file: ``.<name>.<pid>.<8 hex digits>.tmp``."""


def write_atomically(
    path: str | os.PathLike[str], write: Callable[[BinaryIO], object], remove_stale: bool = False
) -> None:
    """Create or replace ``path`` so that readers see the previous file or the whole new one, never a partial one.

    ``write`` streams the content into a hidden temporary file in the same directory (``os.replace`` is atomic
    only within one file system), which is flushed and fsynced, then replaces ``path``. On any error the temporary
    file is removed and ``path`` keeps its previous content; only a hard kill leaves the temporary file, beside
    the target, named ``.<name>.<pid>.<random>.tmp`` (:data:`TEMPORARY_NAME`). With ``remove_stale``, a successful
    write then removes such leftovers from the directory (see :func:`remove_stale_temporaries`).

    Args:
        path: The target file; its directory is created if missing.
        write: Writes the content to the binary file it is given.
        remove_stale: Remove the temporary files that killed writes left in the directory.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
    # os.open applies the umask as an ordinary write does (mkstemp would make the file 0600, unreadable to the
    # other users of a shared cache or run directory).
    fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    started = os.fstat(fd).st_mtime  # the file system's clock, as the leftovers' times are
    try:
        with os.fdopen(fd, "wb") as file:
            write(file)
            file.flush()
            os.fsync(file.fileno())  # the bytes are on disk before the rename makes them visible
        if path.is_dir() and not path.is_symlink():  # a sharded checkpoint saved there before: swap it out
            replace_atomically(temporary, path)
        else:
            os.replace(temporary, path)
    except BaseException:
        with contextlib.suppress(OSError):
            temporary.unlink()
        raise
    if remove_stale:
        remove_stale_temporaries(path.parent, started)


def remove_stale_temporaries(directory: str | os.PathLike[str], before: float) -> list[Path]:
    """Remove the temporary files of :func:`write_atomically` in ``directory`` that a killed write left: those last
    written before ``before`` (a file system time) by a process that no longer runs on this machine. A write still
    in progress (its process alive, or its file written since ``before``) keeps its file. Returns what it removed.
    """
    removed = []
    with contextlib.suppress(OSError):
        entries = list(os.scandir(directory))
        for entry in entries:
            match = TEMPORARY_NAME.match(entry.name)
            if match is None or not entry.is_file(follow_symlinks=False) or _alive(int(match["pid"])):
                continue
            with contextlib.suppress(OSError):
                if entry.stat(follow_symlinks=False).st_mtime < before:
                    os.unlink(entry.path)
                    removed.append(Path(entry.path))
    return removed


def _alive(pid: int) -> bool:
    """Whether process ``pid`` runs on this machine (a process of another user counts as running)."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except (ProcessLookupError, OverflowError):
        return False
    except PermissionError:
        return True
    return True


def replace_atomically(source: str | os.PathLike[str], target: str | os.PathLike[str]) -> None:
    """Put ``source`` (a file or directory) in place of ``target``, whatever ``target`` is now (absent, a file, a
    directory, a link), so that readers see the old one or the new one.

    Where Linux can swap two paths in one step (``renameat2`` with ``RENAME_EXCHANGE``), the swap is atomic and the old
    one is removed after. Elsewhere the old one first moves aside to a hidden sibling (``.<name>.old-<random>``), so
    a crash between the two renames leaves it there, whole.
    """
    source, target = Path(source), Path(target)
    if not os.path.lexists(target):
        os.replace(source, target)
    elif not _exchange(source, target):
        aside = target.with_name(f".{target.name}.old-{secrets.token_hex(4)}")
        os.replace(target, aside)
        os.replace(source, target)
        source = aside
    remove_path(source)
    _fsync_directory(target.parent)


def remove_path(path: str | os.PathLike[str]) -> None:
    """Remove a file, a link (not what it points to) or a directory tree. A directory is first renamed to a hidden
    sibling, so a crash mid-removal never leaves a partial directory under its checkpoint name."""
    path = Path(path)
    if path.is_symlink() or path.is_file():
        path.unlink()
    elif path.is_dir():
        doomed = path
        if not path.name.startswith("."):
            doomed = path.with_name(f".{path.name}.removing-{secrets.token_hex(4)}")
            os.replace(path, doomed)
        shutil.rmtree(doomed)


def _exchange(a: Path, b: Path) -> bool:
    """Swap two paths atomically with Linux's ``renameat2(RENAME_EXCHANGE)``; False where it is not available."""
    if sys.platform != "linux":
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        renameat2 = libc.renameat2
    except (OSError, AttributeError):
        return False
    at_fdcwd, rename_exchange = -100, 2
    renameat2.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    return renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0


def _fsync_directory(directory: Path) -> None:
    with contextlib.suppress(OSError):
        fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
