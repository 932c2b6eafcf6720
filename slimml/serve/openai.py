"""OpenAI's chat and completions bodies: requests parsed and checked, responses and stream chunks built.

Framework-free, like :mod:`slimml.serve.protocol`: every refusal is a
:class:`~slimml.errors.RequestError` (a 4xx whose message names the problem and the fix), which
the app turns into OpenAI's error body. The shapes follow OpenAI's API reference for
``POST /v1/chat/completions`` and ``POST /v1/completions``: ``n`` must be 1, ``stream`` sends
server-sent events ending with ``data: [DONE]``, ``stream_options.include_usage`` adds a last
chunk with ``usage`` and no choices.
"""

from __future__ import annotations

import math
import re
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable

from slimml.errors import ConfigError, FeedError, RequestError
from slimml.runtime.tasks.generation.config import MAX_STOP_CHARS
from slimml.runtime.tasks.generation.reply import Reply, ReplyDelta
from slimml.runtime.tasks.generation.tools import CallDelta, ToolCall, Tools, template_messages
from slimml.runtime.tasks.limits import shown, surrogate_at
from slimml.serve.protocol import BEAM_SEARCH_HERE, error_body

ROLES = ("system", "user", "assistant", "tool", "developer")
MAX_STOP = 4  # OpenAI's limit on "stop" strings
MAX_LOGIT_BIAS = 1024  # token ids a request may bias
_EFFORT = re.compile(r"[a-z]{1,16}")  # OpenAI's reasoning_effort: "none", "minimal", "low", "medium", "high", ...
# chat template variables the server sets itself, which chat_template_kwargs may not replace
_SET_BY_SERVER = frozenset({"messages", "tools", "add_generation_prompt", "continue_final_message", "bos_token",
                            "eos_token", "raise_exception", "strftime_now", "model", "self"})
MAX_TOP_LOGPROBS = {True: 20, False: 5}  # chat's top_logprobs, completions' logprobs: OpenAI's limits


@dataclass
class CompletionRequest:
    """One chat or completions request, checked.

    Attributes:
        chat: True for ``/v1/chat/completions`` (``messages``), False for ``/v1/completions`` (``prompt``).
        messages: the chat messages (``{"role", "content"}``), for chat.
        prompt: the prompt text (completions) or token ids.
        max_tokens: tokens to generate at most (None: up to the context; completions: 16, OpenAI's default).
        temperature, top_p, top_k, min_p, repetition_penalty, seed: sampling (temperature 0 is greedy).
        typical_p, epsilon_cutoff, eta_cutoff: transformers' truncation samplers (1, 0 and 0: off).
        no_repeat_ngram_size: never repeat an n-gram of this many tokens (transformers'; 0: off).
        min_tokens: the end ids cannot end the answer before this many tokens (vLLM's; stop strings still
            stop; 0: off).
        presence_penalty, frequency_penalty: OpenAI's penalties on the answer's own tokens.
        logit_bias: ``{token id: bias}`` added to the logits (OpenAI's; from -100 to 100), or None.
        logprobs: None, or return each token's log-probability with this many alternatives (chat:
            ``logprobs: true`` and ``top_logprobs``; completions: ``logprobs``).
        response_format: None (free text), or the format the answer is held to (``json_object``,
            ``json_schema``, slimml's ``regex`` and ``grammar``), checked.
        stop: up to 4 strings that end the answer (not included in it).
        tools: chat only: the functions the model may call, checked with ``tool_choice`` and
            ``parallel_tool_calls`` (None: none, or ``tool_choice`` "none").
        template_kwargs: chat only: more variables for the chat template (``chat_template_kwargs``,
            as vLLM and llama.cpp's server take it, e.g. ``{"enable_thinking": false}``).
        stream: send server-sent events; include_usage: a last chunk with ``usage``.
    """

    chat: bool
    messages: list[dict[str, str]] | None = None
    prompt: str | list[int] | None = None
    max_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    typical_p: float = 1.0
    epsilon_cutoff: float = 0.0
    eta_cutoff: float = 0.0
    repetition_penalty: float = 1.0
    no_repeat_ngram_size: int = 0
    min_tokens: int = 0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[int, float] | None = None
    logprobs: int | None = None
    response_format: dict[str, Any] | None = None
    tools: Tools | None = None
    template_kwargs: dict[str, Any] = field(default_factory=dict)
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stream: bool = False
    include_usage: bool = False


