"""A replica's language-model service: OpenAI chat and completions over one continuous batch.

Requests are checked on their own (a bad one fails alone), then wait for the decode worker, a
thread that runs :class:`~slimml.runtime.tasks.generation.continuous.ContinuousBatch`: between two
steps it admits the waiting sequences (prefilled together in one pass, up to ``prefill_tokens``
prompt tokens a step, so that a burst of new requests does not stall the running answers), then
steps every running sequence in one pass. Prompts that begin with text the replica read before
prefill only the rest (the batch's prefix store). Text reaches each request's event loop as it is made, for server-sent
events or the whole answer. A client that goes away cancels its sequence, which leaves the batch
at the next step with its cache. Beyond ``max_running`` decoding and ``max_waiting`` queued, a
request gets 429 with ``Retry-After``.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import threading
from collections import deque
from collections.abc import AsyncIterator
from typing import Any

from slimml.errors import (ConfigError, FeedError, IntegrityError, NoChatTemplateError, OutOfMemoryError, RequestError,
                           SlimmlError)
from slimml.runtime.tasks.generation.config import GenerationConfig
from slimml.runtime.tasks.generation.continuous import PREFILL_TOKENS, ContinuousBatch, Sequence
from slimml.runtime.tasks.generation.defaults import model_settings
from slimml.runtime.tasks.generation.reply import Reply, ReplyDelta, ReplyFormat, ReplyReader
from slimml.runtime.tasks.generation.tools import finish_reason
import slimml.serve.openai as openai
import slimml.serve.responses as responses

RETRY_AFTER_S = 1  # what a 429 tells a client to wait


class DecodeWorker:
    """The thread that owns the running batch: admits waiting sequences between steps."""

    def __init__(self, model: Any, max_running: int, max_waiting: int, prefill_tokens: int = PREFILL_TOKENS,
                 prefix_bytes: int = 0):
        self.batch = ContinuousBatch(model, max_batch=max_running, prefill_tokens=prefill_tokens, prefix_bytes=prefix_bytes)
        self.max_waiting = max_waiting
        self.capacity = max_running + max_waiting  # answers in the batch, being admitted, or queued
        self._inflight = 0
        self._waiting: deque[Sequence] = deque()
        self._wake = threading.Condition()
        self._stopped = False
        self._thread = threading.Thread(target=self._run, name="slimml-decode", daemon=True)
        self._thread.start()

    def submit(self, seq: Sequence) -> None:
        """Queue ``seq`` for the next step; 429 when the batch and the queue are full."""
        with self._wake:
            if self._inflight >= self.capacity:
                raise RequestError(f"the server is busy: {self._inflight} answers are being generated or wait for a "
                                   f"place; retry in {RETRY_AFTER_S} s (or start the server with a larger "
                                   "--max-waiting).", 429)
            self._inflight += 1
            done = seq.on_done

            def on_done(s: Sequence) -> None:
                with self._wake:
                    self._inflight -= 1
                done(s)

            seq.on_done = on_done
            self._waiting.append(seq)
            self._wake.notify()

    @property
    def load(self) -> dict[str, Any]:
        """Sequences running and waiting, the bytes of the running batch's KV cache, the prefix
        store's figures (bytes held, prompt tokens looked up and reused), and the replica's
        resident memory (Linux; None elsewhere)."""
        prefix = self.batch.prefix.stats if self.batch.prefix is not None else None
        return {"running": len(self.batch.rows) + (self.batch.filling is not None), "waiting": len(self._waiting),
                "cache_bytes": self.batch.cache_bytes,
                "prefix": prefix, "rss_bytes": _rss()}

    def close(self) -> None:
        with self._wake:
            self._stopped = True
            self._wake.notify()
        self._thread.join(timeout=30)

    def _run(self) -> None:
        batch = self.batch
        while True:
            with self._wake:
                while not self._stopped and not self._waiting and not batch.busy:
                    self._wake.wait()
                if self._stopped:
                    break
                joining = batch.take(self._waiting)  # the prefill budget's worth, oldest first
            try:
                if joining:
                    batch.admit(joining)
                batch.step()
            except Exception as e:  # noqa: BLE001 - a bug here must end the requests, not hang them
                for s in joining:
                    if s.finish_reason is None:
                        ContinuousBatch._end(s, "error", e)
                batch.cancel_all(e)
        batch.cancel_all()
        for s in self._waiting:
            ContinuousBatch._end(s, "cancelled")


class LLMService:
    """Chat and completions for one causal-LM model in a replica.

    Args:
        model: the loaded causal-LM task.
        name: the model name clients send.
        max_tokens: the most tokens one request may ask for.
        max_running: sequences decoding together (the batch).
        max_waiting: requests queued for the batch before 429.
        max_text_chars: characters of a prompt (all messages together) at most; more gets 413.
        prefill_tokens: prompt tokens prefilled between two decode steps (at least one prompt).
        prompt_lookup: guessed positions a pass may add while one answer runs alone (0: off).
        prefix_bytes: KV cache kept for prompts that begin with text read before (0: none).
        reasoning: "split": a reasoning model's thoughts (``<think>`` blocks) answer as
            ``reasoning_content``, apart from the content; "keep": left in the content.
    """

    def __init__(self, model: Any, name: str, max_tokens: int, max_running: int, max_waiting: int,
                 max_text_chars: int = 16_384, prefill_tokens: int = PREFILL_TOKENS, prompt_lookup: int = 0,
                 prefix_bytes: int = 0, reasoning: str = "split"):
        self.model = model
        self.reasoning = reasoning
        self.prompt_lookup = prompt_lookup
        self.name = name
        self.max_tokens = max_tokens
        self.max_text_chars = max_text_chars
        self.worker = DecodeWorker(model, max_running, max_waiting, prefill_tokens, prefix_bytes)
        # for the sampling fields a request leaves out: the model's generation config (as vLLM takes it), else
        # generate()'s own defaults (top-k 50, as transformers and llama.cpp's server cut), so that a request
        # answers as in-process generate() with the same options
        self.sampling = {}
        for key, value in model_settings(model).items():
            if key in openai.MODEL_DEFAULTS:
                try:  # a value a request may not send (a temperature of 2.5) would refuse every request that leaves it out
                    openai.completion_request({"prompt": "x", key: value}, False, 1)
                    self.sampling[key] = value
                except RequestError as e:
                    logging.getLogger("slimml").warning("slimml: the model's generation config is left out for %s (%s)",
                                                        key, e)
        self._token_bytes = None  # TokenBytes, made on the first request that asks for log-probabilities

    async def answer(self, data: dict[str, Any], api: str = "chat"):
        """The response to a ``chat`` (completions), ``completions`` or ``responses`` body (OpenAI's
        three APIs): a whole JSON body, or an async iterator of server-sent events when the request
        streams."""
        if isinstance(data, dict) and self.sampling:  # a body that is not an object is refused by the checks below
            data = {**data, **{k: v for k, v in self.sampling.items() if data.get(k) is None}}
        if api == "responses":
            req, echo = responses.responses_request(data, self.max_tokens)
        else:
            req = openai.completion_request(data, api == "chat", self.max_tokens)
        chat = req.chat
        chars = sum(len(m["content"] or "") for m in req.messages) if chat else (  # token ids: the context bounds them
            len(req.prompt) if isinstance(req.prompt, str) else 0)
        if chat:  # an assistant's calls, and the tools' descriptions, become prompt text too
            chars += sum(len(json.dumps(m["tool_calls"])) for m in req.messages if m.get("tool_calls"))
        if req.tools is not None:
            chars += len(json.dumps(req.tools.functions))
        if req.template_kwargs:
            chars += len(json.dumps(req.template_kwargs))
        if chars > self.max_text_chars:  # before any tokenizing: a prompt is never cut, it is refused
            raise RequestError(f"the prompt has {chars} characters, more than this server takes ({self.max_text_chars}); "
                               "shorten it, or start the server with a larger --max-text-chars.", 413,
                               param="messages" if req.chat else "prompt")
        events: asyncio.Queue = asyncio.Queue()
        token_bytes = await asyncio.to_thread(self._bytes_of_tokens) if req.logprobs is not None else None
        try:
            seq, reader = await asyncio.to_thread(self._sequence, req, asyncio.get_running_loop(), events.put_nowait)
        except RequestError as e:  # the format or the prompt, refused in the terms of the request's API
            raise responses.in_terms(e) if api == "responses" else e from None
        self.worker.submit(seq)
        out = responses.ResponseAnswer(echo, self.name) if api == "responses" else openai.Answer(req, self.name, token_bytes)
        if req.stream:
            return self._stream(seq, events, out, reader)
        try:
            text = []
            while True:
                kind, value = await events.get()
                if kind == "text":
                    text.append(value)
                else:
                    break
        finally:
            seq.cancel()  # no-op once finished; a client gone mid-answer frees the batch's row
        self._raise_failure(seq)
        text = "".join(text)
        usage = (len(seq.ids), len(seq.tokens), seq.cached)
        if reader is None:
            return out.reply(Reply(text), seq.finish_reason, usage, _answer_logprobs(seq, 0, len(text))[0])
        reader.feed(text)  # the thoughts apart from the answer, and the calls (read whole by finish())
        reply = reader.finish()[1]
        return out.reply(reply, finish_reason(seq.finish_reason, list(reply.calls)), usage,
                         _answer_logprobs(seq, 0, len(text))[0] if reader.calls is None else None)

    def _bytes_of_tokens(self):
        if self._token_bytes is None:
            from slimml.runtime.tasks.generation.detokenize import TokenBytes
            from slimml.runtime.tasks.generation.prompts import untruncated

            if self.model.text is None:
                raise RequestError("this model has no tokenizer, so its tokens have no text to show log-probabilities "
                                   "for; leave out logprobs.", param="logprobs")
            self._token_bytes = TokenBytes(untruncated(self.model.text))
        return self._token_bytes

    def _sequence(self, req: openai.CompletionRequest, loop: asyncio.AbstractEventLoop,
                  put) -> tuple[Sequence, ReplyReader | None]:
        """The checked sequence of ``req``, whose text and end ``put`` hands to ``loop``, and the
        reader of its reply (None: its text is the answer). Runs on a thread: rendering and
        tokenizing."""
        from slimml.runtime.tasks.generate import chat_prompt, chat_template
        from slimml.runtime.tasks.generation.prompts import special_tokens

        form = ReplyFormat()  # a completion's: plain text
        if req.chat:
            try:
                template = chat_template(self.model)
                form = ReplyFormat.of(template.source, req.tools, self.reasoning, served=True,
                                      specials=special_tokens(self.model.text))
                messages = form.messages(template.known_roles(req.messages))
                prompt, raw = chat_prompt(self.model, messages, **form.variables(req.template_kwargs)), True
                # a reasoning model: no thoughts where a format holds the answer from its start
                prompt = form.prompt(prompt, formatted=req.response_format is not None)
            except FeedError as e:
                raise RequestError(str(e), param="messages") from None
            except NoChatTemplateError:
                raise RequestError("this model has no chat template; send a plain prompt to POST /v1/completions, or "
                                   "start the server with --chat-template FILE.") from None
            except SlimmlError as e:  # the template refused the messages: no paths in the body
                detail = str(e).replace(str(self.model.folder), "the model")
                raise RequestError(f"{detail} (POST /v1/completions takes a plain prompt.)") from None
        else:
            prompt, raw = req.prompt, False
        ids = self._ids(prompt, raw)
        context = self.model.engine.max_sequence_length
        if ids is not None and context is not None:  # in the request's own terms (no truncate=True over HTTP)
            _check_context(len(ids), req.max_tokens, context, "messages" if req.chat else "prompt")
        limit = req.max_tokens or self.max_tokens
        if req.max_tokens is None and context is not None and ids is not None:  # OpenAI's: up to the context
            limit = max(1, min(limit, context - len(ids)))
        try:  # the sampling fields are checked already; response_format's schema or grammar compiles here
            config = form.config(GenerationConfig(
                max_new_tokens=limit, temperature=req.temperature, top_p=req.top_p, top_k=req.top_k, min_p=req.min_p,
                typical_p=req.typical_p, epsilon_cutoff=req.epsilon_cutoff, eta_cutoff=req.eta_cutoff,
                repetition_penalty=req.repetition_penalty, no_repeat_ngram_size=req.no_repeat_ngram_size,
                min_new_tokens=min(req.min_tokens, limit), presence_penalty=req.presence_penalty, frequency_penalty=req.frequency_penalty, logit_bias=req.logit_bias,
                logprobs=req.logprobs,
                response_format=req.response_format, seed=req.seed, stop=tuple(req.stop), prompt_lookup=self.prompt_lookup))
        except ConfigError as e:
            param = "tools" if form.use is not None else "response_format" if "response_format" in str(e) else None
            raise RequestError(str(e), param=param) from None
        try:  # the prompt's length within the context, with max_tokens, and the format: refused here
            seq = self.worker.batch.prepare(
                prompt if ids is None else ids, config, raw_text=raw,
                on_text=lambda piece: loop.call_soon_threadsafe(put, ("text", piece)),
                on_done=lambda s: loop.call_soon_threadsafe(put, ("done", s)))
        except FeedError as e:  # the prompt (or a stop string) against the context and the batch's budget
            field = "stop" if str(e).startswith("stop") else "messages" if req.chat else "prompt"
            raise RequestError(str(e), param=field) from None
        except ConfigError as e:  # a response_format (or tools' grammar) this model's tokenizer cannot follow, a biased id
            param = "logit_bias" if str(e).startswith("logit_bias") else "tools" if form.use is not None else "response_format"
            raise RequestError(str(e), param=param) from None
        return seq, form.reader(prompt, pieces=req.stream) if form.reads else None

    def _ids(self, prompt: str | list[int], raw: bool) -> list[int] | None:
        """The prompt's token ids, as generation would encode it (None: the model has no tokenizer)."""
        if not isinstance(prompt, str):
            return prompt
        if self.model.text is None:
            return None
        from slimml.runtime.tasks.generation.prompts import check_unicode, untruncated

        try:
            check_unicode([prompt])
        except FeedError as e:
            raise RequestError(str(e), param="prompt") from None
        return untruncated(self.model.text).encode(prompt, add_special_tokens=not raw).ids

    async def _stream(self, seq: Sequence, events: asyncio.Queue, out: Any,
                      reader: ReplyReader | None = None) -> AsyncIterator[bytes]:
        """The events of a streamed answer, as ``out`` (an :class:`openai.Answer` or a
        :class:`responses.ResponseAnswer`) writes them: its opening, each piece of the reply, its end."""
        sent = shown = 0  # tokens whose log-probabilities went out; characters of the answer's text read
        tokens = reader is None or reader.calls is None  # log-probabilities go with the content (not with tools)
        try:
            for event in out.opening():
                yield event
            while True:
                kind, value = await events.get()
                if kind == "text":
                    shown += len(value)
                    entries, sent = _answer_logprobs(seq, sent, shown) if tokens else (None, sent)
                    for event in out.events(reader.feed(value) if reader is not None else ReplyDelta(content=value), entries):
                        yield event
                    continue
                if seq.finish_reason == "error":
                    for event in out.failure(_failure(seq), _failure_status(seq)):
                        yield event
                    return
                reason = seq.finish_reason
                if reader is not None:  # what the reader held: the end of the thoughts or of the content, calls whole
                    rest, reply = reader.finish()
                    for event in out.events(rest):
                        yield event
                    reason = finish_reason(reason, list(reply.calls))
                entries = _answer_logprobs(seq, sent, shown)[0] if tokens else None
                for event in out.ending(reason, (len(seq.ids), len(seq.tokens), seq.cached), entries):
                    yield event
                return
        finally:
            seq.cancel()  # the client went away (or the stream ended): the row leaves the batch

    @staticmethod
    def _raise_failure(seq: Sequence) -> None:
        if seq.finish_reason == "error":
            if isinstance(seq.error, IntegrityError):  # answered as every route answers a changed artifact
                raise seq.error
            raise RequestError(_failure(seq), _failure_status(seq))

    def close(self) -> None:
        self.worker.close()


