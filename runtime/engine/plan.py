"""The execution plan: built once by ``load``, walked by every ``run``.

A plan is a list of segments over the artifact's shards, in order:

- a **resident** segment holds consecutive shards loaded once. Its shards are merged into one
  graph (:mod:`slimml.runtime.engine.merge`) and run as one ONNX Runtime session: a model that fits
  runs as a single graph, weights read from the shards' own hashed data files. If ONNX Runtime
  refuses the merged graph, the segment runs its shards one session each and says so once.
- a **streamed** segment holds consecutive shards whose weights pass through K slots, filled
  ahead by :mod:`slimml.runtime.engine.stream`. Each shard's session is compiled once by the plan's
  weight source: :class:`PackedSlots` (CPU on Linux: ONNX Runtime's pre-packed weights in cached
  files, paged in by the slot and dropped after) or :class:`FedSlots` (weights as graph inputs,
  fed from memory-mapped data files: other platforms, or ``pack=False``) or :class:`CudaSlots`
  (on CUDA: each shard's data file copied to device memory by the loader thread, its weights
  bound through IOBinding where they sit).

``load(path)`` gives one resident segment; ``load(path, resident=K, pin=[0, -1])`` gives
resident segments for the pinned shards and streamed ones between them. ``model.plan.describe()``
prints the segments. Every segment keeps the contract :class:`~slimml.runtime.engine.contracts.Segment`
(pipeline stages on Ray actors are a segment too: :mod:`slimml.scale.segment`). The device is the
plan's backend (:mod:`slimml.runtime.engine.backends`); activations stay on it between segments.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Collection
from pathlib import Path
from typing import TYPE_CHECKING, Any

from slimml.errors import ArtifactError, IntegrityError, SlimmlError
from slimml.runtime.artifact.files import safe_path
from slimml.runtime.artifact.manifest import Manifest
from slimml.runtime.engine.backends import Backend, backend_for
from slimml.runtime.engine.budget import StreamPlan, refit
from slimml.runtime.engine.contracts import Segment, WeightSource
from slimml.runtime.engine.merge import merge_shards
from slimml.runtime.engine.session import Step
from slimml.runtime.engine.stream import Streamer, StreamStats

if TYPE_CHECKING:
    from slimml.runtime.engine.config import LoadConfig

log = logging.getLogger("slimml")


class ResidentSegment:
    """Consecutive shards loaded once, merged into one session when ONNX Runtime accepts it."""

    kind = "resident"

    def __init__(self, folder: Path, manifest: Manifest, indices: list[int], backend: Backend, threads: int | None,
                 spinning: bool, drop_after: dict[int, list[str]]):
        self.shards = indices
        self.merged = False
        self.steps: list[Step] = []
        if len(indices) > 1:
            label = f"shards {indices[0]}-{indices[-1]} (merged)"
            try:
                graph = merge_shards(folder, manifest, indices).SerializeToString()
                session = backend.session(graph, backend.session_options(threads, spinning, folder), what=label)
            except ArtifactError as e:
                log.warning("slimml: running shards %d-%d one session each: they could not be merged into one graph "
                            "(%s)", indices[0], indices[-1], str(e).rstrip("."))
            else:
                ins, outs = manifest.segment_io(indices)
                drop = [n for i in indices for n in drop_after[i]]
                self.steps = [Step(label, [t.name for t in ins], [t.name for t in outs], drop, session, backend)]
                self.merged = True
                return
            spinning = False  # several sessions now share the cores
        for i in indices:
            s = manifest.shards[i]
            options = backend.session_options(threads, spinning, shared_arena=not spinning)
            session = backend.session(safe_path(folder, s.file), options)
            self.steps.append(Step(f"shard {i} ({s.file})", [t.name for t in s.inputs], [t.name for t in s.outputs],
                                   drop_after[i], session, backend))

    @property
    def sessions(self) -> int:
        return len(self.steps)

    def run(self, env: dict[str, Any], streamer: Streamer | None) -> None:
        for step in self.steps:
            step.run(env)

    def describe(self) -> str:
        how = "merged into one session" if self.merged else (
            "one session" if len(self.shards) == 1 else "one session per shard (the merge was refused)")
        return f"{_span(self.shards)}: resident, {how}"

    def check_files(self, deep: bool = False) -> None:
        """Nothing: the engine watches (and re-hashes) the files it loaded for this segment."""

    def close(self) -> None:
        self.steps = []


class StreamedSegment:
    """Consecutive shards whose weights stream through slots; sessions compiled once by ``source``."""

    kind = "streamed"

    def __init__(self, manifest: Manifest, indices: list[int], backend: Backend, threads: int | None,
                 spinning: bool, drop_after: dict[int, list[str]], source: WeightSource):
        self.shards = indices
        self.source = source
        self.steps: dict[int, Step] = {}
        for i in indices:
            s = manifest.shards[i]
            session = source.compile(i, threads, spinning)
            self.steps[i] = Step(f"shard {i} ({s.file})", [t.name for t in s.inputs], [t.name for t in s.outputs],
                                 drop_after[i], session, backend, source.names.get(i))

    @property
    def sessions(self) -> int:
        return len({id(step.session) for step in self.steps.values()})  # layers of one type share one

    def run(self, env: dict[str, Any], streamer: Streamer | None) -> None:
        for i in self.shards:
            slot = streamer.take(i)
            t0 = time.perf_counter()
            try:
                self.steps[i].run(env, slot.weights)
            finally:
                streamer.release(time.perf_counter() - t0)

    def check_files(self, deep: bool = False) -> None:
        """The weight source's own files (the pre-packed cache): ``deep`` re-hashes them."""
        self.source.check_cache(deep)

    def describe(self) -> str:
        return f"{_span(self.shards)}: streamed through the slots, sessions compiled once; {self.source.how}"

    def close(self) -> None:
        self.steps = {}


