"""Packed weights read in, not paged: how a streamed model runs when the page cache cannot hold it.

:class:`~slimml.runtime.engine.packed.PackedSlots` lets ONNX Runtime map each streamed shard's
pre-packed weights from its cache file and pages them in per pass. When the streamed shards do
not fit in the memory left (a memory cgroup of half the model: page cache counts against it),
paging thrashes: pages are evicted before the kernels reach them and read again (measured: 1148
MB read per token for 531 MB of weights, 0.7 tokens/s). Instead:

- :func:`anonymous` puts private anonymous memory where ONNX Runtime mapped the file, at the same
  addresses, so the compiled sessions find their weights where they expect them;
- a slot is filled by reading the file's bytes with ``O_DIRECT`` (no page cache, nothing charged
  twice to the cap), 8 reads of 2 MiB in flight (a disk reads faster with a queue: 2.0 GB/s in
  the cap against 1.0 one read at a time, 0.5-0.7 buffered), into a buffer whose pages are
  already there (:class:`Buffers`), then moved to the session's addresses with ``mremap`` (page
  tables move, no byte is copied); released, the pages move back to the buffer for the next
  shard. Reading into fresh pages instead measured a third slower (their faults).

Where ``mremap(MREMAP_DONTUNMAP)`` is refused (Linux before 5.7), slots read straight into the
session's addresses and release them with ``MADV_DONTNEED``.
"""

from __future__ import annotations

import ctypes
import errno
import mmap
import os
import queue
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from slimml.errors import ArtifactError, OutOfMemoryError, SlimmlError

Range = tuple[int, int, int]  # (address, length, file offset)

_PAGE = mmap.PAGESIZE
_READ = 2 << 20  # bytes per read call
_READERS = 8  # reads in flight while a slot fills
_PROT_READ, _PROT_WRITE, _MAP_PRIVATE, _MAP_FIXED, _MAP_ANONYMOUS = 1, 2, 0x02, 0x10, 0x20
_MREMAP_MAYMOVE, _MREMAP_FIXED, _MREMAP_DONTUNMAP = 1, 2, 4
_MADV_DONTNEED, _MADV_HUGEPAGE, _MADV_POPULATE_WRITE = 4, 14, 23
_FAILED = ctypes.c_void_p(-1).value


def libc_fn(name: str, args: list, res):
    """The C library's function ``name`` with its argument and result types, or None where it has none."""
    try:
        fn = getattr(ctypes.CDLL(None, use_errno=True), name)
    except (OSError, AttributeError):
        return None
    fn.argtypes, fn.restype = args, res
    return fn


_mmap = libc_fn("mmap", [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long],
                 ctypes.c_void_p)
_munmap = libc_fn("munmap", [ctypes.c_void_p, ctypes.c_size_t], ctypes.c_int)
_mremap = libc_fn("mremap", [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p],
                   ctypes.c_void_p)
_madvise = libc_fn("madvise", [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int], ctypes.c_int)


def supported() -> bool:
    return None not in (_mmap, _munmap, _madvise)


def advise(ranges: list[Range], advice: int) -> bool:
    ok = True
    for addr, length, _ in ranges:
        ok = _madvise(addr, length, advice) == 0 and ok
    return ok


def anonymous(ranges: list[Range]) -> list[Range]:
    """Private anonymous memory in place of ONNX Runtime's mappings of a packed file (same
    addresses), empty until a slot fills it.

    Raises:
        OutOfMemoryError: the machine had no memory for it; ArtifactError: the system refused it otherwise.
    """
    for addr, length, _ in ranges:
        got = _mmap(addr, length, _PROT_READ | _PROT_WRITE, _MAP_PRIVATE | _MAP_ANONYMOUS | _MAP_FIXED, -1, 0)
        if got != addr:
            raise _refused("mapping memory for the packed weights", ctypes.get_errno())
    return ranges


def _refused(what: str, err: int) -> SlimmlError:
    """The system's refusal of memory for packed weights read in, with the fix: out of memory is the
    machine's (free some, or stream with a smaller budget); anything else, the weights fed instead."""
    why = os.strerror(err) if err else "no reason given"
    if err in (errno.ENOMEM, errno.EAGAIN):
        return OutOfMemoryError(f"{what} failed ({why}); free memory, or load with a smaller memory budget (fewer "
                                "resident and prefetched shards).")
    return ArtifactError(f"{what} failed ({why}); load the model with pack=False (--no-pack) to feed its weights instead.")


