"""OpenAI's Responses API (``POST /v1/responses``): requests read into a chat, replies written as
output items, whole or streamed as typed events.

The Responses API is what OpenAI's newer clients and agent frameworks speak (the ``openai``
package's ``client.responses``, the Agents SDK): ``input`` (a text, or items: messages, the
model's earlier ``function_call`` s and ``reasoning``, the tools' ``function_call_output`` s),
``instructions``, ``max_output_tokens``, function ``tools`` (flat: ``{"type": "function", "name",
"parameters"}``), ``text.format`` and ``reasoning.effort``. A request is read into a chat body and
checked as one (:func:`slimml.serve.openai.completion_request`), so the two endpoints answer the
same conversation alike. The reply comes back as output items in the order it was written: a
``reasoning`` item (the thoughts), a ``message`` (the text), ``function_call`` s.

This server keeps no responses: ``previous_response_id`` and ``conversation`` are refused (send
the whole conversation in ``input``), and ``store`` is answered ``false``. Streamed, the events are
OpenAI's (``response.created``, ``response.output_item.added``, ``response.output_text.delta``,
``response.function_call_arguments.delta``, ..., ``response.completed`` or ``response.incomplete``),
each with its ``sequence_number``, as the ``openai`` client's ``responses.stream`` puts them together.
"""

from __future__ import annotations

import time
import uuid
from typing import Any

from slimml.errors import FeedError, RequestError
from slimml.runtime.tasks.generation.reply import Reply, ReplyDelta
from slimml.runtime.tasks.generation.tools import call_arguments
from slimml.runtime.tasks.limits import shown
from slimml.serve.openai import CompletionRequest, completion_request, refuse_other_fields, sse

# fields the chat checks take as they are (slimml's and vLLM's sampling extras among them)
_SHARED = ("temperature", "top_p", "parallel_tool_calls", "stream", "seed", "stop", "top_k", "min_p", "repetition_penalty",
           "typical_p", "epsilon_cutoff", "eta_cutoff", "no_repeat_ngram_size", "min_tokens", "presence_penalty", "frequency_penalty",
           "logit_bias", "chat_template_kwargs")
_ROLES = ("user", "assistant", "system", "developer")
_TEXT_PARTS = ("input_text", "output_text", "text")


def responses_request(data: dict[str, Any], max_tokens_limit: int) -> tuple[CompletionRequest, dict[str, Any]]:
    """The checked chat request of a Responses body, and the request's settings as a response
    echoes them (``instructions``, ``tools``, ``tool_choice``, ...)."""
    for key, fix in (("previous_response_id", "this server keeps no responses; send the whole conversation in input"),
                     ("conversation", "this server keeps no conversations; send the whole conversation in input"),
                     ("prompt", "send the instructions and input themselves"),
                     ("background", "send the request without it and keep the connection open (or stream)")):
        if data.get(key) not in (None, False):
            raise RequestError(f'"{key}" is not supported by this server; {fix}.', param=key)
    if data.get("include"):
        raise RequestError(f'"include" {shown(data["include"])} is not supported by this server (no log-probabilities, '
                           "hosted tools or encrypted reasoning); leave it out.", param="include")
    if data.get("top_logprobs") not in (None, 0):
        raise RequestError('"top_logprobs" is not supported by this server\'s Responses API (no log-probabilities); leave '
                           "it out, or ask POST /v1/chat/completions with logprobs.", param="top_logprobs")
    if data.get("truncation") not in (None, "disabled"):
        raise RequestError('"truncation" must be "disabled": a conversation longer than the context is refused with its '
                           "length, never cut; shorten input.", param="truncation")
    try:
        refuse_other_fields(data, {  # the Responses API's flat tool shapes
            "functions": 'send "tools": [{"type": "function", "name", "description", "parameters"}]',
            "function_call": 'send "tool_choice" ("auto", "required" or {"type": "function", "name": ...})'})
    except RequestError as e:
        raise in_terms(e) from None
    body: dict[str, Any] = {k: data[k] for k in _SHARED if k in data}
    body["messages"] = _messages(data.get("input"), data.get("instructions"))
    limit = data.get("max_output_tokens")
    if limit is not None:
        if isinstance(limit, bool) or not isinstance(limit, int) or not 1 <= limit <= max_tokens_limit:
            raise RequestError(f'"max_output_tokens" must be a whole number from 1 to {max_tokens_limit} (this '
                               f"server's limit, set by slimml serve --max-new-tokens), got {shown(limit)}.",
                               param="max_output_tokens")
        body["max_tokens"] = limit
    tools = _tools(data.get("tools"))
    if tools is not None:
        body["tools"] = tools
    if data.get("tool_choice") is not None:
        body["tool_choice"] = _tool_choice(data["tool_choice"])
    format = _format(data.get("text"))
    if format is not None:
        body["response_format"] = format
    reasoning = data.get("reasoning")
    if reasoning is not None:
        if not isinstance(reasoning, dict):
            raise RequestError('"reasoning" must be an object such as {"effort": "low"}.', param="reasoning")
        if reasoning.get("effort") is not None:
            body["reasoning_effort"] = reasoning["effort"]
    try:
        req = completion_request(body, True, max_tokens_limit)
    except RequestError as e:
        raise in_terms(e) from None
    echo = {"instructions": data.get("instructions"), "max_output_tokens": limit, "tools": data.get("tools") or [],
            "tool_choice": data.get("tool_choice") or "auto", "parallel_tool_calls": data.get("parallel_tool_calls", True),
            "temperature": data.get("temperature", 1.0), "top_p": data.get("top_p", 1.0),
            "text": data.get("text") or {"format": {"type": "text"}}, "reasoning": reasoning,
            "metadata": data.get("metadata") or {}, "user": data.get("user")}
    return req, echo


