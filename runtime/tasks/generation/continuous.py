"""Continuous batching: sequences join the running batch at the next step and leave when done.

Every pass of the model serves all running sequences at once (for a streamed model each pass reads
the weights once, whoever shares it). A sequence that arrives waits for the current step to end;
the waiting ones are prefilled together in one pass (left-padded), then their caches join the
batch's. One cache holds the whole batch, per layer ``(B, kv_heads, L, head_dim)``, with a mask
``(B, L)`` marking each row's real positions: a row shorter than the batch is left-padded with
masked zeros, which attention ignores, so each sequence decodes as it would alone. Rows that
finish are dropped from the cache at once, and leading columns that no row uses any more are
cut, so memory follows the sequences alive.

Each sequence keeps its own sampler (its seed, temperature, penalty) and its own text stream
(stop strings, incremental text), exactly as :func:`~slimml.runtime.tasks.generate.generate` does
for one prompt: the same seed gives the same answer, batched or alone.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from slimml.errors import SlimmlError
from slimml.runtime.tasks.generation.config import GenerationConfig
from slimml.runtime.tasks.generation.loop import _empty_cache, _present
from slimml.runtime.tasks.generation.prompts import prepare
from slimml.runtime.tasks.generation.sampling import Sampler
from slimml.runtime.tasks.generation.stopping import TextStream

TRIM_AT = 32  # unused leading cache columns tolerated before the cache is cut (a copy)


@dataclass
class Sequence:
    """One request's generation in the batch.

    ``on_text(piece)`` is called (on the batch's thread) with each piece of text as it is made, and
    ``on_done(sequence)`` once at the end; ``cancel()`` makes it leave at the next step.
    """

    ids: list[int]
    config: GenerationConfig
    steps: int
    end_ids: frozenset[int]
    on_text: Callable[[str], None] = lambda piece: None
    on_done: Callable[[Sequence], None] = lambda seq: None
    tokens: list[int] = field(default_factory=list)
    finish_reason: str | None = None  # "stop", "length", "cancelled", or "error"
    error: BaseException | None = None
    submitted: float = field(default_factory=time.perf_counter)
    first_token_s: float | None = None
    sampler: Sampler | None = None
    text: TextStream | None = None
    _cancelled: bool = False

    def cancel(self) -> None:
        """Stop generating (a client that went away): the sequence leaves at the next step."""
        self._cancelled = True

    @property
    def cancelled(self) -> bool:
        return self._cancelled


class ContinuousBatch:
    """The running batch of a causal-LM task: ``admit`` sequences, ``step`` them all, one pass each.

    Not thread-safe by itself: one thread (a server's decode worker) calls ``admit`` and ``step``;
    other threads only ``cancel`` sequences.

    Args:
        model: the causal-LM task (``.engine``, ``.text``, ``.folder``, ``.manifest``).
        max_batch: the most sequences decoding at once.
    """

    def __init__(self, model: Any, max_batch: int = 16):
        self.model = model
        self.engine = model.engine
        self.max_batch = max_batch
        specs = {t.name: t for t in self.engine.inputs}
        if "input_ids" not in specs or "logits" not in {t.name for t in self.engine.outputs}:
            raise SlimmlError(f"the artifact {model.folder} is not a decoder (no input_ids -> logits); continuous "
                              "batching needs one converted with --task text-generation-with-past.")
        names = _empty_cache(self.engine, 1)
        if names is None:
            raise SlimmlError(f"the artifact {model.folder} has no KV cache, so sequences cannot share passes; "
                              "re-convert it with --task text-generation-with-past.")
        from slimml.runtime.engine.kv_cache import shares_buffers

        if shares_buffers(self.engine):  # fused attention takes no padded batch: one answer at a time
            self.max_batch = 1
        self._cache_names = list(names)
        self._outputs = ["logits", *(_present(n) for n in self._cache_names)]
        self._id_dtype = np.dtype(specs["input_ids"].dtype)
        self._has_positions = "position_ids" in specs
        self.rows: list[Sequence] = []
        self.cache: dict[str, np.ndarray] | None = None  # name -> (B, kv_heads, L, head_dim)
        self.mask = np.zeros((0, 0), dtype=np.int64)  # (B, L): 1 where a row has a real position
        self.positions = np.zeros(0, dtype=np.int64)  # (B,): the position of each row's next token
        self.last = np.zeros(0, dtype=np.int64)  # (B,): each row's newest token, fed next step
        self.passes = 0
        self.lock = threading.Lock()  # held by a pass; a reader of the batch's state may take it

    def prepare(self, prompt: str | list[int], config: GenerationConfig, raw_text: bool = False, **hooks) -> Sequence:
        """A :class:`Sequence` for one prompt, checked now (so a bad prompt fails its own request,
        before it meets anyone else's)."""
        job = prepare(self.model, [prompt], config, raw_text)
        seq = Sequence(ids=job.ids[0], config=config, steps=job.steps, end_ids=job.end_ids, **hooks)
        seq.text = TextStream(job.tokenizer, seq.ids, config.stop) if job.tokenizer is not None else None
        return seq

    @property
    def free(self) -> int:
        """Sequences that can join now."""
        return self.max_batch - len(self.rows)

    def admit(self, seqs: list[Sequence]) -> None:
        """Prefill ``seqs`` together in one pass, give each its first token, and add those not
        yet finished to the batch."""
        seqs = [s for s in seqs if not self._left(s)]
        if len(seqs) > self.free:
            raise SlimmlError(f"{len(seqs)} sequences cannot join a batch with room for {self.free}; admit fewer "
                              "(this is a slimml bug).")
        if not seqs:
            return
        width = max(len(s.ids) for s in seqs)
        ids = np.zeros((len(seqs), width), dtype=self._id_dtype)
        mask = np.zeros((len(seqs), width), dtype=np.int64)
        for r, s in enumerate(seqs):  # left padding: each prompt ends at the last column
            ids[r, width - len(s.ids):] = s.ids
            mask[r, width - len(s.ids):] = 1
        feeds = {"input_ids": ids, "attention_mask": mask}
        if self._has_positions:
            feeds["position_ids"] = np.where(mask > 0, np.cumsum(mask, axis=1) - 1, 1).astype(np.int64)
        feeds.update(_empty_cache(self.engine, len(seqs)))
        out = self._pass(feeds, seqs)
        if out is None:
            return
        logits = out["logits"][:, -1, :]  # (k, vocab)
        keep = []
        for r, s in enumerate(seqs):
            s.sampler = Sampler(s.config, [s.ids], logits.shape[-1])
            if self._token(s, logits[r : r + 1]):
                keep.append(r)
        if not keep:
            return
        cache = {n: out[_present(n)][keep] for n in self._cache_names}
        lengths = [len(seqs[r].ids) for r in keep]
        self._join(cache, mask[keep], [seqs[r] for r in keep], lengths)

    def step(self) -> None:
        """One pass over every running sequence: each gets its next token; finished and cancelled
        ones leave the batch."""
        self._drop([r for r, s in enumerate(self.rows) if s.cancelled])
        if not self.rows:
            return
        b = len(self.rows)
        mask = np.concatenate([self.mask, np.ones((b, 1), dtype=self.mask.dtype)], axis=1)  # (B, L + 1)
        feeds = {"input_ids": self.last.reshape(b, 1).astype(self._id_dtype), "attention_mask": mask}
        if self._has_positions:
            feeds["position_ids"] = self.positions.reshape(b, 1).copy()
        feeds.update(self.cache)
        out = self._pass(feeds, self.rows)
        if out is None:
            self.rows, self.cache = [], None
            return
        self.cache = {n: out[_present(n)] for n in self._cache_names}
        self.mask = mask
        self.positions += 1
        logits = out["logits"][:, -1, :]  # (B, vocab)
        done = [r for r, s in enumerate(self.rows) if not self._token(s, logits[r : r + 1])]
        for r, s in enumerate(self.rows):
            if s.tokens:
                self.last[r] = s.tokens[-1]
        self._drop(done)

    def cancel_all(self, error: BaseException | None = None) -> None:
        """End every running sequence (the server is stopping, or a pass failed)."""
        for s in self.rows:
            self._end(s, "error" if error else "cancelled", error)
        self.rows, self.cache = [], None
        self.mask = np.zeros((0, 0), dtype=np.int64)
        self.positions = self.last = np.zeros(0, dtype=np.int64)

    @property
    def cache_bytes(self) -> int:
        """Bytes the batch's KV cache holds now."""
        return sum(a.nbytes for a in (self.cache or {}).values())

    # ---- inside

    def _pass(self, feeds: dict[str, np.ndarray], seqs: list[Sequence]) -> dict[str, np.ndarray] | None:
        try:
            with self.lock:
                out = self.engine.run_trusted(feeds, self._outputs)
        except Exception as e:  # noqa: BLE001 - the pass's failure is each of its sequences' answer
            for s in seqs:
                self._end(s, "error", e)
            return None
        self.passes += 1
        return out

    def _token(self, s: Sequence, logits: np.ndarray) -> bool:
        """Sample ``s``'s next token from its (1, vocab) logits and hand out its text; False once
        ``s`` is finished."""
        token = int(s.sampler(logits)[0])
        if s.first_token_s is None:
            s.first_token_s = time.perf_counter() - s.submitted
        s.tokens.append(token)
        if token in s.end_ids:
            self._emit(s, s.text.finish() if s.text is not None else "")
            return self._end(s, "stop")
        if s.text is not None:
            self._emit(s, s.text.push(token))
            if s.text.stopped:
                return self._end(s, "stop")
        if len(s.tokens) >= s.steps:
            self._emit(s, s.text.finish() if s.text is not None else "")
            return self._end(s, "length")
        s.sampler.add(np.array([token]))
        return not self._left(s)

    def _left(self, s: Sequence) -> bool:
        if s.cancelled and s.finish_reason is None:
            self._end(s, "cancelled")
        return s.finish_reason is not None

    @staticmethod
    def _emit(s: Sequence, piece: str) -> None:
        if piece and not s.cancelled:
            s.on_text(piece)

    @staticmethod
    def _end(s: Sequence, reason: str, error: BaseException | None = None) -> bool:
        if s.finish_reason is None:
            s.finish_reason, s.error = reason, error
            s.on_done(s)
        return False

    def _join(self, cache: dict[str, np.ndarray], mask: np.ndarray, seqs: list[Sequence], lengths: list[int]) -> None:
        """Add prefilled rows (their cache ``(k, h, P, d)`` and mask ``(k, P)``) to the batch,
        left-padding whichever side is shorter."""
        if self.cache is None or not self.rows:
            self.cache, self.mask = cache, mask.astype(np.int64)
            self.positions = np.array(lengths, dtype=np.int64)
            self.last = np.array([s.tokens[-1] for s in seqs], dtype=np.int64)
            self.rows = list(seqs)
            return
        have, new = self.mask.shape[1], mask.shape[1]
        width = max(have, new)
        self.cache = {n: np.concatenate([_left_pad(self.cache[n], width), _left_pad(cache[n], width)], axis=0)
                      for n in self._cache_names}
        self.mask = np.concatenate([_left_pad(self.mask, width), _left_pad(mask.astype(np.int64), width)], axis=0)
        self.positions = np.concatenate([self.positions, np.array(lengths, dtype=np.int64)])
        self.last = np.concatenate([self.last, np.array([s.tokens[-1] for s in seqs], dtype=np.int64)])
        self.rows += seqs

    def _drop(self, rows: list[int]) -> None:
        """Remove ``rows`` from the batch, and cache columns no row uses any more."""
        if rows:
            keep = [r for r in range(len(self.rows)) if r not in set(rows)]
            self.rows = [self.rows[r] for r in keep]
            if not keep:
                self.cache = None
                self.mask = np.zeros((0, 0), dtype=np.int64)
                self.positions = self.last = np.zeros(0, dtype=np.int64)
                return
            self.cache = {n: a[keep] for n, a in self.cache.items()}
            self.mask, self.positions, self.last = self.mask[keep], self.positions[keep], self.last[keep]
        if self.cache is not None and self.mask.size:
            unused = int(np.argmax(self.mask.any(axis=0)))  # leading columns masked in every row
            if unused >= TRIM_AT:
                self.cache = {n: np.ascontiguousarray(a[:, :, unused:]) for n, a in self.cache.items()}
                self.mask = np.ascontiguousarray(self.mask[:, unused:])


def _left_pad(a: np.ndarray, width: int) -> np.ndarray:
    """``a`` (cache ``(B, h, L, d)`` or mask ``(B, L)``) with zero columns before it up to ``width``."""
    axis = 2 if a.ndim == 4 else 1
    short = width - a.shape[axis]
    if short <= 0:
        return a
    pad = [(0, 0)] * a.ndim
    pad[axis] = (short, 0)
    return np.pad(a, pad)
