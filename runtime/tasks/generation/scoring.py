"""How well a decoder predicts text: per-token negative log-likelihood, top-1 predictions, and
perplexity over a text in windows. Used by ``model.perplexity`` and ``slimml eval`` on a language
model, by ``convert``'s check and by the quantization guard (numpy and the artifact's own
sessions; no torch).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from slimml.errors import FeedError
from slimml.runtime.tasks.limits import tokenized

EVAL_WINDOW = 512  # tokens a scored window holds (llama.cpp's perplexity default context)
EVAL_TOKENS = 32_768  # tokens of a text scored at most, by default


def past_shapes(inputs: list[Any]) -> dict[str, tuple[int, int, str]]:
    """``name -> (kv_heads, head_dim, dtype)`` of a decoder's cache inputs (shape ``(batch, heads,
    past, dim)``; float32, or float16 in an fp16 artifact)."""
    return {t.name: (int(t.shape[1]), int(t.shape[3]), t.dtype) for t in inputs
            if t.name.startswith("past_key_values") and len(t.shape) == 4}


def decoder_feeds(input_names: list[str], ids: np.ndarray, past_shape: Mapping[str, tuple] | None = None) -> dict[str, np.ndarray]:
    """Feeds for one pass of a decoder graph over ``ids`` (batch, seq) from the first position: ones
    for the mask, positions 0.., an empty cache for a graph that takes one, and every position's
    logits from a graph that computes only those it is asked for (``logits_index``)."""
    batch, seq = ids.shape
    feeds: dict[str, np.ndarray] = {}
    for name in input_names:
        if name == "input_ids":
            feeds[name] = ids
        elif name == "attention_mask":
            feeds[name] = np.ones((batch, seq), dtype=np.int64)
        elif name in ("position_ids", "logits_index"):
            feeds[name] = np.broadcast_to(np.arange(seq, dtype=np.int64), (batch, seq)).copy()
        elif name.startswith("past_key_values") and past_shape is not None:
            heads, dim, dtype = past_shape[name]
            feeds[name] = np.zeros((batch, heads, 0, dim), dtype=np.dtype(dtype))
    return feeds


def score_run(run: Callable[[dict], Mapping[str, np.ndarray]], feeds_for: Callable[[np.ndarray], dict],
              windows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per-token negative log-likelihood and top-1 predictions of a decoder ``run`` over ``windows``,
    one window per call (memory holds one window's logits, as the graph gives them, and float64 work
    on ``SCORE_ROWS`` positions of them at a time): two arrays ``(n_windows, window - 1)``."""
    nll, top = [], []
    for row in windows:
        logits = run(feeds_for(row[None, :]))["logits"][0]  # (seq, vocab)
        parts = [nll_top(np.asarray(logits[a:min(a + SCORE_ROWS, len(row) - 1)], dtype=np.float64),
                         row[1 + a:1 + min(a + SCORE_ROWS, len(row) - 1)]) for a in range(0, len(row) - 1, SCORE_ROWS)]
        nll.append(np.concatenate([n for n, _ in parts]))
        top.append(np.concatenate([t for _, t in parts]))
    return np.stack(nll), np.stack(top)


SCORE_ROWS = 128  # positions scored at once: float64 copies of 128 rows of logits, not a window's


