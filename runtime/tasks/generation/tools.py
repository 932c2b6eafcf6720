"""Tool calls: the functions a chat may call, how a model family's chat template writes a call,
the grammar that holds each call to its function's parameters, and the calls read back out.

A request gives ``tools`` (OpenAI's ``[{"type": "function", "function": {"name", "description",
"parameters"}}]``) and ``tool_choice`` (``"auto"``, ``"required"``, ``"none"``, or one function by
name). The chat template gets ``tools`` as transformers passes them; what the model writes is then
read by its family's :class:`ToolFormat`, chosen from the template itself (as llama.cpp's server
chooses): ``<tool_call>`` in the template is the Hermes format (Qwen 2.5 and 3, Hermes, SmolLM3),
``<|python_tag|>`` or a "JSON for a function call" instruction is Llama 3.1-3.3's, ``[TOOL_CALLS]``
is Mistral's (a list of calls, or ``NAME[ARGS]{...}`` where the template writes ``[ARGS]``),
harmony's ``<|call|>`` is gpt-oss's, and a template
that knows no tools gets the generic format, where slimml describes the tools in a system message
and the answer is one JSON object, ``{"tool_calls": [...]}`` or ``{"response": "..."}``.

Every format is held by a grammar (:mod:`~slimml.runtime.tasks.generation.structured`): with
``auto`` the model may write text freely, and once it begins a call, the call must name one of
the functions and give arguments its JSON Schema allows; with ``required`` or a named function
the answer is calls only. So a call that comes back always parses and always fits its schema (one
cut by ``max_new_tokens`` excepted: it stays text).
"""

from __future__ import annotations

import hashlib
import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from slimml.errors import ConfigError, FeedError
from slimml.runtime.tasks.generation import harmony
from slimml.runtime.tasks.generation.chat import Arguments
from slimml.runtime.tasks.limits import shown, surrogate_at

NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")  # OpenAI's rule for a function's name (fullmatch)
MAX_DEPTH = 64  # JSON levels of one function's parameters schema (llguidance's own limit is lower for schemas)
_CLOSE = re.compile(r"\s*</tool_call>")
_SPACE = re.compile(r"\s*")
_NINE = re.compile(r"[A-Za-z0-9]{9}")  # a call id as Mistral's templates take it
_ALNUM = "0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz"
_COMMA = re.compile(r"\s*,\s*")
_HEAD = re.compile(r'\{\s*"name"\s*:\s*"([A-Za-z0-9_-]+)"\s*,\s*"(?:arguments|parameters)"\s*:\s*')  # a call's start, in the formats' order
_RESPONSE = re.compile(r'\s*\{\s*"response"\s*:\s*"')
_CALLS = re.compile(r'\s*\{\s*"tool_calls"\s*:\s*\[\s*')
_JSON_MARK = re.compile(r'["{}\[\]]')  # where a string or a bracket begins
_STRING_REST = re.compile(r'[^"\\]*(?:\\.[^"\\]*)*("?)')  # a string's text to its closing quote (group 1), or so far
_HIGH_SURROGATE = re.compile(r"\\u[dD][89abAB][0-9a-fA-F]{2}")
_STRING_BODY = re.compile(r'(?:[^"\\]|\\["\\/bfnrt]|\\u[0-9a-fA-F]{4})*')
_GRAMMAR_WS = " \t\n"  # the whitespace the formats' grammars allow around a call
_WS = r"[ ]?"  # JSON whitespace in a call: compact (pretty-printed calls cost a small model a third more tokens)


@dataclass(frozen=True)
class ToolCall:
    """One call the model made: the function's ``name``, its ``arguments`` (parsed JSON, fitting
    the function's schema) and an ``id`` that the tool's answer refers back to."""

    name: str
    arguments: dict[str, Any]
    id: str = field(default_factory=lambda: "call_" + uuid.uuid4().hex[:24])

    def openai(self) -> dict[str, Any]:
        """OpenAI's shape: ``{"id", "type": "function", "function": {"name", "arguments": "<JSON>"}}``."""
        return {"id": self.id, "type": "function",
                "function": {"name": self.name, "arguments": json.dumps(self.arguments, ensure_ascii=False)}}


