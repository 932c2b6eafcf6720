"""OpenAI's harmony format (gpt-oss), read as messages.

A harmony reply is a sequence of messages, each a header, ``<|message|>``, a body, and an end:

- ``<|channel|>analysis<|message|>`` thoughts ``<|end|>``
- ``<|start|>assistant<|channel|>final<|message|>`` the answer (the reply ends with ``<|return|>``)
- ``<|start|>assistant<|channel|>commentary<|message|>`` a preamble to the user
- a call to a tool, its recipient in the header, before or after the channel:
  ``<|start|>assistant to=functions.NAME<|channel|>commentary json<|message|>{...}<|call|>`` or
  ``<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>{...}<|call|>``

The reply opens after the prompt's ``<|start|>assistant``, so its first header has no
``<|start|>``. Its markers are special tokens, which a text leaves out: replies are decoded with
them (``GenerationConfig.skip_special_tokens=False``). :func:`messages` reads a reply so far into
:class:`Message` s; the thoughts and answer (:mod:`~slimml.runtime.tasks.generation.reasoning`)
and the calls (:mod:`~slimml.runtime.tasks.generation.tools`) are read from them.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass

_HEADER_STARTS = ("<|channel|>", "<|start|>", "to=")  # how a message's header begins (a recipient may come first)
_BODY_END = re.compile(r"<\|(?:end|call|return)\|>|<\|start\|>")  # what ends a message's body
MARKERS = ("<|end|>", "<|call|>", "<|return|>", "<|start|>")
_LONGEST = max(map(len, MARKERS))
_CHANNEL = re.compile(r"<\|channel\|>\s*(\w+)")
_RECIPIENT = re.compile(r"to=([^<\s]+)")


@dataclass(frozen=True)
class Message:
    """One message of a reply.

    Attributes:
        header: its header's text (None: text written outside any header).
        body: its body so far, without an end that may still become a marker.
        start: where the body begins in the reply's text.
    """

    header: str | None
    body: str
    start: int

    @property
    def channel(self) -> str | None:
        m = _CHANNEL.search(self.header) if self.header is not None else None
        return m.group(1) if m else None

    @property
    def recipient(self) -> str | None:
        """Whom the message is to (``functions.NAME`` for a call), or None: the user."""
        m = _RECIPIENT.search(self.header) if self.header is not None else None
        return m.group(1) if m else None


def messages(text: str, final: bool, memo: dict | None = None) -> Iterator[Message]:
    """The messages of ``text``, a reply so far (all of it when ``final``): a header still being
    written is not a message yet, and a body's end that may begin a marker is held back.
    ``memo`` (per reply) keeps the messages that ended, which stay as they are however the reply
    goes on, so that a longer text of the same reply is read on from the first that did not."""
    at = 0
    if memo is not None:
        yield from memo.get("ended", ())
        at = memo.get("at", 0)
    while True:
        head = text[at:].lstrip()
        if not final and not head.startswith(_HEADER_STARTS) and any(t.startswith(head) for t in _HEADER_STARTS):
            return  # a header may still begin here
        header = None
        if head.startswith(_HEADER_STARTS):
            mark = text.find("<|message|>", at)
            if mark < 0 and (not final or "<|" in text[at:]):
                return  # a header still being written (or cut off: no part of the reply)
            if mark >= 0:
                header, at = text[at:mark], mark + len("<|message|>")
        scanned = memo.get("scanned", (at, at)) if memo is not None else (at, at)  # a body's text searched before
        end = _BODY_END.search(text, scanned[1] if scanned[0] == at else at)
        if end is None and memo is not None:  # the next text is searched from here (a marker cut off included)
            memo["scanned"] = (at, max(at, len(text) - _LONGEST + 1))
        body = text[at : end.start() if end else len(text)]
        if end is None and not final:
            body = held(body, MARKERS, strip=False)
        message = Message(header, body, at)
        yield message
        if end is None:
            return
        at = end.start() if end.group() == "<|start|>" else end.end()
        if memo is not None:
            memo.setdefault("ended", []).append(message)
            memo["at"] = at


def split(text: str, final: bool, memo: dict | None = None) -> tuple[str, str, bool]:
    """A reply's thoughts (its ``analysis`` messages) and answer (``final`` messages,
    ``commentary`` to no one, and text written outside any header), and whether it had thoughts;
    messages to a tool (``to=functions.NAME``) are neither. ``memo`` as for :func:`messages`."""
    thoughts, content, had = [], [], False
    for m in messages(text, final, memo):
        if m.recipient is not None:
            continue  # a call to a tool: not for the user
        if m.channel == "analysis":
            had = True
            thoughts.append(m.body)
        elif m.header is not None or m.body.strip():  # final, commentary to the user, or text outside any header
            content.append(m.body)
    return "\n\n".join(thoughts), "\n\n".join(content), had


def held(text: str, tags: tuple[str, ...], strip: bool = True) -> str:
    """``text`` without an end that may begin one of ``tags`` (and, with ``strip``, without
    trailing whitespace)."""
    cut = len(text)
    for tag in tags:
        for k in range(min(len(tag) - 1, len(text)), 0, -1):
            if tag.startswith(text[-k:]):
                cut = min(cut, len(text) - k)
                break
    text = text[:cut]
    return text.rstrip() if strip else text
