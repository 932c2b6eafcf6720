"""A decoder's KV cache in buffers the engine owns, bound in place for every pass of a generation.

For a graph whose attention is ONNX Runtime's ``GroupQueryAttention`` (``convert --exporter
fused``), past and present of each layer are one buffer: ``(batch, kv_heads, capacity, head_dim)``,
allocated once per generation for the prompt plus the new tokens. Each pass binds the buffer as
``past_key_values.N.*`` and as ``present.N.*`` through IOBinding; the kernel writes the new
positions into it and reads the old ones where they lie. Nothing of the cache is copied,
re-allocated, concatenated or checked for NaN between tokens; activations that pass from one
shard's session to the next stay ONNX Runtime values.

This works for every plan: a resident model (one merged session, or a session per shard) and a
streamed one, whose shards' sessions take their weights from the slots as usual while each
layer's cache stays in memory beside it (a layer's cache is bound to the shard that owns it).

The hook a decode loop calls is :meth:`Engine.kv_cache` (engine.py)::

    cache = model.kv_cache(batch=B, capacity=prompt_len + max_new_tokens)   # None: not a fused graph
    logits = cache.step(input_ids, attention_mask)    # (B, S) ids, (B, cache.length + S) mask
    ...                                               # -> logits (B, S, vocab); cache.length += S
    cache.step(next_ids[:, None], mask, at=zeros)     # one position per row -> (B, vocab)

Rows at positions of their own (prompts of different lengths, a continuous batch) use ``run``: a
pass over a block of rows, each row's positions read from its mask's sum (``seqlens_k``), the
caller keeping each row's length; ``move_row`` copies a row's cache into another row::

    logits = cache.run(ids, mask, rows=(0, live), at=last)   # (live, S) ids, mask (live, W), W <= capacity
                                                               # -> (live, vocab) at each row's position ``last``
"""

from __future__ import annotations

import mmap
import time
from contextlib import nullcontext
from typing import TYPE_CHECKING, Any

import numpy as np
import onnxruntime as ort

from slimml.errors import FeedError
from slimml.runtime.engine.feeds import LOGITS_INDEX
from slimml.runtime.engine.session import SHRINK_ARENA

if TYPE_CHECKING:
    from slimml.runtime.artifact.manifest import Manifest
    from slimml.runtime.engine.engine import Engine
    from slimml.runtime.engine.session import Step

PAST = "past_key_values."
PRESENT = "present."


def position_limit(engine: Engine) -> int | None:
    """The most positions a sequence may hold (a fused graph's rotary tables hold
    ``max_position_embeddings`` rows); None where the artifact does not say."""
    return engine.max_sequence_length or engine.manifest.source.get("max_position_embeddings")


def rope_switch(engine: Engine) -> int | None:
    """A LongRoPE graph's switch (``convert.fused_llama.rope_facts``): a pass over more than one
    position whose sequence is longer takes the long factors at every position, so a prompt pass
    keeps the rows on either side of it apart. None for any other graph."""
    switch = engine.manifest.source.get("rope_switch")
    return int(switch) if switch else None


def rope_reprefill(engine: Engine) -> bool:
    """Whether a single sequence that first grows past the LongRoPE switch is run again whole (Phi-3)."""
    return bool(engine.manifest.source.get("rope_switch") and engine.manifest.source.get("rope_reprefill"))


def prompt_blocks(lengths: np.ndarray, switch: int | None) -> list[tuple[int, int]]:
    """The prompt pass over rows of ``lengths`` split into runs of rows on one side of a LongRoPE
    ``switch`` ((start, stop) pairs; one run without a switch)."""
    if not switch or len(lengths) == 0:
        return [(0, len(lengths))]
    long = np.asarray(lengths) > switch
    cuts = [0, *(int(i) + 1 for i in np.flatnonzero(long[1:] != long[:-1])), len(lengths)]
    return list(zip(cuts[:-1], cuts[1:]))


PREFILL_CHUNK = 512  # positions of one row's prompt pass: a longer prompt is prefilled in passes of this many