@dataclass(frozen=True)
class CallDelta:
    """A piece of a call as it streams, OpenAI's ``delta.tool_calls`` entry: a call's first piece
    carries its ``id`` and ``name``, the pieces after it more of its arguments' JSON text (the
    pieces of one ``index`` put together are its arguments)."""

    index: int
    arguments: str = ""
    id: str | None = None
    name: str | None = None

    def openai(self) -> dict[str, Any]:
        if self.name is None:
            return {"index": self.index, "function": {"arguments": self.arguments}}
        return {"index": self.index, "id": self.id, "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}

    @classmethod
    def whole(cls, index: int, call: ToolCall) -> CallDelta:
        """``call`` in one piece."""
        return cls(index, json.dumps(call.arguments, ensure_ascii=False), call.id, call.name)


@dataclass(frozen=True)
class Tools:
    """The functions one chat may call, checked.

    Attributes:
        functions: OpenAI's tool entries (``{"type": "function", "function": {...}}``), as the
            chat template gets them.
        choice: ``"auto"`` (text or calls), ``"required"`` (at least one call), or the one
            function's name that must be called.
        parallel: more than one call in an answer (never with a named function: one call to it);
            None: the format's default (:attr:`ToolFormat.parallel`).
    """

    functions: tuple[dict[str, Any], ...]
    choice: str = "auto"
    parallel: bool | None = None

    @classmethod
    def of(cls, tools: Any, tool_choice: Any = None, parallel_tool_calls: Any = None) -> Tools | None:
        """The checked tools of a request, or None where there are none or ``tool_choice`` is
        ``"none"`` (the chat goes on as plain text). A function may be given bare
        (``{"name", "parameters"}``), as transformers takes it."""
        if tools is None or (isinstance(tools, (list, tuple)) and not tools and tool_choice in (None, "none", "auto")):
            if tool_choice not in (None, "none", "auto"):
                raise ConfigError(f"tool_choice {shown(tool_choice)} needs tools to choose from; pass tools, or leave "
                                  "tool_choice out.")
            return None
        if not isinstance(tools, (list, tuple)) or not tools:
            raise ConfigError('tools must be a non-empty list of {"type": "function", "function": {"name": ..., '
                              f'"parameters": {{...}}}}}}, got {shown(tools)}.')
        functions = tuple(_function(i, t) for i, t in enumerate(tools))
        names = [f["function"]["name"] for f in functions]
        if len(set(names)) < len(names):
            twice = next(n for n in names if names.count(n) > 1)
            raise ConfigError(f"tools name the function {shown(twice)} twice; give each function once.")
        if parallel_tool_calls is not None and not isinstance(parallel_tool_calls, bool):
            raise ConfigError(f"parallel_tool_calls must be true or false, got {shown(parallel_tool_calls)}.")
        choice = "auto" if tool_choice is None else tool_choice
        if choice == "none":
            return None
        if isinstance(choice, dict):
            name = choice.get("function", {}).get("name") if isinstance(choice.get("function"), dict) else None
            if choice.get("type") != "function" or not isinstance(name, str):
                raise ConfigError('tool_choice must be "auto", "required", "none" or {"type": "function", "function": '
                                  f'{{"name": ...}}}}, got {shown(choice)}.')
            if name not in names:
                raise ConfigError(f"tool_choice names the function {shown(name)}, which is not among the tools "
                                  f"({', '.join(names)}); name one of them.")
            choice, parallel_tool_calls = name, False  # a named function: one call to it (OpenAI's, vLLM's)
        elif choice not in ("auto", "required"):
            raise ConfigError('tool_choice must be "auto", "required", "none" or {"type": "function", "function": '
                              f'{{"name": ...}}}}, got {shown(choice)}.')
        return cls(functions, choice, parallel_tool_calls)

    def callable(self) -> list[dict[str, Any]]:
        """The functions a call may name: all, or the one ``tool_choice`` named."""
        return [f["function"] for f in self.functions
                if self.choice in ("auto", "required") or f["function"]["name"] == self.choice]

    def call_schema(self, arguments: str = "arguments", also: dict[str, Any] | None = None) -> dict[str, Any]:
        """The JSON Schema of one call ``{"name": ..., <arguments>: {...}}`` to a callable function
        (and the fields ``also`` after them, required: Mistral's ``id``). The functions' ``$defs``
        (and draft-7 ``definitions``) move to its root, where their ``#/$defs/...`` references
        point once the parameters sit inside it (pydantic's schemas)."""
        defs: dict[str, dict[str, Any]] = {}
        calls = []
        for f in self.callable():
            parameters = dict(_closed(f.get("parameters")))
            for key in ("$defs", "definitions"):
                for name, value in (parameters.pop(key, None) or {}).items():
                    if defs.setdefault(key, {}).setdefault(name, value) != value:
                        raise ConfigError(f"two tools define {key}/{name} differently, and their references share one "
                                          f"root; rename one of them (in {f['name']}).")
            calls.append({"type": "object", "properties": {"name": {"const": f["name"]}, arguments: parameters, **(also or {})},
                          "required": ["name", arguments, *(also or {})], "additionalProperties": False})
        return {**(calls[0] if len(calls) == 1 else {"anyOf": calls}), **defs}

    def calls_schema(self, also: dict[str, Any] | None = None) -> tuple[dict[str, Any], dict[str, Any]]:
        """``(the JSON Schema of a list of calls, its definitions)``: one call or more as
        :attr:`parallel` allows; the definitions go to the root of the answer that holds the list."""
        call = self.call_schema(also=also)
        defs = {k: call.pop(k) for k in ("$defs", "definitions") if k in call}
        calls: dict[str, Any] = {"type": "array", "items": call, "minItems": 1}
        if not self.parallel:
            calls["maxItems"] = 1
        return calls, defs


class CallSpan(NamedTuple):
    """Where one call begun in an answer has its JSON: from ``start`` to ``end`` (None while
    unfinished). ``name``: None where the JSON is the whole call (``{"name": ..., "arguments":
    {...}}``); else the function's name, read from around it, and the JSON its arguments alone."""

    start: int
    end: int | None
    name: str | None = None


class ToolFormat:
    """How one family of chat templates has the model write a call.

    Attributes:
        name: the format's name (reports, docs).
        parallel: whether an answer may hold several calls when the request does not say
            (``parallel_tool_calls`` not given).
        whole_reply: its calls are messages of the reply's own format (harmony's), read from the
            reply as the model wrote it, thoughts and all, and its grammar holds the thoughts too;
            the content is the reasoning format's answer. False: calls are written in the answer
            after any thoughts, and read from it.
        markers: the texts that mark its calls where a tokenizer may have them as special tokens
            (Mistral's ``[TOOL_CALLS]``): where one is, the answer's text keeps special tokens.
    """

    name = ""
    parallel = True
    whole_reply = False
    markers: tuple[str, ...] = ()

    @staticmethod
    def matches(template: str) -> bool:
        raise NotImplementedError

    def used_markers(self, template: str) -> tuple[str, ...]:
        """The :attr:`markers` that replies to chats rendered with ``template`` may hold."""
        return self.markers

    def messages(self, messages: list[dict[str, Any]], tools: Tools) -> list[dict[str, Any]]:
        """The conversation as this family's template takes it (``chat_prompt`` reads the calls'
        arguments into objects for every format)."""
        return self.history(messages)

    def history(self, messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """The conversation's earlier calls and tool answers as this family's template takes them,
        with tools offered or not (the turn after a tool's answer often offers none)."""
        return messages

    def grammar(self, tools: Tools, specials: dict[str, int] | None = None) -> str:
        """The Lark grammar (llguidance's dialect) of an answer; ``specials``: the tokenizer's
        special tokens by text (a marker that is one is written as its token, ``<[id]>``)."""
        raise NotImplementedError

    def content(self, text: str, memo: dict | None = None) -> str:
        """The content of ``text``, an answer so far, that stays content whatever comes next (it
        only grows as the answer does); ``memo`` as for :meth:`calls`."""
        return ""

    def calls(self, text: str, memo: dict | None = None) -> list[CallSpan]:
        """Where each call begun in ``text``, an answer so far, has its JSON, from its ``{``
        (the last one's ``end`` None while unfinished). ``memo`` keeps the scans of earlier calls
        for the next, longer text."""
        return []

    def parse(self, text: str) -> tuple[str, list[ToolCall]]:
        """The answer's content (text outside the calls) and its calls."""
        raise NotImplementedError


FORMATS: list[type[ToolFormat]] = []  # first match wins; the generic format, last, matches any template


def register_format(cls: type[ToolFormat]) -> type[ToolFormat]:
    FORMATS.append(cls)
    return cls


def tool_format(template: str) -> ToolFormat:
    """The :class:`ToolFormat` of the chat template whose source is ``template``."""
    return next(cls for cls in FORMATS if cls.matches(template))()


@register_format
class Harmony(ToolFormat):
    """gpt-oss's calls: harmony messages to ``functions.NAME`` on the commentary channel, their
    body the arguments (:mod:`~slimml.runtime.tasks.generation.harmony`), after any thoughts; the
    reply ends with ``<|call|>``. One call a reply (the model waits for its result)."""

    name = "harmony"
    parallel = False
    whole_reply = True

    @staticmethod
    def matches(template: str) -> bool:  # gpt-oss's template writes an assistant's call ending with <|call|>
        return "<|channel|>" in template and "<|message|>" in template and "<|call|>" in template

    def grammar(self, tools: Tools, specials: dict[str, int] | None = None) -> str:
        rules, in_role, in_channel = [], [], []
        for k, f in enumerate(tools.callable()):
            rules += [f'r{k}: "{f["name"]}" <|channel|> "commentary" type? <|message|> a{k}',
                      f'c{k}: "{f["name"]}" type? <|message|> a{k}', f"a{k}: {_json(_closed(f.get('parameters')))}"]
            in_role.append(f"r{k}")
            in_channel.append(f"c{k}")
        # auto: thoughts and preambles to the user first, as the model writes them, then its answer or a call;
        # required or a named function: the call alone (as llama.cpp's grammar has it). The recipient before
        # the channel (as the template writes calls) or after it (as OpenAI's harmony guide does)
        start = "step* (answer | call)" if tools.choice == "auto" else "call"
        return (f"start: {start}\n"
                'step: <|channel|> ("analysis" | "commentary") <|message|> TEXT <|end|> <|start|> "assistant"\n'
                'answer: <|channel|> "final" <|message|> TEXT\n'
                f'call: " to=functions." ({" | ".join(in_role)}) | <|channel|> "commentary to=functions." '
                f'({" | ".join(in_channel)})\n'
                'type: " json" | " " <|constrain|> "json"\n'
                + "\n".join(rules) + "\nTEXT: /(.|\\n)*/\n")

    def content(self, text: str, memo: dict | None = None) -> str:
        return ""  # a whole-reply format: the reasoning format's reader gives the answer as it streams (ReplyReader)

    def calls(self, text: str, memo: dict | None = None) -> list[CallSpan]:
        out = []
        for m in harmony.messages(text, False, memo.setdefault("harmony", {}) if memo is not None else None):
            if m.recipient is not None and m.recipient.startswith("functions."):
                start = _SPACE.match(text, m.start).end()
                if text.startswith("{", start):
                    out.append(CallSpan(start, _value_end(text, start, memo), m.recipient.removeprefix("functions.")))
        return out

    def parse(self, text: str) -> tuple[str, list[ToolCall]]:
        calls = []
        for m in harmony.messages(text, True):
            if m.recipient is not None and m.recipient.startswith("functions."):  # ended by <|call|>, an end id
                arguments = _loads(m.body.strip())  # cut off by max_new_tokens: no call
                if isinstance(arguments, dict) and NAME.fullmatch(m.recipient.removeprefix("functions.")):
                    calls.append(ToolCall(m.recipient.removeprefix("functions."), arguments))
        return harmony.split(text, True)[1], calls


@register_format
class Hermes(ToolFormat):
    """``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``, one block a call, after
    any text (Qwen 2.5 and 3, Hermes 2 and 3, SmolLM3)."""

    name = "hermes"
    marker = "<tool_call>"

    def content(self, text: str, memo: dict | None = None) -> str:
        return _before(text, self.marker)

    def calls(self, text: str, memo: dict | None = None) -> list[CallSpan]:
        out, at = [], 0
        while (k := text.find(self.marker, at)) >= 0:
            start = _SPACE.match(text, k + len(self.marker)).end()
            if start == len(text):
                break
            end = _value_end(text, start, memo)
            out.append(CallSpan(start, end))
            if end is None:
                break
            at = end
        return out

    @staticmethod
    def matches(template: str) -> bool:
        return "<tool_call>" in template

    def grammar(self, tools: Tools, specials: dict[str, int] | None = None) -> str:
        body = _json(tools.call_schema())
        call = f'"<tool_call>\\n" {body} "\\n</tool_call>"'
        if tools.choice != "auto":  # calls only, a newline between two
            return f'start: call{" (NL call)*" if tools.parallel else ""} NL?\ncall: {call}\nNL: "\\n"\n'
        # free text, and after "<tool_call>" a call that fits (the lazy head ends at the marker)
        return (f"start: call{'*' if tools.parallel else '?'} TEXT\n"
                f'call: head "\\n" {body} "\\n</tool_call>"\n'
                'head[lazy]: TEXT "<tool_call>"\n'
                "TEXT: /(.|\\n)*/\n")

    def parse(self, text: str) -> tuple[str, list[ToolCall]]:
        calls, content, at = [], [], 0
        for m in re.finditer(re.escape(self.marker), text):
            if m.start() < at:
                continue  # inside a call already read
            rest = text[m.end():]
            try:  # the JSON whole (a string in it may hold "</tool_call>"), then the closing tag
                value, end = json.JSONDecoder().raw_decode(text, m.end() + len(rest) - len(rest.lstrip()))
            except (ValueError, RecursionError):
                continue
            close = _CLOSE.match(text, end)
            call = _call(json.dumps(value), "arguments") if close else None
            if call is None:
                continue
            content.append(text[at : m.start()])
            calls.append(call)
            at = close.end()
        content.append(text[at:].split(self.marker)[0])  # a call cut off by max_new_tokens is not content
        return ("".join(content).strip() if self.marker in text else text.strip()), calls


@register_format
class Llama3(ToolFormat):
    """Llama 3.1-3.3's JSON tool calls: the answer is ``{"name": ..., "parameters": {...}}`` (after
    ``<|python_tag|>`` where the model writes it), one call; or text that does not begin with ``{``."""

    name = "llama3"
    parallel = False  # the format has one call an answer

    def content(self, text: str, memo: dict | None = None) -> str:
        head = text.lstrip(_GRAMMAR_WS)
        if not head or head.startswith("{") or "<|python_tag|>".startswith(head[:14]):
            return ""  # the answer may still be, or is, a call
        return text

    def calls(self, text: str, memo: dict | None = None) -> list[CallSpan]:
        start = len(text) - len(text.lstrip(_GRAMMAR_WS))
        if text.startswith("<|python_tag|>", start):
            start += len("<|python_tag|>")
            start += len(text) - start - len(text[start:].lstrip(_GRAMMAR_WS))
        return [CallSpan(start, _value_end(text, start, memo))] if text.startswith("{", start) else []

    @staticmethod
    def matches(template: str) -> bool:
        return "<|python_tag|>" in template or ("JSON for a function call" in template and '"parameters"' in template)

    def grammar(self, tools: Tools, specials: dict[str, int] | None = None) -> str:
        body = _json(tools.call_schema("parameters"))
        if tools.choice != "auto":
            return f"start: {body}\n"
        # text whose first character past any whitespace is not "{", or (after any whitespace) a call that fits
        return f"start: TEXT | WS? {body}\nTEXT: /[ \\t\\n]*[^{{ \\t\\n](.|\\n)*/\nWS: /[ \\t\\n]+/\n"

    def parse(self, text: str) -> tuple[str, list[ToolCall]]:
        body = text.strip(_GRAMMAR_WS).removeprefix("<|python_tag|>").strip(_GRAMMAR_WS)
        call = _call(body, "parameters") if body.startswith("{") else None
        return ("", [call]) if call is not None else (text, [])


class _Mistral(ToolFormat):
    """Mistral's calls, after ``[TOOL_CALLS]``: a special token in Mistral's own tokenizers (the
    grammar writes it as that token, and the text keeps it), text in others. Its templates take a
    call's id only as 9 letters or digits: the conversation's ids are mapped to such ids."""

    marker = "[TOOL_CALLS]"
    THINK = ("[THINK]", "[/THINK]")  # Magistral's thoughts, before its text or calls

    def used_markers(self, template: str) -> tuple[str, ...]:  # thoughts where the template teaches them
        return self.markers if self.THINK[1] in template else tuple(m for m in self.markers if m not in self.THINK)

    def history(self, messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
        return _nine_letter_ids(template_messages(messages))

    def content(self, text: str, memo: dict | None = None) -> str:
        return _before(text, self.marker)

    @classmethod
    def start(cls, tools: Tools, mark: str, calls: str, specials: dict[str, int] | None = None) -> str:
        """The grammar's start rule: ``calls`` after the marker ``mark``; with ``auto``, text
        first or instead (a special token no text can hold; a text marker ends a lazy head).
        Where the tokenizer has Magistral's ``[THINK]`` and ``[/THINK]`` as special tokens, the
        model's thoughts between them may come first (the reasoning reader takes them apart)."""
        think, rule = "", ""
        if specials and all(m in specials for m in cls.THINK):
            think = "thinking? "
            rule = f"\nthinking: {_mark(cls.THINK[0], specials)} TEXT? {_mark(cls.THINK[1], specials)}"
        if tools.choice != "auto":
            return f"start: {think}{mark} {calls}{rule}"
        if mark.startswith("<"):
            return f"start: {think}TEXT | {think}TEXT? {mark} {calls}{rule}"
        return f"start: {think}TEXT | {think}head {calls}\nhead[lazy]: TEXT {mark}{rule}"


@register_format
class MistralJSON(_Mistral):
    """``[TOOL_CALLS][{"name": ..., "arguments": {...}, "id": "<9 letters or digits>"}, ...]``, one
    list of calls after any text (Mistral 7B v0.3, Mistral Nemo, Mistral Small 3 and 3.1)."""

    name = "mistral"
    markers = ("[TOOL_CALLS]", *_Mistral.THINK)

    @staticmethod
    def matches(template: str) -> bool:
        return "[TOOL_CALLS]" in template and "[ARGS]" not in template

    def grammar(self, tools: Tools, specials: dict[str, int] | None = None) -> str:
        calls, defs = tools.calls_schema(also={"id": {"type": "string", "pattern": "^[A-Za-z0-9]{9}$"}})
        return self.start(tools, _mark(self.marker, specials), f'" "? {_json({**calls, **defs})}', specials) \
            + "\nTEXT: /(.|\\n)*/\n"

    def calls(self, text: str, memo: dict | None = None) -> list[CallSpan]:
        k = text.find(self.marker)
        at = _SPACE.match(text, k + len(self.marker)).end() if k >= 0 else len(text)
        return _listed(text, _SPACE.match(text, at + 1).end(), memo) if text.startswith("[", at) else []

    def parse(self, text: str) -> tuple[str, list[ToolCall]]:
        k = text.find(self.marker)
        if k < 0:
            return text.strip(), []
        # the whole calls (a list cut off by max_new_tokens keeps those before the cut, as they streamed)
        calls = [_call(text[c.start : c.end], "arguments") for c in self.calls(text) if c.end is not None]
        return text[:k].strip(), [c for c in calls if c is not None]


@register_format
class MistralArgs(_Mistral):
    """``[TOOL_CALLS]NAME[ARGS]{...}`` a call (``[CALL_ID]`` and 9 letters or digits before
    ``[ARGS]`` where the model writes them), the calls one after another after any text
    (Mistral Small 3.2, Magistral, Devstral)."""

    name = "mistral-args"
    markers = ("[TOOL_CALLS]", "[ARGS]", "[CALL_ID]", *_Mistral.THINK)
    _CALL = re.compile(r"\[TOOL_CALLS\]([A-Za-z0-9_-]{1,64})(?:\[CALL_ID\][A-Za-z0-9]*)?\[ARGS\]\s*")

    @staticmethod
    def matches(template: str) -> bool:
        return "[TOOL_CALLS]" in template and "[ARGS]" in template

    def grammar(self, tools: Tools, specials: dict[str, int] | None = None) -> str:
        mark, args, call_id = (_mark(m, specials) for m in self.markers[:3])
        rules = [f'c{k}: "{f["name"]}" ({call_id} ID)? {args} {_json(_closed(f.get("parameters")))}'
                 for k, f in enumerate(tools.callable())]
        body = "body: " + " | ".join(f"c{k}" for k in range(len(rules)))
        more = f" ({mark} body)*" if tools.parallel else ""
        return "\n".join([self.start(tools, mark, "body" + more, specials), body, *rules, "ID: /[A-Za-z0-9]{9}/",
                          "TEXT: /(.|\\n)*/"]) + "\n"

    def calls(self, text: str, memo: dict | None = None) -> list[CallSpan]:
        """The calls one after another from the first marker, each where the last one's arguments
        end (a marker inside an argument's string is text, not a call)."""
        out, at = [], text.find(self.marker)
        while at >= 0 and (m := self._CALL.match(text, at)) is not None and text.startswith("{", m.end()):
            end = _value_end(text, m.end(), memo)
            out.append(CallSpan(m.end(), end, m.group(1)))
            at = _SPACE.match(text, end).end() if end is not None else -1
        return out

    def parse(self, text: str) -> tuple[str, list[ToolCall]]:
        k = text.find(self.marker)
        if k < 0:
            return text.strip(), []
        calls = [(c.name, _loads(text[c.start : c.end])) for c in self.calls(text) if c.end is not None]
        return text[:k].strip(), [ToolCall(name, arguments) for name, arguments in calls if isinstance(arguments, dict)]


@register_format
class Generic(ToolFormat):
    """Any template that knows no tools: a system message lists them, and the answer is one JSON
    object, ``{"tool_calls": [{"name", "arguments"}, ...]}`` or ``{"response": "<text>"}`` (the
    generic format of llama.cpp's server)."""

    name = "generic"
    parallel = False  # llama.cpp's server default: a model not trained on tools keeps appending calls

    @staticmethod
    def matches(template: str) -> bool:
        return True

    def messages(self, messages: list[dict[str, Any]], tools: Tools) -> list[dict[str, Any]]:
        out = []
        for m in template_messages(messages):
            if m.get("role") == "assistant" and m.get("tool_calls"):
                calls = [{"name": c["function"]["name"], "arguments": c["function"]["arguments"]} for c in m["tool_calls"]]
                m = {"role": "assistant", "content": json.dumps({"tool_calls": calls}, ensure_ascii=False)}
            elif m.get("role") == "assistant":
                m = {**m, "content": json.dumps({"response": m.get("content") or ""}, ensure_ascii=False)}
            out.append(m)
        # every function listed whatever tool_choice says (the grammar holds the choice), so that requests
        # with the same tools share the prompt's beginning, and its cache (the prefix store)
        listing = "\n".join(json.dumps(f["function"], ensure_ascii=False) for f in tools.functions)
        name = "<function name>" if tools.choice in ("auto", "required") else json.dumps(tools.choice)
        how = (f'{{"tool_calls": [{{"name": {name}, "arguments": <its arguments as an object>}}]}} to call '
               + ("functions" if tools.parallel else "one function"))
        if tools.choice == "auto":
            how += ', or {"response": <your answer as a string>} to answer directly'
        text = (f"You can call these functions, described in JSON Schema:\n{listing}\n\n"
                f"Answer with one JSON object: {how}.")
        if out and out[0].get("role") == "system" and isinstance(out[0].get("content"), str):
            return [{**out[0], "content": out[0]["content"] + "\n\n" + text}, *out[1:]]
        return [{"role": "system", "content": text}, *out]

    def grammar(self, tools: Tools, specials: dict[str, int] | None = None) -> str:
        calls, defs = tools.calls_schema()  # the definitions to the answer's root, as references expect
        shape = {"type": "object", "properties": {"tool_calls": calls}, "required": ["tool_calls"], "additionalProperties": False}
        if tools.choice == "auto":
            answer = {"type": "object", "properties": {"response": {"type": "string"}}, "required": ["response"],
                      "additionalProperties": False}
            shape = {"anyOf": [shape, answer]}
        return f"start: {_json({**shape, **defs})}\n"

    def content(self, text: str, memo: dict | None = None) -> str:
        m = _RESPONSE.match(text)
        read = memo.setdefault("response", [0, ""]) if memo is not None else None  # how far its string was read
        return _string_begun(text, m.end(), read) if m else ""

    def calls(self, text: str, memo: dict | None = None) -> list[CallSpan]:
        m = _CALLS.match(text)
        return _listed(text, m.end(), memo) if m else []

    def parse(self, text: str) -> tuple[str, list[ToolCall]]:
        try:
            value = json.loads(text)
        except (ValueError, RecursionError):  # cut by max_new_tokens: the response begun, a call begun is dropped
            return (self.content(text), []) if text.lstrip().startswith("{") else (text, [])
        if isinstance(value, dict) and isinstance(value.get("response"), str):
            return value["response"], []
        found = value.get("tool_calls") if isinstance(value, dict) else None
        calls = [c for c in (_call(json.dumps(x), "arguments") for x in found or []) if c is not None]
        return ("", calls) if calls else (text, [])


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
        self._memo: dict = {}  # scans of the calls' JSON so far (see _value_end)

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
            stop = _value_end(text, start, self._memo)  # the arguments' object, without the call's "}"
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
            same = next((i for i in free if self.streamed[i][1] == c.name and _loads(self.streamed[i][2]) == c.arguments), None)
            if same is not None:
                free.remove(same)
                calls[k] = ToolCall(c.name, c.arguments, self.streamed[same][0])
        rest = content[len(self.handed):] if content.startswith(self.handed) else ""
        return rest, content, calls

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


def call_arguments(arguments: Any) -> Arguments:
    """A tool call's arguments, an object or its JSON text (as OpenAI sends them; empty text: no
    arguments), as templates read them.

    Raises:
        FeedError: not JSON, or JSON that is not an object ("has arguments ...; ..." to follow a name).
    """
    text = arguments if isinstance(arguments, str) else None
    if text is not None:
        try:
            arguments = json.loads(text) if text.strip() else {}
        except (ValueError, RecursionError):
            raise FeedError("has arguments that are not JSON; send them as a JSON object, or its text.") from None
    if not isinstance(arguments, dict):
        raise FeedError(f"has arguments {shown(arguments)}; a call's arguments are a JSON object (its text, as OpenAI "
                        "sends it: '{\"city\": \"Paris\"}').")
    return Arguments(arguments, text if text is not None and text.strip() else None)


def template_messages(messages: list[dict[str, Any]], first: int = 0) -> list[dict[str, Any]]:
    """Messages as chat templates take them: an assistant's ``tool_calls`` with their arguments as
    objects that are also their JSON text (:class:`Arguments`: OpenAI sends text, most templates
    write ``arguments | tojson``, DeepSeek's joins the text), and its ``reasoning_content`` (the
    thoughts a server handed out) also as ``thinking``, where gpt-oss's template reads them (Qwen3's
    reads ``reasoning_content``). A call turn's ``content`` stays as sent, None where left out
    (DeepSeek's template writes the calls only then; :meth:`ChatTemplate.render` gives ``""`` to a
    template that does not test content against none). ``first``: the first message's number, for
    messages."""
    if not isinstance(messages, (list, tuple)):
        return messages  # refused, in one line, where the template's messages are checked
    out = []
    for i, m in enumerate(messages, first):
        calls = m.get("tool_calls") if isinstance(m, dict) else None
        if calls:
            if not isinstance(calls, list):
                raise FeedError(f"message {i}'s tool_calls must be a list of {{\"id\", \"type\": \"function\", "
                                f"\"function\": {{\"name\", \"arguments\"}}}}, got {shown(calls)}.")
            fixed = []
            for k, c in enumerate(calls):
                function = c.get("function") if isinstance(c, dict) else None
                if not isinstance(function, dict) or not isinstance(function.get("name"), str):
                    raise FeedError(f"message {i}'s tool call {k} has no function name; give "
                                    '{"type": "function", "function": {"name": ..., "arguments": ...}}.')
                try:
                    arguments = call_arguments(function.get("arguments", {}))
                except FeedError as e:
                    raise FeedError(f"message {i}'s tool call {k} ({function['name']}) {e}") from None
                fixed.append({**c, "type": "function", "function": {**function, "arguments": arguments}})
            m = {"content": None, **m, "tool_calls": fixed}  # OpenAI's call turn may leave its content out
        if isinstance(m, dict) and isinstance(m.get("reasoning_content"), str) and "thinking" not in m:
            m = {**m, "thinking": m["reasoning_content"]}
        out.append(m)
    return out


def finish_reason(reason: str, calls: list[ToolCall]) -> str:
    """OpenAI's finish reason of an answer with tools: ``tool_calls`` where it ended by itself with calls."""
    return "tool_calls" if calls and reason == "stop" else reason


def _listed(text: str, at: int, memo: dict | None = None) -> list[CallSpan]:
    """The calls of a JSON list whose first item begins at ``text[at]``, each a whole
    ``{"name", "arguments"}`` object (the last one's ``end`` None while unfinished)."""
    out = []
    while text.startswith("{", at):
        end = _value_end(text, at, memo)
        out.append(CallSpan(at, end))
        comma = _COMMA.match(text, end) if end is not None else None
        if comma is None:
            break
        at = comma.end()
    return out


def _before(text: str, marker: str) -> str:
    """The text of an answer so far before its first ``marker`` (what may begin the marker at its
    end held back, and trailing whitespace: it may precede a call)."""
    start = text.find(marker)
    if start < 0:
        start = len(text)
        for k in range(min(len(marker) - 1, len(text)), 0, -1):
            if marker.startswith(text[-k:]):
                start = len(text) - k
                break
    return text[:start].strip()


def _mark(marker: str, specials: dict[str, int] | None) -> str:
    """``marker`` in a grammar: its special token (``<[id]>``, as llguidance names a token by its
    id) where the tokenizer has one, else its text."""
    return f"<[{specials[marker]}]>" if specials and marker in specials else json.dumps(marker)


def _nine_letter_ids(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``messages`` with each call's id, and each tool answer's ``tool_call_id``, as 9 letters or
    digits (Mistral's templates refuse others): an id of that shape kept, any other mapped to one
    by its hash (the same for the call and its answer); a tool answer without an id takes its
    call's in order."""
    if not isinstance(messages, list):
        return messages  # refused, in one line, where the template's messages are checked
    out, waiting = [], []
    for i, m in enumerate(messages):
        if isinstance(m, dict) and m.get("role") == "assistant" and isinstance(m.get("tool_calls"), list):
            calls = [{**c, "id": _nine(c.get("id") or f"{i}.{k}")} if isinstance(c, dict) else c
                     for k, c in enumerate(m["tool_calls"])]
            waiting = [c["id"] for c in calls if isinstance(c, dict)]
            m = {**m, "tool_calls": calls}
        elif isinstance(m, dict) and m.get("role") == "tool":
            given = m.get("tool_call_id")
            id = _nine(given) if isinstance(given, str) and given else (waiting[0] if waiting else _nine(str(i)))
            waiting = [w for w in waiting if w != id]
            m = {**m, "tool_call_id": id}
        out.append(m)
    return out


def _nine(id: Any) -> str:
    text = str(id)
    if _NINE.fullmatch(text):
        return text
    n = int.from_bytes(hashlib.sha256(text.encode("utf-8")).digest()[:8], "big")
    return "".join(_ALNUM[(n // 62 ** k) % 62] for k in range(9))


def _function(i: int, tool: Any) -> dict[str, Any]:
    """Tool ``i`` in OpenAI's shape, checked."""
    fix = 'give {"type": "function", "function": {"name": ..., "description": ..., "parameters": {<JSON Schema>}}}'
    if isinstance(tool, dict) and "function" not in tool and "name" in tool:
        tool = {"type": "function", "function": tool}  # a bare function, as transformers takes it
    if not isinstance(tool, dict) or tool.get("type", "function") != "function" or not isinstance(tool.get("function"), dict):
        raise ConfigError(f"tools[{i}] is not a function tool ({shown(tool)}); {fix}.")
    function = tool["function"]
    name = function.get("name")
    if not isinstance(name, str) or not NAME.fullmatch(name):
        raise ConfigError(f"tools[{i}].function.name must be 1 to 64 letters, digits, '_' or '-', got {shown(name)}; rename it.")
    parameters = function.get("parameters")
    if parameters is not None and not isinstance(parameters, dict):
        raise ConfigError(f"tools[{i}].function.parameters must be a JSON Schema object, got {shown(parameters)}; {fix}.")
    if parameters is not None and _depth(parameters) > MAX_DEPTH:
        raise ConfigError(f"tools[{i}].function.parameters nest deeper than {MAX_DEPTH} levels; flatten the schema.")
    if parameters is not None and parameters.get("type", "object") != "object":
        raise ConfigError(f"tools[{i}].function.parameters must describe an object (\"type\": \"object\", the "
                          f"arguments by name), got type {shown(parameters.get('type'))}; wrap the value in a property.")
    if function.get("description") is not None and not isinstance(function["description"], str):
        raise ConfigError(f"tools[{i}].function.description must be text, got {shown(function['description'])}.")
    where = _surrogate_in(function)
    if where is not None:  # the template writes it into the prompt, which no tokenizer takes then
        raise ConfigError(f"tools[{i}].function.{where} is not valid Unicode (a lone surrogate); replace it (decode "
                          "the text with errors='replace') or remove it.")
    return {"type": "function", "function": dict(function)}


def _surrogate_in(value: Any) -> str | None:
    """The path (``description``, ``parameters.properties.city``) of the first text in JSON ``value``
    (keys included) that holds a lone surrogate, or None. Iterative: ``_depth`` bounds the nesting."""
    todo: list[tuple[str, Any]] = [("", value)]
    while todo:
        path, v = todo.pop()
        if isinstance(v, str):
            if surrogate_at(v) is not None:
                return path
        elif isinstance(v, dict):
            for k, x in v.items():
                if isinstance(k, str) and surrogate_at(k) is not None:
                    return f"{path} (a key)".lstrip()
                todo.append((f"{path}.{k}".lstrip("."), x))
        elif isinstance(v, list):
            todo += [(f"{path}[{n}]", x) for n, x in enumerate(v)]
    return None


def _depth(value: Any) -> int:
    """How deep JSON ``value`` nests (without recursion: a hostile schema may nest thousands deep)."""
    deepest, todo = 0, [(value, 1)]
    while todo:
        v, d = todo.pop()
        if isinstance(v, (dict, list)):
            deepest = max(deepest, d)
            if deepest > MAX_DEPTH:
                break
            todo += [(x, d + 1) for x in (v.values() if isinstance(v, dict) else v)]
    return deepest


def _closed(parameters: dict[str, Any] | None) -> dict[str, Any]:
    """A function's parameters schema with no arguments beyond those it declares, unless it says
    otherwise (``additionalProperties``), as OpenAI's strict function calling has it: a function
    called with one it does not take fails, and a small model held to an open object keeps
    inventing more of them until the answer runs out."""
    if not parameters:
        return {"type": "object", "properties": {}, "additionalProperties": False}
    if "properties" in parameters and "additionalProperties" not in parameters:
        return {**parameters, "additionalProperties": False}
    return parameters


def _json(schema: dict[str, Any]) -> str:
    """``%json {...}`` with JSON whitespace bounded."""
    return "%json " + json.dumps({**schema, "x-guidance": {"whitespace_pattern": _WS}})


def _value_end(text: str, start: int, memo: dict | None = None) -> int | None:
    """Where the JSON object or array that begins at ``text[start]`` ends, or None while it is
    unfinished. ``memo`` (per answer) keeps, per start, how far an unfinished scan got (at what
    depth, whether inside a string) or where the value ended, so that a longer text of the same
    answer is read on from there: each piece of an answer is read once."""
    at, depth, inside = start, 0, False
    if memo is not None and start in memo:
        at, depth, inside, end = memo[start]
        if end is not None:
            return end
    while True:
        if inside:  # in a string: to its closing quote, or as far as whole characters and escapes go
            m = _STRING_REST.match(text, at)
            at, inside = m.end(), not m.group(1)
            if inside:
                break
            continue
        m = _JSON_MARK.search(text, at)
        if m is None:
            at = len(text)
            break
        at = m.end()
        c = m.group()
        if c == '"':
            inside = True
        elif c in "{[":
            depth += 1
        else:
            depth -= 1
            if depth == 0:
                if memo is not None:
                    memo[start] = (at, 0, False, at)
                return at
    if memo is not None:
        memo[start] = (at, depth, inside, None)
    return None


def _string_begun(text: str, start: int, read: list | None = None) -> str:
    """The value so far of the JSON string whose text begins at ``text[start]`` (past its opening
    quote), without an escape still cut off or a high surrogate waiting for its pair. ``read``
    (``[offset, value]``, per answer) carries what earlier calls read, to go on from there."""
    at, value = (start, "") if read is None or read[0] < start else read
    body = _STRING_BODY.match(text, at).group()
    value += json.JSONDecoder(strict=False).decode('"' + body + '"') if body else ""
    at += len(body)
    if value and "\ud800" <= value[-1] <= "\udbff" and _HIGH_SURROGATE.fullmatch(text, at - 6, at):
        value, at = value[:-1], at - 6  # an escaped high surrogate: read it again once its pair comes
    if read is not None:
        read[:] = [at, value]
    return value


def _loads(text: str) -> Any:
    try:
        return json.loads(text)
    except (ValueError, RecursionError):
        return None


def _call(text: str, arguments: str) -> ToolCall | None:
    try:
        value = json.loads(text)
    except (ValueError, RecursionError):
        return None
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    args = value.get(arguments, value.get("arguments", value.get("parameters", {})))
    return ToolCall(value["name"], args) if isinstance(args, dict) else None


@dataclass(frozen=True)
class ToolUse:
    """A chat with tools, as one model's template has them written: what the template gets,
    what the answer is held to, and how it is read back.

    Example:
        >>> use = ToolUse.of(Tools.of([weather]), template_source)
        >>> prompt = template.render(use.messages(messages), **use.variables())
        >>> reader = use.text(); reader.feed(answer_text); rest, content, calls = reader.finish()
    """

    tools: Tools
    format: ToolFormat
    specials: dict[str, int] = field(default_factory=dict)

    @classmethod
    def of(cls, tools: Tools, template: str, specials: dict[str, int] | None = None) -> ToolUse:
        """The use of ``tools`` with the chat template whose source is ``template`` (an unset
        ``parallel`` becomes the format's default); ``specials``: the model's special tokens by
        text, those of the format's markers kept."""
        from dataclasses import replace

        format = tool_format(template)
        marks = {m: specials[m] for m in format.used_markers(template) if specials and m in specials}
        return cls(tools if tools.parallel is not None else replace(tools, parallel=format.parallel), format, marks)

    def messages(self, messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
        return self.format.messages(messages, self.tools)

    def variables(self) -> dict[str, Any]:
        """The template's variables: ``tools`` as transformers passes them."""
        return {"tools": [dict(f) for f in self.tools.functions]}

    def config(self, config: Any, **changes: Any) -> Any:
        """``config`` (a GenerationConfig) with the answer held to the format's grammar (and
        ``changes`` to its other fields, in the same ``replace``)."""
        from dataclasses import replace

        if config.response_format is not None:
            raise ConfigError("tools and response_format both shape the answer, and only one can; leave response_format "
                              'out (a call\'s arguments already fit its schema), or pass tool_choice="none".')
        if self.specials:  # the calls' markers are special tokens, which the text must keep to be read
            changes = {**changes, "skip_special_tokens": False}
        try:
            grammar = self.format.grammar(self.tools, self.specials)
            return replace(config, response_format={"type": "grammar", "grammar": grammar}, **changes)
        except ConfigError as e:  # a parameters schema llguidance cannot use: its words, not the grammar's listing
            detail = getattr(e, "detail", str(e)).split(" 1 | ")[0].strip()
            raise ConfigError(f"the tools' parameters cannot be used ({detail}); fix the function's parameters "
                              "JSON Schema.") from None

    def text(self) -> ToolText:
        """The reader of one answer as it streams."""
        return ToolText(self.format, self.tools)
