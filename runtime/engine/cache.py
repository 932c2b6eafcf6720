"""slimml's own cache folders, checked as the artifact is: private folders, hashed files, no trust
in a record only because it parses.

The pre-packed weight cache (:mod:`slimml.runtime.engine.packed`) holds ONNX graphs that ONNX
Runtime runs. Anyone who can write there can change what a model computes, so:

- cache folders are made 0700 and files 0600; a folder owned by another user or writable by
  group or others is refused in one line (:func:`private_folder`);
- every cached file is listed in the entry's record with its size and sha256 when written, and
  checked against it at load by the code that checks an artifact's shards
  (:func:`~slimml.runtime.artifact.integrity.check_shard_file`: the cached graph may read
  external data only from its own data file, within its bounds);
- a record of any other shape is refused, naming the folder to delete (:func:`read_record`);
- the identity (size, mtime, inode) of each file is recorded while it is hashed, from the file
  descriptor that was hashed, and compared with the path after ONNX Runtime opened it: a file
  swapped between the hash and the session is refused (:func:`hash_file`, :meth:`CacheEntry.same_files`).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import stat
from dataclasses import dataclass
from pathlib import Path

from slimml.errors import IntegrityError
from slimml.runtime.artifact.files import identity
from slimml.runtime.artifact.integrity import check_shard_file
from slimml.runtime.artifact.manifest import ShardSpec

RECORD = "packed.json"
GRAPH, DATA = "shard.onnx", "shard.onnx.data"
_HEX64 = re.compile(r"[0-9a-f]{64}")


def hash_file(path: Path) -> tuple[str, tuple[int, ...]]:
    """sha256 of ``path`` and the identity (size, mtime_ns, inode, device) of the very file hashed
    (``fstat`` on the descriptor read, not a second look-up of the name); a link is not followed."""
    h = hashlib.sha256()
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise IntegrityError(f"{path} is not a regular file; slimml reads only the files it wrote. Delete {path.parent}.")
        with os.fdopen(fd, "rb", closefd=False) as f:
            while block := f.read(1 << 22):
                h.update(block)
    finally:
        os.close(fd)
    return h.hexdigest(), _identity(st)


def _identity(st: os.stat_result) -> tuple[int, ...]:
    """A cached file's identity: an artifact file's (size, mtime, inode, device) and its ctime,
    which every write and every ``utime`` moves (a write in place with the mtime put back is seen;
    an artifact's files are watched by inotify instead, and may be hard-linked, which moves it)."""
    return (*identity(st), st.st_ctime_ns)


def private_folder(path: Path) -> Path:
    """``path`` as a folder only this user can write: made 0700 when missing; refused when it is a
    link, is owned by another user, or is writable by group or others.

    Raises:
        IntegrityError: in one line, naming the folder and the fix.
        OSError: the folder cannot be made (a read-only place, a file in the way).
    """
    path = Path(path)
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    st = os.lstat(path)
    fix = f"set SLIMML_CACHE_DIR (or cache_dir=) to a folder of your own, or fix it: `chown $USER {path}; chmod 700 {path}`"
    if stat.S_ISLNK(st.st_mode) or not stat.S_ISDIR(st.st_mode):
        raise IntegrityError(f"the cache folder {path} is a link or not a folder; slimml will not trust files there: {fix}.")
    if hasattr(os, "geteuid") and st.st_uid != os.geteuid():
        raise IntegrityError(f"the cache folder {path} is owned by another user (uid {st.st_uid}); slimml will not "
                             f"trust files there: {fix}.")
    if st.st_mode & 0o022:
        raise IntegrityError(f"the cache folder {path} is writable by others (mode {stat.S_IMODE(st.st_mode):o}); "
                             f"slimml will not trust files there: {fix}.")
    for parent in path.resolve().parents:  # one that anyone may write to without the sticky bit (as /tmp has) lets
        mode = os.stat(parent).st_mode      # them rename this folder away and put their own in its place
        if mode & 0o002 and not mode & stat.S_ISVTX:
            raise IntegrityError(f"the cache folder {path} is inside {parent}, which anyone can write to (mode "
                                 f"{stat.S_IMODE(mode):o}, no sticky bit): they could swap the folder; slimml will not "
                                 f"trust files there: set SLIMML_CACHE_DIR (or cache_dir=) to a folder of your own, or "
                                 f"`chmod +t {parent}` (as /tmp is).")
    return path


def make_record(folder: Path, source: str, fmt: int) -> dict:
    """The record of a freshly written entry: each file's size and sha256; files made 0600."""
    files = {}
    for name in (GRAPH, DATA):
        os.chmod(folder / name, 0o600)
        digest, ident = hash_file(folder / name)
        files[name] = {"bytes": ident[0], "sha256": digest}
    return {"format": fmt, "source": source, "files": files}


def read_record(folder: Path, fmt: int) -> dict | None:
    """The entry's record, checked for shape; None when the entry does not exist.

    Raises:
        IntegrityError: a record that is not JSON or not of the expected shape, naming the folder.
    """
    path = folder / RECORD
    if not os.path.lexists(path):
        return None
    try:
        st = os.lstat(path)
        if not stat.S_ISREG(st.st_mode) or st.st_size > 1 << 20:
            raise ValueError("not a small regular file")
        record = json.loads(path.read_bytes().decode("utf-8"))
        ok = (isinstance(record, dict) and record.get("format") == fmt and isinstance(record.get("source"), str)
              and isinstance(record.get("files"), dict) and set(record["files"]) == {GRAPH, DATA})
        for entry in record["files"].values() if ok else ():
            ok = ok and isinstance(entry, dict) and type(entry.get("bytes")) is int and entry["bytes"] >= 0
            ok = ok and isinstance(entry.get("sha256"), str) and bool(_HEX64.fullmatch(entry["sha256"]))
        if not ok:
            raise ValueError("not a record of this slimml's cache")
    except (OSError, ValueError, RecursionError) as e:  # UnicodeDecodeError and JSONDecodeError are ValueErrors
        raise damaged(folder, f"its record {RECORD} is unreadable ({type(e).__name__})") from None
    return record


def damaged(folder: Path, why: str) -> IntegrityError:
    return IntegrityError(f"the cache entry {folder} is damaged: {why}. Delete {folder} (slimml rebuilds it) and "
                          "load the model again.")


@dataclass
class CacheEntry:
    """One cached shard: its folder and record, and the identity of each file when last hashed."""

    folder: Path
    record: dict
    seen: dict[str, tuple[int, ...]] | None = None  # file name -> identity (with ctime) when its hash matched

    @property
    def graph(self) -> Path:
        return self.folder / GRAPH

    @property
    def data(self) -> Path:
        return self.folder / DATA

    def verify(self) -> None:
        """Hash every cached file against the record and check the graph's external data as a
        shard's is checked: it may read only its own data file, within its bounds.

        Raises:
            IntegrityError: naming the entry's folder to delete.
        """
        seen = {}
        for name, want in self.record["files"].items():
            path = self.folder / name
            try:
                digest, ident = hash_file(path)
            except FileNotFoundError:
                raise damaged(self.folder, f"{name} is missing") from None
            except OSError as e:
                raise damaged(self.folder, f"{name} cannot be read ({e.strerror})") from None
            if ident[0] != want["bytes"] or digest != want["sha256"]:
                raise damaged(self.folder, f"{name} does not match the hash recorded when it was written")
            seen[name] = ident
        try:
            check_shard_file(self.folder, ShardSpec(index=0, file=GRAPH, data=DATA, weight_bytes=0, inputs=[], outputs=[]),
                             boundary=False)
        except Exception as e:  # ArtifactError: external data outside its file, not ONNX
            raise damaged(self.folder, str(e).split(";")[0]) from None
        self.seen = seen

    def same_files(self) -> bool:
        """Whether every file is still the one hashed (same size, mtime, inode, device and ctime)."""
        if self.seen is None:
            return False
        for name, ident in self.seen.items():
            try:
                if _identity(os.stat(self.folder / name)) != ident:
                    return False
            except OSError:
                return False
        return True

    def check(self, deep: bool = False) -> None:
        """Re-hash (``deep``) or re-hash only what changed since the last match."""
        if deep or not self.same_files():
            self.verify()