# fields a request leaving them out takes from the model's generation config (as vLLM does), else OpenAI's defaults
MODEL_DEFAULTS = ("temperature", "top_p", "top_k", "min_p", "typical_p", "epsilon_cutoff", "eta_cutoff", "repetition_penalty",
                  "no_repeat_ngram_size")
MAX_NO_REPEAT = 64  # a served request's no_repeat_ngram_size at most
COMPLETIONS_MAX_TOKENS = 16  # /v1/completions without max_tokens, as OpenAI documents it


def completion_request(data: dict[str, Any], chat: bool, max_tokens_limit: int) -> CompletionRequest:
    """Check a chat (``chat=True``) or completions request body; ``max_tokens_limit`` is the
    server's cap on ``max_tokens`` (the context is checked once the prompt is tokenized). Fields
    this server does not use are ignored, as OpenAI's are; those that would change the answer
    in a way it cannot give (``echo``, ``best_of``) are refused."""
    req = CompletionRequest(chat=chat)
    _refuse_unsupported(data, chat)
    if chat:
        req.messages = _messages(data)
    else:
        req.prompt = _prompt(data)
    n = data.get("n")
    if n is not None and (n != 1 or isinstance(n, bool)):  # null: the default, as for every other field
        raise RequestError(f'"n" must be 1: this server returns one choice a request, got {shown(n)}; send n separate '
                           "requests (with different seeds) for several answers.", param="n")
    key = "max_completion_tokens" if chat and data.get("max_completion_tokens") is not None else "max_tokens"
    mt = data.get(key)
    if mt is not None:
        if isinstance(mt, bool) or not isinstance(mt, int) or not 1 <= mt <= max_tokens_limit:
            raise RequestError(f'"{key}" must be a whole number from 1 to {max_tokens_limit} (this server\'s '
                               f"limit, set by slimml serve --max-new-tokens), got {shown(mt)}.", param=key)
        req.max_tokens = mt
    elif not chat:  # OpenAI's (and vLLM's) legacy completions default: 16 tokens; a chat's runs to the context
        req.max_tokens = min(COMPLETIONS_MAX_TOKENS, max_tokens_limit)
    req.temperature = _number(data, "temperature", 1.0, 0.0, 2.0, "from 0 to 2 (0 is greedy)")
    req.top_p = _number(data, "top_p", 1.0, 0.0, 1.0, "in (0, 1]", open_low=True)
    req.min_p = _number(data, "min_p", 0.0, 0.0, 1.0, "from 0 to 1 (0: off)")
    req.typical_p = _number(data, "typical_p", 1.0, 0.0, 1.0, "in (0, 1] (1: off)", open_low=True)
    req.epsilon_cutoff = _number(data, "epsilon_cutoff", 0.0, 0.0, 1.0, "in [0, 1) (0: off)", open_high=True)
    req.eta_cutoff = _number(data, "eta_cutoff", 0.0, 0.0, 1.0, "in [0, 1) (0: off)", open_high=True)
    req.repetition_penalty = _number(data, "repetition_penalty", 1.0, 0.0, 10.0, "in (0, 10]", open_low=True)
    req.presence_penalty = _number(data, "presence_penalty", 0.0, -2.0, 2.0, "from -2 to 2")
    req.frequency_penalty = _number(data, "frequency_penalty", 0.0, -2.0, 2.0, "from -2 to 2")
    req.logit_bias = _logit_bias(data.get("logit_bias"))
    req.logprobs = _logprobs(data, chat)
    req.response_format = _response_format(data.get("response_format"))
    req.tools = _tools(data, chat)
    req.template_kwargs = _template_kwargs(data.get("chat_template_kwargs"), chat)
    effort = data.get("reasoning_effort")
    if effort is not None and chat:  # OpenAI's ("low", "medium", "high", ...); a reasoning model's template reads it (gpt-oss's)
        if not isinstance(effort, str) or not _EFFORT.fullmatch(effort):
            raise RequestError(f'"reasoning_effort" must be a word such as "low", "medium" or "high", got {shown(effort)}.',
                               param="reasoning_effort")
        req.template_kwargs.setdefault("reasoning_effort", effort)
    if req.tools is not None and req.logprobs is not None:
        raise RequestError('"logprobs" with "tools" is not supported by this server; leave out one of them.', param="logprobs")
    req.top_k = _count(data, "top_k")
    req.min_tokens = _count(data, "min_tokens", max_tokens_limit)
    if req.max_tokens is not None and req.min_tokens > req.max_tokens:
        raise RequestError(f'"min_tokens" ({req.min_tokens}) must not be above "{key}" ({req.max_tokens}'
                           f'{"" if key in data else ", the default"}); lower it, or send a larger "{key}".',
                           param="min_tokens")
    # its index holds n - 1 tokens a prompt position, built on the batch's thread: summaries use 3 or 4
    req.no_repeat_ngram_size = _count(data, "no_repeat_ngram_size", MAX_NO_REPEAT)
    seed = data.get("seed")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int) or not -2**63 <= seed < 2**63):
        raise RequestError(f'"seed" must be a whole number from -2**63 to 2**63-1, got {shown(seed)}.', param="seed")
    req.seed = None if seed is None else seed % 2**64  # OpenAI's signed 64-bit seed; the sampler's is unsigned
    req.stop = _stop(data.get("stop"))
    stream = data.get("stream", False)
    if stream is None:
        stream = False
    if not isinstance(stream, bool):
        raise RequestError(f'"stream" must be true or false, got {shown(stream)}.', param="stream")
    req.stream = stream
    options = data.get("stream_options")
    if options is not None:
        if not isinstance(options, dict):
            raise RequestError('"stream_options" must be an object such as {"include_usage": true}.', param="stream_options")
        if not stream:
            raise RequestError('"stream_options" is only allowed with "stream": true; add "stream": true or drop it.',
                               param="stream_options")
        usage = options.get("include_usage")
        usage = False if usage is None else usage  # null is the default, as for every other field
        if not isinstance(usage, bool):
            raise RequestError('"stream_options.include_usage" must be true or false.', param="stream_options")
        req.include_usage = usage
    return req