def replica_bytes(manifest: Any, memory_budget: str | int, max_running: int, prefix_bytes: int = 0) -> int:
    """The memory one replica of a streamed language model asks Ray for: its weight budget, the
    KV cache of ``max_running`` answers at the model's full context (fp32 or the cache's dtype),
    and the prefix store's budget."""
    import numpy as np

    from slimml.runtime.engine.budget import parse_bytes

    context = int((manifest.source or {}).get("max_position_embeddings") or 2048)
    per_token = 0
    for t in manifest.inputs:  # past_key_values.N.key/value: (batch, kv_heads, past, head_dim)
        if t.name.startswith("past_key_values.") and all(isinstance(d, int) for d in (t.shape[1], t.shape[3])):
            per_token += t.shape[1] * t.shape[3] * np.dtype(t.dtype).itemsize
    return parse_bytes(memory_budget) + max_running * context * per_token + prefix_bytes


def _rss() -> int | None:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


def _check_context(tokens: int, max_tokens: int | None, context: int, field: str) -> None:
    """Refuse a prompt that leaves no room in the context, or no room for ``max_tokens``."""
    if tokens >= context:
        room = context - (max_tokens or 1)  # the longest prompt that leaves room for the answer asked for
        said = (f"shorten {field} to at most {room} tokens (with max_tokens={max_tokens})" if max_tokens and room > 0
                else f"shorten {field} to at most {context - 1} tokens" + (" and ask for fewer tokens (max_tokens)"
                                                                           if max_tokens else ""))
        raise RequestError(f"the prompt is {tokens} tokens, and this model's context is {context}, which leaves no room "
                           f"for an answer; {said}.", param=field)
    if max_tokens is not None and tokens + max_tokens > context:
        raise RequestError(f"the prompt's {tokens} tokens plus max_tokens={max_tokens} are more than this model's context "
                           f"of {context}; ask for at most {context - tokens} tokens, or shorten {field}.",
                           param="max_tokens")


