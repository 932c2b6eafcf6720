"""Streamed shards on CPU at resident speed: ONNX Runtime's pre-packed weights, kept in files.

ONNX Runtime's CPU matrix kernels work on weights *pre-packed* into their own layout at session
creation. A weight fed as a graph input cannot be pre-packed, so it is packed again on every
call, which makes a decode step 2-4x slower (docs/runtime.md). ONNX Runtime can instead write a
shard's pre-packed weights into an external data file once
(``session.save_external_prepacked_constant_initializers``) and, when a session opens that
graph, map them from the file rather than packing them. Those pages are file-backed: slimml
brings them in ahead of the compute and drops them after it (``madvise``), so a shard costs
memory only while it is in a slot, and the kernels run as on a resident model.

The packed files depend on the shard, the ONNX Runtime version and the CPU, so they live in a
cache (:func:`cache_root`), written once atomically into private
folders with every file's sha256, which ``load`` checks as it checks the artifact's shards (and
a pass checks again if a file changed since, ``Model.verify()`` always):
:mod:`slimml.runtime.engine.cache`. A damaged cache entry is refused, naming the folder to delete.

Where the memory left cannot hold the streamed shards in the page cache (a memory cgroup smaller
than the model), slots read the packed bytes in themselves instead of paging them:
:mod:`slimml.runtime.engine.read_in`.
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import json
import os
import platform
import sys
import threading
import weakref
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import onnxruntime as ort

from slimml.errors import ArtifactError, ConfigError, IntegrityError, SlimmlError
from slimml.runtime.artifact.files import hash_file, safe_path
from slimml.runtime.artifact.manifest import Manifest
from slimml.runtime.artifact.places import home_folder, unwritable
from slimml.runtime.engine import read_in as reads
from slimml.runtime.engine.cache import CacheEntry, make_record, private_folder, read_record
from slimml.runtime.engine.slots import Slot, file_stamp

if TYPE_CHECKING:
    from slimml.runtime.engine.backends.base import Backend
    from slimml.runtime.engine.config import LoadConfig

CACHE_FORMAT = 2  # 2: the record lists the graph too, and says its format
_MADV_WILLNEED, _MADV_DONTNEED, _MADV_POPULATE_READ = 3, 4, 22


def cache_root() -> Path | None:
    """Where slimml keeps its caches: ``SLIMML_CACHE_DIR``, else ``$XDG_CACHE_HOME/slimml``, else
    ``~/.cache/slimml``; None where none is set and there is no home folder to keep it in (a
    container run as a user without one: HOME unset, empty, missing, or one this user cannot
    write, such as ``/``). A cache that is there is used, read-only or not."""
    if os.environ.get("SLIMML_CACHE_DIR"):
        env = os.environ["SLIMML_CACHE_DIR"]
        if os.path.exists(env) and not os.path.isdir(env):  # asked for where the cache is used, not at every load
            raise ConfigError(f"SLIMML_CACHE_DIR={env!r} is a file, not a folder; set it to a folder (it is made where "
                              "missing) for slimml's pre-packed weights, or unset it.")
        return Path(env)
    xdg = os.environ.get("XDG_CACHE_HOME")
    if xdg and os.path.isabs(xdg):  # the spec ignores a relative one
        return Path(xdg) / "slimml"
    home = home_folder()
    if home is None:
        return None
    root = home / ".cache" / "slimml"
    return root if root.is_dir() or unwritable(root) is None else None


NO_CACHE = ("no cache folder (no home folder this user can write, and neither SLIMML_CACHE_DIR nor an absolute "
            "XDG_CACHE_HOME is set); set SLIMML_CACHE_DIR (--cache-dir, load(cache_dir=...)) to a writable folder with "
            "room for about twice the streamed shards")


def supported() -> str | None:
    """Why packed streaming cannot run here, or None when it can."""
    if not sys.platform.startswith("linux"):
        return "it needs Linux (madvise on ONNX Runtime's mappings)"
    if reads.libc_fn("madvise", [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int], ctypes.c_int) is None:
        return "the C library's madvise is not reachable"
    return None


def cpu_key(disabled: list[str] | None) -> str:
    """What the packed layout depends on besides the shard: ONNX Runtime, the CPU's features and
    the graph optimizers left off (``disabled``, the CPU backend's)."""
    flags = ""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line for line in f if line.startswith("flags")), "")
    except OSError:
        pass
    return json.dumps([CACHE_FORMAT, ort.__version__, platform.machine(), sorted(set(flags.split())),
                       disabled])