_NAMES = {"max_tokens": "max_output_tokens", "response_format": "text.format", "reasoning_effort": "reasoning.effort",
          "shorten messages": "shorten input", '"messages"': '"input"', "].function.": "]."}


def in_terms(e: RequestError) -> RequestError:
    """A refusal of the chat request a Responses body was read into, in the Responses API's terms
    (its fields' names; a message's number, which ``input`` items do not keep, as ``input``)."""
    message, param = str(e), e.param
    for chat, name in _NAMES.items():
        message = message.replace(chat, name)
    if param is not None:
        head = param.split("[")[0].split(".")[0]
        param = "input" if head == "messages" else _NAMES.get(head, head) + param[len(head):].replace("].function.", "].")
    return RequestError(message, e.status, param=param)


def _messages(items: Any, instructions: Any) -> list[dict[str, Any]]:
    """``input`` (and ``instructions``, a system message first) as chat messages: an assistant's
    ``function_call`` s join its message as ``tool_calls``, a ``reasoning`` item its
    ``reasoning_content``, a ``function_call_output`` becomes a ``tool`` message."""
    if instructions is not None and not isinstance(instructions, str):
        raise RequestError(f'"instructions" must be a string, got {shown(instructions)}.', param="instructions")
    if isinstance(items, str):
        items = [{"role": "user", "content": items}]
    if not isinstance(items, list) or not items:
        raise RequestError('a Responses request needs "input": a text, or a non-empty list of items ({"role": "user", '
                           '"content": ...}, function_call_output, ...).', param="input")
    out: list[dict[str, Any]] = [{"role": "system", "content": instructions}] if instructions else []
    thoughts: str | None = None  # a reasoning item's text, for the assistant message it precedes
    for i, item in enumerate(items):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise RequestError(f'"{where}" must be an object (a message or a function call item), got {shown(item)}.',
                               param=where)
        kind = item.get("type") or "message"
        if kind == "message":
            role = item.get("role")
            if role is None:
                raise RequestError(f'"{where}" has no "type" and no "role"; give a message its role ({{"role": "user", '
                                   '"content": ...}) or an item its type ("function_call_output", ...).', param=where)
            if role not in _ROLES:
                raise RequestError(f'"{where}".role {shown(role)} is not a known role; use one of {", ".join(_ROLES)}.',
                                   param=f"{where}.role")
            message: dict[str, Any] = {"role": role, "content": _text(item.get("content"), f"{where}.content")}
            if role == "assistant" and thoughts is not None:
                message["reasoning_content"] = thoughts
            thoughts = None  # thoughts belong to the assistant message right after them
            out.append(message)
        elif kind == "function_call":
            name, arguments, call_id = item.get("name"), item.get("arguments", "{}"), item.get("call_id")
            if not isinstance(name, str) or not isinstance(arguments, str) or not isinstance(call_id, str):
                raise RequestError(f'"{where}" (a function_call) needs "call_id", "name" and "arguments" (JSON text) as '
                                   "strings.", param=where)
            try:
                call_arguments(arguments)
            except FeedError as e:  # named by its item, not by the chat message it becomes
                raise RequestError(f'"{where}" {e}', param=f"{where}.arguments") from None
            call = {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}
            last = out[-1] if out else None
            if last is not None and last["role"] == "assistant" and thoughts is None:
                last.setdefault("tool_calls", []).append(call)  # the calls of one reply, after its text
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call],  # no text: as OpenAI's client sends it
                            **({"reasoning_content": thoughts} if thoughts is not None else {})})
                thoughts = None
        elif kind == "function_call_output":
            call_id, output = item.get("call_id"), item.get("output")
            if not isinstance(call_id, str):
                raise RequestError(f'"{where}" (a function_call_output) needs "call_id", the call it answers.', param=where)
            out.append({"role": "tool", "tool_call_id": call_id,
                        "content": output if isinstance(output, str) else _text(output, f"{where}.output")})
        elif kind == "reasoning":
            parts = []
            for key in ("content", "summary"):
                value = item.get(key) or []
                if not isinstance(value, list):
                    raise RequestError(f'"{where}.{key}" must be a list of {{"type": "reasoning_text", "text": ...}} '
                                       f"parts, got {shown(value)}.", param=f"{where}.{key}")
                parts += value
            text = "\n\n".join(p["text"] for p in parts if isinstance(p, dict) and isinstance(p.get("text"), str))
            thoughts = text or None
        else:
            raise RequestError(f'"{where}" is a {shown(kind)} item, which this server does not take; send messages, '
                               "function_call, function_call_output and reasoning items.", param=where)
    if all(m["role"] in ("system", "developer") for m in out):
        raise RequestError('"input" has no message to answer; add at least one {"role": "user", "content": ...}.',
                           param="input")
    return out


