"""A chat's replies: how its template has them written, and how they are read back into
OpenAI's message parts (the thoughts, the content, the tool calls).

A chat template may teach two formats beside plain text: a reasoning model's thoughts
(:mod:`~slimml.runtime.tasks.generation.reasoning`: ``<think>`` blocks, gpt-oss's harmony
channels) and tool calls (:mod:`~slimml.runtime.tasks.generation.tools`: Hermes blocks, Llama 3's
JSON, harmony messages to a function, or slimml's generic JSON). :class:`ReplyFormat` puts the two
together once per chat: the prompt (a thinking block closed where a format holds the answer from
its start), the generation config (the tools' grammar, special tokens kept in the text), and a
:class:`ReplyReader` per reply, which ``chat()``, the server's whole answers and its streams all
read with.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from slimml.errors import ConfigError
from slimml.runtime.tasks.generation.chat import TEMPLATE_ARGUMENTS
from slimml.runtime.tasks.generation.reasoning import ReasoningFormat, ReasoningText, reasoning_format
from slimml.runtime.tasks.generation.tools import CallDelta, ToolCall, ToolFormat, Tools, ToolText, ToolUse, tool_format

REASONING = ("split", "keep")


@dataclass(frozen=True)
class ReplyDelta:
    """What a piece of a reply lets out: some ``reasoning`` (thoughts), some ``content``, and
    pieces of its tool ``calls`` (OpenAI's ``delta``)."""

    reasoning: str = ""
    content: str = ""
    calls: tuple[CallDelta, ...] = ()


@dataclass(frozen=True)
class Reply:
    """A whole reply: its ``content`` (the answer, outside thoughts and calls), its ``reasoning``
    (None where it had no thoughts, or they were not read apart) and its tool ``calls``."""

    content: str
    reasoning: str | None = None
    calls: tuple[ToolCall, ...] = ()


class ReplyReader:
    """One reply's text as it streams, read as thoughts, content and calls.

    :meth:`feed` gives what a piece lets out (never the start of a marker or of a call as
    content), :meth:`finish` what was held back and the whole :class:`Reply`.

    Args:
        thoughts: the reader of its thoughts (None: they stay in the text).
        calls: the reader of its calls (None: the chat has no tools).
        whole_reply: the calls are read from the reply as written (harmony), not from the content
            after the thoughts.
        pieces: hand out the calls in pieces as they are written (a stream); False: the calls
            are read once, whole, by :meth:`finish`.
    """

    def __init__(self, thoughts: ReasoningText | None = None, calls: ToolText | None = None,
                 whole_reply: bool = False, pieces: bool = True):
        self.thoughts = thoughts
        self.calls = calls
        self.whole_reply = whole_reply
        self.pieces = pieces
        self.text: list[str] = []

    def feed(self, piece: str) -> ReplyDelta:
        """The :class:`ReplyDelta` that ``piece``, the reply's next text, lets out."""
        if self.thoughts is None:  # the reply's text, for finish() (a thoughts reader keeps its own)
            self.text.append(piece)
        thought, content = self.thoughts.feed(piece) if self.thoughts is not None else ("", piece)
        if self.calls is None:
            return ReplyDelta(thought, content)
        read, calls = self.calls.feed(piece if self.whole_reply else content, self.pieces)
        return ReplyDelta(thought, content if self.whole_reply else read, tuple(calls))

    def finish(self) -> tuple[ReplyDelta, Reply]:
        """``(what was held back, the whole reply)``; a call no piece handed out comes whole in
        the first (each call exactly once, over :meth:`feed` and this)."""
        if self.thoughts is not None:
            thought, rest, reasoning, content = self.thoughts.finish()
        else:
            thought, rest, reasoning, content = "", "", None, "".join(self.text)
        if self.calls is None:
            return ReplyDelta(thought, rest), Reply(content, reasoning)
        pieces: list[CallDelta] = []
        if not self.whole_reply:  # the calls are in the content: what the thoughts' reader held is read on
            read, pieces = self.calls.feed(rest, self.pieces) if rest else ("", [])
            tail, content, calls = self.calls.finish()
            rest = read + tail
        else:
            calls = self.calls.finish()[2]
        return ReplyDelta(thought, rest, (*pieces, *self.calls.unsent(calls))), Reply(content, reasoning, tuple(calls))


@dataclass(frozen=True)
class ReplyFormat:
    """How one chat's replies are written and read: the template's reasoning format, its tools (as
    its tool format writes them), and whether the thoughts come apart.

    Example:
        >>> form = ReplyFormat.of(template.source, Tools.of([weather]))
        >>> prompt = form.prompt(template.render(form.messages(messages), **form.variables()), formatted=False)
        >>> reader = form.reader(prompt); delta = reader.feed(piece); rest, reply = reader.finish()
    """

    thinking: ReasoningFormat | None = None
    use: ToolUse | None = None
    reasoning: str = "split"
    earlier: ToolFormat | None = None  # without tools: the template's tool format, for the earlier turns' calls
    keep_specials: bool = False  # the thoughts' markers are special tokens of this tokenizer: the text keeps them

    @classmethod
    def of(cls, template: str, tools: Tools | None = None, reasoning: str = "split", *,
           continued: bool = False, served: bool = False, specials: dict[str, int] | None = None) -> ReplyFormat:
        """The format of replies to a chat rendered with the template whose source is ``template``.

        Args:
            tools: the chat's checked tools (None: none).
            reasoning: ``"split"``: a reasoning model's thoughts come apart from its answer;
                ``"keep"``: they stay in the text, as the model wrote them.
            continued: the reply continues the last message (``continue_final_message``): text
                as it comes, no thoughts read apart.
            served: the reply goes back to a client, which sends it back to the template: harmony's
                thoughts always come apart (its template refuses a content holding its markers).
            specials: the model's special tokens by text (a tool format's markers that are
                special tokens are written as such in its grammar, and kept in the text; a
                reasoning format's, kept in the text). None: not known, taken to have them.
        """
        if reasoning not in REASONING:
            raise ConfigError(f'reasoning must be "split" or "keep", got {reasoning!r}.')
        thinking = reasoning_format(template) if not continued else None
        has = thinking is not None and (specials is None or any(m in specials for m in thinking.markers))
        if thinking is not None and thinking.tokens_only and not has:
            thinking = None  # its markers are no tokens of this model's: what it writes is text
        use = ToolUse.of(tools, template, specials) if tools is not None else None
        if thinking is not None and (thinking.split_when_served and served or use is not None and use.format.whole_reply):
            reasoning = "split"  # the calls are read from the same messages as the thoughts
        return cls(thinking, use, reasoning, tool_format(template) if use is None else None,
                   thinking is not None and thinking.special_tokens and has)

    @property
    def reads(self) -> bool:
        """Whether a reply needs reading (thoughts to take apart, or calls)."""
        return self.use is not None or (self.thinking is not None and self.reasoning == "split")

    def messages(self, messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """The conversation as the template takes it (the tool format's rewriting; without tools,
        of the earlier turns' calls and tool answers alone)."""
        if self.use is not None:
            return self.use.messages(messages)
        return self.earlier.history(messages) if self.earlier is not None else messages

    def variables(self, variables: dict[str, Any] | None = None) -> dict[str, Any]:
        """The template's variables: ``variables`` (``chat_template_kwargs``, checked) and the tools.

        Raises:
            ConfigError: ``variables`` is not a dict of names, or sets what the call sets itself.
        """
        if variables is not None and not isinstance(variables, dict):
            raise ConfigError(f"chat_template_kwargs must be a dict of template variables, e.g. "
                              f"{{'enable_thinking': False}}, got {type(variables).__name__}.")
        if not all(isinstance(k, str) and k.isidentifier() for k in variables or ()):
            raise ConfigError("chat_template_kwargs keys must be names (letters, digits and _), e.g. 'enable_thinking'.")
        taken = sorted(set(variables or ()) & TEMPLATE_ARGUMENTS)
        if taken:
            raise ConfigError(f"chat_template_kwargs sets {taken[0]!r}, which chat() sets itself; pass it as chat()'s own "
                              "argument (messages, add_generation_prompt, tools) or leave it out.")
        return {**(variables or {}), **(self.use.variables() if self.use is not None else {})}

    def config(self, config: Any) -> Any:
        """``config`` (a GenerationConfig) with the tools' grammar, and special tokens kept in the
        text where the reasoning format's markers are special tokens (one ``replace``: each
        compiles the grammar again)."""
        keep = {"skip_special_tokens": False} if self.keep_specials else {}
        if self.use is not None:
            return self.use.config(config, **keep)
        return replace(config, **keep) if keep else config

    def prompt(self, rendered: str, formatted: bool) -> str:
        """The rendered prompt, made to open the answer itself where the reply is held to a format
        from its first token: ``formatted`` (a ``response_format`` holds it), or tools whose grammar
        leaves out the thoughts."""
        held = formatted or (self.use is not None and not self.use.format.whole_reply)
        return self.thinking.closed(rendered) if self.thinking is not None and held else rendered

    def reader(self, prompt: str, pieces: bool = True) -> ReplyReader:
        """The reader of one reply to ``prompt`` (from :meth:`prompt`); ``pieces``: hand out the
        calls in pieces as they are written."""
        thoughts = self.thinking.reader(prompt) if self.thinking is not None and self.reasoning == "split" else None
        calls = self.use.text() if self.use is not None else None
        return ReplyReader(thoughts, calls, self.use is not None and self.use.format.whole_reply, pieces)
