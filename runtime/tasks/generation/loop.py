"""The decode loop's passes over the engine: the prompts once, then one position a token.

Two kinds of decoder artifact:

- ``--task text-generation-with-past`` (recommended): inputs ``input_ids``, ``attention_mask``,
  ``position_ids`` and ``past_key_values.N.key/value``; outputs ``logits`` and ``present.N.*``.
  The splitter routes each layer's past/present to that layer's shard, so the cache lives beside
  the streamed layers: the prompt is one pass, and each new token one pass over one position.
- ``--task text-generation`` (cache-free): each new token is one pass over the whole sequence.

The prompts were checked once (:mod:`~slimml.runtime.tasks.generation.prompts`), so every pass goes
through ``Engine.run_trusted``: no feed checks, no NaN scan of the cache, per token. The mask,
positions and (cache-free) sequence are allocated once for prompt + new tokens; each pass feeds
a view of them. Only the last position's logits are kept.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from slimml.errors import SlimmlError


class CacheLoop:
    """:class:`DecodeLoop`'s passes through the engine's in-place cache (``Engine.kv_cache``: an
    artifact whose attention shares past and present, ``--exporter fused``): nothing is copied
    or concatenated per token. Prompts of one length only (a fused batch is not padded).

    Args:
        cache: the engine's :class:`~slimml.runtime.engine.kv_cache.KVCache` for this generation.
        prompts: token ids per prompt, all of one length.
    """

    def __init__(self, cache: Any, prompts: list[list[int]]):
        self.cache = cache
        self.pending = np.asarray(prompts, dtype=np.int64)  # (B, P), then (B, 1) each step
        self.passes = 0

    def next_logits(self) -> np.ndarray:
        """Run the next pass; the last position's logits, (B, vocab)."""
        b, s = self.pending.shape
        logits = self.cache.step(self.pending, np.ones((b, self.cache.length + s), dtype=np.int64))
        self.passes += 1
        return logits[:, -1, :]

    def append(self, ids: np.ndarray) -> None:
        """The next token of every prompt, (B,): fed by the next pass."""
        self.pending = np.asarray(ids, dtype=np.int64).reshape(-1, 1)


def decode_loop(engine: Any, prompts: list[list[int]], pad_id: int, steps: int) -> CacheLoop | DecodeLoop:
    """The fastest loop the artifact allows: its in-place cache where it has one and the prompts
    are of one length, else :class:`DecodeLoop`.

    Raises:
        SlimmlError: prompts of different lengths for an artifact whose attention cannot take a
            padded batch (``--exporter fused``).
    """
    from slimml.runtime.engine.kv_cache import shares_buffers

    if not shares_buffers(engine):
        return DecodeLoop(engine, prompts, pad_id, steps)
    if len(set(map(len, prompts))) != 1:
        raise SlimmlError(f"the artifact {engine.folder} runs fused attention (--exporter fused), which takes a batch of "
                          "prompts of one length; generate prompts of different lengths one at a time, or convert with "
                          "--exporter optimum.")
    return CacheLoop(engine.kv_cache(len(prompts), len(prompts[0]) + steps), prompts)


