"""Noticing that a loaded model's files changed on disk, cheaply enough to ask before every run.

ONNX Runtime memory-maps large external weights, and streamed shards map their data files on
every pass: a data file rewritten or truncated under a running process changes its weights or
kills it with SIGBUS. :class:`FileWatch` remembers each data file's identity at load, and
``Model.run`` asks it before every call, so a changed file is refused, not run.

Two ways to ask, by cost (measured right after a batch-1 pass of the 1.7 ms student, when the
interpreter's caches are cold): an ``fstat`` per file and folder took 15-32 us for the student's
four data files; one poll of a Linux inotify queue watching them took 8-10 us. So on Linux the
kernel queues what happens to the files and the folder (writes, truncation, attribute changes,
renames, removal) and a run polls the queue; elsewhere, or when the kernel's inotify limits are
reached, every run does the ``fstat`` checks. Writes through another process's shared memory map
raise no inotify event, so on the inotify path every 256th check, and any a second after the last
``fstat`` checks, also does them; each compares the change time too, which ``utime`` cannot put back.
A process past half its open-file limit (an application of many models) holds no descriptors for
it: every run then ``stat``s the paths.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import select
import struct
import threading
import time
import weakref
from pathlib import Path

from slimml.errors import IntegrityError, SlimmlError
from slimml.runtime.artifact.files import safe_path
from slimml.runtime.artifact.manifest import Manifest

# inotify event bits (linux/inotify.h)
IN_MODIFY, IN_ATTRIB, IN_CLOSE_WRITE = 0x2, 0x4, 0x8
IN_MOVED_FROM, IN_MOVED_TO, IN_CREATE, IN_DELETE = 0x40, 0x80, 0x100, 0x200
IN_DELETE_SELF, IN_MOVE_SELF, IN_UNMOUNT, IN_Q_OVERFLOW, IN_IGNORED = 0x400, 0x800, 0x2000, 0x4000, 0x8000
FILE_EVENTS = IN_MODIFY | IN_ATTRIB | IN_CLOSE_WRITE | IN_DELETE_SELF | IN_MOVE_SELF
FOLDER_EVENTS = IN_MOVED_FROM | IN_MOVED_TO | IN_CREATE | IN_DELETE | IN_ATTRIB | IN_DELETE_SELF | IN_MOVE_SELF
BACKSTOP = 256  # on the inotify path, every this many checks also fstat the files,
BACKSTOP_S = 1.0  # and a check this long after the last fstat does it too
_EVENT = struct.Struct("iIII")  # wd, mask, cookie, len; then len bytes of name

_live: weakref.WeakSet = weakref.WeakSet()  # watches to set right in a forked child (their lock, their inotify queue)


class FileWatch:
    """Cheap change detection for the weight data files a loaded model runs from.

    Graphs and the tokenizer are parsed into memory at load, so a change to them cannot reach a
    loaded model; :meth:`slimml.runtime.Model.verify` re-hashes every file. Once a change is
    seen, every later :meth:`check` refuses, until the model is loaded again.

    ``follow_paths``: whether the model reads its data files by path after load (a streamed model
    opens its shards' files on every pass), so a file renamed over, removed, or its folder moved
    away, changes what it would run. A fully resident model (False) has its weights mapped or
    copied: only a write to the files it mapped can reach it, and an artifact swapped by renaming
    folders, or an old folder removed, leaves it running as loaded (where the descriptors it holds
    let it tell; with paths alone, it cannot, and follows them).
    """

    def __init__(self, folder: Path, manifest: Manifest, follow_paths: bool = True):
        self.folder = folder
        data = {s.data for s in manifest.shards if s.data}
        paths = [(e.path, os.fspath(safe_path(folder, e.path))) for e in manifest.files if e.path in data]
        self._sha256 = {e.path: e.sha256 for e in manifest.files if e.path in data}
        self._every = [os.fspath(folder), *(os.fspath(safe_path(folder, e.path)) for e in manifest.files)]
        self._expect = [(rel, path, _identity(path)) for rel, path in paths]
        self._refused: str | None = None
        self._lock = threading.RLock()  # the descriptors: checked, drained and closed by one thread at a time
        # the fstat path: each file and its folder held open. fstat of a descriptor skips the path
        # lookup a stat does; a file renamed over, removed or added changes its folder's times
        self._files: list[list] = []  # [rel, path, descriptor, identity at load, links at load]
        self._dirs: list[list] = []
        folders = sorted({os.path.dirname(path) for _, path, _ in self._expect} if follow_paths else ())
        try:
            if not _room_for(len(self._expect) + len(folders) + 2):  # an app of many models: leave it descriptors
                raise OSError("too few file descriptors left")
            for rel, path, was in self._expect:
                if was is not None:
                    fd = os.open(path, os.O_RDONLY)
                    self._files.append([rel, path, fd, was, os.fstat(fd).st_nlink])
            for d in folders:
                fd = os.open(d, os.O_RDONLY)
                st = os.fstat(fd)
                self._dirs.append([fd, st.st_mtime_ns, st.st_ctime_ns])
        except OSError:  # out of descriptors, or a platform that cannot open folders: stat the paths
            self._close_fstat()
        if len(self._files) != len(self._expect):
            self._close_fstat()
        self._paths = follow_paths or not self._files  # without descriptors, the paths are all it has
        self._resident = not follow_paths
        self._notify: _Inotify | None = _Inotify.open(self._expect, folders=self._paths) if self._files else None
        self._calls = 0
        self._fstat_at = time.monotonic()
        _live.add(self)

    @property
    def how(self) -> str:
        """How changes are noticed: ``"inotify"``, ``"fstat"`` (descriptors held open) or ``"stat"`` (paths)."""
        return "inotify" if self._notify is not None else "fstat" if self._files else "stat"

    def check(self) -> None:
        """Raise IntegrityError if any file was replaced, truncated, rewritten or removed since load."""
        if self._refused is not None:
            raise IntegrityError(self._refused)
        notify = self._notify
        if notify is not None:
            try:
                queued = notify.poll(0)
            except (OSError, ValueError):  # closed by another thread while this call was under way
                if self._notify is None:
                    raise SlimmlError("the model was closed; load it again to run it.") from None
                raise
            if queued:  # the kernel queued something: look at what
                self._drain()
            self._calls += 1
            now = time.monotonic()
            if self._calls % BACKSTOP and now - self._fstat_at < BACKSTOP_S:
                return
            self._fstat_at = now
        with self._lock:
            self._check_fstat()

    def at_paths(self) -> bool:
        """Whether the files at the artifact's paths are still the ones loaded (not renamed over,
        removed, or their folder swapped for another): what a new session may be made from."""
        with self._lock:
            if not self._files:
                return all(_identity(path) == was for _, path, was in self._expect)
            for _, path, fd, *_ in self._files:
                now, st = _identity(path), os.fstat(fd)
                if now is None or now[2:4] != (st.st_ino, st.st_dev):
                    return False
            return True

    def _held(self, rel: str) -> tuple | None:
        """The identity of the file ``rel`` this watch holds open (where it is now, or unlinked)."""
        for entry in self._files:
            if entry[0] == rel:
                return _fstat_identity(os.fstat(entry[2]))
        return None

    def snapshot(self) -> tuple:
        """The identity (inode, size, times, change time) of the artifact's folder and of every file it
        lists, at their paths: equal before and after a new session is made from them, the session
        read what was hashed in between (a rename, of a file or of the folder, moves a change time)."""
        return tuple(_identity(p) for p in self._every)

    def _drain(self) -> None:
        with self._lock:
            notify = self._notify
            if notify is None:
                return self._check_fstat()
            look, modified = notify.read()
            for rel, path, was in modified:  # written or truncated in place, whatever its times say now
                now = _identity(path) if self._paths else self._held(rel)
                self._refuse(rel, _what(was, now) if now != was else "was rewritten in place (its size and times put back)")
            if look:
                self._check_paths() if self._paths else self._check_fstat()

    def _check_fstat(self) -> None:
        if not self._files:
            return self._check_paths()
        fstat = os.fstat
        for entry in self._dirs:
            st = fstat(entry[0])
            if st.st_mtime_ns != entry[1] or st.st_ctime_ns != entry[2]:
                self._check_paths()  # something in the folder changed: the paths decide
                entry[1:] = st.st_mtime_ns, st.st_ctime_ns
        for entry in self._files:
            rel, path, fd, was, links = entry
            st = fstat(fd)
            if st.st_mtime_ns != was[1] or st.st_size != was[0] or st.st_ctime_ns != was[4]:
                if (not self._paths and st.st_size == was[0] and st.st_mtime_ns == was[1] and st.st_nlink < links
                        and _sha256_of(fd) == self._sha256.get(rel)):  # unlinked (its folder removed), its bytes as
                    entry[3], entry[4] = (*was[:4], st.st_ctime_ns), st.st_nlink  # listed (not written, then unlinked)
                    continue
                self._refuse(rel, _what(was, _identity(path)) if self._paths else _what(was, _fstat_identity(st)))

    def _check_paths(self) -> None:
        for rel, path, was in self._expect:
            now = _identity(path)
            if was is None or now != was:
                self._refuse(rel, _what(was, now))

    def _refuse(self, rel: str, what: str) -> None:
        fix = ("Restore the artifact (replace artifacts by writing a new folder and renaming it, never by overwriting "
               "files in place) and load it again.")
        if self._paths and self._files:  # a streamed model: a folder renamed into place changes it too
            fix = ("A streamed model reads its shards from the folder as it runs: load the artifact again (to replace "
                   "one a streamed model runs from, load the new folder and close the old model first; never "
                   "overwrite files in place).")
        elif self._resident and not self._files:  # no descriptors to follow the files it loaded: the paths decide
            fix = ("This model was loaded past half the process's open-file limit, so its watch follows the paths and "
                   "refuses a swapped folder too: load the new artifact (a higher limit, ulimit -n, lets a resident "
                   "model run on through a swap).")
        self._refused = f"{rel} in {self.folder} {what} after the model was loaded; slimml will not run a model whose files changed under it. {fix}"
        raise IntegrityError(self._refused)

    def _after_fork(self) -> None:
        """A forked child shares the parent's inotify queue (whoever reads an event takes it from
        the other), so the child checks with fstat."""
        notify, self._notify = self._notify, None
        if notify is not None:
            notify.close()

    def _in_child(self) -> None:
        """In a forked child: the lock anew (a parent thread may have held it at the fork: held forever
        here), then off the parent's inotify queue."""
        self._lock = threading.RLock()
        self._after_fork()

    def _close_fstat(self) -> None:
        for _, _, fd, *_ in self._files:
            os.close(fd)
        for fd, *_ in self._dirs:
            os.close(fd)
        self._files, self._dirs = [], []

    def close(self) -> None:
        """Let go of the descriptors (later checks stat the paths)."""
        with self._lock:  # not while another thread fstats them (a number closed may be reused at once)
            self._after_fork()
            self._close_fstat()

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass


def _identity(path: str) -> tuple | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    # ctime too: a write through a shared memory map followed by utime() putting the mtime back
    # moves the ctime, which no caller can set
    return (st.st_size, st.st_mtime_ns, st.st_ino, st.st_dev, st.st_ctime_ns)


def _room_for(descriptors: int) -> bool:
    """Whether the process may hold ``descriptors`` more and stay within half its open-file limit
    (a server of 200 small models ran out of descriptors for its own files: each model's watch held
    one per data file and folder, and an inotify queue)."""
    try:
        import resource

        soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
        held = len(os.listdir("/proc/self/fd"))
    except (ImportError, OSError, ValueError):
        return True
    return soft == resource.RLIM_INFINITY or held + descriptors <= soft // 2


def _sha256_of(fd: int) -> str:
    """The sha256 of the file open as ``fd``, read with ``pread`` (its offset untouched)."""
    digest, at = hashlib.sha256(), 0
    while chunk := os.pread(fd, 1 << 20, at):
        digest.update(chunk)
        at += len(chunk)
    return digest.hexdigest()


def _fstat_identity(st: os.stat_result) -> tuple:
    return (st.st_size, st.st_mtime_ns, st.st_ino, st.st_dev, st.st_ctime_ns)


def _put_back(was: tuple | None, now: tuple | None) -> bool:
    """Whether a changed file's size, mtime and inode are what they were (only the change time moved)."""
    return was is not None and now is not None and now[:4] == was[:4]