def _refuse_unsupported(data: dict[str, Any], chat: bool) -> None:
    """Refuse the OpenAI fields that would change the answer in a way this server cannot give
    (echo, several candidates), rather than ignore them and answer something else than asked;
    their "off" values pass."""
    modalities = data.get("modalities")
    asks = {
        "echo": data.get("echo") not in (None, False),
        "best_of": data.get("best_of") not in (None, 1),
        "suffix": not chat and data.get("suffix") not in (None, ""),  # completions' field; chat has none
        "modalities": modalities is not None and (not isinstance(modalities, list) or any(m != "text" for m in modalities)),
        "audio": data.get("audio") is not None,
    }
    fixes = {"echo": "leave it out (the prompt is what you sent)",
             "best_of": "leave it out, or send 1",
             "suffix": "leave it out (this server continues a prompt; it does not fill in text before a suffix)",
             "modalities": 'this model answers in text: send ["text"] or leave it out',
             "audio": "this model answers in text: leave it out"}
    for key, asked in asks.items():
        if asked:
            raise RequestError(f'"{key}" {shown(data[key])} is not supported by this server; {fixes[key]}.', param=key)
    refuse_other_fields(data)


def refuse_other_fields(data: dict[str, Any], fixes: dict[str, str] | None = None) -> None:
    """Refuse a field of another API (:data:`OTHER_FIELDS`; ``fixes``: an endpoint's own words for some)
    that asks for something this server would not do."""
    for key, (off, fix) in OTHER_FIELDS.items():
        asked = data.get(key)
        if key == "do_sample" and asked is False and data.get("temperature") == 0:
            continue  # greedy, and said so in this API's terms too
        if key in data and asked not in off:
            raise RequestError(f'"{key}" is not read by this server, and leaving it unread would answer otherwise than '
                               f"asked; {(fixes or {}).get(key, fix)}.", param=key)