class DecodeLoop:
    """Passes of one batch of left-padded prompts through ``engine``.

    Args:
        engine: the model's :class:`~slimml.runtime.engine.engine.Engine`.
        prompts: token ids per prompt (checked).
        pad_id: the id that left-pads shorter prompts (masked out).
        steps: new tokens to make room for.

    Example:
        >>> loop = DecodeLoop(model.engine, [[1, 2, 3]], pad_id=0, steps=8)
        >>> logits = loop.next_logits()  # (1, vocab): the prompt's pass
        >>> loop.append(logits.argmax(-1))  # then one position a pass
    """

    def __init__(self, engine: Any, prompts: list[list[int]], pad_id: int, steps: int):
        self.engine = engine
        specs = {t.name: t for t in engine.inputs}
        if "input_ids" not in specs or "logits" not in {t.name for t in engine.outputs}:
            raise SlimmlError(f"the artifact {engine.folder} is a {engine.manifest.task!r} model without input_ids -> "
                              "logits; generate() needs a decoder converted with --task text-generation.")
        dtype = {name: np.dtype(specs[name].dtype) for name in ("input_ids", "attention_mask", "position_ids") if name in specs}
        batch, width = len(prompts), max(map(len, prompts))
        total = width + steps  # the longest sequence this generation can reach
        self.seq = np.full((batch, total), pad_id, dtype=dtype["input_ids"])  # (B, P + N)
        self.mask = np.zeros((batch, total), dtype=dtype.get("attention_mask", np.int64))
        for i, p in enumerate(prompts):  # left padding: every prompt's last token sits at column width - 1
            self.seq[i, width - len(p) : width] = p
            self.mask[i, width - len(p) :] = 1  # new tokens are all attended; a finished prompt's are ignored
        self.positions = None
        if "position_ids" in dtype:  # positions count real tokens, as transformers does; pads get 1
            self.positions = np.where(self.mask > 0, np.cumsum(self.mask, axis=1) - 1, 1).astype(dtype["position_ids"])
        self.has_mask = "attention_mask" in specs
        self.length = width  # columns filled so far
        self.passes = 0
        self.cache = _empty_cache(engine, batch)  # None for a cache-free artifact
        self._outputs = ["logits", *(_present(n) for n in self.cache or ())]

    def next_logits(self) -> np.ndarray:
        """Run the next pass (the prompts first); return the last position's logits, (B, vocab)."""
        end = self.length
        start = end - 1 if self.cache is not None and self.passes else 0  # with a cache, only the new position
        feeds = {"input_ids": _rows(self.seq, start, end)}
        if self.has_mask:
            feeds["attention_mask"] = _rows(self.mask, 0, end)
        if self.positions is not None:
            feeds["position_ids"] = _rows(self.positions, start, end)
        if self.cache is not None:
            feeds.update(self.cache)
        out = self.engine.run_trusted(feeds, self._outputs)
        self.passes += 1
        if self.cache is not None:  # the present of this pass is the past of the next
            self.cache = {name: out[_present(name)] for name in self.cache}
        return out["logits"][:, -1, :]  # (B, T, vocab) -> (B, vocab)

    def append(self, ids: np.ndarray) -> None:
        """Add the next token of every prompt, (B,), to the sequence."""
        if self.length == self.seq.shape[1]:
            raise SlimmlError(f"the decode loop made room for {self.seq.shape[1]} positions and they are full; "
                              "ask for more max_new_tokens.")
        self.seq[:, self.length] = ids
        self.length += 1


def _rows(a: np.ndarray, start: int, end: int) -> np.ndarray:
    """Columns [start, end) of every row, C-contiguous (a view at batch 1; a small copy above)."""
    return np.ascontiguousarray(a[:, start:end])


def _present(past: str) -> str:
    return past.replace("past_key_values.", "present.", 1)


def _empty_cache(engine: Any, batch: int) -> dict[str, np.ndarray] | None:
    """A zero-length cache per ``past_key_values.*`` input (the first pass has no past), or None."""
    outputs = {t.name for t in engine.outputs}
    cache = {}
    for t in engine.inputs:
        if not t.name.startswith("past_key_values."):
            continue
        if _present(t.name) not in outputs:
            raise SlimmlError(f"the artifact takes {t.name} but outputs no matching present.*; re-convert it.")
        if not all(isinstance(d, int) for d in t.shape[1:2] + t.shape[3:]):
            raise SlimmlError(f"cannot tell the cache shape of {t.name} ({t.shape}); re-convert the model.")
        shape = [batch, t.shape[1], 0, *t.shape[3:]]  # (B, kv_heads, past=0, head_dim)
        cache[t.name] = np.zeros(shape, dtype=np.dtype(t.dtype))
    return cache or None