def nll_top(logits: np.ndarray, targets: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Negative log-likelihood of ``targets`` under ``logits`` (seq, vocab), and the argmax per position."""
    m = logits.max(axis=-1, keepdims=True)
    lse = np.log(np.exp(logits - m).sum(axis=-1)) + m[:, 0]
    return lse - logits[np.arange(len(targets)), targets], logits.argmax(axis=-1)


def windows_of(ids: np.ndarray, window: int) -> np.ndarray:
    """Consecutive windows of at most ``window`` tokens covering (nearly) all of ``ids``, of equal
    length: an int64 array ``(n, size)``."""
    n = max(1, min(-(-len(ids) // window), len(ids) // 2))  # a window scores its tokens after the first: 2 at least
    size = len(ids) // n
    return np.asarray(ids[: n * size], dtype=np.int64).reshape(n, size)


def _first_tokens(encode, text: str, limit: int) -> np.ndarray:
    """The first ``limit`` token ids of ``text``, tokenizing only as much of it as they need (a
    20 MB file took 41 s and 2.9 GB whole, for the same 100 tokens): a prefix, four times longer
    until it gives more tokens than asked plus a margin (the cut's own word may tokenize otherwise)."""
    chars = max(limit, 64) * 8
    while True:
        ids = tokenized(lambda: encode(text[:chars]))
        if chars >= len(text) or len(ids) > limit + 64:
            return np.asarray(ids[:limit], dtype=np.int64)
        chars *= 4


@dataclass
class Perplexity:
    """A decoder's perplexity over a text: ``exp`` of the mean negative log-likelihood of each token
    after the first of each window, ``tokens`` of them scored, in ``windows`` windows of ``window``
    (cut equal, so at most ``window_limit``: the window asked for, or the default)."""

    perplexity: float
    tokens: int
    windows: int
    window: int
    window_limit: int = 0

    def to_json(self) -> dict[str, Any]:
        return {"perplexity": round(self.perplexity, 4), "tokens": self.tokens, "windows": self.windows, "window": self.window}


def perplexity(model: Any, text: str, window: int | None = None, max_tokens: int | None = None) -> Perplexity:
    """The perplexity of ``model`` (a causal-LM task) over ``text``: its tokens (no special tokens
    added), at most ``max_tokens`` (default 32,768), cut into windows of equal length, at most ``window``
    (default 512, at most the model's context), each run from an empty cache.

    Args:
        model: a loaded ``text-generation`` artifact with a tokenizer (``model.perplexity`` calls this).
        text: the text to score.
        window: tokens a window holds at most (2 or more; not past the model's context).
        max_tokens: tokens of the text read at most (2 or more).

    Returns:
        A :class:`Perplexity`: ``perplexity``, ``tokens`` scored (each window's after its first),
        ``windows``, and ``window``, the tokens each window held.

    Raises:
        FeedError: not a text, a window or token count out of range, or a text of fewer than two tokens.

    Example:
        >>> perplexity(model, "The quick brown fox jumps over the lazy dog. " * 20)
        Perplexity(perplexity=1.55..., tokens=200, windows=1, window=201, window_limit=512)
    """
    if not isinstance(text, str):
        raise FeedError(f"perplexity() takes a text (str), got {type(text).__name__}; read the file first.")
    context = model.engine.max_sequence_length
    if window is None:  # the default fits the context; a window asked for is refused past it
        window = min(EVAL_WINDOW, context) if context else EVAL_WINDOW
    for name, value, low in (("window", window, 2), ("max_tokens", max_tokens, 2)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < low):
            raise FeedError(f"{name} must be a whole number >= {low}, got {value!r}.")
    if context and window > context:
        raise FeedError(f"window={window} is more than the model's context of {context} positions; use at most {context}.")
    if model.text is None:
        raise FeedError(f"the artifact {model.folder} has no tokenizer, so it cannot read text; re-convert it from a "
                        "folder with its tokenizer.")
    from slimml.runtime.tasks.generation.prompts import untruncated

    limit = EVAL_TOKENS if max_tokens is None else max_tokens
    ids = _first_tokens(lambda part: untruncated(model.text).encode(part, add_special_tokens=False).ids, text, limit)
    if len(ids) < 2:
        raise FeedError(f"the text is {len(ids)} token(s) long; perplexity needs at least two: give a longer text.")
    windows = windows_of(ids, window)
    names, past = [t.name for t in model.engine.inputs], past_shapes(model.engine.inputs)
    nll, _ = score_run(model.run, lambda row: decoder_feeds(names, row, past), windows)
    return Perplexity(perplexity=float(np.exp(nll.mean())), tokens=int(nll.size), windows=len(windows),
                      window=int(windows.shape[1]), window_limit=int(window))
