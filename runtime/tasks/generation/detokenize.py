"""Token ids to text as they come, never half a character.

A byte-level tokenizer splits one character (an emoji, a CJK character) over several tokens, and
decoding a prefix of them gives U+FFFD; a SentencePiece tokenizer drops the leading space of the
first token decoded alone. So, as vLLM and transformers' ``TextStreamer`` do, each new token is
decoded together with a few tokens before it, and the text that decoding adds is emitted only
once it no longer ends in a broken character.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tokenizers import Tokenizer

CONTEXT_TOKENS = 6  # prompt tokens decoded before the first new one: enough for its leading space
BROKEN = "\ufffd"  # what a decoder gives for the first bytes of a character not yet complete


class Detokenizer:
    """One prompt's new tokens in, its new text out, piece by piece.

    Args:
        tokenizer: the artifact's ``tokenizers.Tokenizer``.
        prompt: the prompt's ids; its last few give the first new token its spacing.
    """

    def __init__(self, tokenizer: Tokenizer, prompt: list[int]):
        self.tokenizer = tokenizer
        self.ids = list(prompt[-CONTEXT_TOKENS:])
        self.prefix = 0  # ids[prefix:read] were decoded last time: the context of the next piece
        self.read = len(self.ids)

    def add(self, token: int) -> str:
        """The text ``token`` completes ("" while a character is still incomplete)."""
        self.ids.append(token)
        return self._take(final=False)

    def flush(self) -> str:
        """What is left at the end (a broken character, if generation stopped inside one)."""
        return self._take(final=True)

    def _take(self, final: bool) -> str:
        if self.read == len(self.ids):
            return ""
        decode = self.tokenizer.decode
        before = decode(self.ids[self.prefix : self.read], skip_special_tokens=True)
        after = decode(self.ids[self.prefix :], skip_special_tokens=True)
        if len(after) <= len(before) or (after.endswith(BROKEN) and not final):
            return ""  # a special token (skipped), or the first bytes of a character
        self.prefix, self.read = self.read, len(self.ids)
        return after[len(before) :]
