"""The running batch's KV cache, one class per kind of decoder graph.

:class:`~slimml.runtime.tasks.generation.continuous.ContinuousBatch` keeps the sequences (their
samplers, text, ends); a rows object keeps their cache, one row per sequence in the same order,
and runs the passes:

- :class:`SlotRows`, for a graph whose attention shares past and present (``--exporter fused``,
  GroupQueryAttention): one buffer per layer of ``max_rows`` rows, bound in place
  (:class:`~slimml.runtime.engine.kv_cache.KVCache`). New sequences are prefilled into the free
  rows after the live ones (right-padded, from an empty cache, as GroupQueryAttention needs), then
  every live row decodes in one pass, each at its own position. The live rows stay first: a row
  that leaves is filled by the last live row's cache, and a pass runs only the live rows, so a
  batch of 16 rows with 3 sequences costs what 3 do. The buffer starts small and doubles when a
  row needs more positions, and is freed when the batch empties. A LongRoPE graph's prompts on
  either side of its switch are prefilled apart, and a Phi-3 sequence running alone is run again
  whole when it grows past the switch (as ``generate`` runs it: :class:`~.loop.CacheLoop`).
  With a :class:`~.prefix.PrefixStore`, a prompt that begins with text read before (the same
  system prompt, an earlier turn of the conversation) gets those positions copied into its row
  and only the rest prefilled, alone in its row; every prompt is stored once prefilled, and every
  sequence's whole text when it leaves.
- :class:`GrowingRows`, for a traced graph (optimum, ``present = concat(past, new)``): one cache
  ``(B, kv_heads, L, head_dim)`` left-padded with a mask, concatenated when sequences join, cut
  when they leave.

Both take and give rows in the batch's order: ``reuse(seq)`` says how many of a waiting prompt's
positions are stored already (none for a traced graph), ``prefill(seqs)`` appends rows and returns
their first logits, ``decode(seqs)`` feeds every row its newest token, ``drop(rows, seqs)``
returns the new order as old row indices.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from slimml.errors import SlimmlError
from slimml.runtime.engine.kv_cache import prefill_alone, prefill_chunk, prompt_blocks, rope_reprefill, rope_switch
from slimml.runtime.engine.packed import trim_heap
from slimml.runtime.tasks.generation.lookup import FORCED, Lookahead
from slimml.runtime.tasks.generation.loop import _empty_cache, _mask, _present
from slimml.runtime.tasks.generation.prefix import BLOCK, MIN_REUSE, PrefixStore, common

if TYPE_CHECKING:
    from slimml.runtime.tasks.generation.continuous import Sequence

TRIM_AT = 32  # unused leading cache columns tolerated before a growing cache is cut (a copy)
FIRST_CAPACITY = 256  # positions a slot buffer starts with; it doubles up to the context


class SlotRows:
    """The batch's cache in the engine's in-place buffers (a fused graph).

    Args:
        engine: the decoder's engine (``kv_cache`` gives the buffers).
        max_rows: the most sequences at once.
        context: the most positions one row may reach.
        prefix: where prompts' caches are kept for the prompts that begin with them (None: every
            prompt is prefilled whole). Not for a LongRoPE graph, whose keys depend on the
            length of the pass that made them.
    """

    def __init__(self, engine: Any, max_rows: int, context: int, prefix: PrefixStore | None = None):
        self.engine = engine
        self.max_rows = max_rows
        self.context = context
        self.cache: Any = None  # the KVCache, made at the first prefill and freed when the batch empties
        self.lengths = np.zeros(max_rows, dtype=np.int64)  # positions each row holds
        self.live = 0  # rows [0, live) hold sequences
        self.switch = rope_switch(engine)
        self.lookahead = Lookahead()  # prompt lookup while one row runs alone
        self.reprefill = rope_reprefill(engine)
        self.prefix = prefix if prefix is not None and prefix.budget > 0 and not self.switch else None
        self.chunk = prefill_chunk(engine)  # 0: a prompt is prefilled in one pass (LongRoPE)
        self.filled = 0  # positions of the long prompt being prefilled a chunk a step in the last row (0: none)

    @property
    def nbytes(self) -> int:
        return self.cache.nbytes if self.cache is not None else 0

    def reuse(self, s: Sequence) -> int:
        """Positions of ``s``'s prompt whose cache is stored (kept on ``s`` until its prefill once
        found; looked up again while none is: a prompt that waits may find what was stored since)."""
        if self.prefix is None:
            return 0
        if not s.prefix:
            s.prefix = self.prefix.match(s.ids)
        return len(s.prefix) * BLOCK

    def waits_for(self, s: Sequence, joining: list[Sequence]) -> bool:
        """Whether ``s`` (nothing stored for it) begins as a prompt that joins now does: it then
        waits one step and copies that one's cache (a burst of prompts over one document
        prefills the document once)."""
        return self.prefix is not None and any(common(s.ids, j.ids) >= MIN_REUSE for j in joining)

    def prefill(self, seqs: list[Sequence]) -> np.ndarray:
        """Prefill ``seqs`` into the rows after the live ones: those with no stored prefix in one
        right-padded pass (give them first; each alone in chunks where one is past
        ``prefill_chunk`` positions), each of the others alone after its stored positions; their
        last positions' logits, (k, vocab)."""
        lens = np.array([len(s.ids) for s in seqs], dtype=np.int64)
        start, stop = self.live, self.live + len(seqs)
        self.lookahead.ahead = []  # guessed positions past a row's length are not kept when the buffers grow
        self._room(int(lens.max()) + 1)
        fresh = next((j for j, s in enumerate(seqs) if s.prefix), len(seqs))  # the leading prompts stored nowhere
        if any(not s.prefix for s in seqs[fresh:]):
            raise SlimmlError("prefill: give the prompts without a stored prefix first (this is a slimml bug).")
        parts = []
        if fresh and self.chunk and lens[:fresh].max() > self.chunk:  # long prompts: each alone, in chunks
            parts = [prefill_alone(self.cache, start + j, seqs[j].ids, chunk=self.chunk) for j in range(fresh)]
        for a, b in prompt_blocks(lens[:fresh], self.switch) if fresh and not parts else []:  # LongRoPE: either side of its switch apart
            ids = np.zeros((b - a, int(lens[a:b].max())), dtype=np.int64)
            for r, s in enumerate(seqs[a:b]):
                ids[r, : len(s.ids)] = s.ids
            parts.append(self.cache.run(ids, _mask(lens[a:b]), rows=(start + a, start + b), at=lens[a:b] - 1))
        for j in range(fresh, len(seqs)):
            logits, seqs[j].cached = self.prefix.prefill(self.cache, start + j, seqs[j].ids, seqs[j].prefix)
            parts.append(logits)
        logits = np.concatenate(parts)  # (k, vocab)
        self.lengths[start:stop] = lens
        self.live = stop
        for j, s in enumerate(seqs):
            s.prefix = None
            if self.prefix is not None:
                self.prefix.read(s.ids, self.cache.buffers, start + j)
        return logits

    @property
    def fill_row(self) -> int:
        """The row a long prompt is prefilled in, apart from the live rows (which never reach it
        while it is in use: the batch counts it as taken)."""
        return self.max_rows - 1

    def fill(self, s: Sequence, chunk: int) -> np.ndarray | None:
        """Prefill the next ``chunk`` positions of ``s``'s prompt into :attr:`fill_row` (its stored
        prefix copied in first); once the whole prompt is in, move its row after the live ones and
        return its last position's logits, (1, vocab); None before that."""
        row = self.fill_row
        if not self.filled:  # its first chunk
            self.lookahead.ahead = []  # guessed positions past a row's length are not kept when the buffers grow
            self._room(len(s.ids) + 1)
            if s.prefix:
                self.filled = s.cached = self.prefix.load(s.prefix, self.cache.buffers, row)
        end = min(len(s.ids), self.filled + chunk)
        logits = prefill_alone(self.cache, row, s.ids[:end], self.filled, chunk=0)
        self.filled = end
        if end < len(s.ids):
            return None
        self.lookahead.ahead = []  # a row joins: the one running alone no longer guesses
        self.cache.move_row(row, self.live, end)
        self.lengths[self.live] = end
        if self.prefix is not None:
            self.prefix.read(s.ids, self.cache.buffers, self.live)
        self.live += 1
        s.prefix, self.filled = None, 0
        return logits

    def stop_filling(self) -> None:
        """Forget the prompt being prefilled (its request went away); its row's positions are left."""
        self.filled = 0
        if self.live == 0:
            self.clear()

    def decode(self, seqs: list[Sequence]) -> np.ndarray:
        """One position for every live row: its newest token; the logits, (live, vocab)."""
        live = self.live
        seen = self.lengths[:live] + 1
        self._room(int(seen.max()))
        if self.reprefill and live == 1 and self.lengths[0] == self.switch:  # growing past LongRoPE's switch, alone:
            whole = np.array([[*seqs[0].ids, *seqs[0].tokens]], dtype=np.int64)  # all again, as in-process generate
            logits = self.cache.run(whole, _mask(seen), rows=(0, 1), at=seen - 1)
            self.lengths[:1] = seen
            return logits
        if live == 1 and (seqs[0].config.prompt_lookup or seqs[0].constraint is not None):
            return self._alone(seqs[0])
        self.lookahead.ahead = []
        ids = np.array([s.tokens[-1] for s in seqs], dtype=np.int64).reshape(live, 1)
        logits = self.cache.run(ids, _mask(seen), rows=(0, live), at=np.zeros(live, dtype=np.int64))
        self.lengths[:live] = seen
        return logits

    def _alone(self, s: Sequence) -> np.ndarray:
        """The one running sequence's next logits with prompt lookup (:class:`~.lookup.Lookahead`):
        from the last pass's guessed positions while the sampler chose the guesses, else a pass over
        its newest token and the tokens its format forces or up to ``prompt_lookup`` guessed ones,
        else its plain pass."""
        length, k = int(self.lengths[0]), s.config.prompt_lookup
        logits = self.lookahead.ready(s.tokens[-1])
        if logits is None:
            forced = s.constraint.forced(FORCED) if s.constraint is not None else None
            self._room(min(length + 1 + max(k, len(forced or ())), self.context))
            text = np.array([*s.ids, *s.tokens] if k else s.tokens[-1:], dtype=np.int64)  # the whole text for prompt lookup only
            logits = self.lookahead.run(self.cache, 0, text, length, k, self.switch, forced, s.config.no_repeat_ngram_size)
        if logits is None:
            logits = self.cache.run(np.array([[s.tokens[-1]]], dtype=np.int64), _mask(self.lengths[:1] + 1), rows=(0, 1),
                                    at=np.zeros(1, dtype=np.int64))
        self.lengths[0] += 1
        return logits

    def drop(self, rows: list[int], seqs: list[Sequence]) -> list[int]:
        """Free ``rows`` (of ``seqs``, the batch's sequences in row order; their text is stored
        first): the live rows after the new end move into the holes (their cache with them).
        Returns the new order, old row indices."""
        self.lookahead.ahead = []
        if self.prefix is not None:
            for r in rows:
                s = seqs[r]
                if s.finish_reason != "error":
                    self.prefix.keep([*s.ids, *s.tokens], self.cache.buffers, r, int(self.lengths[r]))
        gone = set(rows)
        n = self.live - len(gone)
        order = list(range(n))
        holes = [r for r in sorted(gone) if r < n]
        movers = [r for r in range(n, self.live) if r not in gone]
        for hole, mover in zip(holes, movers):
            self.cache.move_row(mover, hole, int(self.lengths[mover]))
            self.lengths[hole] = self.lengths[mover]
            order[hole] = mover
        self.live = n
        if n == 0 and not self.filled:
            self.clear()
        return order

    def clear(self) -> None:
        """Free the buffers (the batch is empty), and give the freed heap back to the system."""
        self.lookahead.ahead = []
        had = self.cache is not None
        self.cache, self.live, self.filled = None, 0, 0
        if had:
            trim_heap()

    def _room(self, positions: int) -> None:
        """Buffers that hold ``positions`` per row: made, or doubled with the live rows copied."""
        old = self.cache
        if old is not None and positions <= old.capacity:
            return
        capacity = max(positions, FIRST_CAPACITY) if old is None else max(positions, 2 * old.capacity)
        cache = self.engine.kv_cache(self.max_rows, min(capacity, self.context))
        if old is not None:
            held = int(self.lengths[: self.live].max(initial=0))
            row = self.fill_row
            for name, buf in cache.buffers.items():
                buf[: self.live, :, :held] = old.buffers[name][: self.live, :, :held]
                if self.filled:  # the long prompt's positions so far
                    buf[row, :, : self.filled] = old.buffers[name][row, :, : self.filled]
        self.cache = cache