class PackedSlots:
    """Streamed shards whose sessions map pre-packed weight files; slots page them in and out.

    :meth:`compile` builds (or finds) a shard's packed files, checks them, and opens its session once;
    :meth:`fill` (loader thread) re-hashes the packed files if one changed and brings its pages in;
    the slot's release drops them from this process.
    """

    how = "pre-packed weights mapped from the cache and paged in and out"
    kind = "pre-packed"

    def __init__(self, folder: Path, manifest: Manifest, backend: Backend, config: LoadConfig, read_in: bool = False):
        self.folder, self.manifest, self.backend, self.verify = folder, manifest, backend, config.verify
        root = config.cache_dir or cache_root()
        if root is None:  # the CPU backend feeds the weights instead (weight_source)
            raise ArtifactError(f"pre-packed weights need a cache folder, and there is {NO_CACHE}")
        self.cache = root / "packed"
        self.ranges: dict[int, list[tuple[int, int, int]]] = {}  # shard -> (address, length, file offset)
        # the streamed shards do not fit in the page cache beside the rest: read them in ourselves
        self.read_in = read_in and reads.supported()
        self._buffers: reads.Buffers | None = None
        large_allocations_off_heap()  # a batch's prompt pass must not leave the heap at its high-water mark
        if self.read_in:
            self.how = "pre-packed weights read from the cache in large reads, dropped from the page cache"
        self.sessions: dict[int, object] = {}
        self.names: dict[int, dict[str, str]] = {}  # none renamed: each shard's packed weights are its session's
        self.entries: dict[int, CacheEntry] = {}  # shard -> its cache entry (folder, record, files as hashed)
        self.key = cpu_key(backend.disabled_optimizers())

    def compile(self, index: int, threads: int | None, spinning: bool):
        """The shard's session over its packed graph, opened once.

        Every cached file is hashed against its record and the graph checked as a shard is
        (:class:`~slimml.runtime.engine.cache.CacheEntry`), even with ``verify=False``: the cache
        is not part of the artifact the caller chose to trust.

        Raises:
            ArtifactError: the packed files cannot be made here, or ONNX Runtime did not map them.
            IntegrityError: the cache folder is not private, or the entry is damaged.
        """
        entry = self._packed(index, threads)
        entry.check()
        self.entries[index] = entry
        options = self.backend.session_options(threads, spinning, shared_arena=True)
        with _MAPPING:  # another model of this process may map the same file: its mappings are not ours
            before = set(_mappings(entry.data))
            session = self.backend.session(entry.graph, options, what=f"the packed shard {index} ({entry.graph})")
            ranges = sorted(set(_mappings(entry.data)) - before)
        if not entry.same_files():  # swapped between the hash and ONNX Runtime's open
            entry.seen = None
            raise IntegrityError(f"the cache entry {entry.folder} changed while it was loaded; delete {entry.folder} "
                                 "(slimml rebuilds it) and load the model again.")
        if not ranges and entry.data.stat().st_size:
            raise ArtifactError("ONNX Runtime did not map the pre-packed weights from their file; load the model with "
                                "pack=False (--no-pack) to feed its weights instead.")
        self.sessions[index] = session  # the mappings live as long as the session: kept while slots may advise them
        if self.read_in:
            ranges = reads.anonymous(ranges)
        reads.advise(ranges, _MADV_DONTNEED)  # nothing stays in memory until a slot brings it in
        self.ranges[index] = ranges
        trim_heap()
        return session

    def loaded_bytes(self) -> dict[int, int]:
        """Shard -> the bytes its slot holds (its pre-packed weights, larger than the file for 4-bit
        weights: up to 1.6x), for the shards compiled so far."""
        return {i: sum(n for _, n, _ in r) for i, r in self.ranges.items()}

    def fill(self, index: int) -> Slot:
        entry = self.entries[index]
        entry.check()  # re-hashed only if a file changed since it was hashed
        ranges = self.ranges[index]
        if not ranges:  # a shard whose weights are all small constants inside its graph
            return Slot(index, {}, 0)
        nbytes = sum(n for _, n, _ in ranges)
        if self.read_in:
            if self._buffers is None:  # one per slot in use, as large as the largest shard's packed weights
                self._buffers = reads.Buffers(max(sum(n for _, n, _ in r) for r in self.ranges.values()))
                weakref.finalize(self, self._buffers.close)
            return Slot(index, {}, nbytes, reads.fill(entry.data, ranges, self._buffers, self.sessions[index]))
        # map the pages in here, on the loader thread: left to the compute, the faults cost it more
        # (measured: decode 11.4-11.9 tok/s against 14.5 with the pages populated ahead)
        if not reads.advise(ranges, _MADV_POPULATE_READ):  # kernels before 5.14: ask for read-ahead
            reads.advise(ranges, _MADV_WILLNEED)
        return Slot(index, {}, nbytes, _Pages(ranges, self.sessions[index]))

    def check_cache(self, deep: bool = False) -> None:
        """Every cache entry this model uses: re-hashed (``deep``, as ``Model.verify()`` asks), else
        compared with the files as hashed and re-hashed where one changed.

        Raises:
            IntegrityError: naming the entry's folder to delete.
        """
        for entry in self.entries.values():
            entry.check(deep)

    # -- the cache ------------------------------------------------------------------------------

    def _packed(self, index: int, threads: int | None) -> CacheEntry:
        shard = self.manifest.shards[index]
        hashes = {f.path: f.sha256 for f in self.manifest.files}
        key = hashlib.sha256(json.dumps([self.key, hashes[shard.file], hashes.get(shard.data)]).encode()).hexdigest()[:32]
        try:  # owner and mode: refused in one line (IntegrityError) unless only this user can write
            private_folder(self.cache.parent)
            private_folder(self.cache)
        except OSError as e:
            raise self._failed(index, e.strerror or str(e)) from None
        folder = self.cache / key
        record = read_record(folder, CACHE_FORMAT)  # a damaged record of any shape: refused, naming the folder
        if record is not None:
            return CacheEntry(folder, record)
        with _entry_lock(self.cache / f".{key}.lock"):  # one writer: another loader of this shard waits, then reads
            record = read_record(folder, CACHE_FORMAT)  # what the writer it waited for made
            if record is not None:
                return CacheEntry(folder, record)
            return self._pack(index, threads, shard, folder)

    def _pack(self, index: int, threads: int | None, shard, folder: Path) -> CacheEntry:
        """Write shard ``index``'s pre-packed graph and weights as the cache entry ``folder``."""
        from slimml.runtime.artifact.atomic import atomic_folder  # the one atomic writer: stale temp folders go, a kill leaves none

        sources = self._sources_as_listed(index, shard)  # the bytes packed are the bytes the manifest names
        try:
            with atomic_folder(folder, private=True) as tmp:
                so = self.backend.session_options(threads, spinning=False)
                so.optimized_model_filepath = os.fspath(tmp / "shard.onnx")
                so.add_session_config_entry("session.optimized_model_external_initializers_file_name", "shard.onnx.data")
                so.add_session_config_entry("session.optimized_model_external_initializers_min_size_in_bytes", "1024")
                so.add_session_config_entry("session.save_external_prepacked_constant_initializers", "1")
                ort.InferenceSession(os.fspath(safe_path(self.folder, shard.file)), so, providers=["CPUExecutionProvider"],
                                     disabled_optimizers=self.backend.disabled_optimizers())
                if not (tmp / "shard.onnx.data").is_file():
                    if _largest_weight(safe_path(self.folder, shard.file)) >= 1024:  # it should have written them
                        raise ArtifactError("ONNX Runtime wrote no pre-packed weights for it")
                    (tmp / "shard.onnx.data").touch()  # no weight of 1 KB or more (a small head): nothing to map
                if any(file_stamp(path) != stamp for path, stamp in sources):  # changed while ONNX Runtime read it
                    raise IntegrityError(f"shard {index}'s files changed while they were packed; restore the artifact "
                                         "(write a new folder and rename it, never overwrite files in place) and load "
                                         "it again.")
                record = make_record(tmp, shard.file, CACHE_FORMAT)
                (tmp / "packed.json").write_text(json.dumps(record, indent=1))
                os.chmod(tmp / "packed.json", 0o600)
        except IntegrityError:
            raise
        except Exception as e:  # a read-only or full disk (SlimmlError from atomic_folder), ORT's own errors
            why = str(e).split(";")[0].rstrip(".") if isinstance(e, SlimmlError) else f"{type(e).__name__}: {e}"
            raise self._failed(index, why) from None
        return CacheEntry(folder, record)

    def _sources_as_listed(self, index: int, shard) -> list[tuple[Path, tuple | None]]:
        """The shard's graph and data files hashed now, against the manifest's sha256: an entry is
        shared by every later load of the same manifest (its key is the listed hashes), trusted
        even with ``verify=False``, so it must be made from the listed bytes, whatever this load
        was told to trust. Their identities (change time included), for the check after packing.

        Raises:
            IntegrityError: a file differs from its manifest entry.
        """
        listed = {f.path: f.sha256 for f in self.manifest.files}
        out = []
        for rel in (shard.file, shard.data):
            if not rel:
                continue
            path = safe_path(self.folder, rel)
            stamp = file_stamp(path)
            if hash_file(path)[0] != listed.get(rel) or file_stamp(path) != stamp:
                raise IntegrityError(f"{rel} in {self.folder} does not match its sha256 in the manifest, so shard {index} "
                                     "was not packed; the artifact is damaged or was tampered with: re-convert it.")
            out.append((path, stamp))
        return out

    def _failed(self, index: int, why: str) -> ArtifactError:
        return ArtifactError(
            f"packing shard {index} into {self.cache} failed ({why}); set SLIMML_CACHE_DIR (--cache-dir, "
            "load(cache_dir=...)) to a writable folder with room for about twice the streamed shards, or load with "
            "pack=False (--no-pack)"
        )