def _text(content: Any, where: str) -> str:
    """A message's content: a string, or text parts (``input_text``, ``output_text``)."""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and content and all(
            isinstance(p, dict) and p.get("type") in _TEXT_PARTS and isinstance(p.get("text"), str) for p in content):
        return "".join(p["text"] for p in content)
    raise RequestError(f'"{where}" must be a string or a list of {{"type": "input_text", "text": ...}} parts; this model '
                       f"takes text only, got {shown(content)}.", param=where)


def _tools(tools: Any) -> list[dict[str, Any]] | None:
    """Function tools in the chat shape (``{"type": "function", "function": {...}}``); hosted
    tools (web search, file search, ...) are refused."""
    if tools is None or tools == []:
        return None
    if not isinstance(tools, list):
        raise RequestError('"tools" must be a list of {"type": "function", "name": ..., "parameters": {...}}.', param="tools")
    out = []
    for i, t in enumerate(tools):
        if isinstance(t, dict) and t.get("type") == "function" and isinstance(t.get("function"), dict):
            out.append(t)  # the chat completions' shape, taken as it is
            continue
        if not isinstance(t, dict) or t.get("type") != "function":
            kind = t.get("type") if isinstance(t, dict) else t
            raise RequestError(f'"tools"[{i}] is a {shown(kind)} tool; this server runs none of OpenAI\'s hosted tools, '
                               'only functions: {"type": "function", "name": ..., "parameters": {...}}.', param=f"tools[{i}]")
        out.append({"type": "function", "function": {k: t[k] for k in ("name", "description", "parameters") if k in t}})
    return out


def _tool_choice(choice: Any) -> Any:
    if isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    if choice in ("auto", "required", "none"):
        return choice
    raise RequestError(f'"tool_choice" must be "auto", "required", "none" or {{"type": "function", "name": ...}}, got '
                       f"{shown(choice)}.", param="tool_choice")