class GrowingRows:
    """The batch's cache as arrays the graph returns (a traced graph): left-padded, concatenated.

    Args:
        engine: the decoder's engine (``run_trusted`` runs the passes).
    """

    def __init__(self, engine: Any):
        self.engine = engine
        specs = {t.name: t for t in engine.inputs}
        self.names = list(_empty_cache(engine, 1))
        self.outputs = ["logits", *(_present(n) for n in self.names)]
        self.id_dtype = np.dtype(specs["input_ids"].dtype)
        self.has_positions = "position_ids" in specs
        self.clear()

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in (self.cache or {}).values())

    def reuse(self, s: Sequence) -> int:
        """No prefix store for a traced graph: every prompt is prefilled whole."""
        return 0

    def waits_for(self, s: Sequence, joining: list[Sequence]) -> bool:
        return False

    def clear(self) -> None:
        self.cache: dict[str, np.ndarray] | None = None  # name -> (B, kv_heads, L, head_dim)
        self.mask = np.zeros((0, 0), dtype=np.int64)  # (B, L): 1 where a row has a real position
        self.positions = np.zeros(0, dtype=np.int64)  # (B,): the position of each row's next token

    def prefill(self, seqs: list[Sequence]) -> np.ndarray:
        """Prefill ``seqs`` together (left-padded) and append their rows; their last logits, (k, vocab)."""
        width = max(len(s.ids) for s in seqs)
        ids = np.zeros((len(seqs), width), dtype=self.id_dtype)
        mask = np.zeros((len(seqs), width), dtype=np.int64)
        for r, s in enumerate(seqs):  # left padding: each prompt ends at the last column
            ids[r, width - len(s.ids):] = s.ids
            mask[r, width - len(s.ids):] = 1
        feeds = {"input_ids": ids, "attention_mask": mask}
        if self.has_positions:
            feeds["position_ids"] = np.where(mask > 0, np.cumsum(mask, axis=1) - 1, 1).astype(np.int64)
        feeds.update(_empty_cache(self.engine, len(seqs)))
        out = self.engine.run_trusted(feeds, self.outputs)
        self._join({n: out[_present(n)] for n in self.names}, mask, [len(s.ids) for s in seqs])
        return out["logits"][:, -1, :]

    def decode(self, seqs: list[Sequence]) -> np.ndarray:
        """One position for every row: its newest token; the logits, (B, vocab)."""
        b = len(seqs)
        mask = np.concatenate([self.mask, np.ones((b, 1), dtype=self.mask.dtype)], axis=1)  # (B, L + 1)
        last = np.array([s.tokens[-1] for s in seqs], dtype=self.id_dtype).reshape(b, 1)
        feeds = {"input_ids": last, "attention_mask": mask}
        if self.has_positions:
            feeds["position_ids"] = self.positions.reshape(b, 1).copy()
        feeds.update(self.cache)
        out = self.engine.run_trusted(feeds, self.outputs)
        self.cache = {n: out[_present(n)] for n in self.names}
        self.mask = mask
        self.positions += 1
        return out["logits"][:, -1, :]

    def drop(self, rows: list[int], seqs: list[Sequence]) -> list[int]:
        """Remove ``rows``, and cache columns no row uses any more; the kept rows keep their order."""
        keep = [r for r in range(len(self.positions)) if r not in set(rows)]
        if not keep:
            self.clear()
            return []
        if rows:
            self.cache = {n: a[keep] for n, a in self.cache.items()}
            self.mask, self.positions = self.mask[keep], self.positions[keep]
        unused = int(np.argmax(self.mask.any(axis=0)))  # leading columns masked in every row
        if unused >= TRIM_AT:
            self.cache = {n: np.ascontiguousarray(a[:, :, unused:]) for n, a in self.cache.items()}
            self.mask = np.ascontiguousarray(self.mask[:, unused:])
        return keep

    def _join(self, cache: dict[str, np.ndarray], mask: np.ndarray, lengths: list[int]) -> None:
        """Append prefilled rows (cache ``(k, h, P, d)``, mask ``(k, P)``), left-padding the shorter side."""
        if self.cache is None:
            self.cache, self.mask = cache, mask.astype(np.int64)
            self.positions = np.array(lengths, dtype=np.int64)
            return
        width = max(self.mask.shape[1], mask.shape[1])
        self.cache = {n: np.concatenate([_left_pad(self.cache[n], width), _left_pad(cache[n], width)], axis=0)
                      for n in self.names}
        self.mask = np.concatenate([_left_pad(self.mask, width), _left_pad(mask.astype(np.int64), width)], axis=0)
        self.positions = np.concatenate([self.positions, np.array(lengths, dtype=np.int64)])


def _left_pad(a: np.ndarray, width: int) -> np.ndarray:
    """``a`` (cache ``(B, h, L, d)`` or mask ``(B, L)``) with zero columns before it up to ``width``."""
    axis = 2 if a.ndim == 4 else 1
    short = width - a.shape[axis]
    if short <= 0:
        return a
    pad = [(0, 0)] * a.ndim
    pad[axis] = (short, 0)
    return np.pad(a, pad)