def _what(was: tuple | None, now: tuple | None) -> str:
    if now is None:
        return "was removed"
    if was and now[0] != was[0]:
        return f"was truncated or grown ({was[0]} -> {now[0]} bytes)"
    if _put_back(was, now):
        return "was rewritten in place (its size and times put back)"
    return "was rewritten or replaced"


class _Inotify:
    """A non-blocking inotify queue over the data files and their folders (Linux only)."""

    _libc = None

    def __init__(self, fd: int, files: dict[int, tuple], dirs: dict[int, set[bytes]]):
        self.fd, self.files, self.dirs = fd, files, dirs
        # epoll, not select.poll: a poll object refuses calls from two threads at once
        self._epoll = select.epoll()
        self._epoll.register(fd, select.EPOLLIN)
        self.poll = self._epoll.poll

    @classmethod
    def open(cls, expect: list[tuple[str, str, tuple | None]], folders: bool = True) -> _Inotify | None:
        """The queue, or None where inotify is missing or its per-user limits are reached.
        ``folders``: watch the files' folders too (a model that reads its files by path)."""
        if not hasattr(select, "epoll") or not os.path.exists("/proc/sys/fs/inotify"):
            return None
        try:
            libc = cls._libc = cls._libc or ctypes.CDLL(None, use_errno=True)
            fd = libc.inotify_init1(os.O_NONBLOCK | os.O_CLOEXEC)
        except (OSError, AttributeError):
            return None
        if fd < 0:
            return None
        files: dict[int, tuple] = {}  # watch descriptor -> the watch's (rel, path, identity at load)
        dirs: dict[int, set[bytes]] = {}
        names: dict[str, set[bytes]] = {}
        for rel, path, was in expect:
            if was is None:
                continue
            wd = libc.inotify_add_watch(fd, os.fsencode(path), FILE_EVENTS)
            if wd < 0:
                os.close(fd)
                return None
            files[wd] = (rel, path, was)
            names.setdefault(os.path.dirname(path), set()).add(os.fsencode(os.path.basename(path)))
        for d, ours in (names if folders else {}).items():
            wd = libc.inotify_add_watch(fd, os.fsencode(d), FOLDER_EVENTS)
            if wd < 0:
                os.close(fd)
                return None
            dirs[wd] = ours
        return cls(fd, files, dirs)

    def read(self) -> tuple[bool, list[tuple]]:
        """Take every queued event: (whether the paths must be compared, the entries of files
        modified in place)."""
        look, modified = False, []
        while True:
            try:
                buf = os.read(self.fd, 65536)
            except BlockingIOError:
                return look, modified
            at = 0
            while at + _EVENT.size <= len(buf):
                wd, mask, _, n = _EVENT.unpack_from(buf, at)
                name = buf[at + _EVENT.size: at + _EVENT.size + n].rstrip(b"\0")
                at += _EVENT.size + n
                if mask & (IN_Q_OVERFLOW | IN_UNMOUNT):
                    look = True
                elif wd in self.files:
                    if mask & IN_MODIFY:
                        modified.append(self.files[wd])
                    elif mask & ~(IN_CLOSE_WRITE | IN_IGNORED):  # attributes, moved, deleted: compare
                        look = True
                elif wd in self.dirs and (not name or name in self.dirs[wd]):  # the folder itself, or one of ours
                    look = look or bool(mask & ~IN_IGNORED)

    def close(self) -> None:
        if self.fd >= 0:
            self._epoll.close()
            os.close(self.fd)
            self.fd = -1


def _child_after_fork() -> None:
    for watch in list(_live):
        watch._in_child()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_child_after_fork)