_MAPPING = threading.Lock()  # one session opened at a time, so that the mappings it adds are known to be its own


def _child_after_fork() -> None:
    global _MAPPING
    _MAPPING = threading.Lock()  # a parent's loader thread may have held it at the fork: it is gone


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_child_after_fork)


@contextlib.contextmanager
def _entry_lock(path: Path) -> Iterator[None]:
    """An exclusive lock on ``path`` (made, mode 600) while a cache entry is written: loaders in
    other processes and threads that need the same entry wait for it, instead of writing their own
    and swapping it in under a loader that already checked the first (which then refused it)."""
    try:
        import fcntl
    except ImportError:  # not POSIX: no lock, as before
        yield
        return
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # closing the descriptor releases the lock


class _Pages:
    """What a packed slot holds: ONNX Runtime's mappings of one shard; closing drops their pages.

    It keeps the session that owns the mappings alive, so the addresses it advises are always
    that session's mappings, never memory the process reused after the session went.
    """

    def __init__(self, ranges: list[tuple[int, int, int]], owner: object):
        self.ranges, self.owner = ranges, owner

    def close(self) -> None:
        reads.advise(self.ranges, _MADV_DONTNEED)
        self.owner = None


def _mappings(path: Path) -> list[tuple[int, int, int]]:
    """This process's mappings of ``path``: (address, length, file offset) from /proc/self/maps."""
    target = os.path.realpath(path)
    out = []
    with open("/proc/self/maps") as f:
        for line in f:
            parts = line.rstrip("\n").split(maxsplit=5)
            if len(parts) == 6 and parts[5] == target:
                lo, hi = (int(x, 16) for x in parts[0].split("-"))
                out.append((lo, hi - lo, int(parts[2], 16)))
    return out


