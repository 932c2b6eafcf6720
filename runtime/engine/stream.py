"""Streaming: a background loader fills weight slots ahead of the compute, cyclically.

At most K shards are loaded at a time. The pinned ones stay for the model's lifetime (they run
in resident segments of the plan); the rest pass through K - len(pinned) slots
(:mod:`slimml.runtime.engine.slots`). The loader thread walks the streamed shards in run order,
cyclically (the next pass, the next generated token, starts where this one ended), and keeps up
to P shards filled ahead of the one computing; the compute releases each slot as soon as its
shard has run, which lets the loader refill it. Sessions are never built here: every streamed
shard's session was compiled once at load (:mod:`slimml.runtime.engine.weights`), so a pass costs the
weights' bytes and nothing else.

A pass holds the plan's lock, so one model serves concurrent callers correctly (their passes
are serialised; activations never mix).
"""

from __future__ import annotations

import os
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from typing import Any

from slimml.errors import ArtifactError, SlimmlError
from slimml.runtime.engine.slots import Slot


@dataclass
class StreamStats:
    """Counters since the model was loaded (or since :meth:`Streamer.reset_stats`).

    ``wait_s`` is time the compute side sat blocked on a slot not filled yet; ``load_s`` is the
    loader thread's time mapping and reading shards (mostly hidden behind compute when P >= 1).
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
    to the plan, so a model that goes out of scope is collected and its thread stopped)."""

    def __init__(self, fill: Callable[[int], Slot], order: list[int], slots: int, prefetch: int):
        self.fill = fill  # shard index -> a filled Slot
        self.order = order  # streamed shard indices, in run order
        self.slots = slots
        self.prefetch = prefetch
        self.cv = threading.Condition()
        self.ready: dict[int, Slot] = {}  # step -> slot; shard order[step % len(order)]
        self.cursor = 0  # the step computing now, or next
        self.next = 0  # the next step to load
        self.error: tuple[int, BaseException] | None = None
        self.closed = False
        self.stats = StreamStats()
        self._start()
        _live.add(self)

    def _start(self) -> None:
        self.thread = threading.Thread(target=self._main, name="slimml-shard-loader", daemon=True)
        self.thread.start()

    def _after_fork(self) -> None:
        """In a forked child: the thread did not come along (a pass there would wait for it
        forever), and the parent's threads may have held the condition's lock. A fresh lock and
        thread; the slots filled before the fork are the child's own copies, and stay."""
        self.cv = threading.Condition()
        if not self.closed and self.error is None:
            self._start()

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
                slot = self.fill(self.order[step % len(self.order)])
            except BaseException as e:  # reported to the compute side, which raises it
                with self.cv:
                    self.error = (step, e)
                    self.cv.notify_all()
                return
            with self.cv:
                # closed, or a pass that failed skipped past this step while it loaded: drop it
                if self.closed or step < self.cursor:
                    slot.release()
                    if self.closed:
                        return
                else:
                    self.ready[step] = slot
                self.next = max(self.next, step + 1)
                self.stats.shards_loaded += 1
                self.stats.peak_streamed = max(self.stats.peak_streamed, len(self.ready))
                self.stats.bytes_loaded += slot.nbytes
                self.stats.load_s += time.perf_counter() - t0
                self.cv.notify_all()
            slot = None

    def take(self, step: int) -> Slot:
        """The slot for ``step``, waiting for the loader if it is not filled yet."""
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
            slot = self.ready.pop(step, None)
        if slot is not None:
            slot.release()  # unmapped here, before the loader may fill the slot again
        with self.cv:
            self.cursor = max(self.cursor, step + 1)
            self.cv.notify_all()

    def skip_to(self, step: int) -> None:
        """Abandon the rest of a pass that failed, so the next pass starts at its first shard."""
        with self.cv:
            stale = [self.ready.pop(s) for s in list(self.ready) if s < step]
            self.cursor = max(self.cursor, step)
            self.next = max(self.next, step)
            self.cv.notify_all()
        for slot in stale:
            slot.release()

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
            slots = list(self.ready.values())
            self.ready.clear()
            self.cv.notify_all()
        for slot in slots:
            slot.release()
        if self.thread is not threading.current_thread():
            self.thread.join(timeout=30)


_live: weakref.WeakSet[_Loader] = weakref.WeakSet()  # every loader of this process, for a forked child


def _child_after_fork() -> None:
    for loader in list(_live):
        loader._after_fork()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_child_after_fork)


class Streamer:
    """The streamed shards' slots for a plan: one pass at a time, in run order.

    Args:
        fill: shard index -> a filled :class:`Slot` (``PackedSlots.fill`` or ``FedSlots.fill``), run on the loader thread.
        order: the streamed shard indices in run order.
        slots: K - len(pinned), the slots the streamed shards pass through.
        prefetch: P, slots filled ahead of the one computing.
    """

    def __init__(self, fill: Callable[[int], Slot], order: list[int], slots: int, prefetch: int):
        self._loader = _Loader(fill, order, slots, prefetch)
        self._step = 0
        weakref.finalize(self, self._loader.close)

    @contextmanager
    def one_pass(self) -> Iterator[None]:
        """Bracket one pass: a pass that fails part-way is skipped to its end, so the next pass
        starts at the first streamed shard again."""
        loader = self._loader
        if loader.error is not None or loader.closed:
            raise loader.failure()
        first = self._step = loader.cursor
        try:
            yield
        finally:
            if self._step < first + len(loader.order):
                loader.skip_to(first + len(loader.order))
        loader.stats.passes += 1

    def take(self, index: int) -> Slot:
        slot = self._loader.take(self._step)
        assert slot.index == index, (slot.index, index)  # the loader walks the plan's own order
        return slot

    def release(self, compute_s: float) -> None:
        self._loader.release(self._step)
        self._loader.stats.compute_s += compute_s
        self._step += 1

    @property
    def stats(self) -> StreamStats:
        with self._loader.cv:
            return StreamStats(**asdict(self._loader.stats))

    def reset_stats(self) -> None:
        with self._loader.cv:
            self._loader.stats = StreamStats()

    @property
    def alive(self) -> bool:
        return self._loader.thread.is_alive()

    def close(self) -> None:
        self._loader.close()