# fields of other APIs (transformers' generate, OpenAI's deprecated function calling, hosted tools) that a client
# may send here expecting them read: each refused, with what to send instead, unless it asks for what happens anyway
OTHER_FIELDS = {
    "max_new_tokens": ((None,), 'send "max_tokens"'),
    "min_new_tokens": ((None, 0), 'send "min_tokens" (vLLM\'s name: the end token is held back until that many)'),
    "do_sample": ((None, True), 'send "temperature": 0 for greedy decoding (sampling is the default)'),
    "num_return_sequences": ((None, 1), "send one request per answer (with different seeds)"),
    **{key: (off, f"this server decodes token by token; {BEAM_SEARCH_HERE}")  # (length_penalty alone changes nothing)
       for key, off in (("num_beams", (None, 1)), ("use_beam_search", (None, False)))},
    "functions": ((None, []), 'OpenAI\'s deprecated function calling: send "tools": [{"type": "function", "function": '
                              '{"name", "description", "parameters"}}]'),
    "function_call": ((None, "none"), 'OpenAI\'s deprecated function calling: send "tool_choice" ("auto", "required" '
                                      'or {"type": "function", "function": {"name": ...}})'),
    "web_search_options": ((None,), "this server has no web search: leave it out"),
}


def _tools(data: dict[str, Any], chat: bool) -> Tools | None:
    """``tools``, ``tool_choice`` and ``parallel_tool_calls``, checked (chat only)."""
    tools, choice = data.get("tools"), data.get("tool_choice")
    if not chat:
        if tools or choice not in (None, "none"):
            raise RequestError('"tools" are for POST /v1/chat/completions; send the request there with "messages".',
                               param="tools")
        return None
    try:
        return Tools.of(tools, choice, data.get("parallel_tool_calls"))
    except ConfigError as e:
        text = str(e)
        param = next((k for k in ("tool_choice", "parallel_tool_calls") if text.startswith(k)), "tools")
        raise RequestError(text, param=param) from None


def _response_format(value: Any) -> dict[str, Any] | None:
    """OpenAI's ``response_format`` (``text``, ``json_object``, ``json_schema``; slimml's ``regex``
    and ``grammar`` too). Its schema or grammar is compiled off the event loop, with the request's
    generation settings (``GenerationConfig``): one that cannot be used fails its own request, 400."""
    if value is None or (isinstance(value, dict) and value.get("type") == "text"):
        return None
    if not isinstance(value, dict):
        raise RequestError(f'"response_format" must be an object such as {{"type": "json_object"}}, got {shown(value)}.',
                           param="response_format")
    return value


def _logprobs(data: dict[str, Any], chat: bool) -> int | None:
    """The alternatives to return beside each token's log-probability, or None (off): chat's
    ``logprobs: true`` with ``top_logprobs`` (0 to 20), completions' ``logprobs`` (0 to 5)."""
    most = MAX_TOP_LOGPROBS[chat]
    if chat:
        on, top = data.get("logprobs"), data.get("top_logprobs")
        if on is not None and not isinstance(on, bool):
            raise RequestError(f'"logprobs" must be true or false, got {shown(on)}.', param="logprobs")
        if top is not None:
            if isinstance(top, bool) or not isinstance(top, int) or not 0 <= top <= most:
                raise RequestError(f'"top_logprobs" must be a whole number from 0 to {most}, got {shown(top)}.',
                                   param="top_logprobs")
            if not on:
                raise RequestError('"top_logprobs" needs "logprobs": true; add it, or drop "top_logprobs".',
                                   param="top_logprobs")
        return (top or 0) if on else None
    k = data.get("logprobs")
    if k is None:
        return None
    if isinstance(k, bool) or not isinstance(k, int) or not 0 <= k <= most:
        raise RequestError(f'"logprobs" must be a whole number from 0 to {most} (the alternatives to return beside each '
                           f"token) or null, got {shown(k)}.", param="logprobs")
    return k