_malloc_trim = (reads.libc_fn("malloc_trim", [ctypes.c_size_t], ctypes.c_int)  # glibc only
                if sys.platform.startswith("linux") else None)


_mallopt = reads.libc_fn("mallopt", [ctypes.c_int, ctypes.c_int], ctypes.c_int) if sys.platform.startswith("linux") else None
_M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter
OFF_HEAP_BYTES = 1 << 20  # allocations this large or larger are mapped and unmapped on their own


def large_allocations_off_heap() -> None:
    """Fix glibc's mmap threshold at :data:`OFF_HEAP_BYTES`, so that large activations are mapped
    on their own and go back to the system when freed (elsewhere nothing).

    glibc raises the threshold (up to 32 MB) after the first large free, and from then on large
    tensors land on the heap, where a freed block below a live one cannot be given back: a
    streamed int4 1.1B Llama prefilling 16 prompts of 32 tokens peaked at 689 MB of anonymous
    memory (587 MB after the pass, 110 MB after ``malloc_trim``), enough to be killed in a 293 MB
    cgroup; with the threshold fixed it peaked at 328 MB and kept 134 MB. The price is fresh pages
    for each large tensor: that prompt pass took 1.9 s instead of 1.5 s (uncapped; under a cap the
    pass waits on the disk). Decode passes allocate less than a MiB a tensor up to batch 16.
    """
    if _mallopt is not None:
        _mallopt(_M_MMAP_THRESHOLD, OFF_HEAP_BYTES)


def trim_heap() -> None:
    """Give the C heap's freed memory back to the system (glibc's ``malloc_trim``; elsewhere nothing).

    Opening a session reads the shard's original weights onto the heap and frees them once the
    packed ones are mapped; glibc raises its mmap threshold after the first large free, so the
    later ones land on the heap and stay in the process: measured 12.4 MB of a 24 MB int4 Llama
    layer kept per session (304 MB anonymous memory after opening 22, 40 MB with the trim), which
    a model streamed under a memory cap cannot afford.
    """
    if _malloc_trim is not None:
        _malloc_trim(0)


def _largest_weight(path: Path) -> int:
    """Bytes of the largest initializer of the shard graph at ``path`` (its data not read)."""
    import onnx
    from onnx import external_data_helper

    largest = 0
    for t in onnx.load(os.fspath(path), load_external_data=False).graph.initializer:
        if external_data_helper.uses_external_data(t):
            size = int({e.key: e.value for e in t.external_data}.get("length", 0))
        else:
            size = len(t.raw_data) or t.ByteSize()
        largest = max(largest, size)
    return largest
