"""The next token from the last position's logits, with numpy.

The processors run in the order transformers runs them (``_get_logits_processor``): repetition
penalty, then temperature, top-k and top-p, each computed as transformers computes it, so that a
transformers user's settings mean the same here. Sampling draws one uniform number per prompt per
step from one ``numpy.random.Generator`` seeded by ``seed``: the same seed, prompts and model give
the same tokens.
"""

from __future__ import annotations

import numpy as np

from slimml.runtime.tasks.generation.config import GenerationConfig


class Sampler:
    """Picks each prompt's next token; remembers the tokens seen for the repetition penalty.

    Args:
        config: the checked generation settings.
        prompts: each prompt's token ids (they count as seen, as in transformers).
        vocab: the logits' last dimension.
    """

    def __init__(self, config: GenerationConfig, prompts: list[list[int]], vocab: int):
        self.config = config
        self.rng = np.random.Generator(np.random.PCG64(config.seed))
        self.seen: np.ndarray | None = None  # (B, vocab) bool, only with a repetition penalty
        if config.repetition_penalty != 1.0:
            self.seen = np.zeros((len(prompts), vocab), dtype=bool)
            for row, ids in enumerate(prompts):
                self.seen[row, [i for i in ids if 0 <= i < vocab]] = True

    def __call__(self, logits: np.ndarray) -> np.ndarray:
        """(B, vocab) logits of the last position -> (B,) int64 token ids."""
        c = self.config
        scores = logits.astype(np.float32, copy=self.seen is not None)  # (B, V)
        if self.seen is not None:
            p = np.float32(c.repetition_penalty)
            penalised = np.where(scores < 0, scores * p, scores / p)
            scores = np.where(self.seen, penalised, scores)
        if c.greedy:
            return scores.argmax(axis=-1).astype(np.int64)
        scores = scores / np.float32(c.temperature)
        if c.top_k:
            scores = top_k(scores, c.top_k)
        if c.top_p < 1.0:
            scores = top_p(scores, c.top_p)
        return self._draw(scores)

    def add(self, ids: np.ndarray) -> None:
        """Count the tokens just chosen, (B,), as seen."""
        if self.seen is not None:
            self.seen[np.arange(len(ids)), ids] = True

    def _draw(self, scores: np.ndarray) -> np.ndarray:
        """One token per row from softmax(scores), by inverse CDF on one uniform draw a row."""
        z = scores.astype(np.float64)
        z -= z.max(axis=-1, keepdims=True)
        cdf = np.cumsum(np.exp(z), axis=-1)  # (B, V); -inf scores add nothing
        u = self.rng.random(len(z)) * cdf[:, -1]
        picked = np.array([np.searchsorted(cdf[row], u[row], side="right") for row in range(len(z))], dtype=np.int64)
        return np.minimum(picked, z.shape[-1] - 1)


def top_k(scores: np.ndarray, k: int) -> np.ndarray:
    """Keep the ``k`` highest scores a row (ties with the k-th kept, as transformers does); -inf the rest."""
    vocab = scores.shape[-1]
    if k >= vocab:
        return scores
    kth = np.partition(scores, vocab - k, axis=-1)[:, vocab - k : vocab - k + 1]  # (B, 1)
    return np.where(scores < kth, np.float32(-np.inf), scores)


def top_p(scores: np.ndarray, p: float) -> np.ndarray:
    """Nucleus filtering as transformers' ``TopPLogitsWarper``: sort ascending, drop the tokens whose
    cumulative probability is <= 1 - p, always keep the most likely one."""
    order = np.argsort(scores, axis=-1, kind="stable")  # ascending
    ordered = np.take_along_axis(scores, order, axis=-1).astype(np.float64)
    ordered -= ordered[:, -1:]
    probs = np.exp(ordered)
    cum = np.cumsum(probs / probs.sum(axis=-1, keepdims=True), axis=-1)
    drop_sorted = cum <= (1 - p)
    drop_sorted[:, -1] = False
    drop = np.zeros_like(drop_sorted)
    np.put_along_axis(drop, order, drop_sorted, axis=-1)
    return np.where(drop, np.float32(-np.inf), scores)