def _messages(data: dict[str, Any]) -> list[dict[str, str]]:
    messages = data.get("messages")
    if not isinstance(messages, list) or not messages:
        raise RequestError('a chat request needs "messages": a non-empty list of {"role": ..., "content": ...}.',
                           param="messages")
    out = []
    for i, m in enumerate(messages):
        calls = m.get("tool_calls") if isinstance(m, dict) else None
        if not isinstance(m, dict) or "role" not in m or ("content" not in m and not calls):
            raise RequestError(f'"messages"[{i}] must be an object with "role" and "content", got '
                               f"{shown(m)}.", param=f"messages[{i}]")
        role, content = m["role"], m.get("content")
        if role not in ROLES:
            raise RequestError(f'"messages"[{i}].role {shown(role)} is not a known role; use one of {", ".join(ROLES)}.',
                               param=f"messages[{i}].role")
        if isinstance(content, list):  # OpenAI's content parts: only text parts are understood here
            if not content:
                raise RequestError(f'"messages"[{i}].content is an empty list of parts; send at least one '
                                   '{"type": "text", "text": ...} part, or the content as a string.',
                                   param=f"messages[{i}].content")
            texts = []
            for part in content:
                if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise RequestError(f'"messages"[{i}].content has a part that is not {{"type": "text", "text": ...}}; '
                                       "this model takes text only: send text parts, or the content as a string.",
                                       param=f"messages[{i}].content")
                texts.append(part["text"])
            content = "".join(texts)
        if content is None and role == "assistant" and not calls:  # a call turn keeps None (the template decides)
            content = ""
        if not isinstance(content, str) and not (content is None and role == "assistant"):
            raise RequestError(f'"messages"[{i}].content must be a string or a list of text parts, got {shown(content)}.',
                               param=f"messages[{i}].content")
        message: dict[str, Any] = {"role": role, "content": content}
        if calls:  # an assistant's calls, read by the chat template (arguments as objects)
            if role != "assistant" or not isinstance(calls, list):
                raise RequestError(f'"messages"[{i}].tool_calls must be a list, on an assistant message.',
                                   param=f"messages[{i}].tool_calls")
            message["tool_calls"] = calls
            try:
                template_messages([message], first=i)
            except FeedError as e:
                raise RequestError(str(e), param=f"messages[{i}].tool_calls") from None
        if role == "tool" and m.get("tool_call_id") is not None and not isinstance(m["tool_call_id"], str):
            raise RequestError(f'"messages"[{i}].tool_call_id must be a string: the id of the call this message '
                               f"answers, as the assistant's tool_calls gave it; got {shown(m['tool_call_id'])}.",
                               param=f"messages[{i}].tool_call_id")
        for key in ("tool_call_id", "name", "reasoning_content"):  # Qwen3's template reads an answer's thoughts
            if isinstance(m.get(key), str):
                message[key] = m[key]
        out.append(message)
    return out


def _prompt(data: dict[str, Any]) -> str | list[int]:
    prompt = data.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # OpenAI allows a list of prompts; one is what n=1 answers
    if isinstance(prompt, str):
        if not prompt:
            raise RequestError('"prompt" is empty; give the text to continue.', param="prompt")
        return prompt
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return prompt
    if isinstance(prompt, list) and len(prompt) > 1 and all(isinstance(p, (str, list)) for p in prompt):
        raise RequestError(f'"prompt" holds {len(prompt)} prompts; send one prompt a request.', param="prompt")
    if isinstance(prompt, list) and prompt and any(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        bad = next(t for t in prompt if isinstance(t, bool) or not isinstance(t, int))
        raise RequestError(f'"prompt" as token ids must hold whole numbers only, got {shown(bad)} among them; send a text '
                           "or a list of token ids.", param="prompt")
    raise RequestError('a completions request needs "prompt": a non-empty text (or a list of token ids).', param="prompt")


def _number(data: dict[str, Any], key: str, default: float, low: float, high: float, what: str,
            open_low: bool = False, open_high: bool = False) -> float:
    v = data.get(key, default)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) \
            or v < low or v > high or (open_low and v <= low) or (open_high and v >= high):
        raise RequestError(f'"{key}" must be a number {what}, got {shown(v)}.', param=key)
    return float(v)