def _format(text: Any) -> dict[str, Any] | None:
    """``text.format`` as chat's ``response_format``."""
    if text is None:
        return None
    if not isinstance(text, dict):
        raise RequestError(f'"text" must be an object such as {{"format": {{"type": "json_object"}}}}, got {shown(text)}.',
                           param="text")
    format = text.get("format")
    if format is None:
        return None
    if not isinstance(format, dict) or format.get("type") not in ("text", "json_object", "json_schema"):
        raise RequestError('"text.format" must be {"type": "text"}, {"type": "json_object"} or {"type": "json_schema", '
                           f'"name": ..., "schema": {{...}}}}, got {shown(format)}.', param="text.format")
    if format["type"] == "json_schema":
        if not isinstance(format.get("schema"), dict):
            raise RequestError('"text.format" json_schema needs its JSON Schema as an object under "schema": '
                               '{"type": "json_schema", "name": ..., "schema": {...}}.', param="text.format")
        return {"type": "json_schema", "json_schema": {"name": format.get("name", "answer"), "schema": format.get("schema")}}
    return {"type": format["type"]}


class ResponseAnswer:
    """One request's response: whole (:meth:`reply`), or as stream events (:meth:`opening`, then
    :meth:`events` per piece of the reply, then :meth:`ending` or :meth:`failure`)."""

    def __init__(self, echo: dict[str, Any], model: str):
        self.echo = echo
        self.model = model
        self.id = "resp_" + uuid.uuid4().hex[:24]
        self.created = int(time.time())
        self.output: list[dict[str, Any]] = []  # items written so far (streamed), the open one last
        self.open: tuple | None = None  # the open item: ("reasoning" | "message", None) or ("call", its index)
        self.calls: dict[int, int] = {}  # a call's index -> its item's place in the output
        self.sequence = 0

    def body(self, status: str, output: list[dict[str, Any]], usage: tuple[int, int, int] | None = None,
             incomplete: str | None = None, error: str | None = None) -> dict[str, Any]:
        """The response object (``usage``: prompt, completion and cached tokens)."""
        body = {"id": self.id, "object": "response", "created_at": self.created, "status": status, "model": self.model,
                "output": output, "error": {"code": "server_error", "message": error} if error else None,
                "incomplete_details": {"reason": incomplete} if incomplete else None, "store": False,
                "previous_response_id": None, "truncation": "disabled", **self.echo,
                "usage": None}
        if usage is not None:
            prompt, completion, cached = usage
            body["usage"] = {"input_tokens": prompt, "input_tokens_details": {"cached_tokens": cached, "cache_write_tokens": 0},
                             "output_tokens": completion, "output_tokens_details": {"reasoning_tokens": 0},
                             "total_tokens": prompt + completion}
        return body

    def reply(self, reply: Reply, finish_reason: str, usage: tuple[int, int, int], entries: list | None = None) -> dict[str, Any]:
        """The non-streamed response to a whole reply (``usage``: prompt, completion and cached
        tokens; no log-probabilities: ``include`` is refused)."""
        items = [_reasoning_item(reply.reasoning, "completed")] if reply.reasoning else []
        if reply.content or not (items or reply.calls):  # a reply with nothing else is an empty message
            items.append(_message_item(reply.content, "completed"))
        items += [_call_item(c.id, c.name, c.arguments_text, "completed") for c in reply.calls]
        return self._final(items, finish_reason, usage)

    def _final(self, items: list[dict[str, Any]], finish_reason: str, usage: tuple[int, int, int]) -> dict[str, Any]:
        if finish_reason == "length":
            if items:  # the item the limit cut (the ones before it were done)
                items[-1]["status"] = "incomplete"
            return self.body("incomplete", items, usage, incomplete="max_output_tokens")
        return self.body("completed", items, usage)

    # the stream

    def _event(self, kind: str, **fields: Any) -> bytes:
        self.sequence += 1
        return f"event: {kind}\n".encode() + sse({"type": kind, "sequence_number": self.sequence - 1, **fields})

    def opening(self) -> list[bytes]:
        """The events before any piece: the response created, in progress."""
        body = self.body("in_progress", [])
        return [self._event("response.created", response=body), self._event("response.in_progress", response=body)]

    def events(self, delta: ReplyDelta, entries: list | None = None) -> list[bytes]:
        """The events of a piece of the reply: its thoughts, its text, pieces of its calls (each in
        its own output item, opened as the reply moves on to it)."""
        out, calls = [], list(delta.calls)
        while calls and calls[0].name is None:  # more of a call begun in an earlier piece, written before this piece's text
            out += self._arguments(calls.pop(0))
        if delta.reasoning:
            out += self._to(("reasoning", None), lambda: _reasoning_item("", "in_progress"))
            item = self.output[-1]
            item["content"][0]["text"] += delta.reasoning
            out.append(self._event("response.reasoning_text.delta", item_id=item["id"], output_index=len(self.output) - 1,
                                   content_index=0, delta=delta.reasoning))
        if delta.content:
            out += self._to(("message", None), lambda: _message_item("", "in_progress"))
            item = self.output[-1]
            item["content"][0]["text"] += delta.content
            out.append(self._event("response.output_text.delta", item_id=item["id"], output_index=len(self.output) - 1,
                                   content_index=0, delta=delta.content, logprobs=[]))
        for piece in calls:
            if piece.name is not None:
                out += self._to(("call", piece.index), lambda p=piece: _call_item(p.id, p.name, "", "in_progress"))
                self.calls[piece.index] = len(self.output) - 1
            out += self._arguments(piece)
        return out

    def _arguments(self, piece: Any) -> list[bytes]:
        """The event of more of a call's arguments, into the item of its call."""
        index = self.calls.get(piece.index)
        if not piece.arguments or index is None:
            return []
        item = self.output[index]
        item["arguments"] += piece.arguments
        return [self._event("response.function_call_arguments.delta", item_id=item["id"], output_index=index,
                            delta=piece.arguments)]

    def ending(self, finish_reason: str, usage: tuple[int, int, int], entries: list | None = None) -> list[bytes]:
        """The last events: the open item done, the response completed (or incomplete at
        ``max_output_tokens``)."""
        cut = finish_reason == "length"
        if not self.output:  # a reply with nothing in it is an empty message, as a whole one is
            out = self._to(("message", None), lambda: _message_item("", "in_progress"))
        else:
            out = []
        out += self._close("incomplete" if cut else "completed")
        body = self._final([dict(item) for item in self.output], finish_reason, usage)
        return out + [self._event("response.incomplete" if body["status"] == "incomplete" else "response.completed",
                                  response=body)]

    def failure(self, message: str, status: int = 500) -> list[bytes]:
        """The events of a generation that failed: an error, the response failed (its code is
        ``server_error`` whatever the ``status``, as the Responses API's stream words a server's failure)."""
        return [self._event("error", code="server_error", message=message, param=None),
                self._event("response.failed", response=self.body("failed", self.output, error=message))]

    def _to(self, key: tuple, make) -> list[bytes]:
        """Events that open the item ``key`` (closing the one open before), none if it is open."""
        if self.open == key:
            return []
        out = self._close()
        item = make()
        self.output.append(item)
        self.open = key
        index = len(self.output) - 1
        fresh = {**item, "content": []} if item["type"] != "function_call" else item
        out.append(self._event("response.output_item.added", output_index=index, item=fresh))
        if item["type"] == "message":
            out.append(self._event("response.content_part.added", item_id=item["id"], output_index=index, content_index=0,
                                   part={"type": "output_text", "text": "", "annotations": []}))
        return out

    def _close(self, status: str = "completed") -> list[bytes]:
        if self.open is None:
            return []
        item, index = self.output[-1], len(self.output) - 1
        item["status"] = status
        out = []
        if item["type"] == "message":
            part = item["content"][0]
            out += [self._event("response.output_text.done", item_id=item["id"], output_index=index, content_index=0,
                                text=part["text"], logprobs=[]),
                    self._event("response.content_part.done", item_id=item["id"], output_index=index, content_index=0,
                                part=part)]
        elif item["type"] == "reasoning":
            out.append(self._event("response.reasoning_text.done", item_id=item["id"], output_index=index, content_index=0,
                                   text=item["content"][0]["text"]))
        else:
            out.append(self._event("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                                   name=item["name"], arguments=item["arguments"]))
        out.append(self._event("response.output_item.done", output_index=index, item=item))
        self.open = None
        return out


def _reasoning_item(text: str, status: str) -> dict[str, Any]:
    return {"type": "reasoning", "id": "rs_" + uuid.uuid4().hex[:24], "summary": [],
            "content": [{"type": "reasoning_text", "text": text}], "status": status}


def _message_item(text: str, status: str) -> dict[str, Any]:
    return {"type": "message", "id": "msg_" + uuid.uuid4().hex[:24], "status": status, "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": []}]}


def _call_item(call_id: str, name: str, arguments: str, status: str) -> dict[str, Any]:
    return {"type": "function_call", "id": "fc_" + uuid.uuid4().hex[:24], "call_id": call_id, "name": name,
            "arguments": arguments, "status": status}

