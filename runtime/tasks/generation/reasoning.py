"""A reasoning model's thoughts, read apart from its answer.

Models trained to think before they answer write their thoughts in a form their chat template
teaches, then the answer:

- ``<think>`` ... ``</think>`` (:class:`ThinkTags`: Qwen3, DeepSeek-R1 and its distillations,
  SmolLM3, Phi-4-reasoning, QwQ, Magistral 2506). Some templates open the block in the prompt itself
  (DeepSeek-R1's ends the assistant's turn opener with ``<think>\\n``), so that the answer begins inside it.
- ``[THINK]`` ... ``[/THINK]`` (:class:`MistralThink`: Magistral from 2507 on), special tokens of
  Mistral's tokenizers, so its answers are decoded with them.
- OpenAI's harmony format (:class:`Harmony`: gpt-oss): messages on channels,
  ``<|channel|>analysis<|message|>`` thoughts ``<|end|>``, then ``<|start|>assistant<|channel|>final<|message|>``
  the answer. Its markers are special tokens, which a text leaves out, so its answers are decoded
  with them (``GenerationConfig.skip_special_tokens=False``) and read here.

OpenAI-compatible servers (llama.cpp's, vLLM's, DeepSeek's API) hand the thoughts out as
``reasoning_content`` and only the answer as ``content``; a client that shows the content then
shows the answer. :class:`ReasoningText` reads an answer as it streams: :meth:`~ReasoningText.feed`
gives the thoughts and the answer that can go out now (never a piece of a marker),
:meth:`~ReasoningText.finish` the rest and the whole of each once the answer is done. An answer
with no thoughts is all content; one cut off inside its thoughts (``max_new_tokens``) is all thoughts.
"""

from __future__ import annotations

from collections.abc import Callable

from slimml.runtime.tasks.generation import harmony
from slimml.runtime.tasks.generation.harmony import held

Split = Callable[[str, bool], "tuple[str, str, bool]"]  # (text so far, final) -> (thoughts, content, has thoughts)


class ReasoningFormat:
    """How one family of chat templates has the model think.

    Attributes:
        name: the format's name.
        markers: the texts that open and close its thoughts (what a tokenizer may have as tokens).
        special_tokens: its markers are special tokens, which the answer's text must keep (where
            the tokenizer has them).
        tokens_only: read only where the tokenizer has its markers as special tokens; in another
            tokenizer they are the model's text (Magistral's, whose markers are its own tokens).
        split_when_served: thoughts always come apart in a served reply (its template refuses a
            content holding its markers when the client sends it back: harmony's).
    """

    name = ""
    markers: tuple[str, ...] = ()
    special_tokens = False
    tokens_only = False
    split_when_served = False

    @staticmethod
    def matches(template: str) -> bool:
        raise NotImplementedError

    def closed(self, prompt: str) -> str:
        """``prompt`` made to open the answer itself, not thoughts: for an answer held to a format
        (``response_format``, tools) from its first token."""
        return prompt

    def reader(self, prompt: str) -> ReasoningText:
        """The reader of an answer to ``prompt`` as it streams."""
        raise NotImplementedError


FORMATS: list[type[ReasoningFormat]] = []


def register_format(cls: type[ReasoningFormat]) -> type[ReasoningFormat]:
    FORMATS.append(cls)
    return cls


def reasoning_format(template: str) -> ReasoningFormat | None:
    """The :class:`ReasoningFormat` of the chat template whose source is ``template``, or None
    where the template teaches no thinking."""
    return next((cls() for cls in FORMATS if cls.matches(template)), None)