def _count(data: dict[str, Any], key: str, most: int = 1 << 20) -> int:
    """A whole-number sampling extra (``top_k``, ``no_repeat_ngram_size``) from 0 to ``most``: absent or null is 0 (off)."""
    v = data.get(key)
    if v is None:
        return 0
    if isinstance(v, bool) or not isinstance(v, int) or v < 0 or v > most:
        limit = f"from 0 to {most}" if most < 1 << 20 else ">= 0"
        raise RequestError(f'"{key}" must be a whole number {limit} (0: off), got {shown(v)}.', param=key)
    return v


def _template_kwargs(value: Any, chat: bool) -> dict[str, Any]:
    """``chat_template_kwargs``: an object of variables for the chat template, none of the ones
    the server sets itself."""
    if value is None or value == {}:
        return {}
    if not chat:
        raise RequestError('"chat_template_kwargs" is for POST /v1/chat/completions; leave it out of a completions '
                           "request.", param="chat_template_kwargs")
    if not isinstance(value, dict):
        raise RequestError(f'"chat_template_kwargs" must be an object of template variables, e.g. {{"enable_thinking": '
                           f"false}}, got {shown(value)}.", param="chat_template_kwargs")
    taken = sorted(set(value) & _SET_BY_SERVER)
    if taken:
        raise RequestError(f'"chat_template_kwargs" sets {shown(taken[0])}, which the server sets itself; send it in its own '
                           "field (messages, tools) or leave it out.", param="chat_template_kwargs")
    if not all(isinstance(k, str) and k.isidentifier() for k in value):
        raise RequestError('"chat_template_kwargs" keys must be names (letters, digits and _).', param="chat_template_kwargs")
    return dict(value)


def _logit_bias(value: Any) -> dict[int, float] | None:
    """``logit_bias``: ``{"<token id>": bias}`` with biases from -100 to 100 (the vocabulary is
    checked with the prompt)."""
    if value is None or value == {}:
        return None
    if not isinstance(value, dict) or len(value) > MAX_LOGIT_BIAS:
        raise RequestError(f'"logit_bias" must be an object of at most {MAX_LOGIT_BIAS} token ids and their biases '
                           f'from -100 to 100, e.g. {{"50256": -100}}, got {shown(value)}.', param="logit_bias")
    out = {}
    for key, bias in value.items():
        token = key.strip() if isinstance(key, str) else ""
        if not (token.isascii() and token.isdigit()) or len(token) > 18:  # 19+ digits: no vocabulary (nor int()) holds it
            raise RequestError(f'"logit_bias" has the key {shown(key)}, which is not a token id; use the ids of this '
                               'model\'s tokenizer as keys, e.g. {"50256": -100}.', param="logit_bias")
        if isinstance(bias, bool) or not isinstance(bias, (int, float)) or not -100 <= bias <= 100:
            raise RequestError(f'"logit_bias" gives token {token} the bias {shown(bias)}; a bias is a number from -100 '
                               "to 100.", param="logit_bias")
        out[int(token)] = float(bias)
    return out


def _stop(stop: Any) -> list[str]:
    if stop is None:
        return []
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
        raise RequestError('"stop" must be a non-empty string or a list of non-empty strings.', param="stop")
    if len(stops) > MAX_STOP:
        raise RequestError(f'"stop" has {len(stops)} strings; at most {MAX_STOP} are allowed: keep the ones that matter.',
                           param="stop")
    for i, s in enumerate(stops):
        if len(s) > MAX_STOP_CHARS:  # before the tokenizer, which holds the GIL for seconds on megabytes
            raise RequestError(f'"stop" string {i} has {len(s):,} characters, more than {MAX_STOP_CHARS:,}; an answer stops '
                               "on a short piece of text: send the few words it ends on.", param="stop")
        if (at := surrogate_at(s)) is not None:  # JSON's "\ud800"
            raise RequestError(f'"stop" string {i} is not valid Unicode (a lone surrogate at position {at}); send '
                               "text without one.", param="stop")
    return list(stops)


