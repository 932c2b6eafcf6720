"""An artifact's files: paths that stay inside its folder and are UTF-8, each file's size and
sha256 as the manifest lists it (:class:`FileEntry`), hashing, the checks that a listed file is
there, is the one hashed, and has not been swapped since, and the small files read after load
(:func:`read_listed`, :func:`read_config`). The manifest itself: :mod:`.manifest`."""

from __future__ import annotations

import hashlib
import json
import os
import shlex
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import TYPE_CHECKING, Any

from slimml.errors import ArtifactError, ConfigError, IntegrityError

if TYPE_CHECKING:
    from slimml.runtime.artifact.manifest import Manifest


@dataclass
class FileEntry:
    path: str  # relative to the artifact folder, POSIX separators
    bytes: int
    sha256: str


def utf8_path(path: Path) -> None:
    """Refuse a path that is not valid UTF-8 (bytes the file system took, which Python keeps as
    surrogates): ONNX Runtime, tokenizers and onnx take UTF-8 paths, and failed with tracebacks.

    Raises:
        ConfigError: naming the path and the fix.
    """
    try:
        os.fspath(path).encode("utf-8")
    except UnicodeEncodeError:
        raise ConfigError(f"the path {os.fsencode(path).decode('utf-8', 'backslashreplace')} is not valid UTF-8, "
                          "which ONNX Runtime and the tokenizers need; rename it (or a folder above it) in UTF-8.") from None


def safe_path(folder: Path, rel: str) -> Path:
    """Resolve ``rel`` inside ``folder``, refusing absolute paths, ``..`` and symlinks out."""
    p = PurePosixPath(rel)
    if not rel or p.is_absolute() or ".." in p.parts or "\\" in rel or rel.startswith("~"):
        raise ArtifactError(
            f"the manifest names the path {rel!r}, which leaves the artifact folder; refusing to load it. Copy the "
            "artifact again from where it was made, or convert the model again."
        )
    full = folder / Path(*p.parts)
    try:
        root = folder.resolve()
        resolved = full.resolve()
    except (OSError, RuntimeError, ValueError) as e:  # a link loop, a NUL byte, ...
        raise ArtifactError(f"the manifest names the path {rel!r}, which cannot be resolved ({e}); refusing to load it. "
                            "Copy the artifact again from where it was made, or convert the model again.") from None
    if resolved != root and root not in resolved.parents:
        raise ArtifactError(f"{rel!r} is a link that points outside the artifact folder; refusing to load it. Copy the "
                            f"artifact with its files in place of links (`cp -rL {shlex.quote(str(folder))} NEW_FOLDER`; a Hugging Face hub "
                            "snapshot: snapshot_download(..., local_dir=NEW_FOLDER)) and load the copy.")
    return full


def read_config(path: Path, what: str) -> dict[str, Any]:
    """A JSON object shipped in the artifact (a preprocessor config), or one ArtifactError naming ``what``."""
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError) as e:
        raise ArtifactError(f"could not read the {what} {path.name}: {e}; re-convert the model.") from None
    if not isinstance(config, dict):
        raise ArtifactError(f"the {what} {path.name} is not a JSON object; re-convert the model.")
    return config


def sha256_file(path: str | os.PathLike, chunk: int = 1 << 22) -> str:
    return hash_file(path, chunk)[0]


