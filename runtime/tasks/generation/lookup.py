"""Prompt lookup: a pass that also computes the positions the text is likely to take next.

Text that quotes its prompt (a summary, an edit of code or of a document, an answer from retrieved
passages) repeats runs of tokens. When the last few tokens appeared earlier, the tokens that followed
them then are a guess at what comes next (transformers' ``prompt_lookup_num_tokens``, llama.cpp's
lookup decoding). :class:`LookupLoop` feeds the newest token and up to ``k`` guessed ones in one pass
(batch 1, the fused graph's cache, where a pass over several positions after a cache is allowed) and
keeps the logits of every position. The sampler then chooses each token from the logits it would
have had anyway: while its choices equal the guesses, the next logits are already there and no pass
runs; at the first difference the rest are dropped and the cache positions they wrote are written
over by the next pass. The tokens are those of a plain pass per token, greedy or sampled (the same
draws from the same seed), fewer passes where the guesses hold; where they fail, a pass over ``1 + k``
positions costs somewhat more than a pass over one (on CPU at batch 1 a pass is bound by reading the
weights, which several positions share).

One difference: a pass over several positions computes them with other roundings than a pass over
one (the 4-bit kernels at ``accuracy_level`` 4 quantize the activations per row either way, but sum
in another order), so two tokens whose logits tie within that rounding may come out the other way.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from slimml.runtime.tasks.generation.loop import CacheLoop, _mask

NGRAMS = (3, 2)  # the longest tail that appeared before wins; single tokens repeat by chance too often
FORCED = 16  # forced tokens a pass may compute beside the newest one (they hold unless the model splits their text otherwise)


def guess(tokens: np.ndarray, k: int, ngrams: tuple[int, ...] = NGRAMS, no_repeat: int = 0) -> np.ndarray:
    """Up to ``k`` tokens that followed the latest earlier occurrence of the last ``n`` tokens of
    ``tokens`` (1-D int), the longest ``n`` of ``ngrams`` first; empty when none occurred.
    ``no_repeat`` (``no_repeat_ngram_size``): the j-th guess completes an (n + j)-gram that occurred
    before, which the sampler bans from n + j >= no_repeat on: only those before are guessed."""
    for n in ngrams:
        if len(tokens) <= n:
            continue
        windows = np.lib.stride_tricks.sliding_window_view(tokens[:-1], n)  # every earlier n-gram, not the tail itself
        hits = np.flatnonzero((windows == tokens[-n:]).all(axis=1))
        if len(hits):
            start = int(hits[-1]) + n
            return tokens[start : start + (min(k, max(0, no_repeat - n - 1)) if no_repeat else k)]
    return tokens[:0]


class Lookahead:
    """One cache row's guessed positions: the pass that computes them beside the newest token, and
    their logits, handed out while the sampler chooses the guesses (:class:`LookupLoop`, and the
    server's batch while one answer runs alone)."""

    def __init__(self) -> None:
        self.ahead: list[tuple[int, np.ndarray]] = []  # (guessed token, the logits after it), in order
        self.kept = 0  # tokens whose logits a guessed position had computed (no pass of their own)

    def ready(self, token: int) -> np.ndarray | None:
        """The next logits, (1, vocab), if ``token`` (the sampler's choice) is the next guess; else
        None, and the rest are dropped (the cache positions they wrote are written over later)."""
        if self.ahead and token == self.ahead[0][0]:
            self.kept += 1
            return self.ahead.pop(0)[1]
        self.ahead = []
        return None

    def run(self, cache: Any, row: int, text: np.ndarray, length: int, k: int, switch: int | None,
            forced: list[int] | None = None, no_repeat: int = 0) -> np.ndarray | None:
        """A pass over the newest token (``text[-1]``, to be written at ``length``) and up to ``k``
        guesses, on ``row`` of ``cache``; its first logits, (1, vocab). The guesses are ``forced``,
        the tokens a format allows nothing else than (:meth:`Constraint.forced`), where there are
        any, else the text's repeats, those ``no_repeat`` (the n-gram size the sampler bans) leaves
        possible. None where there is no guess (or the guesses would cross LongRoPE's ``switch``):
        the caller runs its plain pass."""
        room = cache.capacity - length - 1
        if forced:
            guesses = np.array(forced[:room], dtype=np.int64)
        else:
            guesses = guess(text, min(k, room), no_repeat=no_repeat) if k else text[:0]
        if len(guesses) == 0 or (switch and length < switch + 1 <= length + 1 + len(guesses)):
            return None
        ids = np.concatenate([text[-1:], guesses]).astype(np.int64)[None]  # (1, 1 + g)
        logits = cache.run(ids, _mask(np.array([length + ids.shape[1]])), rows=(row, row + 1))[0]  # (1 + g, vocab)
        self.ahead = [(int(t), logits[j + 1 : j + 2]) for j, t in enumerate(guesses)]
        return logits[:1]


def lookup_loop(engine: Any, prompts: list[list[int]], steps: int, k: int, prefix: Any = None,
                constraint: Any = None, no_repeat: int = 0) -> LookupLoop | None:
    """A :class:`LookupLoop` where it applies (``k`` > 0 or a format's ``constraint``, one prompt, a
    fused graph's in-place cache), else None. ``no_repeat``: the sampler's ``no_repeat_ngram_size``."""
    from slimml.runtime.engine.kv_cache import rope_reprefill, rope_switch, shares_buffers

    if (not k and constraint is None) or len(prompts) != 1 or not shares_buffers(engine):
        return None
    return LookupLoop(engine.kv_cache(1, len(prompts[0]) + steps), prompts[0], k, rope_switch(engine), rope_reprefill(engine),
                      prefix, constraint, no_repeat)


class LookupLoop(CacheLoop):
    """:class:`CacheLoop` for one prompt, each pass also computing up to ``k`` guessed positions,
    or the tokens its format forces next.

    Args:
        cache: the engine's KV cache for this generation.
        prompt: the prompt's token ids.
        k: guessed positions a pass may add (0: only forced tokens).
        switch: the graph's LongRoPE switch, or None (no guessed pass crosses it).
        reprefill, prefix: as :class:`CacheLoop`.
        constraint: the answer's format (:class:`~slimml.runtime.tasks.generation.structured.Constraint`),
            whose forced tokens (up to :data:`FORCED`) a pass computes beside the newest one.
        no_repeat: the sampler's ``no_repeat_ngram_size`` (0: none): no guess it would ban.
    """

    def __init__(self, cache: Any, prompt: list[int], k: int, switch: int | None = None, reprefill: bool = False,
                 prefix: Any = None, constraint: Any = None, no_repeat: int = 0):
        super().__init__(cache, [prompt], switch, reprefill, prefix)
        self.k = k
        self.no_repeat = no_repeat
        self.constraint = constraint
        self.text = np.zeros(cache.capacity, dtype=np.int64)  # the prompt and every token since
        self.text[: len(prompt)] = prompt
        self.count = len(prompt)
        self.lookahead = Lookahead()

    def next_logits(self) -> np.ndarray:
        if self.passes == 0:
            return super().next_logits()
        token = int(self.pending[0, 0])
        logits = self.lookahead.ready(token)
        if logits is None and self.live:
            forced = self.constraint.forced(FORCED) if self.constraint is not None else None
            logits = self.lookahead.run(self.cache, 0, self.text[: self.count], int(self.lengths[0]), self.k, self.switch,
                                        forced, self.no_repeat)
            if logits is not None:
                self.passes += 1
        if logits is None:
            return super().next_logits()
        self.lengths += 1
        return logits

    def append(self, ids: np.ndarray) -> None:
        super().append(ids)
        if self.count < len(self.text):
            self.text[self.count] = int(self.pending[0, 0])
            self.count += 1