class Buffers:
    """Populated buffers that slots read into and move to a session's addresses: one per slot
    in use (made when none is free, kept for the model's lifetime), each ``size`` bytes."""

    def __init__(self, size: int):
        self.size = -(-size // _PAGE) * _PAGE
        self.free: queue.SimpleQueue[int] = queue.SimpleQueue()
        self.made: list[int] = []
        self.lock = threading.Lock()
        self.moves = _mremap is not None  # False after the kernel refused a move: read in place

    def take(self) -> int:
        try:
            return self.free.get_nowait()
        except queue.Empty:
            pass
        addr = _mmap(None, self.size, _PROT_READ | _PROT_WRITE, _MAP_PRIVATE | _MAP_ANONYMOUS, -1, 0)
        if addr in (None, _FAILED):
            raise _refused(f"allocating {self.size} bytes for a streamed shard", ctypes.get_errno())
        if _madvise(addr, self.size, _MADV_POPULATE_WRITE) != 0:  # kernels before 5.14: touch a byte a page
            ctypes.memset(addr, 0, self.size)
        with self.lock:
            self.made.append(addr)
        return addr

    def give(self, addr: int) -> None:
        self.free.put(addr)

    def close(self) -> None:
        with self.lock:
            made, self.made = self.made, []
        for addr in made:
            _munmap(addr, self.size)


def _move(src: int, dst: int, length: int) -> bool:
    """Move the pages of ``[src, src + length)`` to ``dst`` (its old mapping replaced); ``src``
    stays mapped, empty."""
    got = _mremap(src, length, length, _MREMAP_MAYMOVE | _MREMAP_FIXED | _MREMAP_DONTUNMAP, dst)
    return got == dst


class Filled:
    """A read-in slot's handle: its pages moved to the session's addresses; ``close`` moves them
    back to the buffer (or drops them, where nothing moved)."""

    def __init__(self, ranges: list[Range], buffers: Buffers, buf: int | None, places: list[int], owner: object):
        self.ranges, self.buffers, self.buf, self.places, self.owner = ranges, buffers, buf, places, owner

    def close(self) -> None:
        if self.buf is None:
            advise(self.ranges, _MADV_DONTNEED)
        else:
            for (addr, length, _), at in zip(self.ranges, self.places):
                if not _move(addr, self.buf + at, length):  # cannot happen once moved the other way
                    advise([(addr, length, 0)], _MADV_DONTNEED)
            self.buffers.give(self.buf)
        self.owner = None


def fill(path: Path, ranges: list[Range], buffers: Buffers, owner: object) -> Filled:
    """Read ``ranges`` of the packed file at ``path`` in, where the session maps them.

    Raises:
        ArtifactError: the file is shorter than the ranges say, or memory could not be had.
    """
    ordered = sorted(ranges, key=lambda r: r[2])
    if buffers.moves:
        buf = buffers.take()
        places, at = [], 0
        for _, length, _ in ordered:
            places.append(at)
            at += length
        try:
            read_into(path, [(buf + p, length, offset) for p, (_, length, offset) in zip(places, ordered)])
        except BaseException:
            buffers.give(buf)
            raise
        for i, ((addr, length, _), p) in enumerate(zip(ordered, places)):
            if not _move(buf + p, addr, length):  # a kernel without MREMAP_DONTUNMAP: read in place from now on
                for (a, n, _), q in zip(ordered[:i], places):
                    _move(a, buf + q, n)
                buffers.give(buf)
                buffers.moves = False
                break
        else:
            return Filled(ordered, buffers, buf, places, owner)
    read_into(path, ordered)
    return Filled(ordered, buffers, None, [], owner)


def read_into(path: Path, ranges: list[Range]) -> None:
    """Read the file's bytes into the ranges (address, length, file offset): pieces of ``_READ``
    bytes, ``_READERS`` in flight, with ``O_DIRECT``; where the file system refuses it, buffered
    and dropped from the page cache after.

    Raises:
        ArtifactError: the file is shorter than the ranges say.
    """
    direct = hasattr(os, "O_DIRECT")
    try:
        fd = os.open(path, os.O_RDONLY | (os.O_DIRECT if direct else 0))
    except OSError:  # a file system without O_DIRECT (tmpfs)
        fd, direct = os.open(path, os.O_RDONLY), False
    try:
        size = os.fstat(fd).st_size
        pieces = [(addr + k, min(_READ, length - k), offset + k)
                  for addr, length, offset in ranges for k in range(0, length, _READ) if offset + k < size]
        try:
            list(_pool().map(lambda p: _read_piece(fd, p, size, direct), pieces))
        except OSError as e:
            if not direct or e.errno != errno.EINVAL:
                raise
            os.close(fd)  # the file system refused the direct read: read through the cache
            fd, direct = os.open(path, os.O_RDONLY), False
            for p in pieces:
                _read_piece(fd, p, size, direct)
        if not direct:
            for _, length, offset in ranges:
                os.posix_fadvise(fd, offset, length, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def _read_piece(fd: int, piece: Range, size: int, direct: bool) -> None:
    addr, length, offset = piece
    want = min(length, size - offset)
    n = min(length, -(-want // _PAGE) * _PAGE) if direct else want  # O_DIRECT: whole pages (the ranges are)
    view = memoryview((ctypes.c_ubyte * n).from_address(addr)).cast("B")
    done = 0
    while done < want:  # the GIL is released while the kernel reads
        step = os.preadv(fd, [view[done:n]], offset + done)
        if step <= 0:
            raise ArtifactError("a packed weight file ended early; delete slimml's cache folder (it is rebuilt)")
        done += step


_readers: ThreadPoolExecutor | None = None
_readers_lock = threading.Lock()


def _pool() -> ThreadPoolExecutor:
    global _readers
    with _readers_lock:
        if _readers is None:
            _readers = ThreadPoolExecutor(_READERS, thread_name_prefix="slimml-read")
        return _readers


def _child_after_fork() -> None:
    """A forked child has none of the pool's threads (work given to it would never run): a new
    pool, made on first use, and a lock no parent thread holds."""
    global _readers, _readers_lock
    _readers, _readers_lock = None, threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_child_after_fork)