def _answer_logprobs(seq: Sequence, start: int, shown: int) -> tuple[list, int]:
    """The log-probabilities of ``seq``'s tokens from ``start`` on whose text begins within the
    first ``shown`` characters of the answer handed out, as ``(entry, where its text begins)``
    pairs, and the index of the first token not taken. A token whose text is held back (it may
    begin a stop string) waits for its text; one cut with a stop string, or the end-of-sequence id
    that closed the answer, never comes (neither is part of the content)."""
    made = min(len(seq.logprobs), len(seq.starts))  # the decode thread appends to both
    out, i = [], start
    while i < made and seq.starts[i] < shown:
        if seq.logprobs[i].id not in seq.end_ids:
            out.append((seq.logprobs[i], seq.starts[i]))
        i += 1
    return out, i


def _failure(seq: Sequence) -> str:
    if isinstance(seq.error, OutOfMemoryError):  # the batch's pass could not allocate: every row of it ends so
        return ("the server ran out of memory for the batch this request was in; retry it, or ask for fewer tokens "
                "(max_tokens) or send a shorter prompt.")
    if isinstance(seq.error, IntegrityError):  # the artifact changed on disk: no retry helps, as /health says
        return str(seq.error)
    kind = type(seq.error).__name__ if seq.error is not None else "error"
    return f"generation failed ({kind}); the server logged it. Retry the request."


def _failure_status(seq: Sequence) -> int:
    """503 where the pass ran out of memory (retry later) or the artifact's files changed (every route
    answers 503 so, /health included, until the server is restarted); else 500: a failed generation
    is the server's."""
    return 503 if isinstance(seq.error, (OutOfMemoryError, IntegrityError)) else 500