class ExecutionPlan:
    """What ``load`` decided: the memory plan (K, P, pinned) and the segments that carry it out.

    ``run`` walks the segments; a plan with streamed segments serialises passes (one cursor over
    the slots), a fully resident one lets threads run at once.

    Raises:
        TypeError: a segment that does not keep the :class:`~slimml.runtime.engine.contracts.Segment` contract.
    """

    def __init__(self, memory: StreamPlan, backend: Backend | str, segments: list[Segment],
                 streamer: Streamer | None):
        self.memory = memory
        self.backend = backend_for(backend)
        for seg in segments:
            if not isinstance(seg, Segment):
                missing = [m for m in ("kind", "shards", "sessions", "run", "describe", "check_files", "close")
                           if not hasattr(seg, m)]
                raise TypeError(f"{type(seg).__name__} is not a plan segment: it lacks {', '.join(missing)}")
        self.segments = segments
        self.streamer = streamer
        self.closed = False
        self._lock = threading.Lock() if streamer is not None else None
        self._copies_out = self.backend.device_values  # outputs may sit on the device: copied to the host
        self._only: Step | None = None  # a plan of one session: run() calls it directly
        if len(segments) == 1 and isinstance(segments[0], ResidentSegment) and len(segments[0].steps) == 1:
            # nothing to hand on: a plain session call, host arrays in and out (the segment's own
            # step still keeps outputs on the device, for run(keep=...))
            self._only = dataclasses.replace(segments[0].steps[0], on_device=False)

    @property
    def device(self) -> str:
        """The device's name (the backend's, as ``load(device=...)`` takes it)."""
        return self.backend.name

    # the memory plan's figures, as a caller reads them off the plan
    streaming = property(lambda self: self.memory.streaming)
    resident = property(lambda self: self.memory.resident)
    prefetch = property(lambda self: self.memory.prefetch)
    pinned = property(lambda self: self.memory.pinned)
    streamed = property(lambda self: self.memory.streamed)
    peak_bytes = property(lambda self: self.memory.peak_bytes)
    model_bytes = property(lambda self: self.memory.model_bytes)
    sizes = property(lambda self: self.memory.sizes)

    @property
    def sessions(self) -> int:
        return sum(s.sessions for s in self.segments)

    def run(self, env: dict[str, Any], outputs: list[str], keep: Collection[str] = ()) -> dict[str, Any]:
        """One pass over the segments on checked feeds ``env`` (updated in place, except by a plan of
        one session, which is called with it directly).

        ``keep``: outputs to hand back as the backend's device values (on CUDA, OrtValues in GPU
        memory that a later call binds where they sit); the rest come back as host arrays. On a
        backend without device values it changes nothing.
        """
        only = self._only
        if only is not None and outputs == only.outputs and len(env) == len(only.inputs) and not (
                keep and self._copies_out):  # feeds = its inputs
            return only.call(env)
        try:
            if self._lock is None:
                for seg in self.segments:
                    seg.run(env, None)
            else:
                with self._lock, self.streamer.one_pass():
                    for seg in self.segments:
                        seg.run(env, self.streamer)
            if self._copies_out:
                to_host = self.backend.to_host
                return {name: env[name] if name in keep else to_host(env[name]) for name in outputs}
            return {name: env[name] for name in outputs}
        except Exception:
            if self.closed:  # closed by another thread during this pass: its segments went away under it
                raise SlimmlError("the model was closed; load it again to run it.") from None
            raise

    def describe(self) -> str:
        """The plan in a few lines: the memory plan (K, P, pinned), then each segment.

        Example:
            >>> print(load("artifacts/all-MiniLM-L6-v2").plan.describe())
            fully resident: all 7 shards loaded once (90.36 MB).
            plan on cpu: 1 segment(s), 1 session(s)
              shards 0-6: resident, merged into one session
        """
        lines = [self.memory.describe(), f"plan on {self.device}: {len(self.segments)} segment(s), {self.sessions} session(s)"]
        lines += [f"  {seg.describe()}" for seg in self.segments]
        return "\n".join(lines)

    def check_files(self, deep: bool = False) -> None:
        """Segments that own their files (pipeline stages, perhaps on other machines) check them:
        ``deep`` re-hashes, else a ``stat`` each. The engine checks the files it loaded itself."""
        for seg in self.segments:
            seg.check_files(deep)

    @property
    def stats(self) -> StreamStats:
        """Streaming counters since load (or :meth:`reset_stats`); all zero for a resident plan."""
        return self.streamer.stats if self.streamer is not None else StreamStats()

    def reset_stats(self) -> None:
        """Set the streaming counters back to zero."""
        if self.streamer is not None:
            self.streamer.reset_stats()

    def close(self) -> None:
        self.closed = True
        if self.streamer is not None:
            self.streamer.close()
        for seg in self.segments:
            seg.close()
        self.segments = []
        self._only = None


