"""Replacing one file atomically, under a name no one else can have made first."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO


def replace_file(path: str | os.PathLike, data: bytes | str | Callable[[BinaryIO], None], mode: int = 0o644) -> Path:
    """Write ``path`` atomically: into a new file beside it (a name ``mkstemp`` made, opened with
    O_EXCL, so nothing planted there is followed or overwritten), then renamed over ``path``.

    ``data``: the bytes or text to write, or a function that writes to the open file (``torch.save``).
    ``mode``: the file's permissions (0600 for what only this user should read).

    Raises:
        OSError: as the writes do; the temporary file is removed.
    """
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".part", dir=path.parent if str(path.parent) else ".")
    try:
        with os.fdopen(fd, "wb") as f:
            if callable(data):
                data(f)
            else:
                f.write(data.encode() if isinstance(data, str) else data)
        os.chmod(tmp, mode & ~umask())
        os.replace(tmp, path)  # a kill before this leaves the previous file whole
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def umask() -> int:
    """This process's umask, read without changing it (os.umask would, for every thread)."""
    try:
        with open("/proc/self/status") as f:
            return int(next(line for line in f if line.startswith("Umask:")).split()[1], 8)
    except (OSError, StopIteration, ValueError, IndexError):
        return 0o022
