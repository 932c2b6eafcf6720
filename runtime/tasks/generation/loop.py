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
from slimml.runtime.engine.kv_cache import prefill_alone, prefill_chunk, prompt_blocks
from slimml.runtime.tasks.generation.prefix import PrefixStore
from slimml.runtime.tasks.limits import a_or_an


class CacheLoop:
    """:class:`DecodeLoop`'s passes through the engine's in-place cache (``Engine.kv_cache``: an
    artifact whose attention shares past and present, ``--exporter fused``): nothing is copied
    or concatenated per token.

    Prompts of different lengths are one batch: right-padded in the first pass (from an empty
    cache, as GroupQueryAttention needs; where the longest is past ``prefill_chunk`` positions,
    each prompt alone in passes of that many, so that attention's scores stay chunk x positions a
    head), each row's logits taken at its last real position, then
    one position per row per pass, each row at its own position (from its mask's sum). Rows that
    finish leave the pass: the live rows are kept first in the cache (a finished row's place is
    filled by the last live row's cache) and only they run.

    A LongRoPE graph (``rope_switch``) prefills the prompts on either side of its switch in passes
    of their own, and where the model's generate does so (Phi-3, ``reprefill``), a single sequence
    that first grows past the switch is run again whole, as transformers and onnxruntime-genai do
    at batch 1 (in a batch, its cache keeps the short factors' keys).

    One prompt with a :class:`~slimml.runtime.tasks.generation.prefix.PrefixStore` (the model's):
    the positions it shares with text read before are copied from the store and only the rest is
    prefilled; the prompt is stored once prefilled, and its whole text by :meth:`remember`.

    Args:
        cache: the engine's :class:`~slimml.runtime.engine.kv_cache.KVCache` for this generation.
        prompts: token ids per prompt.
        switch: the graph's LongRoPE switch, or None.
        reprefill: run a single sequence again whole when it first grows past ``switch``.
        prefix: where one prompt's cache is looked up and kept (None, several prompts, or a
            LongRoPE graph: prefilled whole).
    """

    def __init__(self, cache: Any, prompts: list[list[int]], switch: int | None = None, reprefill: bool = False,
                 prefix: PrefixStore | None = None):
        self.cache = cache
        self.prefix = prefix if prefix is not None and prefix.budget > 0 and len(prompts) == 1 and not switch else None
        self.prompt = [int(t) for t in prompts[0]] if self.prefix is not None else None
        self.cached = 0  # prompt positions copied from ``prefix``
        self.switch = switch
        self.history = [int(t) for t in prompts[0]] if reprefill and switch and len(prompts) == 1 else None
        batch, width = len(prompts), max(map(len, prompts))
        self.lengths = np.array([len(p) for p in prompts], dtype=np.int64)  # (B,) positions each prompt holds
        self.pending = np.zeros((batch, width), dtype=np.int64)  # (B, W) right-padded, then (B, 1) each step
        for i, p in enumerate(prompts):
            self.pending[i, : len(p)] = p
        self.slot = np.arange(batch)  # prompt -> its cache row; the live prompts hold rows [0, live)
        self.order = list(range(batch))  # cache row -> prompt
        self.live = batch
        self.passes = 0
        self.chunk = prefill_chunk(cache.engine)  # a prompt longer than this is prefilled in passes of it

    def next_logits(self) -> np.ndarray:
        """Run the next pass; each prompt's last position's logits, (B, vocab) (zeros for finished ones)."""
        live = self.order[: self.live]
        if self.passes == 0 and self.prefix is not None:
            last = self._after_prefix()
        elif self.passes == 0 and self.chunk and self.pending.shape[1] > self.chunk:  # long prompts: each alone, in chunks
            last = np.concatenate([prefill_alone(self.cache, r, self.pending[r, :n], chunk=self.chunk)
                                   for r, n in enumerate(self.lengths)])
        elif self.passes == 0:
            last = np.concatenate([self._prompts(start, stop) for start, stop in prompt_blocks(self.lengths, self.switch)])
        elif self.history is not None and self.lengths[0] == self.switch:  # growing past the switch: all again
            seq = np.array([self.history], dtype=np.int64)
            last = self.cache.run(seq, _mask(self.lengths + 1), rows=(0, 1), at=self.lengths.copy())
            self.lengths += 1
        else:
            seen = self.lengths[live] + 1  # each row's positions after this pass
            last = self.cache.run(self.pending[live], _mask(seen), rows=(0, self.live), at=np.zeros(len(live), dtype=np.int64))
            self.lengths[live] += 1
        self.passes += 1
        if self.live == len(self.order):
            return last
        out = np.zeros((len(self.order), last.shape[-1]), dtype=last.dtype)
        out[live] = last
        return out

    def _prompts(self, start: int, stop: int) -> np.ndarray:
        """The prompt pass over rows [start, stop) (from their empty cache): their last positions' logits."""
        seen = self.lengths[start:stop]
        width = int(seen.max()) if (start, stop) != (0, len(self.lengths)) else self.pending.shape[1]
        return self.cache.run(self.pending[start:stop, :width], _mask(seen, width), rows=(start, stop), at=seen - 1)

    def _after_prefix(self) -> np.ndarray:
        """The one prompt's pass over what the store does not hold (all of it when it holds
        nothing), its stored positions copied first; the prompt is stored after."""
        last, self.cached = self.prefix.prefill(self.cache, 0, self.prompt, self.prefix.match(self.prompt))
        self.prefix.read(self.prompt, self.cache.buffers, 0)
        return last

    def remember(self, tokens: list[list[int]]) -> None:
        """The generation ended with ``tokens`` per prompt: store the one prompt's whole text (its
        positions in the cache) for the prompts that begin with it."""
        if self.prefix is not None and self.passes:
            self.prefix.keep([*self.prompt, *tokens[0]], self.cache.buffers, 0, int(self.lengths[0]))

    def append(self, ids: np.ndarray) -> None:
        """The next token of every prompt, (B,): fed by the next pass (finished prompts' are ignored)."""
        self.pending = np.asarray(ids, dtype=np.int64).reshape(-1, 1)
        if self.history is not None:
            self.history.append(int(self.pending[0, 0]))

    def take_prefill(self, small: CacheLoop, repeat: int) -> None:
        """This loop's prompts are ``small``'s, each ``repeat`` times in a row (beam search's rows), and
        ``small`` ran its first pass: take that pass's cache for every copy instead of running it again."""
        held = int(small.lengths.max())
        for name, buf in self.cache.buffers.items():
            buf[:, :, :held] = np.repeat(small.cache.buffers[name][:, :, :held], repeat, axis=0)
        self.lengths = np.repeat(small.lengths, repeat)
        self.passes = small.passes

    def reorder(self, rows: np.ndarray) -> None:
        """Each row takes row ``rows[i]``'s cache and length (beam search's survivors; every row live)."""
        rows = np.asarray(rows)
        moved = np.flatnonzero(rows != np.arange(len(rows)))  # only the rows that take another's (a copy is read first)
        if not len(moved):
            return
        self.lengths = self.lengths[rows]
        held = int(self.lengths.max())
        for buf in self.cache.buffers.values():
            buf[moved, :, :held] = buf[rows[moved], :, :held]

    def finish(self, prompts: list[int]) -> None:
        """``prompts`` are done: their rows leave the passes (the last live rows move into their places)."""
        for p in prompts:
            row = int(self.slot[p])
            if row >= self.live:
                continue
            last = self.live - 1
            moved = self.order[last]
            if row != last:  # the last live row fills the hole, its cache with it
                self.cache.move_row(last, row, int(self.lengths[moved]))
                self.order[row], self.order[last] = moved, p
                self.slot[moved], self.slot[p] = row, last
            self.live -= 1


