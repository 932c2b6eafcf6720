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
    cache.step(next_ids[:, None], mask)               # one position per row
"""

from __future__ import annotations

import time
from contextlib import nullcontext
from typing import TYPE_CHECKING, Any

import numpy as np
import onnxruntime as ort

from slimml.errors import FeedError

if TYPE_CHECKING:
    from slimml.runtime.engine.engine import Engine
    from slimml.runtime.engine.session import Step

PAST = "past_key_values."
PRESENT = "present."
FUSED_EXPORTERS = ("fused",)  # graphs whose attention shares past and present (GroupQueryAttention)


def shares_buffers(engine: Engine) -> bool:
    """True when the artifact's attention can read and write its cache in one buffer."""
    return engine.manifest.source.get("exporter") in FUSED_EXPORTERS


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
        # the rotary tables of a fused graph hold max_position_embeddings rows
        limit = engine.max_sequence_length or engine.manifest.source.get("max_position_embeddings")
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
            buf = np.zeros((batch, t.shape[1], capacity, t.shape[3]), dtype=np.dtype(t.dtype))
            value = ort.OrtValue.ortvalue_from_numpy(buf)  # shares buf's memory
            self.buffers[t.name] = buf
            self._values[t.name] = self._values[PRESENT + t.name[len(PAST):]] = value
        self._outputs = [t.name for t in engine.manifest.outputs if not t.name.startswith(PRESENT)]
        self._bindings: dict[int, Any] = {}  # id(step) -> its IOBinding, the cache bound once

    @property
    def nbytes(self) -> int:
        return sum(b.nbytes for b in self.buffers.values())

    def step(self, input_ids: np.ndarray, attention_mask: np.ndarray) -> np.ndarray:
        """One pass over ``input_ids`` (B, S), its cache read and extended in place.

        Args:
            input_ids: int64 (B, S): the prompt on the first pass, then one new token per row.
            attention_mask: int64 (B, length + S), 1 for real tokens (rows right-padded or full).

        Returns:
            The logits, (B, S, vocab).

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
        self.engine._check_watch()  # a file changed since load is refused, as by run()
        env: dict[str, Any] = {"input_ids": np.ascontiguousarray(input_ids, dtype=np.int64),
                               "attention_mask": np.ascontiguousarray(attention_mask, dtype=np.int64)}
        plan = self.engine.plan
        streamer = plan.streamer
        with plan._lock or nullcontext(), streamer.one_pass() if streamer is not None else nullcontext():
            for seg in plan.segments:
                if seg.kind == "resident":
                    for st in seg.steps:
                        self._run(st, env)
                else:
                    for i in seg.shards:
                        slot = streamer.take(i)
                        t0 = time.perf_counter()
                        try:
                            self._run(seg.steps[i], env, slot.weights)
                        finally:
                            streamer.release(time.perf_counter() - t0)
        self.length += s
        logits = env["logits"]
        return logits.numpy() if isinstance(logits, ort.OrtValue) else logits

    def _run(self, st: Step, env: dict[str, Any], weights: dict | None = None) -> None:
        names = st.names or {}
        binding = self._bindings.get(id(st))
        if binding is None or weights is not None:  # a streamed step's weights change slot each pass
            binding = st.session.io_binding()
            for name in [*st.inputs, *st.outputs]:
                if name in self._values:
                    bind = binding.bind_ortvalue_input if name in st.inputs else binding.bind_ortvalue_output
                    bind(names.get(name, name), self._values[name])
            if weights is None:
                self._bindings[id(st)] = binding
        for name in st.inputs:
            if name in self._values:
                continue
            value = env[name]
            if isinstance(value, ort.OrtValue):
                binding.bind_ortvalue_input(names.get(name, name), value)
            else:
                binding.bind_cpu_input(names.get(name, name), value)
        for name, value in (weights or {}).items():
            binding.bind_cpu_input(names.get(name, name), value)
        fresh = [n for n in st.outputs if n not in self._values]
        for name in fresh:
            binding.bind_output(names.get(name, name), "cpu")
        try:
            st.session.run_with_iobinding(binding)
        except Exception as e:  # onnxruntime's own exception classes
            raise st._error(e) from None
        # get_outputs lists the outputs in the order first bound: the cache's, then the fresh ones
        values = binding.get_outputs()[-len(fresh):] if fresh else []
        env.update(zip(fresh, values))
        for name in st.drop:
            env.pop(name, None)
