"""Weight slots: where a streamed shard's weights sit while it computes.

A streamed model holds at most K shards' weights at once. Each streamed shard passes through a
slot: the loader thread *fills* a slot ahead of the compute (the next P shards), the compute
feeds the slot's arrays to the shard's compiled-once session, then *releases* it, and the
loader refills it with a later shard.

:class:`FedSlots` compiles each streamed shard with its weights as graph inputs
(:mod:`slimml.runtime.engine.weights`) and fills a slot by memory-mapping the shard's data file read-only and bringing
its pages in (``MAP_POPULATE``, else a read-through), so the compute finds them resident; the
arrays it hands out are views of the mapping (no copy), and release unmaps it, returning the
memory. A CUDA filler keeps the same contract with device buffers allocated once per slot,
filled from pinned host memory on a copy stream and bound through IOBinding.

A data file whose size, mtime or inode changed since ``load`` hashed it is hashed again before
it is mapped: a corrupted or replaced file is refused, never run. On CPU under Linux the plan
prefers :class:`slimml.runtime.engine.packed.PackedSlots` (pre-packed weights, resident speed); both
keep the contract :class:`slimml.runtime.engine.contracts.WeightSource` (``compile(index, ...) ->
session``, ``fill(index) -> Slot``, ``names``), and the slots they hand out, ``Slot.release()``.
"""

from __future__ import annotations

import logging
import mmap
import os
from pathlib import Path, PurePosixPath
from typing import TYPE_CHECKING

import numpy as np

import onnx

from slimml.errors import ArtifactError
from slimml.runtime.artifact.files import safe_path, verify_file
from slimml.runtime.artifact.manifest import Manifest
from slimml.runtime.engine.budget import fmt_bytes
from slimml.runtime.engine.merge import relative_to_folder
from slimml.runtime.engine.weights import WeightSpec, canonical, unpacked_bytes, weights_as_inputs

log = logging.getLogger("slimml")

if TYPE_CHECKING:
    from slimml.runtime.engine.backends.base import Backend
    from slimml.runtime.engine.config import LoadConfig

_PAGE = mmap.PAGESIZE


class Slot:
    """One shard's weights, ready to feed: ``weights`` maps input names to arrays."""

    def __init__(self, index: int, weights: dict[str, np.ndarray], nbytes: int, handle=None):
        self.index = index
        self.weights = weights
        self.nbytes = nbytes
        self._handle = handle  # what backs the arrays (an mmap on CPU)

    def release(self) -> None:
        """Give the slot's memory back. The arrays must not be used afterwards."""
        self.weights = {}
        handle, self._handle = self._handle, None
        if handle is not None:
            try:
                handle.close()
            except BufferError:  # a view still referenced somewhere: unmapped when it goes
                pass