def build_plan(folder: Path, manifest: Manifest, memory: StreamPlan, config: LoadConfig,
               backend: Backend | None = None) -> ExecutionPlan:
    """Segments for ``memory``: runs of resident shards (all of them when nothing streams) and
    runs of streamed shards, each made ready to run once, here.

    ``config.threads`` sizes the sessions; streamed shards take their weights from the
    backend's source (:meth:`Backend.weight_source`: ``config.pack``, ``config.verify`` and
    ``config.cache_dir`` apply there). ``backend`` defaults to ``config.device``'s.
    """
    backend = backend or backend_for(config.device)
    threads = config.threads
    streamed = set(memory.streamed)
    runs: list[tuple[bool, list[int]]] = []
    for s in manifest.shards:
        if runs and runs[-1][0] == (s.index in streamed):
            runs[-1][1].append(s.index)
        else:
            runs.append((s.index in streamed, [s.index]))
    # one session owns the cores and may spin between ops (ORT's default); several that run one
    # after another must not, or the idle pools steal the cores of the one computing, and they
    # share one activation arena (docs/runtime.md)
    spinning = len(runs) == 1 and not streamed
    drop_after = manifest.last_uses()
    source = backend.weight_source(folder, manifest, config) if streamed else None

    def streamed_with(source: WeightSource) -> dict[int, StreamedSegment]:
        return {n: StreamedSegment(manifest, idx, backend, threads, spinning, drop_after, source)
                for n, (is_streamed, idx) in enumerate(runs) if is_streamed}

    resident = {n: ResidentSegment(folder, manifest, idx, backend, threads, spinning, drop_after)
                for n, (is_streamed, idx) in enumerate(runs) if not is_streamed}
    packing_failed = None
    try:
        moving = streamed_with(source)
    except ArtifactError as e:
        fallback = None if isinstance(e, IntegrityError) else backend.fallback_source(folder, manifest, config)
        if fallback is None or type(fallback) is type(source):
            raise
        log.warning("slimml: streaming weights as graph inputs (slower decoding): packing them failed (%s)",
                    str(e).rstrip("."))
        packing_failed = str(e).split(";")[0].rstrip(".")  # its cause, without the fixes the fallback itself took
        source = fallback
        moving = streamed_with(source)  # the resident segments stay as built
    segments = [resident.get(n) or moving[n] for n in range(len(runs))]
    loaded = getattr(source, "loaded_bytes", None)  # what a slot holds, known once the shards are ready (pre-packed)
    kept = getattr(source, "kept_bytes", None)  # what sessions hold outside the slots (fed 4-bit weights)
    unpacked = getattr(source, "unpacked_bytes", None)  # what a fed 4-bit matmul unpacks to as it runs (CPU)
    if loaded is not None or kept is not None or unpacked is not None:
        try:
            memory = refit(memory, loaded() if loaded else {}, manifest, config.resident, kept() if kept else None,
                           unpacked() if unpacked else None, packing_failed)
        except BaseException:
            for seg in segments:
                seg.close()
            raise
    streamer = None
    if streamed:
        streamer = Streamer(source.fill, list(memory.streamed), memory.resident - len(memory.pinned), memory.prefetch)
    return ExecutionPlan(memory, backend, segments, streamer)


def _span(indices: list[int]) -> str:
    return f"shard {indices[0]}" if len(indices) == 1 else f"shards {indices[0]}-{indices[-1]}"