def hash_file(path: str | os.PathLike, chunk: int = 1 << 22) -> tuple[str, tuple[int, int, int, int]]:
    """sha256 of ``path`` and the identity (size, mtime_ns, inode, device) of the very file hashed:
    ``fstat`` on the descriptor that was read, not a second look-up of the name, so what was
    hashed can later be compared with what a session opened (:func:`check_unchanged`)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        st = os.fstat(f.fileno())
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest(), identity(st)


def identity(st: os.stat_result) -> tuple[int, int, int, int]:
    return (st.st_size, st.st_mtime_ns, st.st_ino, st.st_dev)


def read_listed(folder: str | os.PathLike, manifest: Manifest, name: str) -> bytes | None:
    """The bytes of ``name`` where the manifest lists it, checked against its size and sha256 as they
    are read: a small file read after load (a chat template, ``generation_config.json``) cannot be
    swapped under a loaded model. None where the manifest does not list it: a file dropped beside an
    artifact is never read.

    Raises:
        IntegrityError: the file differs from what the manifest records.
        ArtifactError: it cannot be read, or links out of the folder.
    """
    entry = next((f for f in manifest.files if f.path == name), None)
    if entry is None:
        return None
    path = safe_path(Path(folder), name)
    try:
        data = path.read_bytes()
    except OSError as e:
        raise ArtifactError(f"could not read {name} of the artifact {folder} ({e.strerror or e}); copy the artifact "
                            "again or re-convert.") from None
    if len(data) != entry.bytes or hashlib.sha256(data).hexdigest() != entry.sha256:
        raise IntegrityError(f"{name} does not match its sha256 in the manifest: the file was changed or tampered "
                             "with. Copy the artifact again or re-convert; slimml will not use it.")
    return data


def file_entry(folder: Path, path: Path) -> FileEntry:
    return FileEntry(path=path.relative_to(folder).as_posix(), bytes=path.stat().st_size, sha256=sha256_file(path))


def verify_file(folder: Path, entry: FileEntry) -> Path:
    """Check one listed file's presence, size and sha256; return its path."""
    return _verify_file(folder, entry)[0]


def _verify_file(folder: Path, entry: FileEntry) -> tuple[Path, tuple[int, int, int, int]]:
    """:func:`verify_file`, and the identity of the file that was hashed.

    Raises:
        IntegrityError: naming the file and what differs.
    """
    path = _present(folder, entry)
    digest, ident = hash_file(path)
    if digest != entry.sha256 or ident[0] != entry.bytes:
        raise IntegrityError(
            f"{entry.path} does not match its sha256 in the manifest: the file is corrupted or was "
            "tampered with. Copy the artifact again or re-convert; slimml will not run it."
        )
    return path, ident


def check_present(folder: str | os.PathLike, manifest: Manifest) -> None:
    """Every listed file there, a regular file of the size recorded (no hashing: ``slimml info``).

    Raises:
        IntegrityError: naming the file and what differs.
    """
    for entry in manifest.files:
        _present(Path(folder), entry)


def _present(folder: Path, entry: FileEntry) -> Path:
    path = safe_path(folder, entry.path)
    if path.exists() and not path.is_file():
        raise IntegrityError(
            f"{entry.path} in the artifact {folder} is not a regular file (a folder, pipe or device); "
            "slimml reads only the files it wrote. Copy the artifact again or re-convert."
        )
    if not path.is_file():
        raise IntegrityError(
            f"{entry.path} is missing from the artifact {folder}; copy the whole folder again or re-convert."
        )
    size = path.stat().st_size
    if size != entry.bytes:
        raise IntegrityError(
            f"{entry.path} is {size} bytes but the manifest records {entry.bytes}: the file is truncated "
            "or was modified. Copy the artifact again or re-convert; slimml will not run it."
        )
    return path


def verify_driver_files(folder: str | os.PathLike, manifest: Manifest) -> None:
    """Hash every listed file but the shards' (graphs and data): what a process reads itself while
    pipeline stages hash their own shards (the tokenizer, templates, configs)."""
    owned = {p for s in manifest.shards for p in (s.file, s.data) if p}
    for entry in manifest.files:
        if entry.path not in owned:
            verify_file(Path(folder), entry)


def verify_files(folder: str | os.PathLike, manifest: Manifest) -> dict[str, tuple[int, int, int, int]]:
    """Check every listed file (:func:`verify_file`); return each one's identity as hashed."""
    folder = Path(folder)
    return {entry.path: _verify_file(folder, entry)[1] for entry in manifest.files}


def check_unchanged(folder: str | os.PathLike, seen: dict[str, tuple[int, int, int, int]], during: str = "the model loaded",
                    fix: str = "slimml will not run it. Replace artifacts by writing a new folder and renaming it, "
                               "then load again.") -> None:
    """Refuse files that are no longer the ones hashed (``seen``, from :func:`verify_files`): call it
    once the sessions have opened them, so a file swapped between the hash and the open is caught
    (``during``, ``fix``: what was under way, and what to do, for the message).

    Raises:
        IntegrityError: naming the file.
    """
    folder = Path(folder)
    for rel, ident in seen.items():
        try:
            now = identity(os.stat(safe_path(folder, rel)))
        except OSError:
            now = None
        if now != ident:
            raise IntegrityError(
                f"{rel} in the artifact {folder} was replaced while {during} (after its hash was checked); {fix}"
            )