class FedSlots:
    """Weights fed as graph inputs from memory-mapped data files (any device, any platform).

    :meth:`compile` opens a shard's session once, its weights turned into inputs; :meth:`fill`
    (the loader thread) maps the shard's data file and hands out views of it. Shards of one
    layer type (the same graph once values are named by position) share one session:
    ``names[index]`` maps such a shard's input and output names to the session's.

    Args:
        backend: the device the sessions run on.
        config: ``config.verify``: a data file that changes after load is hashed again before it
            is mapped (else trusted as it is).
    """

    how = "weights fed from memory-mapped data files"
    kind = "fed"  # what a bench baseline records (how is said in words, and may vary with the memory free)

    def __init__(self, folder: Path, manifest: Manifest, backend: Backend, config: LoadConfig):
        self.folder, self.manifest, self.backend = folder, manifest, backend
        verify = config.verify
        self.specs: dict[int, list[WeightSpec]] = {}
        self.names: dict[int, dict[str, str]] = {}
        self._compiled: dict[str, object] = {}  # canonical graph's sha256 -> its session
        self._kept: dict[int, int] = {}  # shard -> bytes of 4-bit weights its session holds as constants (PACKED_TYPES)
        self._unpacked: dict[int, int] = {}  # shard -> bytes its largest fed 4-bit matmul unpacks to as it runs (CPU)
        self.entries = {f.path: f for f in manifest.files}
        # what each file looked like when load() hashed it: a change mid-stream means re-hashing
        self.seen = {p: file_stamp(safe_path(folder, p)) for p in self.entries} if verify else None

    def compile(self, index: int, threads: int | None, spinning: bool):
        """The shard's session with its weights as graph inputs, opened once.

        Raises:
            ArtifactError: ONNX Runtime needs some of the shard's weights as constants.
        """
        shard = self.manifest.shards[index]
        model = onnx.load_model_from_string(safe_path(self.folder, shard.file).read_bytes())  # weights not read
        relative_to_folder(model, PurePosixPath(shard.file).parent)  # weights kept as constants: read from the folder
        graph, self.specs[index], packed = weights_as_inputs(model, shard.file)
        if packed and not any(self._kept.values()):  # not streamed: said once, not in silence
            log.warning("slimml: 4-bit weights stay in their shards' sessions, loaded for the model's life (counted in "
                        "the memory budget), from shard %d on (%s there): ONNX Runtime's Python API cannot feed two "
                        "values a byte; stream them pre-packed (pack=True, the default) to page them in and out",
                        index, fmt_bytes(packed))
        self._kept[index] = packed
        if self.backend.name == "cpu":
            self._unpacked[index] = unpacked_bytes(model, {w.name for w in self.specs[index]})
        same = canonical(graph)
        if same is not None:
            key, graph, self.names[index] = same
            if key in self._compiled:
                return self._compiled[key]
        try:
            options = self.backend.session_options(threads, spinning, self.folder if packed else None, shared_arena=True)
            session = self.backend.session(graph, options, what=shard.file)
        except ArtifactError as e:
            raise ArtifactError(
                f"shard {index} cannot stream: {str(e).split(': ', 1)[-1].split('. ')[0]}; ONNX Runtime needs some of "
                f"its weights as constants. Pin it (pin=[{index}]) or load the model fully resident."
            ) from None
        if same is not None:
            self._compiled[key] = session
        return session

    def kept_bytes(self) -> dict[int, int]:
        """Shard -> the bytes of its weights its session holds as constants for its life, outside the
        slots (4-bit ones), for the shards compiled so far."""
        return {i: n for i, n in self._kept.items() if n}

    def unpacked_bytes(self) -> dict[int, int]:
        """Shard -> the bytes ONNX Runtime's CPU kernel unpacks its largest fed 4-bit matmul weight
        into as the shard runs (a weight fed as an input is not pre-packed: MatMulNBits turns it into
        a float matrix each pass, and the shared arena keeps the largest), for the shards compiled so far."""
        return {i: n for i, n in self._unpacked.items() if n}

    def check_cache(self, deep: bool = False) -> None:
        """Nothing: fed weights are read from the artifact's own (watched) files."""

    def fill(self, index: int) -> Slot:
        shard = self.manifest.shards[index]
        if shard.data is None or not self.specs[index]:
            return Slot(index, {}, 0)
        self._recheck(shard.data)
        mm = self._map_checked(index)
        buf = np.frombuffer(mm, dtype=np.uint8)
        weights = {}
        for w in self.specs[index]:
            arr = buf[w.offset: w.offset + w.nbytes].view(w.dtype).reshape(w.shape)
            weights[w.name] = arr if arr.ctypes.data % w.dtype.itemsize == 0 else arr.copy()  # unaligned: copy
        del buf
        return Slot(index, weights, len(mm), mm)

    def _map_checked(self, index: int) -> mmap.mmap:
        """The shard's data file mapped read-only, pages brought in, every weight inside it.

        Raises:
            ArtifactError: the file ends before one of the shard's weights.
        """
        shard = self.manifest.shards[index]
        with open(safe_path(self.folder, shard.data), "rb") as f:
            size = os.fstat(f.fileno()).st_size
            mm = _map(f.fileno(), size)
        for w in self.specs[index]:
            if w.offset + w.nbytes > size:
                mm.close()
                raise ArtifactError(f"{shard.data} ends before weight {w.name!r}; the artifact is damaged: re-convert it.")
        return mm

    def _recheck(self, rel: str) -> None:
        """Re-hash a file whose size, mtime or inode changed since it was verified."""
        if self.seen is None:
            return
        stamp = file_stamp(safe_path(self.folder, rel))
        if stamp != self.seen.get(rel):
            verify_file(self.folder, self.entries[rel])  # raises IntegrityError naming the file
            self.seen[rel] = file_stamp(safe_path(self.folder, rel))


def _map(fd: int, size: int) -> mmap.mmap:
    """Map a whole file read-only with its pages brought in now (on the loader thread)."""
    populate = getattr(mmap, "MAP_POPULATE", 0)
    mm = mmap.mmap(fd, size, flags=mmap.MAP_SHARED | populate, prot=mmap.PROT_READ)
    if not populate:  # touch one byte a page instead
        if hasattr(mm, "madvise"):
            mm.madvise(mmap.MADV_WILLNEED)
        np.frombuffer(mm, dtype=np.uint8)[::_PAGE].sum()
    return mm


def file_stamp(path: Path) -> tuple[int, int, int, int] | None:
    """A file's size, mtime, inode and change time (None if it is gone): what changes when it is
    rewritten, even with its mtime put back afterwards (``utime`` moves the change time)."""
    try:
        st = path.stat()
    except OSError:
        return None
    return (st.st_size, st.st_mtime_ns, st.st_ino, st.st_ctime_ns)