def prefill_chunk(engine: Engine) -> int:
    """Positions a long prompt is prefilled in a pass: :data:`PREFILL_CHUNK`, four times that for a
    streamed plan (each pass reads the weights again), 0 (one pass) for a LongRoPE graph (whose
    keys depend on the length of the pass that made them: prefilled whole)."""
    if rope_switch(engine):
        return 0
    return PREFILL_CHUNK * (4 if engine.plan.streaming else 1)


def prefill_alone(cache: KVCache, row: int, ids: list[int] | np.ndarray, done: int = 0, chunk: int | None = None) -> np.ndarray:
    """``ids[done:]`` into ``row`` of ``cache`` (its first ``done`` positions hold ``ids[:done]``),
    in passes of at most ``chunk`` positions (default :func:`prefill_chunk`; 0: one pass): after a
    cache, a pass over several positions runs at batch 1. Attention's scores then take chunk x
    positions per head, not the prompt's square. The last position's logits, (1, vocab)."""
    chunk = prefill_chunk(cache.engine) if chunk is None else chunk
    ids = np.asarray(ids, dtype=np.int64)
    end = done
    while True:
        start, end = end, len(ids) if not chunk else min(len(ids), end + chunk)
        logits = cache.run(ids[None, start:end], np.ones((1, end), dtype=np.int64), rows=(row, row + 1),
                           at=np.array([end - start - 1]))
        if end == len(ids):
            return logits


FUSED_EXPORTERS = ("fused",)  # graphs whose attention shares past and present (GroupQueryAttention)


def shares_buffers(engine: Engine) -> bool:
    """True when the artifact's attention can read and write its cache in one buffer (a fused
    graph: by its exporter, or by the ``logits_index`` input only that graph takes)."""
    return cache_in_place(engine.manifest)


def cache_in_place(manifest: Manifest) -> bool:
    """:func:`shares_buffers`, read from the manifest alone (before anything loads)."""
    return manifest.source.get("exporter") in FUSED_EXPORTERS or any(t.name == LOGITS_INDEX for t in manifest.inputs)


def takes_logits_index(engine: Engine) -> bool:
    """True when the graph computes logits only at the positions its ``logits_index`` names."""
    return any(t.name == LOGITS_INDEX for t in engine.manifest.inputs)



MAPPED_BYTES = 1 << 20  # buffers this large are mapped zero pages of their own


