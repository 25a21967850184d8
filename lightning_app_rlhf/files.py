"""Writing files atomically. Plain Python."""

from __future__ import annotations

import contextlib
import os
import secrets
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO


def write_atomically(path: str | os.PathLike[str], write: Callable[[BinaryIO], object]) -> None:
    """Create or replace ``path`` so that readers see the previous file or the whole new one, never a partial one.

    ``write`` streams the content into a hidden temporary file in the same directory (``os.replace`` is atomic
    only within one file system), which is flushed and fsynced, then replaces ``path``. On any error the temporary
    file is removed and ``path`` keeps its previous content; only a hard kill leaves the temporary file, beside
    the target, named ``.<name>.<pid>.<random>.tmp``.

    Args:
        path: The target file; its directory is created if missing.
        write: Writes the content to the binary file it is given.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
    # os.open applies the umask as an ordinary write does (mkstemp would make the file 0600, unreadable to the
    # other users of a shared cache or run directory).
    fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    try:
        with os.fdopen(fd, "wb") as file:
            write(file)
            file.flush()
            os.fsync(file.fileno())  # the bytes are on disk before the rename makes them visible
        os.replace(temporary, path)
    except BaseException:
        with contextlib.suppress(OSError):
            temporary.unlink()
        raise
