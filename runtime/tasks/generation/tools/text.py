"""One answer read as it streams: the content that can go out now and the pieces of its calls."""

from __future__ import annotations

import re
import uuid
from dataclasses import replace

from slimml.runtime.tasks.generation.tools.calls import CallDelta, ToolCall, Tools
from slimml.runtime.tasks.generation.tools.formats import ToolFormat
from slimml.runtime.tasks.generation.tools.scan import json_or_none, value_end

_HEAD = re.compile(r'\{\s*"name"\s*:\s*"([A-Za-z0-9_-]+)"\s*,\s*"(?:arguments|parameters)"\s*:\s*')  # a call's start, in the formats' order


class ToolText:
    """One answer's text as it streams, read as content and calls: :meth:`feed` gives the content
    that can go out now (text that cannot be part of a call) and the pieces of the calls made so
    far (each call's name once written, then its arguments' JSON text as it comes), :meth:`finish`
    the rest of the content and the calls once the answer is whole. Each piece costs about its
    own length: what earlier pieces settled is not read again."""

    def __init__(self, format: ToolFormat, tools: Tools | None = None):
        self.format = format
        self.tools = tools  # the calls kept: to the functions it offers, one unless parallel (None: all)
        self.text = ""
        self.handed = ""  # the content handed out
        self.streamed: list[list] = []  # per call handed out: [its id, its name, its arguments' text handed out]
        self._memo: dict = {}  # scans of the calls' JSON so far (see value_end)

    def feed(self, piece: str, calls: bool = True) -> tuple[str, list[CallDelta]]:
        """``(content, call pieces)`` that ``piece``, the answer's next text, lets out; with
        ``calls=False`` no call pieces (the calls are read whole by :meth:`finish`)."""
        self.text += piece
        text = self.text
        content = self.format.content(text, self._memo)
        out = content[len(self.handed):]
        self.handed += out
        deltas = []
        for index, (start, end, name) in enumerate(self.format.calls(text, self._memo) if calls else ()):
            if index < len(self.streamed) and self.streamed[index][3]:
                continue  # handed out whole already
            if name is None:  # {"name": ..., "arguments": ...}: its arguments begin once its name is whole
                m = _HEAD.match(text, start)
                name, start = (m.group(1), m.end()) if m is not None else (None, start)
            if name is None or not self._keeps(name, index):
                break  # its name is not whole yet
            stop = value_end(text, start, self._memo)  # the arguments' object, without the call's "}"
            arguments = text[start : stop if stop is not None else (end or len(text))]
            if index == len(self.streamed):
                self.streamed.append(["call_" + uuid.uuid4().hex[:24], name, arguments, False])
                deltas.append(CallDelta(index, arguments, self.streamed[index][0], name))
            elif len(arguments) > len(self.streamed[index][2]):
                deltas.append(CallDelta(index, arguments[len(self.streamed[index][2]):]))
                self.streamed[index][2] = arguments
            self.streamed[index][3] = stop is not None
        return out, deltas

    def finish(self) -> tuple[str, str, list[ToolCall]]:
        """``(content not yet handed out, the whole content, the calls)``; a call handed out in
        pieces keeps the id its first piece gave it (matched by its name and arguments)."""
        content, calls = self.format.parse(self.text)
        calls = [c for k, c in enumerate(calls) if self._keeps(c.name, k)]
        free = list(range(len(self.streamed)))
        for k, c in enumerate(calls):
            same = next((i for i in free if self.streamed[i][1] == c.name and json_or_none(self.streamed[i][2]) == c.arguments), None)
            if same is not None:
                free.remove(same)
                calls[k] = ToolCall(c.name, c.arguments, self.streamed[same][0], text=self.streamed[same][2])
        written = self._written() if any(c.text is None for c in calls) else []  # a reply read whole: not streamed
        for k, c in enumerate(calls):
            same = next((i for i, (n, t) in enumerate(written) if n == c.name and json_or_none(t) == c.arguments), None)
            if c.text is None and same is not None:
                calls[k] = replace(c, text=written.pop(same)[1])
        rest = content[len(self.handed):] if content.startswith(self.handed) else ""
        return rest, content, calls

    def _written(self) -> list[tuple[str, str]]:
        """Each whole call's name and its arguments' JSON text as the model wrote it, in order (what
        :meth:`feed` hands out in pieces)."""
        out = []
        for start, end, name in self.format.calls(self.text, self._memo):
            if name is None:  # {"name": ..., "arguments": ...}
                m = _HEAD.match(self.text, start)
                if m is None:
                    continue
                name, start = m.group(1), m.end()
            stop = value_end(self.text, start, self._memo)
            if stop is not None:
                out.append((name, self.text[start:stop]))
        return out

    def unsent(self, calls: list[ToolCall]) -> list[CallDelta]:
        """The calls of :meth:`finish` that no piece handed out, each whole, numbered after the
        calls handed out in pieces."""
        ids = {s[0] for s in self.streamed}
        late = [c for c in calls if c.id not in ids]
        return [CallDelta.whole(len(self.streamed) + k, c) for k, c in enumerate(late)]

    def _keeps(self, name: str, index: int) -> bool:
        if self.tools is None:
            return True
        return (self.tools.parallel or index == 0) and any(f["name"] == name for f in self.tools.callable())