class Answer:
    """Builds the response bodies and stream chunks of one request."""

    def __init__(self, req: CompletionRequest, model: str, token_bytes: Callable[[int], bytes] | None = None):
        self.req = req
        self.model = model
        self.token_bytes = token_bytes  # a token id's own bytes, for log-probabilities
        self.id = ("chatcmpl-" if req.chat else "cmpl-") + uuid.uuid4().hex[:24]
        self.created = int(time.time())
        self._first = True

    def _head(self, kind: str) -> dict[str, Any]:
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model}

    @staticmethod
    def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict[str, Any]:
        """OpenAI's usage; ``cached_tokens``: prompt tokens whose cache the prefix store held."""
        return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                "total_tokens": prompt_tokens + completion_tokens, "prompt_tokens_details": {"cached_tokens": cached_tokens}}

    def logprobs(self, entries: list | None) -> dict[str, Any] | None:
        """OpenAI's ``logprobs`` of a choice for ``entries``, pairs of a :class:`TokenLogprob` and
        where its token's text begins in the answer; None when the request did not ask: chat's
        ``content`` list, completions' parallel lists (``text_offset`` from those beginnings)."""
        if self.req.logprobs is None or entries is None:
            return None
        if self.req.chat:
            content = []
            for e, _ in entries:
                text, raw = self._show(e.id)
                top = [{"token": t, "logprob": lp, "bytes": list(b)} for t, b, lp in ((*self._show(i), lp) for i, lp in e.top)]
                content.append({"token": text, "logprob": e.logprob, "bytes": list(raw), "top_logprobs": top})
            return {"content": content, "refusal": None}
        return {"tokens": [self._show(e.id)[0] for e, _ in entries], "token_logprobs": [e.logprob for e, _ in entries],
                "top_logprobs": [{self._show(i)[0]: lp for i, lp in e.top} for e, _ in entries],
                "text_offset": [start for _, start in entries]}

    def _show(self, token: int) -> tuple[str, bytes]:
        """A token as OpenAI shows it: its text, or ``bytes:\\xNN...`` where its bytes are part of a
        character (not UTF-8 alone); and its bytes."""
        raw = self.token_bytes(token) if self.token_bytes is not None else b""
        try:
            return raw.decode("utf-8"), raw
        except UnicodeDecodeError:
            return "bytes:" + "".join(f"\\x{b:02x}" for b in raw), raw

    def whole(self, text: str, finish_reason: str, prompt_tokens: int, completion_tokens: int,
              cached_tokens: int = 0, logprobs: list | None = None, tool_calls: list[ToolCall] | None = None,
              reasoning: str | None = None) -> dict[str, Any]:
        """The non-streamed response; ``logprobs``: the answer's entries (see :meth:`logprobs`);
        ``tool_calls``: the calls the model made (the message's ``content`` is then the rest, or null);
        ``reasoning``: a reasoning model's thoughts (``message.reasoning_content``)."""
        if self.req.chat:
            message: dict[str, Any] = {"role": "assistant", "content": text}
            if tool_calls:
                message = {"role": "assistant", "content": text or None, "tool_calls": [c.openai() for c in tool_calls]}
            elif self.req.tools is not None and not text and finish_reason == "length":  # the call it began, cut off
                message["content"] = None
            if reasoning is not None:
                message["reasoning_content"] = reasoning
            choice = {"index": 0, "message": message, "logprobs": self.logprobs(logprobs), "finish_reason": finish_reason}
            body = self._head("chat.completion")
        else:
            choice = {"index": 0, "text": text, "logprobs": self.logprobs(logprobs), "finish_reason": finish_reason}
            body = self._head("text_completion")
        body["choices"] = [choice]
        body["usage"] = self.usage(prompt_tokens, completion_tokens, cached_tokens)
        return body

    def chunk(self, text: str, finish_reason: str | None = None, logprobs: list | None = None,
              reasoning: str | None = None) -> dict[str, Any]:
        """One streamed piece of text (or the last, with its finish reason); ``logprobs``: the
        entries (see :meth:`logprobs`) of the tokens whose text begins in this piece; ``reasoning``:
        a piece of a reasoning model's thoughts instead (``delta.reasoning_content``)."""
        if self.req.chat:
            delta: dict[str, Any] = {"content": text} if text or finish_reason is None else {}
            if reasoning:
                delta = {"reasoning_content": reasoning}
            if self._first:
                delta = {"role": "assistant", **delta}
            self._first = False
            body = self._head("chat.completion.chunk")
            body["choices"] = [{"index": 0, "delta": delta, "logprobs": self.logprobs(logprobs),
                                "finish_reason": finish_reason}]
        else:
            body = self._head("text_completion")
            body["choices"] = [{"index": 0, "text": text, "logprobs": self.logprobs(logprobs),
                                "finish_reason": finish_reason}]
        if self.req.include_usage:
            body["usage"] = None
        return body

    def tool_chunk(self, pieces: list[CallDelta]) -> dict[str, Any]:
        """Pieces of a streamed chat answer's calls (``delta.tool_calls``: a call's first piece with
        its ``index``, ``id`` and name, the next ones more of its arguments)."""
        delta: dict[str, Any] = {"tool_calls": [p.openai() for p in pieces]}
        if self._first:
            delta = {"role": "assistant", "content": None, **delta}
        self._first = False
        body = self._head("chat.completion.chunk")
        body["choices"] = [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": None}]
        if self.req.include_usage:
            body["usage"] = None
        return body

    def reply(self, reply: Reply, finish_reason: str, usage: tuple[int, int, int], entries: list | None = None) -> dict[str, Any]:
        """The non-streamed response to a whole reply (``usage``: prompt, completion and cached tokens)."""
        return self.whole(reply.content, finish_reason, *usage, entries, tool_calls=list(reply.calls) or None,
                          reasoning=reply.reasoning)

    def opening(self) -> list[bytes]:
        """The events before any piece of a stream: none."""
        return []

    def events(self, delta: ReplyDelta, entries: list | None = None) -> list[bytes]:
        """The events of a piece of a streamed reply: its thoughts, its text (with the entries of
        its tokens' log-probabilities), and pieces of its calls."""
        out = [sse(self.chunk("", reasoning=delta.reasoning))] if delta.reasoning else []
        if delta.content or entries:
            out.append(sse(self.chunk(delta.content, logprobs=entries)))
        if delta.calls:
            out.append(sse(self.tool_chunk(list(delta.calls))))
        return out

    def ending(self, finish_reason: str, usage: tuple[int, int, int], entries: list | None = None) -> list[bytes]:
        """The last events: the finish reason, the usage (``stream_options.include_usage``), ``[DONE]``."""
        out = [sse(self.chunk("", finish_reason, entries))]
        if self.req.include_usage:
            out.append(sse(self.usage_chunk(*usage)))
        return out + [sse("[DONE]")]

    @staticmethod
    def failure(message: str, status: int = 500) -> list[bytes]:
        """The events of a generation that failed: OpenAI's error body, ``[DONE]``."""
        return [sse(error_body(message, status)), sse("[DONE]")]

    def usage_chunk(self, prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict[str, Any]:
        """The last chunk of ``stream_options.include_usage``: no choices, the usage."""
        body = self._head("chat.completion.chunk" if self.req.chat else "text_completion")
        body["choices"] = []
        body["usage"] = self.usage(prompt_tokens, completion_tokens, cached_tokens)
        return body


def sse(body: dict[str, Any] | str) -> bytes:
    """One server-sent event: ``data: <json>`` and a blank line (``data: [DONE]`` for the string)."""
    if isinstance(body, str):
        return f"data: {body}\n\n".encode()
    import orjson

    return b"data: " + orjson.dumps(body) + b"\n\n"