def _mask(seen: np.ndarray, width: int | None = None) -> np.ndarray:
    """A mask (b, width) whose row i sums to ``seen[i]`` (the graph reads only the sums and the
    width); ``width`` defaults to the longest row."""
    width = int(seen.max()) if width is None else width
    return (np.arange(width)[None, :] < seen[:, None]).astype(np.int64)


def decode_loop(engine: Any, prompts: list[list[int]], pad_id: int, steps: int,
                prefix: PrefixStore | None = None, row_steps: list[int] | None = None) -> CacheLoop | DecodeLoop:
    """The fastest loop the artifact allows: its in-place cache where it has one (``--exporter
    fused``; one prompt reuses what ``prefix`` holds), else :class:`DecodeLoop` (for one prompt
    with guessed positions: :func:`~slimml.runtime.tasks.generation.lookup.lookup_loop`).
    ``row_steps``: each prompt's own most new tokens, where they differ (at most ``steps``)."""
    from slimml.runtime.engine.kv_cache import rope_reprefill, rope_switch, shares_buffers

    if not shares_buffers(engine):
        return DecodeLoop(engine, prompts, pad_id, steps)
    room = max(len(p) + s for p, s in zip(prompts, row_steps or [steps] * len(prompts)))
    return CacheLoop(engine.kv_cache(len(prompts), room), prompts, rope_switch(engine), rope_reprefill(engine), prefix)


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
            raise SlimmlError(f"the artifact {engine.folder} is {a_or_an(repr(engine.manifest.task))} model without input_ids -> "
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
            if engine.max_sequence_length:  # a row done at its own end of context runs on with the batch: its
                np.minimum(self.positions, engine.max_sequence_length - 1, out=self.positions)  # ignored ids, in the table
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

    def take_prefill(self, small: DecodeLoop, repeat: int) -> None:
        """This loop's prompts are ``small``'s, each ``repeat`` times in a row (beam search's rows), and
        ``small`` ran its first pass: take that pass's cache for every copy instead of running it again."""
        if small.cache is not None:
            self.cache = {name: np.repeat(v, repeat, axis=0) for name, v in small.cache.items()}
        self.passes = small.passes

    def reorder(self, rows: np.ndarray) -> None:
        """Each row takes row ``rows[i]``'s sequence and cache (beam search's survivors)."""
        rows = np.asarray(rows)
        if np.array_equal(rows, np.arange(len(rows))):
            return
        self.seq, self.mask = self.seq[rows], self.mask[rows]
        if self.positions is not None:
            self.positions = self.positions[rows]
        if self.cache is not None:
            self.cache = {name: np.ascontiguousarray(v[rows]) for name, v in self.cache.items()}

    def finish(self, prompts: list[int]) -> None:
        """``prompts`` are done (a padded batch runs on with every row: nothing to do)."""

    cached = 0  # prompt positions copied from a prefix store: none, a traced graph's cache is not stored

    def remember(self, tokens: list[list[int]]) -> None:
        """Nothing is stored from a traced graph's cache."""

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
