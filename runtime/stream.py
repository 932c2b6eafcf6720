"""The streaming engine: run a model whose shards do not all fit in memory at once.

At most K shards are loaded at a time. The pinned ones stay for the model's lifetime; the rest
pass through K - len(pinned) slots. A background loader thread walks the streamed shards in run
order, cyclically (the next pass, the next generated token, starts where this one ended), and
keeps up to P shards loaded ahead of the one computing; the compute side releases each shard as
soon as it has run, which frees a slot for the loader.

On CPU a shard's weights stay in its external-data file: ONNX Runtime memory-maps external data,
and with weight prepacking off (``session.disable_prepacking``) it computes straight from the
mapping instead of copying the weights, so a loaded shard costs its file's pages and dropping its
session unmaps them. The loader reads the file ahead (``posix_fadvise`` then a read-through), so
by the time the compute reaches a shard its pages sit in the page cache: a model larger than RAM
runs with peak RSS that follows K, not the model.

On CUDA, activations stay on the device between shards (IOBinding, OrtValue); only the model's
outputs come back to the host.

Every pass holds ``run``'s lock, so one model serves concurrent callers correctly (their passes
are serialised; activations never mix).
"""

from __future__ import annotations

import os
import threading
import time
import weakref
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from slimml.errors import ArtifactError, SlimmlError
from slimml.runtime.budget import StreamPlan
from slimml.runtime.feeds import check_feeds
from slimml.runtime.manifest import FileEntry, Manifest, safe_path, verify_file
from slimml.runtime.session import make_session, run_shard, session_options

_READ_CHUNK = 16 << 20


@dataclass
class StreamStats:
    """Counters since the model was loaded (or since :meth:`StreamEngine.reset_stats`).

    ``wait_s`` is time the compute side sat blocked on a shard not loaded yet; ``load_s`` is the
    loader thread's time reading and opening shards (mostly hidden behind compute when P >= 1).
    """

    passes: int = 0
    shards_loaded: int = 0
    bytes_loaded: int = 0
    load_s: float = 0.0
    wait_s: float = 0.0
    compute_s: float = 0.0
    peak_streamed: int = 0  # most streamed shards loaded at once (pinned ones come on top)

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        for k in ("load_s", "wait_s", "compute_s"):
            d[k] = round(d[k], 4)
        if self.passes:
            d["bytes_per_pass"] = self.bytes_loaded // self.passes
        return d


