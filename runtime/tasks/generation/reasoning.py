"""A reasoning model's thoughts, read apart from its answer.

Models trained to think before they answer (Qwen3, DeepSeek-R1 and its distillations, SmolLM3,
Phi-4-reasoning, QwQ) write their thoughts between ``<think>`` and ``</think>``, then the answer.
Their chat templates say so (the tags appear in them), and some open the block in the prompt
itself (DeepSeek-R1's ends the assistant's turn opener with ``<think>\\n``), so that the answer
begins inside it. OpenAI-compatible servers (llama.cpp's, vLLM's, DeepSeek's API) hand the
thoughts out as ``reasoning_content`` and only the answer as ``content``; a client that shows
only the content then shows the answer, and the next turn's template drops the thoughts itself.

:class:`ReasoningText` reads an answer as it streams: :meth:`~ReasoningText.feed` gives the
thoughts and the answer that can go out now (never a piece of a tag), :meth:`~ReasoningText.finish`
the rest and the whole of each once the answer is done. An answer that never opens a block is all
content; one cut off inside its block (``max_new_tokens``) is all thoughts.
"""

from __future__ import annotations

OPEN, CLOSE = "<think>", "</think>"


def thinks(template: str) -> bool:
    """Whether the chat template whose source is ``template`` teaches ``<think>`` blocks."""
    return CLOSE in template


def opened(prompt: str) -> bool:
    """Whether the rendered ``prompt`` leaves a ``<think>`` block open, so that the answer begins
    inside it (DeepSeek-R1's templates; Qwen3's with thinking off close an empty one)."""
    return prompt.rstrip().endswith(OPEN)


def closed(prompt: str) -> str:
    """``prompt`` with a ``<think>`` block it leaves open closed empty (as Qwen3's template writes
    it with thinking off): for an answer held to a format from its first token."""
    return prompt.rstrip() + "\n\n" + CLOSE + "\n\n" if opened(prompt) else prompt


class ReasoningText:
    """One answer's text as it streams, its thoughts apart from its content.

    Args:
        inside: the answer begins inside a ``<think>`` block the prompt opened.
    """

    def __init__(self, inside: bool = False):
        self.inside = inside
        self.text = ""
        self.sent = [0, 0]  # characters of thoughts, of content handed out

    def feed(self, piece: str) -> tuple[str, str]:
        """``(thoughts, content)`` that ``piece``, the answer's next text, lets out."""
        self.text += piece
        thoughts, content, _ = self._split(final=False)
        out = thoughts[self.sent[0]:], content[self.sent[1]:]
        self.sent = [max(self.sent[0], len(thoughts)), max(self.sent[1], len(content))]
        return out

    def finish(self) -> tuple[str, str, str | None, str]:
        """``(thoughts not yet handed out, content not yet handed out, the whole thoughts or None
        where the answer had no block, the whole content)``."""
        thoughts, content, had = self._split(final=True)
        return thoughts[self.sent[0]:], content[self.sent[1]:], (thoughts if had else None), content

    def _split(self, final: bool) -> tuple[str, str, bool]:
        """The thoughts and the content that the text so far settles (all of it when ``final``),
        and whether the answer has a block."""
        text = self.text
        start = 0 if self.inside else None
        if start is None:
            head = text.lstrip()
            if head.startswith(OPEN):
                start = len(text) - len(head) + len(OPEN)
            elif not final and OPEN.startswith(head):
                return "", "", False  # may still open a block
            else:
                return "", text, False
        end = text.find(CLOSE, start)
        if end < 0:
            thoughts = text[start:]
            if not final:  # hold what may begin the closing tag, and trailing whitespace
                thoughts = _held(thoughts, CLOSE)
            return thoughts.strip() if final else thoughts.lstrip(), "", True
        return text[start:end].strip(), text[end + len(CLOSE):].lstrip(), True


def _held(text: str, tag: str) -> str:
    """``text`` without an end that may begin ``tag``, and without trailing whitespace."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-k:]):
            text = text[:-k]
            break
    return text.rstrip()
