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


def guess(tokens: np.ndarray, k: int, ngrams: tuple[int, ...] = NGRAMS) -> np.ndarray:
    """Up to ``k`` tokens that followed the latest earlier occurrence of the last ``n`` tokens of
    ``tokens`` (1-D int), the longest ``n`` of ``ngrams`` first; empty when none occurred."""
    for n in ngrams:
        if len(tokens) <= n:
            continue
        windows = np.lib.stride_tricks.sliding_window_view(tokens[:-1], n)  # every earlier n-gram, not the tail itself
        hits = np.flatnonzero((windows == tokens[-n:]).all(axis=1))
        if len(hits):
            start = int(hits[-1]) + n
            return tokens[start : start + k]
    return tokens[:0]


def lookup_loop(engine: Any, prompts: list[list[int]], steps: int, k: int) -> LookupLoop | None:
    """A :class:`LookupLoop` where it applies (``k`` > 0, one prompt, a fused graph's in-place cache), else None."""
    from slimml.runtime.engine.kv_cache import rope_reprefill, rope_switch, shares_buffers

    if not k or len(prompts) != 1 or not shares_buffers(engine):
        return None
    return LookupLoop(engine.kv_cache(1, len(prompts[0]) + steps), prompts[0], k, rope_switch(engine), rope_reprefill(engine))


class LookupLoop(CacheLoop):
    """:class:`CacheLoop` for one prompt, each pass also computing up to ``k`` guessed positions.

    Args:
        cache: the engine's KV cache for this generation.
        prompt: the prompt's token ids.
        k: guessed positions a pass may add (1 or more).
        switch: the graph's LongRoPE switch, or None (no guessed pass crosses it).
        reprefill: as :class:`CacheLoop`.
    """

    def __init__(self, cache: Any, prompt: list[int], k: int, switch: int | None = None, reprefill: bool = False):
        super().__init__(cache, [prompt], switch, reprefill)
        self.k = k
        self.seen = np.zeros(len(prompt) + cache.capacity, dtype=np.int64)  # the prompt and every token since
        self.seen[: len(prompt)] = prompt
        self.count = len(prompt)
        self.ahead: list[np.ndarray] = []  # logits already computed for the next positions, if their guesses hold
        self.guessed: list[int] = []  # the guessed token each of ``ahead`` assumed
        self.guesses = self.kept = 0  # guessed positions computed, and those the sampler chose

    def next_logits(self) -> np.ndarray:
        if self.passes == 0:
            return super().next_logits()
        token = int(self.pending[0, 0])
        if self.ahead and token == self.guessed[0]:  # the guess held: its logits are ready, its position cached
            self.guessed.pop(0)
            self.kept += 1
            self.lengths += 1
            return self.ahead.pop(0)
        self.ahead, self.guessed = [], []
        room = self.cache.capacity - int(self.lengths[0]) - 1
        guesses = guess(self.seen[: self.count], min(self.k, room)) if self.live and room > 0 else self.seen[:0]
        length = int(self.lengths[0])
        if self.switch and length < self.switch + 1 <= length + 1 + len(guesses):
            guesses = guesses[:0]  # no pass of several positions across LongRoPE's switch
        if len(guesses) == 0:
            return super().next_logits()
        ids = np.concatenate([[token], guesses]).astype(np.int64)[None]  # (1, 1 + g)
        logits = self.cache.run(ids, _mask(self.lengths + ids.shape[1]), rows=(0, 1))[0]  # (1 + g, vocab)
        self.passes += 1
        self.lengths += 1
        self.guesses += len(guesses)
        self.ahead = [logits[j : j + 1] for j in range(1, len(logits))]
        self.guessed = [int(t) for t in guesses]
        return logits[:1]

    def append(self, ids: np.ndarray) -> None:
        super().append(ids)
        if self.count < len(self.seen):
            self.seen[self.count] = int(self.pending[0, 0])
            self.count += 1