class ReasoningText:
    """One answer's text as it streams, its thoughts apart from its content.

    Args:
        split: ``(text so far, final) -> (thoughts, content, whether it has thoughts)``: what the
            text settles (all of it when final); each only grows as the text does.
    """

    def __init__(self, split: Split):
        self.split = split
        self.text = ""
        self.sent = [0, 0]  # characters of thoughts, of content handed out

    def feed(self, piece: str) -> tuple[str, str]:
        """``(thoughts, content)`` that ``piece``, the answer's next text, lets out."""
        self.text += piece
        thoughts, content, _ = self.split(self.text, False)
        out = thoughts[self.sent[0]:], content[self.sent[1]:]
        self.sent = [max(self.sent[0], len(thoughts)), max(self.sent[1], len(content))]
        return out

    def finish(self) -> tuple[str, str, str | None, str]:
        """``(thoughts not yet handed out, content not yet handed out, the whole thoughts or None
        where the answer had none, the whole content)``."""
        thoughts, content, had = self.split(self.text, True)
        return thoughts[self.sent[0]:], content[self.sent[1]:], (thoughts if had else None), content


class Tags(ReasoningFormat):
    """Thoughts between an opening and a closing marker, then the answer; the prompt may open the block."""

    OPEN, CLOSE = "", ""

    @classmethod
    def matches(cls, template: str) -> bool:
        return cls.CLOSE in template

    def closed(self, prompt: str) -> str:  # an opened block closed empty, as Qwen3's template writes it with thinking off
        return prompt.rstrip() + "\n\n" + self.CLOSE + "\n\n" if self._opened(prompt) else prompt

    def reader(self, prompt: str) -> ReasoningText:
        inside = self._opened(prompt)
        return ReasoningText(lambda text, final: self._split(text, final, inside))

    def _opened(self, prompt: str) -> bool:
        """Whether ``prompt`` leaves a block open, so that the answer begins inside it."""
        return prompt.rstrip().endswith(self.OPEN)

    def _split(self, text: str, final: bool, inside: bool) -> tuple[str, str, bool]:
        start = 0 if inside else None
        if start is None:
            head = text.lstrip()
            if head.startswith(self.OPEN):
                start = len(text) - len(head) + len(self.OPEN)
            elif not final and self.OPEN.startswith(head):
                return "", "", False  # may still open a block
            else:
                return "", text, False
        end = text.find(self.CLOSE, start)
        if end < 0:
            thoughts = text[start:]
            return (thoughts.strip(), "", True) if final else (held(thoughts, (self.CLOSE,)).lstrip(), "", True)
        return text[start:end].strip(), text[end + len(self.CLOSE):].lstrip(), True


@register_format
class MistralThink(Tags):
    """``[THINK]`` thoughts ``[/THINK]`` answer (Magistral Small 2507 and 2509, Magistral Medium):
    Mistral's tokenizers have the markers as special tokens, which the answer's text keeps."""

    name = "mistral-think"
    special_tokens = tokens_only = True
    OPEN, CLOSE = "[THINK]", "[/THINK]"
    markers = (OPEN, CLOSE)


@register_format
class ThinkTags(Tags):
    """``<think>`` thoughts ``</think>`` answer."""

    name = "think"
    OPEN, CLOSE = "<think>", "</think>"
    markers = (OPEN, CLOSE)


@register_format
class Harmony(ReasoningFormat):
    """OpenAI's harmony format (gpt-oss): the thoughts are the ``analysis`` channel's messages, the
    answer the ``final`` channel's (and ``commentary`` addressed to no tool: a preamble to the user)."""

    name = "harmony"
    special_tokens = split_when_served = True
    markers = ("<|channel|>", "<|message|>")

    @staticmethod
    def matches(template: str) -> bool:
        return "<|channel|>" in template and "<|message|>" in template

    def closed(self, prompt: str) -> str:  # the answer opens on the final channel
        return prompt + "<|channel|>final<|message|>" if prompt.endswith("<|start|>assistant") else prompt

    def reader(self, prompt: str) -> ReasoningText:
        inside, memo = prompt.endswith("<|channel|>final<|message|>"), {}  # the messages read so far
        return ReasoningText(lambda text, final: ("", text, False) if inside else harmony.split(text, final, memo))
