"""Where slimml may write: the user's home folder, where there is one, and whether a folder
could be made and written at a path (checked before work that would write there at its end)."""

from __future__ import annotations

import os
from pathlib import Path


def home_folder() -> Path | None:
    """The user's home folder, or None where there is none: HOME empty, or unset for a user the
    password database does not know (a container run as a bare uid), or a path that is not a folder."""
    if os.environ.get("HOME") == "":
        return None
    try:
        home = Path.home()
    except (RuntimeError, KeyError):
        return None
    return home if home.is_dir() else None


def unwritable(path: Path) -> str | None:
    """Why a folder at ``path`` could not be made or written, or None where it could: the nearest
    folder at or above it that exists must be one this user can write (a read-only mount cannot be)."""
    try:
        nearest = next(p for p in (path, *path.parents) if p.exists())
        if not nearest.is_dir():
            return f"{nearest} is a file" if nearest == path else f"it is under the file {nearest}"
    except OSError as e:  # a folder above it that this user cannot look into
        return f"it cannot be looked at ({e.strerror or e})"
    if not os.access(nearest, os.W_OK | os.X_OK):
        return f"{nearest} is not writable"
    return None