class _Loader:
    """The background thread and the state it shares with the compute side (no reference back
    to the engine, so an engine that goes out of scope is collected and its thread stopped)."""

    def __init__(self, build: Callable[[int], tuple[Any, int]], order: list[int], slots: int, prefetch: int):
        self.build = build  # shard index -> (session, bytes read)
        self.order = order  # streamed shard indices, in run order
        self.slots = slots
        self.prefetch = prefetch
        self.cv = threading.Condition()
        self.ready: dict[int, Any] = {}  # step -> session; shard order[step % len(order)]
        self.cursor = 0  # the step computing now, or next
        self.next = 0  # the next step to load
        self.error: tuple[int, BaseException] | None = None
        self.closed = False
        self.stats = StreamStats()
        self.thread = threading.Thread(target=self._main, name="slimml-shard-loader", daemon=True)
        self.thread.start()

    def _main(self) -> None:
        while True:
            with self.cv:
                while not self.closed and self.error is None and not (
                    self.next <= self.cursor + self.prefetch and len(self.ready) < self.slots
                ):
                    self.cv.wait()
                if self.closed or self.error is not None:
                    return
                step = self.next
            t0 = time.perf_counter()
            try:
                session, nbytes = self.build(self.order[step % len(self.order)])
            except BaseException as e:  # reported to the compute side, which raises it
                with self.cv:
                    self.error = (step, e)
                    self.cv.notify_all()
                return
            with self.cv:
                if self.closed:
                    return
                # a pass that failed may have skipped past this step while it loaded: drop it
                if step >= self.cursor:
                    self.ready[step] = session
                self.next = max(self.next, step + 1)
                self.stats.shards_loaded += 1
                self.stats.peak_streamed = max(self.stats.peak_streamed, len(self.ready))
                self.stats.bytes_loaded += nbytes
                self.stats.load_s += time.perf_counter() - t0
                self.cv.notify_all()
            session = None  # the ready dict holds it now; a released shard must not linger here

    def take(self, step: int) -> Any:
        """The session for ``step``, waiting for the loader if it is not ready."""
        t0 = time.perf_counter()
        with self.cv:
            while step not in self.ready and self.error is None and not self.closed:
                self.cv.wait()
            self.stats.wait_s += time.perf_counter() - t0
            if step in self.ready:
                return self.ready[step]
        raise self.failure()

    def release(self, step: int) -> None:
        with self.cv:
            session = self.ready.pop(step, None)
        del session  # unmapped here, before the loader may fill the slot
        with self.cv:
            self.cursor = max(self.cursor, step + 1)
            self.cv.notify_all()

    def skip_to(self, step: int) -> None:
        """Abandon the rest of a pass that failed, so the next pass starts at its first shard."""
        with self.cv:
            stale = [s for s in self.ready if s < step]
            dropped = [self.ready.pop(s) for s in stale]
        del dropped
        with self.cv:
            self.cursor = max(self.cursor, step)
            self.next = max(self.next, step)
            self.cv.notify_all()

    def failure(self) -> SlimmlError:
        if self.error is None:
            return SlimmlError("the model was closed; load it again to run it.")
        step, e = self.error
        if isinstance(e, SlimmlError):
            return type(e)(str(e))
        index = self.order[step % len(self.order)]
        return ArtifactError(f"loading shard {index} failed: {type(e).__name__}: {e}. The artifact may be damaged; re-convert it.")

    def close(self) -> None:
        with self.cv:
            self.closed = True
            sessions = list(self.ready.values())
            self.ready.clear()
            self.cv.notify_all()
        del sessions
        if self.thread is not threading.current_thread():
            self.thread.join(timeout=30)


class StreamEngine:
    """Runs a manifest's shards under a :class:`StreamPlan`. :func:`slimml.runtime.load` makes one."""

    def __init__(self, folder: Path, manifest: Manifest, device: str, threads: int | None, plan: StreamPlan,
                 verify: bool = True):
        self.folder = folder
        self.manifest = manifest
        self.device = device
        self.threads = threads
        self.plan = plan
        self._lock = threading.Lock()
        self._drop_after = manifest.last_uses()
        self._pinned = {i: make_session(folder / manifest.shards[i].file, device, threads) for i in plan.pinned}
        self._loader: _Loader | None = None
        if plan.streamed:
            slots = plan.resident - len(plan.pinned)
            opener = _Opener(folder, manifest, device, threads, verify)
            self._loader = _Loader(opener, list(plan.streamed), slots, plan.prefetch)
            weakref.finalize(self, self._loader.close)

    # -- running ---------------------------------------------------------------------------------

    def run(self, feeds: Mapping[str, np.ndarray], device_outputs: bool = False) -> dict[str, Any]:
        """One pass over all shards; see :meth:`slimml.runtime.Model.run`."""
        env: dict[str, Any] = check_feeds(feeds, self.manifest.inputs)
        loader = self._loader
        with self._lock:
            if loader is not None and (loader.error is not None or loader.closed):
                raise loader.failure()
            first = loader.cursor if loader else 0
            step = first
            try:
                for shard in self.manifest.shards:
                    if shard.index in self._pinned:
                        self._run_shard(shard, self._pinned[shard.index], env)
                    else:
                        self._run_shard(shard, loader.take(step), env)
                        loader.release(step)
                        step += 1
            finally:
                if loader is not None and step < first + len(loader.order):
                    loader.skip_to(first + len(loader.order))
            if loader is not None:
                loader.stats.passes += 1
        out = {t.name: env[t.name] for t in self.manifest.outputs}
        if self.device == "cuda" and not device_outputs:
            out = {k: v.numpy() if hasattr(v, "numpy") else v for k, v in out.items()}
        return out

    def _run_shard(self, shard, session, env: dict[str, Any]) -> None:
        t0 = time.perf_counter()
        call = (lambda names, feeds: _run_bound(session, names, feeds)) if self.device == "cuda" else session.run
        run_shard(shard, call, env, self._drop_after[shard.index])
        if self._loader is not None:
            self._loader.stats.compute_s += time.perf_counter() - t0

    @property
    def stats(self) -> StreamStats:
        if self._loader is None:
            return StreamStats()
        with self._loader.cv:
            return StreamStats(**asdict(self._loader.stats))

    def reset_stats(self) -> None:
        if self._loader is not None:
            with self._loader.cv:
                self._loader.stats = StreamStats()

    def close(self) -> None:
        """Stop the loader thread and drop every session."""
        if self._loader is not None:
            self._loader.close()
        self._pinned.clear()


