"""What one call may ask of a model, checked before any model work.

A small input can cost a lot: attention grows with the square of the sequence, a decoder's logits
with rows x tokens x vocabulary, and a tokenizer's time with the characters it is given. Measured
on a 2-layer, 32,000-token decoder before these checks: one 3,000-id sequence (a 74 kB request
body) raised a server's memory by 1.39 GB, and 64 prompts of 50 ids asking for new tokens by
439 MB. So every text is cut to ``max_text_chars`` before it is tokenized, a sequence may not pass
the model's positions, and a generate call may hold at most ``max_batch_tokens`` rows x tokens.

``model.limits`` holds them; raise them for inputs you trust::

    model = load("artifacts/my-llama")
    model.limits.max_batch_tokens = 65_536

``slimml serve`` sets them from ``--max-text-chars`` and ``--max-batch-tokens``.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from typing import Callable, TypeVar

from slimml.errors import FeedError


PROMPT_CHARS_PER_TOKEN = 16  # a prompt's characters a context position allows (English runs ~4 a token)


@dataclass
class Limits:
    """Per-call limits of a loaded model (``model.limits``).

    Attributes:
        max_text_chars: characters of one text kept before tokenizing (the rest is cut, as the
            tokenizer's truncation would cut its tokens): 16,384 is 32 characters a token for a
            512-token model, far more than any language needs, and bounds the tokenizer's time.
        max_batch_tokens: rows x (prompt + new tokens) of one ``generate`` call (an
            encoder-decoder's: rows x beams x prompt tokens, :meth:`check_encoded`). None (default):
            for a graph that computes logits only where they are read (``logits_index``, the fused
            exporter's), 8,192 or the model's context if longer, so one prompt may fill the context
            (its cache is rows x tokens positions; a long prompt is prefilled in chunks). For
            another graph, whose logits cover every position, 8,192, or fewer for a vocabulary past
            8,192 tokens, so that one pass's logits (rows x tokens x vocabulary float32) stay within
            256 MiB: 2,097 for 32,000 tokens, 442 for 151,646. Measured on a 2-layer, 32,000-token
            decoder without a KV cache, 64 prompts of 50 ids asking for 16 new tokens (4,224) raised
            a server's RSS by 1.05 GB.
        max_prompt_chars: characters of one language-model prompt (a rendered chat included) at
            most; more is refused, or with ``truncate`` its start is dropped (never its end, as a
            plain cut would). None (default): 16 a position of the model's context, at least
            ``max_text_chars`` (131,072 for an 8,192-position model).
        max_window_tokens: tokens of all the windows one call reads a long text in (``entities``
            with ``stride``, ``answer``): a window's share grows as the windows overlap more
            (a stride of 509 in 512-token windows reads each token 170 times), so this bounds the
            work, not the text. 65,536 is sixteen times a 16,384-character text's tokens.
    """

    max_text_chars: int = 16_384
    max_batch_tokens: int | None = None
    max_window_tokens: int = 65_536
    max_prompt_chars: int | None = None

    def prompt_chars(self, context: int | None) -> int:
        """``max_prompt_chars``, or its default for a model of ``context`` positions: 16 characters
        a position (a language model's prompt may fill its context), at least ``max_text_chars``."""
        if self.max_prompt_chars is not None:
            if isinstance(self.max_prompt_chars, bool) or not isinstance(self.max_prompt_chars, int) or self.max_prompt_chars < 1:
                raise FeedError(f"limits.max_prompt_chars must be a whole number >= 1 (or None: from the context), got "
                                f"{self.max_prompt_chars!r}.")
            return self.max_prompt_chars
        return max(self.max_text_chars, PROMPT_CHARS_PER_TOKEN * context) if context else self.max_text_chars

    def check_prompts(self, texts: list[str], context: int | None, truncate: bool = False) -> list[str]:
        """A language model's prompts within :meth:`prompt_chars` characters: never cut silently
        (the end of a prompt holds its question, a chat's the assistant's turn). With ``truncate``
        a longer one keeps its end, as its tokens would be kept.

        Raises:
            FeedError: naming the prompt, its length, the limit and the fixes.
        """
        n = self.prompt_chars(context)
        if truncate:
            for i, t in enumerate(texts):
                if len(t) > n:
                    logging.getLogger("slimml").warning("slimml: prompt %d has %d characters, more than the %d a call "
                                                        "reads; kept its last %d (truncate=True).", i, len(t), n, n)
            return [t if len(t) <= n else t[-n:] for t in texts]
        long = next((i for i, t in enumerate(texts) if len(t) > n), None)
        if long is not None:
            why = ("model.limits.max_prompt_chars" if self.max_prompt_chars is not None
                   else f"{PROMPT_CHARS_PER_TOKEN} a position of the model's context")
            raise FeedError(f"prompt {long} has {len(texts[long])} characters, more than the {n} a call reads "
                            f"({why}); shorten it, pass truncate=True "
                            "(slimml generate --truncate) to keep its end, or raise the limit for input you trust "
                            "(model.limits.max_prompt_chars; slimml serve --max-text-chars).")
        return texts

    def batch_tokens(self, vocab_size: int | None, indexed: bool = False, positions: int | None = None) -> int:
        """``max_batch_tokens``, or its default for a model with ``vocab_size`` tokens whose graph
        computes logits at every position (``indexed``: only where asked, ``positions`` its context)."""
        if self.max_batch_tokens is not None:
            return self.max_batch_tokens
        if indexed:
            return max(8_192, positions or 0)
        return min(8_192, max(256, (1 << 26) // vocab_size)) if vocab_size else 8_192

    def cut(self, texts: list[str]) -> list[str]:
        """``texts`` cut to ``max_text_chars`` each (a new list; short texts are the same objects)."""
        n = self.max_text_chars
        return [t if len(t) <= n else t[:n] for t in texts]

    def check_whole(self, texts: list[str], what: str) -> None:
        """Refuse a text that a call promises to read whole (in windows) but :meth:`cut` would cut.

        Raises:
            FeedError: naming the text and the limit, and how to raise it.
        """
        n = self.max_text_chars
        long = next((i for i, t in enumerate(texts) if len(t) > n), None)
        if long is not None:
            raise FeedError(f"{what} {long} has {len(texts[long])} characters, more than the {n} a call reads; split it, "
                            "or raise the limit for input you trust (model.limits.max_text_chars; slimml serve "
                            "--max-text-chars).")

    def check_windows(self, counts: list[int], room: list[int], stride: int, window: int) -> None:
        """Refuse, before any window is made, texts whose windows would hold more tokens, all
        together, than ``max_window_tokens``: text ``i`` of ``counts[i]`` tokens, ``room[i]`` of them
        a window, windows overlapping by ``stride``, each at most ``window`` tokens.

        Raises:
            FeedError: naming the tokens, the limit and how to read with fewer.
        """
        windows = sum(1 if n <= r else 1 + -(-(n - r) // max(r - stride, 1)) for n, r in zip(counts, room))
        # the windows of a call are padded to the longest: a short text's one window holds its own tokens
        # and what each window adds (the special tokens, a question), not the model's whole window
        longest = max((min(n, r) + window - r for n, r in zip(counts, room)), default=0)
        if windows * longest > self.max_window_tokens:
            raise FeedError(f"these texts make {windows} windows of up to {windows * longest} tokens in all, more than the "
                            f"{self.max_window_tokens} a call reads; overlap the windows less (a smaller stride or "
                            "doc_stride), or send fewer or shorter texts (for input you trust, raise the limit: "
                            "model.limits.max_window_tokens in Python, slimml serve --max-window-tokens).")

    def check_generate(self, lengths: list[int], max_new_tokens: int, positions: int | None,
                       vocab_size: int | None = None, indexed: bool = False, context: int | None = None,
                       beams: int = 1) -> None:
        """Refuse a generation that would pass the model's positions or this call's token budget
        (``beams``: cache rows a prompt, for beam search).

        Raises:
            FeedError: naming the limit, and how to raise it where it can be raised.
        """
        longest = max(lengths)
        if positions is not None and longest + max_new_tokens > positions:
            raise FeedError(
                f"a prompt of {longest} token{'s' if longest != 1 else ''} plus max_new_tokens={max_new_tokens} is more than this model's "
                f"{positions} positions; shorten the prompt or ask for at most {max(positions - longest, 0)} new tokens."
            )
        total = len(lengths) * beams * (longest + max_new_tokens)  # prompts are padded to the longest
        limit = self.batch_tokens(vocab_size, indexed, context or positions)
        if total > limit:
            each = f" x {beams} beams" if beams > 1 else ""
            raise FeedError(
                f"{len(lengths)} prompt(s){each} x ({longest} + {max_new_tokens} new) tokens = {total} is more than the "
                f"limit of {limit} tokens a call; send fewer or shorter prompts, or raise the limit "
                "(slimml serve --max-batch-tokens; model.limits.max_batch_tokens in Python)."
            )


    def check_encoded(self, rows: int, width: int, beams: int = 1, context: int | None = None) -> None:
        """Refuse an encoder-decoder's generation whose prompts, ``rows`` padded to ``width`` tokens,
        each read by ``beams`` beams (the decoders' cross-attention keeps them), hold more tokens than
        this call's budget (the prompts are what a caller makes long; the new tokens are bounded by
        ``max_new_tokens``, and each step's logits are one position a row).

        Raises:
            FeedError: naming the tokens and the limit, and how to raise it.
        """
        total = rows * beams * width
        limit = self.batch_tokens(None, True, context)
        if total > limit:
            each = f" x {beams} beams" if beams > 1 else ""
            raise FeedError(
                f"{rows} prompt(s){each} x {width} tokens = {total} is more than the limit of {limit} tokens a call; "
                "send fewer or shorter prompts, or raise the limit (slimml serve --max-batch-tokens; "
                "model.limits.max_batch_tokens in Python)."
            )


def surrogate_at(text: str) -> int | None:
    """Where ``text`` holds a lone surrogate (from a bad decode upstream: no UTF-8 for it, and no
    tokenizer takes it), else None."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        return e.start
    return None


def a_or_an(word: str) -> str:
    """``word`` after its article, as a message says it: "an 'image-classification'", "a 'text-generation'"."""
    return ("an " if word.lstrip("'\"").lower()[:1] in ("a", "e", "i", "o") else "a ") + word


def shown(value: object, width: int = 40) -> str:
    """A value as a message quotes it: as JSON writes it (``null``, ``true``, ``{"a": 1}``: what a
    request sent, and readable in Python too), a lone surrogate escaped, cut to ``width`` characters."""
    try:
        text = json.dumps(value, ensure_ascii=False)
        text.encode("utf-8")
    except UnicodeEncodeError:  # a lone surrogate: escaped
        text = json.dumps(value)
    except (TypeError, ValueError, RecursionError):  # not JSON (a Python object), or nested too deeply
        text = repr(value) if not isinstance(value, (dict, list)) else f"<a {type(value).__name__} nested too deeply>"
    return text if len(text) <= width else text[: width - 3] + "..."


T = TypeVar("T")


def tokenized(call: Callable[[], T]) -> T:
    """``call()`` (a tokenizer's encode), with a panic of the tokenizers library (a Rust panic is a
    ``BaseException``, past every ``except Exception``: a regex of the tokenizer that gives up on a
    text, for one) turned into one :class:`FeedError`."""
    try:
        return call()
    except BaseException as e:
        if type(e).__name__ != "PanicException":
            raise
        why = (str(e).strip().splitlines() or ["a panic"])[0][:160]
        raise FeedError(f"the artifact's tokenizer failed on this text ({why}); change or shorten the text, or "
                        "re-convert the model with a tokenizer that takes it.") from None
