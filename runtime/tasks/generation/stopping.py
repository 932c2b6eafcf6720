"""Stop strings, matched on the text as it is produced.

A stop string may span tokens (``"\\n\\n"`` from two ``"\\n"`` tokens, ``"###"`` from ``"#"`` and
``"##"``), so it is looked for in the text, not the ids. As OpenAI and llama.cpp return it, the
text ends just before the stop string, and text that may still turn out to be the start of one
is held back from a stream until the next tokens decide.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from slimml.runtime.tasks.generation.detokenize import Detokenizer

if TYPE_CHECKING:
    from tokenizers import Tokenizer


class TextStream:
    """One prompt's text: new tokens in, pieces safe to show out, until a stop string appears.

    Args:
        tokenizer: the artifact's ``tokenizers.Tokenizer``.
        prompt: the prompt's token ids.
        stop: the stop strings (may be empty).
        skip_special: leave special tokens out of the text.
    """

    def __init__(self, tokenizer: Tokenizer, prompt: list[int], stop: tuple[str, ...] = (), skip_special: bool = True):
        self.detok = Detokenizer(tokenizer, prompt, skip_special)
        self.stop = stop
        self.longest = max(map(len, stop), default=0)
        self.full = ""  # all text decoded so far
        self.shown = 0  # full[:shown] has been handed out
        self.stopped = False

    @property
    def text(self) -> str:
        """The text so far, ending before a stop string once one appeared."""
        return self.full[: self.shown] if self.stopped else self.full

    def push(self, token: int) -> str:
        """Add a new token; return the text now safe to show (maybe ""). Sets ``stopped`` when
        a stop string appeared (the text then ends right before it)."""
        return self._extend(self.detok.add(token), final=False)

    def finish(self) -> str:
        """Generation ended (an end id, or no tokens left): the rest of the text, held-back text
        included. The characters held back until a token completed them may still complete a stop
        string: ``stopped`` then says so, and the text ends before it."""
        return self._extend(self.detok.flush(), final=True)

    def _extend(self, piece: str, final: bool) -> str:
        if self.stopped:
            return ""
        start = max(len(self.full) - self.longest + 1, 0)  # a new match must end in the new piece
        self.full += piece
        if self.stop:
            hits = [k for k in (self.full.find(s, start) for s in self.stop) if k >= 0]
            if hits:
                self.stopped = True
                return self._show(min(hits))
        return self._show(len(self.full) if final else len(self.full) - self._held())

    def _show(self, upto: int) -> str:
        piece = self.full[self.shown : upto] if upto > self.shown else ""
        self.shown = max(self.shown, upto)
        return piece

    def _held(self) -> int:
        """Characters at the end of the text that begin some stop string (they may complete it)."""
        best = 0
        for s in self.stop:
            for n in range(min(len(s) - 1, len(self.full)), best, -1):
                if self.full.endswith(s[:n]):
                    best = n
                    break
        return best