def zeroed(shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
    """A zero-filled array; from ``MAPPED_BYTES`` up, on anonymous pages of its own (unmapped when the
    array goes), which the kernel zeroes as they are first touched: a cache buffer costs only the
    positions written. ``np.zeros`` from a thread other than the main one takes glibc's per-thread
    arena, whose trimmed heap ``calloc`` must clear: a serve worker's 16-row cache of SmolLM2
    (60 buffers, 189 MB) took 70 ms to make there against 5 ms on the main thread, on every
    request's first pass after the batch had emptied."""
    nbytes = int(np.prod(shape)) * dtype.itemsize
    if nbytes < MAPPED_BYTES:
        return np.zeros(shape, dtype=dtype)
    return np.frombuffer(mmap.mmap(-1, nbytes), dtype=dtype).reshape(shape)

class KVCache:
    """One generation's cache: ``step`` runs one pass of the engine's plan with it bound in place.

    Args:
        engine: the loaded decoder (its plan's sessions run the passes).
        batch: rows of the generation.
        capacity: positions the cache holds (prompt + new tokens); a pass beyond it is refused.

    Attributes:
        length: positions filled so far (the next pass's past length).
    """

    def __init__(self, engine: Engine, batch: int, capacity: int):
        limit = position_limit(engine)
        if limit and capacity > limit:
            raise FeedError(f"a cache of {capacity} positions is longer than the model's {limit}; "
                            "ask for fewer new tokens or a shorter prompt.")
        self.engine = engine
        self.batch = batch
        self.capacity = capacity
        self.length = 0
        self.buffers: dict[str, np.ndarray] = {}  # past name -> (B, kv_heads, capacity, head_dim)
        self._values: dict[str, ort.OrtValue] = {}  # past and present names -> the same OrtValue
        for t in engine.manifest.inputs:
            if not t.name.startswith(PAST):
                continue
            buf = zeroed((batch, t.shape[1], capacity, t.shape[3]), np.dtype(t.dtype))
            value = ort.OrtValue.ortvalue_from_numpy(buf)  # shares buf's memory
            self.buffers[t.name] = buf
            self._values[t.name] = self._values[PRESENT + t.name[len(PAST):]] = value
        self._outputs = [t.name for t in engine.manifest.outputs if not t.name.startswith(PRESENT)]
        self._indexed = takes_logits_index(engine)
        self._blocks: dict[tuple[int, int], dict[str, ort.OrtValue]] = {}  # (start, stop) -> values over those rows
        self._bindings: dict[tuple[int, int, int], Any] = {}  # (id(step), start, stop) -> its IOBinding, bound once

    @property
    def nbytes(self) -> int:
        return sum(b.nbytes for b in self.buffers.values())

    def step(self, input_ids: np.ndarray, attention_mask: np.ndarray, at: np.ndarray | None = None) -> np.ndarray:
        """One pass over ``input_ids`` (B, S), its cache read and extended in place.

        Args:
            input_ids: int64 (B, S): the prompt on the first pass, then one new token per row.
            attention_mask: int64 (B, length + S), 1 for real tokens (rows right-padded or full).
            at: int (B,): the one position of each row whose logits are wanted (as in :meth:`run`).

        Returns:
            The logits, (B, vocab) at ``at``; (B, S, vocab) without it.

        Raises:
            FeedError: shapes that do not fit this cache.
        """
        b, s = input_ids.shape
        if b != self.batch or attention_mask.shape != (b, self.length + s):
            raise FeedError(f"cache step: input_ids {input_ids.shape} and attention_mask {attention_mask.shape} do not "
                            f"fit a cache of batch {self.batch} holding {self.length} positions; the mask must be "
                            f"(batch, {self.length} + new positions).")
        if self.length + s > self.capacity:
            raise FeedError(f"the cache holds {self.capacity} positions and is full ({self.length} + {s}); "
                            "make it with a larger capacity.")
        logits = self.run(input_ids, attention_mask, at=at)
        self.length += s
        return logits

    def run(self, input_ids: np.ndarray, attention_mask: np.ndarray, rows: tuple[int, int] | None = None,
            at: np.ndarray | None = None) -> np.ndarray:
        """One pass over rows ``[start, stop)`` of the cache (all rows by default), each row's
        positions taken from its mask: the caller keeps each row's length (``length`` is not moved).

        The rows of a pass are one contiguous block of the buffers, bound as a batch of their own:
        a batch keeps its live rows first and runs only those. A pass over more than one position
        per row must be those rows' first (GroupQueryAttention's limit), its prompts right-padded.

        Args:
            input_ids: int64 (b, S), b = stop - start.
            attention_mask: int64 (b, W), W <= capacity: row i holds ``sum(mask[i])`` positions after
                this pass (its past plus its S new ones); only the sums and the width matter.
            rows: ``(start, stop)``, a block of the cache's rows.
            at: int (b,): the one position of each row whose logits are wanted (its last real one);
                a graph that takes ``logits_index`` computes only those.

        Returns:
            The logits, (b, vocab) at ``at``; (b, S, vocab) without it.
        """
        start, stop = rows or (0, self.batch)
        if not 0 <= start < stop <= self.batch or input_ids.shape[0] != stop - start or attention_mask.shape[0] != stop - start \
                or attention_mask.shape[1] > self.capacity:
            raise FeedError(f"cache pass over rows {start}:{stop}: input_ids {input_ids.shape} and attention_mask "
                            f"{attention_mask.shape} do not fit a cache of {self.batch} rows and {self.capacity} positions; "
                            "give rows inside the cache, as many rows of ids and mask as they span, and a mask no wider "
                            "than its positions.")
        self.engine._check_watch()  # a file changed since load is refused, as by run()
        env: dict[str, Any] = {"input_ids": np.ascontiguousarray(input_ids, dtype=np.int64),
                               "attention_mask": np.ascontiguousarray(attention_mask, dtype=np.int64)}
        if self._indexed:  # the graph computes logits only at the positions it is given
            b, s = input_ids.shape
            env[LOGITS_INDEX] = (np.asarray(at, dtype=np.int64).reshape(b, 1) if at is not None
                                 else np.broadcast_to(np.arange(s, dtype=np.int64), (b, s)).copy())
        values = self._block(start, stop)
        # a prompt pass allocates S-long activations (and (b, S, vocab) logits from a graph without
        # logits_index): give that arena memory back when the pass ends, so a burst of long prompts
        # does not stay as the process's size
        run_options = SHRINK_ARENA if input_ids.shape[1] > 1 else None  # prompt passes give their arena back
        plan = self.engine.plan
        streamer = plan.streamer
        with plan._lock or nullcontext(), streamer.one_pass() if streamer is not None else nullcontext():
            for seg in plan.segments:
                if seg.kind == "resident":
                    for st in seg.steps:
                        self._run(st, env, values, (start, stop), None, run_options)
                else:
                    for i in seg.shards:
                        slot = streamer.take(i)
                        t0 = time.perf_counter()
                        try:
                            self._run(seg.steps[i], env, values, (start, stop), slot.weights, run_options)
                        finally:
                            streamer.release(time.perf_counter() - t0)
        logits = env["logits"]
        logits = logits.numpy() if isinstance(logits, ort.OrtValue) else logits
        if at is None:
            return logits
        return logits[:, 0] if self._indexed else logits[np.arange(len(logits)), np.asarray(at)]

    def move_row(self, src: int, dst: int, positions: int) -> None:
        """Copy row ``src``'s first ``positions`` cached positions into row ``dst`` (a batch that
        keeps its live rows first fills the hole a finished row left)."""
        if src != dst:
            for buf in self.buffers.values():
                buf[dst, :, :positions] = buf[src, :, :positions]

    def _block(self, start: int, stop: int) -> dict[str, ort.OrtValue]:
        """Past and present names -> OrtValues over rows [start, stop) of the buffers (made once)."""
        if (start, stop) == (0, self.batch):
            return self._values
        values = self._blocks.get((start, stop))
        if values is None:
            values = {}
            for name, buf in self.buffers.items():  # rows of a (B, h, L, d) C-order buffer: one contiguous block
                values[name] = values[PRESENT + name[len(PAST):]] = ort.OrtValue.ortvalue_from_numpy(buf[start:stop])
            self._blocks[(start, stop)] = values
        return values

    def _run(self, st: Step, env: dict[str, Any], cache: dict[str, ort.OrtValue], rows: tuple[int, int],
             weights: dict | None = None, run_options: ort.RunOptions | None = None) -> None:
        names = st.names or {}
        key = (id(st), *rows)
        binding = self._bindings.get(key)
        if binding is None or weights is not None:  # a streamed step's weights change slot each pass
            binding = st.session.io_binding()
            for name in [*st.inputs, *st.outputs]:
                if name in cache:
                    bind = binding.bind_ortvalue_input if name in st.inputs else binding.bind_ortvalue_output
                    bind(names.get(name, name), cache[name])
            if weights is None:
                self._bindings[key] = binding
        for name in st.inputs:
            if name in cache:
                continue
            value = env[name]
            if isinstance(value, ort.OrtValue):
                binding.bind_ortvalue_input(names.get(name, name), value)
            else:
                binding.bind_cpu_input(names.get(name, name), value)
        for name, value in (weights or {}).items():
            binding.bind_cpu_input(names.get(name, name), value)
        fresh = [n for n in st.outputs if n not in cache]
        for name in fresh:
            binding.bind_output(names.get(name, name), "cpu")
        try:
            st.session.run_with_iobinding(binding, run_options)
        except Exception as e:  # onnxruntime's own exception classes
            raise st._error(e) from None
        # get_outputs lists the outputs in the order first bound: the cache's, then the fresh ones
        values = binding.get_outputs()[-len(fresh):] if fresh else []
        env.update(zip(fresh, values))
        for name in st.drop:
            env.pop(name, None)
