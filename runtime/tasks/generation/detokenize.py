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
        skip_special: leave special tokens out of the text (``<|im_start|>``, harmony's
            ``<|channel|>``), as transformers' ``decode(skip_special_tokens=True)``.
    """

    def __init__(self, tokenizer: Tokenizer, prompt: list[int], skip_special: bool = True):
        self.tokenizer = tokenizer
        self.skip_special = skip_special
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
        before = decode(self.ids[self.prefix : self.read], skip_special_tokens=self.skip_special)
        # the prompt's last ids (given as ids, a prompt may end inside a character): the new token
        # that completes it turns the prompt's U+FFFD into that character, which is new text
        inside = self.prefix == 0 and before.endswith(BROKEN)
        before = before.rstrip(BROKEN) if inside else before
        after = decode(self.ids[self.prefix :], skip_special_tokens=self.skip_special)
        if len(after) <= len(before) or (after.endswith(BROKEN) and not final):
            return ""  # a special token (skipped), or the first bytes of a character
        # the next piece's context starts on a character (byte-fallback decodes a run of byte
        # tokens that is not UTF-8 as a whole into U+FFFD a byte): here, the prompt's too
        self.prefix, self.read = (0 if inside else self.read), len(self.ids)
        return after[len(before) :]


class TokenBytes:
    """Each token's own bytes, as OpenAI's log-probabilities show a token (``token`` and ``bytes``):
    a byte-level BPE token's characters mapped back to its bytes, a SentencePiece byte-fallback
    token (``<0xE2>``) as its byte, ``▁`` as a space. A token that holds part of a character has
    bytes that are not UTF-8 on their own; its text shows U+FFFD there."""

    def __init__(self, tokenizer: Tokenizer):
        import json

        self.tokenizer = tokenizer
        decoder = json.dumps(json.loads(tokenizer.to_str()).get("decoder"))
        self.byte_level = '"ByteLevel"' in decoder
        self.unbyte = {c: b for b, c in _bytes_to_unicode().items()}
        self.added = set(tokenizer.get_added_tokens_decoder())  # written as text, not in the byte alphabet

    def __call__(self, token: int) -> bytes:
        piece = self.tokenizer.id_to_token(int(token))
        if piece is None:
            return b""
        if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
            try:
                return bytes([int(piece[3:5], 16)])
            except ValueError:
                pass
        if self.byte_level and int(token) not in self.added and all(c in self.unbyte for c in piece):
            return bytes(self.unbyte[c] for c in piece)
        return piece.replace("\u2581", " ").encode()


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character map, which byte-level BPE vocabularies are written in."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    out, extra = {}, 0
    for b in range(256):
        if b in keep:
            out[b] = chr(b)
        else:
            out[b] = chr(256 + extra)
            extra += 1
    return out