class _Opener:
    """Checks, reads ahead and opens one streamed shard (the loader thread's work)."""

    def __init__(self, folder: Path, manifest: Manifest, device: str, threads: int | None, verify: bool):
        self.folder, self.manifest, self.device, self.threads = folder, manifest, device, threads
        self.entries = {f.path: f for f in manifest.files}
        # what each file looked like when load() hashed it: a change mid-stream means re-hashing
        self.seen = {p: _stamp(folder, p) for p in self.entries} if verify else None

    def __call__(self, index: int) -> tuple[Any, int]:
        shard = self.manifest.shards[index]
        nbytes = 0
        for rel in (shard.file, shard.data):
            if rel is None:
                continue
            self._recheck(rel)
            nbytes += _read_ahead(safe_path(self.folder, rel))
        path = self.folder / shard.file
        if self.device == "cpu":
            so = session_options(self.threads)
            # compute from the memory-mapped external data instead of copying weights into packed
            # buffers: the shard then costs its file's pages, released when the session goes
            so.add_session_config_entry("session.disable_prepacking", "1")
            return _open(path, so, ["CPUExecutionProvider"]), nbytes
        return make_session(path, self.device, self.threads), nbytes

    def _recheck(self, rel: str) -> None:
        """Re-hash a file whose size, mtime or inode changed since it was verified."""
        if self.seen is None:
            return
        stamp = _stamp(self.folder, rel)
        if stamp != self.seen.get(rel):
            entry: FileEntry = self.entries[rel]
            verify_file(self.folder, entry)  # raises IntegrityError naming the file
            self.seen[rel] = _stamp(self.folder, rel)


def _run_bound(session, names: list[str], feeds: dict[str, Any]) -> list[Any]:
    """Run on CUDA with IOBinding: inputs may be host arrays or device OrtValues from an earlier
    shard; outputs stay on the device as OrtValues."""
    binding = session.io_binding()
    for name, value in feeds.items():
        if isinstance(value, np.ndarray):
            binding.bind_cpu_input(name, value)
        else:
            binding.bind_ortvalue_input(name, value)
    for name in names:
        binding.bind_output(name, "cuda")
    session.run_with_iobinding(binding)
    return binding.get_outputs()


def _open(path: Path, so, providers):
    import onnxruntime as ort

    try:
        return ort.InferenceSession(os.fspath(path), sess_options=so, providers=providers)
    except Exception as e:
        raise ArtifactError(
            f"ONNX Runtime could not load {path}: {str(e).strip().splitlines()[0]}. The file is not a "
            "valid ONNX model for this onnxruntime; re-convert it."
        ) from None


def _read_ahead(path: Path) -> int:
    """Bring a file into the page cache (so the compute's page faults are cheap); return its size."""
    with open(path, "rb", buffering=0) as f:
        size = os.fstat(f.fileno()).st_size
        if hasattr(os, "posix_fadvise"):
            os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_WILLNEED)
            os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_SEQUENTIAL)
        buf = bytearray(min(_READ_CHUNK, max(size, 1)))
        view = memoryview(buf)
        while f.readinto(view):
            pass
    return size


def _stamp(folder: Path, rel: str) -> tuple[int, int, int] | None:
    try:
        st = safe_path(folder, rel).stat()
    except OSError:
        return None
    return (st.st_size, st.st_mtime_ns, st.st_ino)
