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
prints the segments. The device (CPU or CUDA) is the plan's; activations stay on it between
segments.
"""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

from slimml.errors import ArtifactError, ConfigError, IntegrityError
from slimml.runtime.engine.budget import StreamPlan
from slimml.runtime.engine.cuda_slots import CudaSlots
from slimml.runtime.artifact.manifest import Manifest, safe_path
from slimml.runtime.engine.merge import merge_shards
from slimml.runtime.engine.packed import PackedSlots
from slimml.runtime.engine.packed import supported as packed_supported
from slimml.runtime.engine.session import Step, make_session, session_options
from slimml.runtime.engine.slots import FedSlots
from slimml.runtime.engine.stream import Streamer, StreamStats

log = logging.getLogger("slimml")


class ResidentSegment:
    """Consecutive shards loaded once, merged into one session when ONNX Runtime accepts it."""

    kind = "resident"

    def __init__(self, folder: Path, manifest: Manifest, indices: list[int], device: str, threads: int | None,
                 spinning: bool, drop_after: dict[int, list[str]]):
        self.shards = indices
        self.merged = False
        self.steps: list[Step] = []
        if len(indices) > 1:
            label = f"shards {indices[0]}-{indices[-1]} (merged)"
            try:
                graph = merge_shards(folder, manifest, indices).SerializeToString()
                session = make_session(graph, device, options=session_options(threads, spinning, folder), what=label)
            except ArtifactError as e:
                log.warning("slimml: running shards %d-%d one session each: they could not be merged into one graph "
                            "(%s)", indices[0], indices[-1], str(e).rstrip("."))
            else:
                ins, outs = manifest.segment_io(indices)
                drop = [n for i in indices for n in drop_after[i]]
                self.steps = [Step(label, [t.name for t in ins], [t.name for t in outs], drop, session, device)]
                self.merged = True
                return
            spinning = False  # several sessions now share the cores
        for i in indices:
            s = manifest.shards[i]
            options = session_options(threads, spinning, shared_arena=not spinning, device=device)
            session = make_session(safe_path(folder, s.file), device, options=options)
            self.steps.append(Step(f"shard {i} ({s.file})", [t.name for t in s.inputs], [t.name for t in s.outputs],
                                   drop_after[i], session, device))

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


class StreamedSegment:
    """Consecutive shards whose weights stream through slots; sessions compiled once by ``source``."""

    kind = "streamed"

    def __init__(self, manifest: Manifest, indices: list[int], device: str, threads: int | None, spinning: bool,
                 drop_after: dict[int, list[str]], source):
        self.shards = indices
        self.source = source
        self.steps: dict[int, Step] = {}
        for i in indices:
            s = manifest.shards[i]
            session = source.compile(i, device, threads, spinning)
            self.steps[i] = Step(f"shard {i} ({s.file})", [t.name for t in s.inputs], [t.name for t in s.outputs],
                                 drop_after[i], session, device, source.names.get(i))

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
        if hasattr(self.source, "check_cache"):
            self.source.check_cache(deep)

    def describe(self) -> str:
        how = ("pre-packed weights mapped from the cache and paged in and out" if isinstance(self.source, PackedSlots)
               else "weights copied to device slots and bound in place" if isinstance(self.source, CudaSlots)
               else "weights fed from memory-mapped data files")
        return f"{_span(self.shards)}: streamed through the slots, sessions compiled once; {how}"


class ExecutionPlan:
    """What ``load`` decided: the memory plan (K, P, pinned) and the segments that carry it out.

    ``run`` walks the segments; a plan with streamed segments serialises passes (one cursor over
    the slots), a fully resident one lets threads run at once.
    """

    def __init__(self, memory: StreamPlan, device: str, segments: list, streamer: Streamer | None):
        self.memory = memory
        self.device = device
        self.segments = segments
        self.streamer = streamer
        self._lock = threading.Lock() if streamer is not None else None
        self._only: Step | None = None  # a plan of one session: run() calls it directly
        if len(segments) == 1 and isinstance(segments[0], ResidentSegment) and len(segments[0].steps) == 1:
            segments[0].steps[0].on_device = False  # nothing to hand on: run as a plain session.run, host arrays in and out
            self._only = segments[0].steps[0]

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

    def run(self, env: dict[str, Any], outputs: list[str]) -> dict[str, np.ndarray]:
        """One pass over the segments on checked feeds ``env`` (updated in place, except by a plan of
        one session, which is called with it directly)."""
        only = self._only
        if only is not None and outputs == only.outputs and len(env) == len(only.inputs):  # feeds = its inputs
            return only.call(env)
        if self._lock is None:
            for seg in self.segments:
                seg.run(env, None)
        else:
            with self._lock, self.streamer.one_pass():
                for seg in self.segments:
                    seg.run(env, self.streamer)
        out = {name: env[name] for name in outputs}
        if self.device == "cuda":
            out = {k: v.numpy() if hasattr(v, "numpy") else v for k, v in out.items()}
        return out

    def describe(self) -> str:
        lines = [self.memory.describe(), f"plan on {self.device}: {len(self.segments)} segment(s), {self.sessions} session(s)"]
        lines += [f"  {seg.describe()}" for seg in self.segments]
        return "\n".join(lines)

    def check_files(self, deep: bool = False) -> None:
        """Segments that own their files (pipeline stages, perhaps on other machines) check them:
        ``deep`` re-hashes, else a ``stat`` each. The model checks the files it loaded itself."""
        for seg in self.segments:
            if hasattr(seg, "check_files"):
                seg.check_files(deep)

    @property
    def stats(self) -> StreamStats:
        return self.streamer.stats if self.streamer is not None else StreamStats()

    def reset_stats(self) -> None:
        if self.streamer is not None:
            self.streamer.reset_stats()

    def close(self) -> None:
        if self.streamer is not None:
            self.streamer.close()
        for seg in self.segments:
            if hasattr(seg, "close"):  # pipeline stages: actors to stop
                seg.close()
        self.segments = []


def build_plan(folder: Path, manifest: Manifest, device: str, threads: int | None, memory: StreamPlan,
               verify: bool = True, pack: bool | None = None, cache_dir: Path | None = None) -> ExecutionPlan:
    """Segments for ``memory``: runs of resident shards (all of them when nothing streams) and
    runs of streamed shards, each made ready to run once, here.

    ``pack``: stream pre-packed weights (:mod:`slimml.runtime.engine.packed`); None packs where it can
    (CPU on Linux), False feeds weights as inputs (:class:`FedSlots`).
    """
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
    source = _weight_source(folder, manifest, device, verify, pack, cache_dir) if streamed else None

    def streamed_with(source) -> dict[int, StreamedSegment]:
        return {n: StreamedSegment(manifest, idx, device, threads, spinning, drop_after, source)
                for n, (is_streamed, idx) in enumerate(runs) if is_streamed}

    resident = {n: ResidentSegment(folder, manifest, idx, device, threads, spinning, drop_after)
                for n, (is_streamed, idx) in enumerate(runs) if not is_streamed}
    try:
        moving = streamed_with(source)
    except ArtifactError as e:
        if not isinstance(source, PackedSlots) or pack or isinstance(e, IntegrityError):
            raise
        log.warning("slimml: streaming weights as graph inputs (slower decoding): packing them failed (%s)",
                    str(e).rstrip("."))
        source = FedSlots(folder, manifest, verify)
        moving = streamed_with(source)  # the resident segments stay as built
    segments = [resident.get(n) or moving[n] for n in range(len(runs))]
    streamer = None
    if streamed:
        streamer = Streamer(source.fill, list(memory.streamed), memory.resident - len(memory.pinned), memory.prefetch)
    return ExecutionPlan(memory, device, segments, streamer)


def _weight_source(folder: Path, manifest: Manifest, device: str, verify: bool, pack: bool | None,
                   cache_dir: Path | None):
    why = "it runs on CPU only" if device != "cpu" else packed_supported()
    if pack and why:
        raise ConfigError(f"pack=True cannot be honoured: {why}. Use pack=None (the default) or pack=False.")
    if device == "cuda":
        return CudaSlots(folder, manifest, verify)
    if pack is False or why:
        return FedSlots(folder, manifest, verify)
    return PackedSlots(folder, manifest, cache_dir, verify)


def _span(indices: list[int]) -> str:
    return f"shard {indices[0]}" if len(indices) == 1 else f"shards {indices[0]}-{indices[-1]}"

