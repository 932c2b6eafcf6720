"""The functions a chat may call (:class:`Tools`, checked), the calls a model made
(:class:`ToolCall`, and :class:`CallDelta` as they stream), and a conversation's earlier calls as
chat templates take them."""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

from slimml.errors import ConfigError, FeedError
from slimml.runtime.tasks.generation.chat import Arguments
from slimml.runtime.tasks.limits import shown, surrogate_at

NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")  # OpenAI's rule for a function's name (fullmatch)
MAX_DEPTH = 64  # JSON levels of one function's parameters schema (llguidance's own limit is lower for schemas)


@dataclass(frozen=True)
class ToolCall:
    """One call the model made: the function's ``name``, its ``arguments`` (parsed JSON, fitting
    the function's schema) and an ``id`` that the tool's answer refers back to; ``text``: the
    arguments' JSON as the model wrote it, where read (None: written again from ``arguments``)."""

    name: str
    arguments: dict[str, Any]
    id: str = field(default_factory=lambda: "call_" + uuid.uuid4().hex[:24])
    text: str | None = field(default=None, compare=False, repr=False)

    @property
    def arguments_text(self) -> str:
        """The arguments as JSON text: as the model wrote them (what their streamed pieces add up to), else written again."""
        return self.text if self.text is not None else json.dumps(self.arguments, ensure_ascii=False)

    def openai(self) -> dict[str, Any]:
        """OpenAI's shape: ``{"id", "type": "function", "function": {"name", "arguments": "<JSON>"}}``."""
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments_text}}


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
        return cls(index, call.arguments_text, call.id, call.name)


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
            parameters = dict(closed(f.get("parameters")))
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


def closed(parameters: dict[str, Any] | None) -> dict[str, Any]:
    """A function's parameters schema with no arguments beyond those it declares, unless it says
    otherwise (``additionalProperties``), as OpenAI's strict function calling has it: a function
    called with one it does not take fails, and a small model held to an open object keeps
    inventing more of them until the answer runs out."""
    if not parameters:
        return {"type": "object", "properties": {}, "additionalProperties": False}
    if "properties" in parameters and "additionalProperties" not in parameters:
        return {**parameters, "additionalProperties": False}
    return parameters
