"""How each family of chat templates has the model write a call (:class:`ToolFormat`, one
class a family, chosen from the template by :func:`tool_format`): the grammar that holds an
answer, and the calls read back out of it."""

from __future__ import annotations

import hashlib
import json
import re
from typing import Any

from slimml.runtime.tasks.generation import harmony
from slimml.runtime.tasks.generation.tools.calls import NAME, ToolCall, Tools, closed, template_messages
from slimml.runtime.tasks.generation.tools.scan import (SPACE, CallSpan, json_or_none, listed, parse_call, string_begun,
                                                        text_before, value_end)

_CLOSE = re.compile(r"\s*</tool_call>")
_NINE = re.compile(r"[A-Za-z0-9]{9}")  # a call id as Mistral's templates take it
_ALNUM = "0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz"
_RESPONSE = re.compile(r'\s*\{\s*"response"\s*:\s*"')
_CALLS = re.compile(r'\s*\{\s*"tool_calls"\s*:\s*\[\s*')
_GRAMMAR_WS = " \t\n"  # the whitespace the formats' grammars allow around a call
_WS = r"[ ]?"  # JSON whitespace in a call: compact (pretty-printed calls cost a small model a third more tokens)


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
                      f'c{k}: "{f["name"]}" type? <|message|> a{k}', f"a{k}: {_json(closed(f.get('parameters')))}"]
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
                start = SPACE.match(text, m.start).end()
                if text.startswith("{", start):
                    out.append(CallSpan(start, value_end(text, start, memo), m.recipient.removeprefix("functions.")))
        return out

    def parse(self, text: str) -> tuple[str, list[ToolCall]]:
        calls = []
        for m in harmony.messages(text, True):
            if m.recipient is not None and m.recipient.startswith("functions."):  # ended by <|call|>, an end id
                arguments = json_or_none(m.body.strip())  # cut off by max_new_tokens: no call
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
        return text_before(text, self.marker)

    def calls(self, text: str, memo: dict | None = None) -> list[CallSpan]:
        out, at = [], 0
        while (k := text.find(self.marker, at)) >= 0:
            start = SPACE.match(text, k + len(self.marker)).end()
            if start == len(text):
                break
            end = value_end(text, start, memo)
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
            call = parse_call(json.dumps(value), "arguments") if close else None
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
        return [CallSpan(start, value_end(text, start, memo))] if text.startswith("{", start) else []

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
        call = parse_call(body, "parameters") if body.startswith("{") else None
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
        return text_before(text, self.marker)

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
        at = SPACE.match(text, k + len(self.marker)).end() if k >= 0 else len(text)
        return listed(text, SPACE.match(text, at + 1).end(), memo) if text.startswith("[", at) else []

    def parse(self, text: str) -> tuple[str, list[ToolCall]]:
        k = text.find(self.marker)
        if k < 0:
            return text.strip(), []
        # the whole calls (a list cut off by max_new_tokens keeps those before the cut, as they streamed)
        calls = [parse_call(text[c.start : c.end], "arguments") for c in self.calls(text) if c.end is not None]
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
        rules = [f'c{k}: "{f["name"]}" ({call_id} ID)? {args} {_json(closed(f.get("parameters")))}'
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
            end = value_end(text, m.end(), memo)
            out.append(CallSpan(m.end(), end, m.group(1)))
            at = SPACE.match(text, end).end() if end is not None else -1
        return out

    def parse(self, text: str) -> tuple[str, list[ToolCall]]:
        k = text.find(self.marker)
        if k < 0:
            return text.strip(), []
        calls = [(c.name, json_or_none(text[c.start : c.end])) for c in self.calls(text) if c.end is not None]
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
        return string_begun(text, m.end(), read) if m else ""

    def calls(self, text: str, memo: dict | None = None) -> list[CallSpan]:
        m = _CALLS.match(text)
        return listed(text, m.end(), memo) if m else []

    def parse(self, text: str) -> tuple[str, list[ToolCall]]:
        try:
            value = json.loads(text)
        except (ValueError, RecursionError):  # cut by max_new_tokens: the response begun, a call begun is dropped
            return (self.content(text), []) if text.lstrip().startswith("{") else (text, [])
        if isinstance(value, dict) and isinstance(value.get("response"), str):
            return value["response"], []
        found = value.get("tool_calls") if isinstance(value, dict) else None
        calls = [c for c in (parse_call(json.dumps(x), "arguments") for x in found or []) if c is not None]
        return ("", calls) if calls else (text, [])


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


def _json(schema: dict[str, Any]) -> str:
    """``%json {...}`` with JSON whitespace bounded."""
    return "%json " + json.dumps({**schema, "x-guidance": {"whitespace_pattern": _WS}})
