"""Reading an answer's JSON as it streams: where a value begun at an offset ends (or None
while unfinished), a string's value so far, the calls of a JSON list, and a whole call parsed."""

from __future__ import annotations

import json
import re
from typing import Any, NamedTuple

from slimml.runtime.tasks.generation.tools.calls import ToolCall

SPACE = re.compile(r"\s*")
_COMMA = re.compile(r"\s*,\s*")
_JSON_MARK = re.compile(r'["{}\[\]]')  # where a string or a bracket begins
_STRING_REST = re.compile(r'[^"\\]*(?:\\.[^"\\]*)*("?)')  # a string's text to its closing quote (group 1), or so far
_HIGH_SURROGATE = re.compile(r"\\u[dD][89abAB][0-9a-fA-F]{2}")
_STRING_BODY = re.compile(r'(?:[^"\\]|\\["\\/bfnrt]|\\u[0-9a-fA-F]{4})*')


class CallSpan(NamedTuple):
    """Where one call begun in an answer has its JSON: from ``start`` to ``end`` (None while
    unfinished). ``name``: None where the JSON is the whole call (``{"name": ..., "arguments":
    {...}}``); else the function's name, read from around it, and the JSON its arguments alone."""

    start: int
    end: int | None
    name: str | None = None


def listed(text: str, at: int, memo: dict | None = None) -> list[CallSpan]:
    """The calls of a JSON list whose first item begins at ``text[at]``, each a whole
    ``{"name", "arguments"}`` object (the last one's ``end`` None while unfinished)."""
    out = []
    while text.startswith("{", at):
        end = value_end(text, at, memo)
        out.append(CallSpan(at, end))
        comma = _COMMA.match(text, end) if end is not None else None
        if comma is None:
            break
        at = comma.end()
    return out


def text_before(text: str, marker: str) -> str:
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


def value_end(text: str, start: int, memo: dict | None = None) -> int | None:
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


def string_begun(text: str, start: int, read: list | None = None) -> str:
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


def json_or_none(text: str) -> Any:
    """The JSON value of ``text``, or None where it is not JSON (a call cut off by max_new_tokens)."""
    try:
        return json.loads(text)
    except (ValueError, RecursionError):
        return None


def parse_call(text: str, arguments: str) -> ToolCall | None:
    try:
        value = json.loads(text)
    except (ValueError, RecursionError):
        return None
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    args = value.get(arguments, value.get("arguments", value.get("parameters", {})))
    return ToolCall(value["name"], args) if isinstance(args, dict) else None
