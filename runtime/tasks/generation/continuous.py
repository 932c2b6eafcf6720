"""Continuous batching: sequences join the running batch at the next step and leave when done.

Every pass of the model serves all running sequences at once (for a streamed model each pass reads
the weights once, whoever shares it). A sequence that arrives waits for the current step to end;
between two steps the waiting ones are prefilled (together in one pass, up to a budget of prompt
tokens so that running answers keep flowing), then decode with the batch. Each sequence's cache
is a row of the batch's (:mod:`~slimml.runtime.tasks.generation.rows`): on a fused graph
(``--exporter fused``) rows of the engine's in-place buffers, each at its own position, the live
rows first so that a pass runs only them; on a traced graph one growing cache, left-padded. Rows
that finish or are cancelled leave the batch at once, their cache with them.

Each sequence keeps its own sampler (its seed, temperature, penalty) and its own text stream
(stop strings, incremental text), exactly as :func:`~slimml.runtime.tasks.generate.generate` does
for one prompt: the same seed gives the same answer, batched or alone.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from slimml.errors import SlimmlError
from slimml.runtime.tasks.generation.config import GenerationConfig
from slimml.runtime.tasks.generation.loop import _empty_cache
from slimml.runtime.tasks.generation.prefix import PrefixStore
from slimml.runtime.tasks.generation.prompts import prepare
from slimml.runtime.tasks.generation.rows import GrowingRows, SlotRows
from slimml.runtime.tasks.generation.sampling import Sampler, TokenLogprob, token_logprobs
from slimml.runtime.tasks.generation.stopping import TextStream

PREFILL_TOKENS = 512  # prompt tokens (padding included) prefilled between two steps, beyond the first prompt


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
    held_ids: frozenset[int] = frozenset()  # the end ids min_new_tokens holds back (Prompts.held_ids)
    on_text: Callable[[str], None] = lambda piece: None
    on_done: Callable[[Sequence], None] = lambda seq: None
    tokens: list[int] = field(default_factory=list)
    finish_reason: str | None = None  # "stop", "length", "cancelled", or "error"
    error: BaseException | None = None
    submitted: float = field(default_factory=time.perf_counter)
    first_token_s: float | None = None
    sampler: Sampler | None = None
    text: TextStream | None = None
    constraint: Any = None  # structured.Constraint: the format its answer is held to (None: free text)
    prefix: list | None = None  # the stored blocks its prompt begins with, once looked up (until its prefill)
    cached: int = 0  # prompt positions copied from the prefix store instead of prefilled
    logprobs: list[TokenLogprob] = field(default_factory=list)  # one a token, with config.logprobs set
    starts: list[int] = field(default_factory=list)  # with logprobs: where each token's text begins in the answer
    _cancelled: bool = False

    def cancel(self) -> None:
        """Stop generating (a client that went away): the sequence leaves at the next step."""
        self._cancelled = True

    @property
    def cancelled(self) -> bool:
        return self._cancelled


class ContinuousBatch:
    """The running batch of a causal-LM task: ``admit`` sequences, ``step`` them all, one pass each.

    Not thread-safe by itself: one thread (a server's decode worker) calls ``take``, ``admit`` and
    ``step``; other threads only ``cancel`` sequences.

    Args:
        model: the causal-LM task (``.engine``, ``.text``, ``.folder``, ``.manifest``).
        max_batch: the most sequences decoding at once.
        prefill_tokens: prompt tokens (padded) prefilled between two steps; a longer prompt is
            prefilled alone. Smaller keeps running answers flowing, larger serves a burst's first
            tokens sooner. Positions copied from the prefix store do not count.
        prefix_bytes: bytes of KV cache kept for prompts that begin with text read before
            (:class:`~slimml.runtime.tasks.generation.prefix.PrefixStore`; a fused graph's); 0: none.
    """

    def __init__(self, model: Any, max_batch: int = 16, prefill_tokens: int = PREFILL_TOKENS, prefix_bytes: int = 0):
        self.model = model
        self.engine = model.engine
        self.max_batch = max_batch
        self.prefill_tokens = prefill_tokens
        specs = {t.name: t for t in self.engine.inputs}
        if "input_ids" not in specs or "logits" not in {t.name for t in self.engine.outputs}:
            raise SlimmlError(f"the artifact {model.folder} is not a decoder (no input_ids -> logits); continuous "
                              "batching needs one converted with --task text-generation-with-past.")
        if _empty_cache(self.engine, 1) is None:
            raise SlimmlError(f"the artifact {model.folder} has no KV cache, so sequences cannot share passes; "
                              "re-convert it with --task text-generation-with-past.")
        from slimml.runtime.engine.kv_cache import position_limit, shares_buffers

        self.prefix = PrefixStore(prefix_bytes) if prefix_bytes else None
        if shares_buffers(self.engine):
            context = position_limit(self.engine)
            self.cache: SlotRows | GrowingRows = SlotRows(self.engine, max_batch, int(context or 2048), self.prefix)
        else:
            self.cache = GrowingRows(self.engine)
        self.rows: list[Sequence] = []  # in the order of the cache's rows
        self.filling: Sequence | None = None  # a prompt past prefill_tokens, prefilled that many a step in a row of its own
        self.passes = 0
        self.lock = threading.Lock()  # held by a pass; a reader of the batch's state may take it

    def prepare(self, prompt: str | list[int], config: GenerationConfig, raw_text: bool = False, **hooks) -> Sequence:
        """A :class:`Sequence` for one prompt, checked now (so a bad prompt fails its own request,
        before it meets anyone else's)."""
        job = prepare(self.model, [prompt], config, raw_text)
        seq = Sequence(ids=job.ids[0], config=config, steps=job.steps, end_ids=job.end_ids, held_ids=job.held_ids, **hooks)
        seq.text = (TextStream(job.tokenizer, seq.ids, config.stop, config.skip_special_tokens)
                    if job.tokenizer is not None else None)
        seq.constraint = job.constraints[0] if job.constraints else None
        return seq

    @property
    def free(self) -> int:
        """Sequences that can join now (the prompt being prefilled holds a row)."""
        return self.max_batch - len(self.rows) - (self.filling is not None)

    @property
    def busy(self) -> bool:
        """Whether a step has work: running sequences, or a prompt being prefilled."""
        return bool(self.rows) or self.filling is not None

    def _long(self, s: Sequence, reused: int) -> bool:
        """Whether ``s``'s prompt is prefilled a chunk a step (past ``prefill_tokens`` positions to
        compute, on a graph whose rows take chunks), not in one pass that would hold up the batch."""
        return isinstance(self.cache, SlotRows) and self.cache.chunk > 0 and len(s.ids) - reused > self.prefill_tokens

    def take(self, waiting: deque[Sequence]) -> list[Sequence]:
        """The waiting sequences (oldest first) to admit before the next step: as many as there
        are free rows and the prefill budget allows (at least one). The prompts without a stored
        prefix cost their padded width each; the others, the positions left to prefill. A prompt
        that begins as one taken now does waits for the next step, to copy its cache.

        A long prompt (read a chunk a step) that finds another one being read keeps its place at
        the head of the queue, and the short prompts behind it join past it, leaving it a row:
        they do not wait seconds for a prompt that cannot start yet (before, one long prompt
        being read held every request behind the next one)."""
        joining: list[Sequence] = []
        width = fresh = after = 0  # the padded pass's width and rows; positions prefilled after a stored prefix
        kept = 0  # long prompts left at the head of the queue, each with a row kept for it
        while len(waiting) > kept and len(joining) < self.free - min(kept, 1):
            head = waiting[kept]
            if head.cancelled:  # gone before its turn: ended without a pass
                del waiting[kept]
                self._left(head)
                continue
            reused = self.cache.reuse(head)
            if joining and not reused and self.cache.waits_for(head, joining):
                break  # it begins as one joining now does: next step it copies that one's cache
            if self._long(head, reused):  # prefilled a chunk a step, beside the running answers
                if self.filling is None:  # (then none is kept: it is at the head, a row free for it)
                    self.filling = waiting.popleft()
                else:
                    kept += 1
                continue
            cost = (width * fresh + after + len(head.ids) - reused if reused
                    else max(width, len(head.ids)) * (fresh + 1) + after)
            if joining and cost > self.prefill_tokens:
                break
            del waiting[kept]
            joining.append(head)
            if reused:
                after += len(head.ids) - reused
            else:
                width, fresh = max(width, len(head.ids)), fresh + 1
        return joining

    def admit(self, seqs: list[Sequence]) -> None:
        """Prefill ``seqs`` together in one pass, give each its first token, and keep those not
        yet finished in the batch."""
        seqs = [s for s in seqs if not self._left(s)]
        if len(seqs) > self.free:
            raise SlimmlError(f"{len(seqs)} sequences cannot join a batch with room for {self.free}; admit fewer "
                              "(this is a slimml bug).")
        if not seqs:
            return
        seqs.sort(key=lambda s: bool(self.cache.reuse(s)))  # the prompts prefilled whole first, in one pass
        logits = self._pass(self.cache.prefill, seqs)
        if logits is None:
            return
        self.rows += seqs
        done = [len(self.rows) - len(seqs) + r for r, s in enumerate(seqs) if not self._first(s, logits[r : r + 1])]
        self._drop(done)

    def _first(self, s: Sequence, logits: np.ndarray) -> bool:
        """``s``'s sampler, and its first token from its prompt's last logits (1, vocab); False once finished."""
        try:
            s.sampler = Sampler(s.config, [s.ids], logits.shape[-1], s.held_ids,
                                [s.constraint] if s.constraint is not None else None)
            return self._token(s, logits)
        except Exception as e:  # noqa: BLE001 - one sequence's sampling failed: it ends, the batch goes on
            return self._end(s, "error", e)

    def _fill(self) -> None:
        """The next chunk of the long prompt being prefilled; once it is all in, the sequence joins
        the batch with its first token (this step's pass then gives it its second)."""
        s = self.filling
        if self._left(s):  # gone while its prompt was read
            self.filling = None
            self.cache.stop_filling()
            return
        try:
            with self.lock:
                logits = self.cache.fill(s, self.prefill_tokens)
        except Exception as e:  # noqa: BLE001 - its own failure: the running batch goes on
            self.filling = None
            self.cache.stop_filling()
            self._end(s, "error", e)
            return
        self.passes += 1
        if logits is None:
            return
        self.filling = None
        self.rows.append(s)
        if not self._first(s, logits):
            self._drop([len(self.rows) - 1])

    def step(self) -> None:
        """The next chunk of a long prompt being prefilled, then one pass over every running
        sequence: each gets its next token; finished and cancelled ones leave the batch."""
        gone = [r for r, s in enumerate(self.rows) if self._left(s)]  # cancelled since the last step
        self._drop(gone)
        if self.filling is not None:
            self._fill()
        if not self.rows:
            return
        logits = self._pass(self.cache.decode, self.rows)
        if logits is None:
            return
        self._drop([r for r, s in enumerate(self.rows) if not self._token(s, logits[r : r + 1])])

    def cancel_all(self, error: BaseException | None = None) -> None:
        """End every running sequence (the server is stopping, or a pass failed)."""
        for s in [*self.rows, *([self.filling] if self.filling is not None else [])]:
            self._end(s, "error" if error else "cancelled", error)
        self.rows, self.filling = [], None
        self.cache.clear()

    @property
    def cache_bytes(self) -> int:
        """Bytes the batch's KV cache holds now."""
        return self.cache.nbytes

    # ---- inside

    def _pass(self, run: Callable[[list[Sequence]], np.ndarray], seqs: list[Sequence]) -> np.ndarray | None:
        """``run(seqs)`` (a prefill or a decode pass). On failure ``seqs`` end with the error (a
        failed prefill leaves the running batch as it was; a failed decode empties it)."""
        try:
            with self.lock:
                logits = run(seqs)
        except Exception as e:  # noqa: BLE001 - the pass's failure is each of its sequences' answer
            for s in seqs:
                self._end(s, "error", e)
            if seqs is self.rows:
                self.rows = []
                self.cache.clear()
            return None
        self.passes += 1
        return logits

    def _token(self, s: Sequence, logits: np.ndarray) -> bool:
        """Sample ``s``'s next token from its (1, vocab) logits and hand out its text; False once
        ``s`` is finished."""
        token = int(s.sampler(logits)[0])
        if s.config.logprobs is not None:  # before its text is handed out: a reader of that text finds it
            s.starts.append(len(s.text.full) if s.text is not None else 0)
            s.logprobs += token_logprobs(logits, np.array([token]), s.config.logprobs)
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
            return self._end(s, "stop" if s.text is not None and s.text.stopped else "length")  # see TextStream.finish
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

    def _drop(self, rows: list[int]) -> None:
        """Remove ``rows`` from the batch, their cache with them."""
        if rows or not self.rows:
            order = self.cache.drop(rows, self.rows)
            self.rows = [self.rows[r] for r in order]
