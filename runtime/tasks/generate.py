"""Text generation for decoder artifacts: greedy or sampled, stop strings and ids, streamed text,
chat templates, batches of prompts of different lengths.

The parts live in :mod:`slimml.runtime.tasks.generation`; this module puts them together:
prompts checked once -> the decode loop's passes -> the sampler -> per prompt, its stop ids,
its text as it comes and its stop strings. Either way a streamed model loads each shard once per
token (never once per layer per token), and prompts of different lengths are one batch, so one
pass serves them all (left-padded for a traced graph; right-padded, each row at its own position,
on the engine's in-place cache of a fused one).
"""

from __future__ import annotations

import threading
import time
import weakref
from collections.abc import Callable, Generator
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from slimml.errors import ConfigError, FeedError, SlimmlError
from slimml.runtime.tasks.generation.beams import search_beams
from slimml.runtime.tasks.generation.chat import ChatTemplate, check_messages, joined_text
from slimml.runtime.tasks.generation.config import GenerationConfig
from slimml.runtime.tasks.generation.defaults import model_settings
from slimml.runtime.tasks.generation.lookup import lookup_loop
from slimml.runtime.tasks.generation.loop import CacheLoop, DecodeLoop, decode_loop
from slimml.runtime.tasks.generation.prompts import Prompts, prepare, special_tokens
from slimml.runtime.tasks.generation.reply import ReplyDelta, ReplyFormat, ReplyReader
from slimml.runtime.tasks.generation.sampling import Sampler, TokenLogprob, token_logprobs
from slimml.runtime.tasks.generation.stopping import TextStream
from slimml.runtime.tasks.generation.tools import ToolCall, Tools, finish_reason, template_messages

_templates: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> its ChatTemplate, compiled once

__all__ = ["Generation", "GenerationConfig", "GenerationStream", "chat", "chat_prompt", "generate", "stream", "use_chat_template"]


@dataclass
class Generation:
    """What :func:`generate` returns.

    Attributes:
        tokens: per prompt, the new token ids (ending with, and including, the end-of-sequence or
            stop id, or the token that completed a stop string).
        texts: per prompt, the new text (without a stop string), when the prompts were strings.
        finish_reasons: per prompt, ``"stop"`` (an end id or a stop string) or ``"length"`` (max_new_tokens,
            or the model's context, reached), as OpenAI reports it; ``"cancelled"`` where ``cancel`` came first.
        seconds: wall time of the whole generation.
        passes: model passes run (one per new token; fewer where ``prompt_lookup`` guesses held).
        prompt_tokens: tokens in the prompts (without padding).
        cached_tokens: of those, the tokens whose KV cache was copied from the model's prefix
            store instead of prefilled (:meth:`CausalLM.prefix_cache`).
        prefill_s: wall time of the first pass (the prompts; time to the first token).
        reasoning: from ``chat`` with a reasoning model's template (``<think>`` blocks), per
            conversation, its thoughts (None where it wrote none); ``texts`` hold the answers.
        tool_calls: from ``chat(..., tools=...)``, per conversation, the
            :class:`~slimml.runtime.tasks.generation.tools.ToolCall` s the model made (their
            finish reason is ``"tool_calls"``; ``texts`` hold the rest of each answer).
        logprobs: with ``GenerationConfig.logprobs`` set, per prompt, one
            :class:`~slimml.runtime.tasks.generation.sampling.TokenLogprob` for each of ``tokens``
            (the chosen token's log-probability under the model and the most likely alternatives).
    """

    tokens: list[list[int]]
    texts: list[str] | None = None
    seconds: float = 0.0
    passes: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    prefill_s: float = 0.0
    extra: dict = field(default_factory=dict)
    finish_reasons: list[str] = field(default_factory=list)
    logprobs: list[list[TokenLogprob]] | None = None
    tool_calls: list[list[ToolCall]] | None = None
    reasoning: list[str | None] | None = None

    @property
    def tokens_per_s(self) -> float:
        """New tokens (all prompts together) per second of the whole generation."""
        return sum(len(t) for t in self.tokens) / self.seconds if self.seconds else 0.0

    @property
    def prefill_tokens_per_s(self) -> float:
        """Prompt tokens prefilled (not copied from the prefix store) per second of the first pass."""
        return (self.prompt_tokens - self.cached_tokens) / self.prefill_s if self.prefill_s else 0.0

    @property
    def decode_tokens_per_s(self) -> float:
        """New tokens per second after the first (each one pass over one position per prompt)."""
        later = sum(max(len(t) - 1, 0) for t in self.tokens)
        return later / (self.seconds - self.prefill_s) if self.seconds > self.prefill_s and later else 0.0


class GenerationStream:
    """Text pieces as generation produces them: ``(prompt index, piece)`` pairs, or the pieces
    alone for one prompt (``indexed=False``, as :func:`stream` and ``chat(stream=True)`` give).
    Once it is exhausted, ``result`` holds the :class:`Generation` (tokens, finish reasons, timings).
    """

    def __init__(self, steps: Generator[tuple[int, str], None, Generation], indexed: bool = True):
        self._steps = steps
        self.indexed = indexed
        self.result: Generation | None = None

    def __iter__(self) -> GenerationStream:
        return self

    def __next__(self) -> tuple[int, str] | str:  # an iterator: next(model.stream(...)) gives the first piece
        if self.result is not None:  # read already: nothing more to give
            raise StopIteration
        try:
            i, piece = next(self._steps)
        except StopIteration as done:
            self.result = done.value
            raise StopIteration from None
        except ValueError as e:  # Python's "generator already executing": a second thread reading it
            if str(e) != "generator already executing":
                raise
            raise SlimmlError("this stream is being read by another thread now; read a stream from one thread at a "
                              "time (hand its pieces to others through a queue), or start a stream for each.") from None
        return (i, piece) if self.indexed else piece


def generate(model: Any, prompts: Any, config: GenerationConfig | None = None, *, stream: bool = False,
             on_text: Callable[[int, str], None] | None = None, cancel: threading.Event | None = None,
             **options: Any) -> Generation | GenerationStream:
    """Continue each prompt, batched: as the model's generation config says where the caller says
    nothing (greedy where it says nothing either), sampled with a temperature.

    Args:
        model: a loaded ``text-generation`` artifact (streamed or resident); it has ``engine``,
            ``text`` (its tokenizer, or None), ``folder`` and ``manifest``.
        prompts: a text or texts (the artifact must ship a tokenizer), or token id lists / a
            2-D id array. Prompts of different lengths run as one batch.
        config: a :class:`GenerationConfig`; ``options`` set its fields one by one instead
            (``max_new_tokens=64, temperature=0.7, top_p=0.9, seed=0, stop=["\\n\\n"]``). A
            ``config`` is taken whole; without one, a field the options leave out takes the model's
            own, as transformers' ``generate()`` does: its
            ``generation_config.json``'s ``do_sample`` with its temperature, top-k and top-p, and its
            ``repetition_penalty`` (:mod:`~slimml.runtime.tasks.generation.defaults`); sampling keeps
            the 50 most likely tokens where neither names a top-k (transformers' default). Pass
            ``temperature=0`` (or ``do_sample=False``) for greedy decoding whatever the model says.
        stream: return a :class:`GenerationStream` of ``(prompt index, text piece)`` instead.
        on_text: called with ``(prompt index, text piece)`` as each piece is ready.
        cancel: set it (from another thread) to stop after the current pass; the tokens so far
            are returned (a server sets it when its client goes away).

    Returns:
        A :class:`Generation`: per prompt, the new tokens, text and finish reason.

    Raises:
        ConfigError: a setting out of range (the message names the range).
        FeedError: before any pass: a prompt with ids outside the vocabulary, longer than the
            model's context (unless ``truncate=True``), or more rows x tokens than
            ``model.limits.max_batch_tokens`` (:mod:`slimml.runtime.tasks.limits`).

    Example:
        >>> model = load("artifacts/my-llama", memory_budget="2GB")
        >>> model.generate(["The capital of France is"], max_new_tokens=8).texts
        >>> model.generate(["Once upon a time"], temperature=0.8, top_p=0.95, seed=1, stop=["."]).texts
    """
    _check_cancel(cancel)
    if on_text is not None and not callable(on_text):
        raise ConfigError(f"on_text must be a function of (prompt index, text piece), got {type(on_text).__name__}.")
    config = GenerationConfig.of(config, model_settings(model), **options)
    steps = _steps(model, prompts, config, cancel=cancel)
    return GenerationStream(steps) if stream else _drain(steps, on_text)


def _check_cancel(cancel: Any) -> None:
    if cancel is not None and not callable(getattr(cancel, "is_set", None)):
        raise ConfigError(f"cancel must be a threading.Event (set it from another thread to stop the generation), "
                          f"got {type(cancel).__name__}; make one with threading.Event().")


def stream(model: Any, prompt: str | list[int], config: GenerationConfig | None = None, *,
           cancel: threading.Event | None = None, **options: Any) -> GenerationStream:
    """The text of one prompt's continuation, piece by piece as it is produced (never half a
    character, never the start of what may still become a stop string); ``.result`` is the
    :class:`Generation` once the pieces are all read.

    Args:
        model: a loaded ``text-generation`` artifact.
        prompt: one text (the artifact must ship a tokenizer), or one list of token ids.
        config: a :class:`GenerationConfig`; ``options`` set its fields one by one instead.
        cancel: as :func:`generate` takes it: set, the stream ends after the current pass
            (finish reason ``"cancelled"``).

    Returns:
        A :class:`GenerationStream` of text pieces (``indexed=False``). The prompt is checked now,
        so a bad one raises here, before the first piece.

    Raises:
        FeedError: several prompts (``generate(prompts, stream=True)`` streams a batch), a prompt
            that is neither a text nor ids, or one that does not fit the model.
        ConfigError: a setting out of range, or an unknown option.

    Example:
        >>> for piece in model.stream("Tell me a story.", max_new_tokens=100, temperature=0.7, seed=0):
        ...     print(piece, end="", flush=True)
    """
    if isinstance(prompt, (list, tuple)) and prompt and isinstance(prompt[0], (str, list, tuple)):
        raise FeedError(f"stream() takes one prompt (a text or a list of token ids), got a list of {len(prompt)} prompts; "
                        "stream them one at a time, or call generate(prompts, stream=True) for a batch.")
    if not isinstance(prompt, (str, list, tuple)):  # bytes would read as ids, an array or a number as nothing sensible
        raise FeedError(f"stream() takes one prompt, a text or a list of token ids, got {type(prompt).__name__}; "
                        "decode bytes to str first, or pass ids as a list (array.tolist()).")
    _check_cancel(cancel)
    one = [prompt] if isinstance(prompt, str) else [list(prompt)]
    return GenerationStream(_steps(model, one, GenerationConfig.of(config, model_settings(model), **options), cancel=cancel),
                            indexed=False)


def chat(model: Any, messages: list[dict[str, Any]] | list[list[dict[str, Any]]], config: GenerationConfig | None = None,
         *, stream: bool | str = False, add_generation_prompt: bool = True, continue_final_message: bool = False,
         chat_template_kwargs: dict[str, Any] | None = None, tools: list[dict[str, Any]] | None = None,
         tool_choice: str | dict[str, Any] | None = None, parallel_tool_calls: bool | None = None,
         reasoning: str = "split", cancel: threading.Event | None = None, **options: Any) -> Generation | GenerationStream:
    """The assistant's reply to a conversation, rendered with the model's chat template.

    Args:
        model: a loaded ``text-generation`` artifact with a chat template (its own, or one
            :func:`use_chat_template` gave).
        messages: ``[{"role": "system"|"user"|"assistant"|"tool", "content": "..."}, ...]``, or a
            list of such conversations for a batch (``"developer"``, OpenAI's newer name for the
            instructions, is the system message of a template that has no such role).
        stream: True: return a :class:`GenerationStream` of the reply's text pieces instead (its
            answer, outside thoughts and calls; pairs of conversation index and piece for a
            batch). ``"deltas"``: of :class:`~slimml.runtime.tasks.generation.reply.ReplyDelta` s
            instead of text, each with the ``reasoning``, ``content`` and tool-call pieces
            (``calls``: a call's name once written, then its arguments' JSON text) that piece
            lets out, as a server streams OpenAI's ``delta``.
        add_generation_prompt: open the assistant's turn after the messages (as transformers'
            ``apply_chat_template`` means it); False renders the messages alone.
        continue_final_message: continue the last message (an assistant's reply begun) instead of
            starting a new turn, as transformers does; not with ``add_generation_prompt``.
        chat_template_kwargs: more variables for the template (``documents``,
            ``enable_thinking``, ...).
        tools: functions the model may call, as OpenAI gives them (``[{"type": "function",
            "function": {"name", "description", "parameters": <JSON Schema>}}]``): the calls come
            back in ``Generation.tool_calls``, each fitting its function's schema
            (:mod:`slimml.runtime.tasks.generation.tools`). A stream yields the text outside them.
        tool_choice: ``"auto"`` (the default: text or calls), ``"required"``, ``"none"``, or
            ``{"type": "function", "function": {"name": ...}}``.
        parallel_tool_calls: allow more than one call in a reply; None: as the format has it (the
            Hermes format's may hold several, the generic format's and Llama 3's one).
        reasoning: for a reasoning model (its template writes ``<think>`` blocks, or gpt-oss's
            harmony channels): ``"split"`` (the default) puts the thoughts in
            ``Generation.reasoning`` and the answer alone in ``texts`` (a stream yields the
            answer's text only); ``"keep"`` leaves them in the text, as the model wrote them
            (harmony's markers too). A reply held to a format (``response_format``, tools) does not
            think: a block the prompt opens is closed empty, a harmony reply opens on its final
            channel. Except gpt-oss's own calls: with tools, a harmony reply may think before it
            answers or calls (``tool_choice="auto"``), and its thoughts always come apart.
        cancel: as :func:`generate` takes it: set, the reply stops after the current pass.
        config, options: as :func:`generate` takes them (``max_new_tokens``, ``temperature``,
            ``response_format``, ...).

    Returns:
        A :class:`Generation` whose ``texts`` are the replies (a :class:`GenerationStream` with ``stream``).

    Raises:
        FeedError: messages that are not a list of dicts with a ``role`` and text ``content``.
        ConfigError: a setting out of range, an unknown option, ``tools`` that are not OpenAI's
            form, or ``continue_final_message`` with tools or with ``add_generation_prompt``.
        NoChatTemplateError: the artifact has no chat template (:func:`use_chat_template` gives one).
        SlimmlError: the template failed to render these messages (its ``raise_exception``, say).

    Example:
        >>> model.chat([{"role": "user", "content": "What is 2+2?"}], max_new_tokens=32).texts[0]
        >>> model.chat([{"role": "user", "content": "Weather in Paris?"}], tools=[weather]).tool_calls[0]
    """
    conversations = messages if messages and isinstance(messages, (list, tuple)) and isinstance(messages[0], (list, tuple)) \
        else [messages]
    for j, m in enumerate(conversations):  # a batch's messages named by their conversation
        check_messages(m, f"conversation {j}, " if len(conversations) > 1 else "")
    conversations = [joined_text(m) for m in conversations]
    _check_cancel(cancel)
    config = GenerationConfig.of(config, model_settings(model), **options)
    checked = Tools.of(tools, tool_choice, parallel_tool_calls)
    if checked is not None and continue_final_message:
        raise ConfigError("continue_final_message continues a reply as text, and tools hold a reply to their format "
                          'from its start; leave one out (tool_choice="none" keeps the tools in the conversation).')
    if stream not in (False, None, True, "deltas"):
        raise ConfigError(f'stream must be True, False or "deltas", got {stream!r}.')
    template = chat_template(model)
    form = ReplyFormat.of(template.source, checked, reasoning, continued=continue_final_message,
                          specials=special_tokens(model.text))
    variables = form.variables(chat_template_kwargs)
    formatted = config.grammar is not None  # a response_format holds the reply
    config = form.config(config)
    # developer messages as the system message first: a tool format joins its listing to that one
    rendered = [form.prompt(chat_prompt(model, form.messages(template.known_roles(m)), add_generation_prompt=add_generation_prompt,
                                        continue_final_message=continue_final_message, **variables), formatted)
                for m in conversations]
    steps = _steps(model, rendered, config, raw_text=True, cancel=cancel)
    deltas = stream == "deltas"
    if form.reads or deltas:
        steps = _replies(steps, form, [form.reader(r, pieces=deltas) for r in rendered], deltas)
    if stream:
        return GenerationStream(steps, indexed=len(rendered) > 1)
    return _drain(steps)


def _replies(steps: Generator[tuple[int, str], None, Generation], form: ReplyFormat, readers: list[ReplyReader],
             deltas: bool = False) -> Generator[tuple[int, Any], None, Generation]:
    """``steps`` with each reply read by its reader: its content (with ``deltas``, each
    :class:`ReplyDelta`) goes out as it comes; once the replies are whole, their thoughts go into
    ``reasoning``, their calls into ``tool_calls`` (finish reason ``tool_calls``) and their
    content into ``texts``."""
    def out(delta: ReplyDelta) -> Any:
        if deltas:
            return delta if delta.reasoning or delta.content or delta.calls else None
        return delta.content or None

    while True:
        try:
            i, piece = next(steps)
        except StopIteration as done:
            result = done.value
            break
        piece = out(readers[i].feed(piece))
        if piece is not None:
            yield i, piece
    for i, reader in enumerate(readers):
        rest, reply = reader.finish()
        if reader.thoughts is not None:
            result.reasoning = [*(result.reasoning or []), reply.reasoning]
        if form.use is not None:
            result.tool_calls = [*(result.tool_calls or []), list(reply.calls)]
            result.finish_reasons[i] = finish_reason(result.finish_reasons[i], list(reply.calls))
        if result.texts is not None:
            result.texts[i] = reply.content
        piece = out(rest)
        if piece is not None:
            yield i, piece
    return result


def chat_prompt(model: Any, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                continue_final_message: bool = False, **variables: Any) -> str:
    """The prompt text the chat template makes of ``messages``: what transformers'
    ``tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)`` gives.
    ``variables`` reach the template (``tools``, ``enable_thinking``, ...). An assistant's
    ``tool_calls`` may give their arguments as JSON text, as OpenAI sends them.

    Args:
        model: a loaded ``text-generation`` artifact.
        messages: ``[{"role": ..., "content": ...}, ...]``: one conversation.
        add_generation_prompt: open the assistant's turn after the messages.
        continue_final_message: end inside the last message, to continue it (not with
            ``add_generation_prompt``).

    Returns:
        The prompt text, special tokens written out as text.

    Raises:
        NoChatTemplateError: the artifact has no chat template.
        FeedError, ConfigError, SlimmlError: as :func:`chat` raises them.

    Example:
        >>> chat_prompt(model, [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}])
        '<|im_start|>system\\nBe brief.<|im_end|>\\n<|im_start|>user\\nHi<|im_end|>\\n<|im_start|>assistant\\n'
    """
    return chat_template(model).render(template_messages(messages), add_generation_prompt=add_generation_prompt,
                                       continue_final_message=continue_final_message, **variables)


def chat_template(model: Any) -> ChatTemplate:
    """The model's :class:`ChatTemplate`, read and compiled once (or the one :func:`use_chat_template` gave)."""
    template = _templates.get(model)
    if template is None:
        template = _templates[model] = ChatTemplate.of_artifact(model.folder, model.manifest.tokenizer,
                                                                manifest=model.manifest)
    return template


def use_chat_template(model: Any, template: str) -> None:
    """Render ``model``'s chats with ``template`` (a Jinja file's path, or the template's text)
    instead of the artifact's own: a GGUF whose template knows no tools, a fixed template.

    Args:
        model: a loaded ``text-generation`` artifact (``model.use_chat_template(template)`` calls this).
        template: a Jinja file's path, or the template's text; the artifact's special tokens still fill it.

    Raises:
        ConfigError: a path that is not a file, or a template that does not parse.

    Example:
        >>> use_chat_template(model, "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\\n{% endfor %}")
        >>> chat_prompt(model, [{"role": "user", "content": "Hi"}], add_generation_prompt=False)
        'user: Hi\\n'
    """
    _templates[model] = ChatTemplate.of_artifact(model.folder, model.manifest.tokenizer, override=template,
                                                 manifest=model.manifest)


def _drain(steps: Generator[tuple[int, str], None, Generation], on_text: Callable[[int, str], None] | None = None) -> Generation:
    """Run ``steps`` to the end, handing each piece to ``on_text``; its :class:`Generation`."""
    while True:
        try:
            i, piece = next(steps)
        except StopIteration as done:
            return done.value
        if on_text is not None:
            on_text(i, piece)


def _steps(model: Any, prompts: Any, config: GenerationConfig, raw_text: bool = False,
           cancel: threading.Event | None = None) -> Generator[tuple[int, str], None, Generation]:
    """The generation: prompts checked now (a stream refuses bad ones before its first piece), then
    a generator that yields ``(prompt index, text piece)`` and returns the :class:`Generation`."""
    t0 = time.perf_counter()
    job = prepare(model, prompts, config, raw_text)
    if config.num_beams > 1:
        return _beams(model, job, config, t0, cancel)
    prefix = getattr(model, "prefix", None)  # the model's store of text read before (CausalLM.prefix_cache)
    constraint = job.constraints[0] if job.constraints and len(job.ids) == 1 else None  # forced tokens: several a pass
    loop = (lookup_loop(model.engine, job.ids, job.steps, config.prompt_lookup, prefix, constraint, config.no_repeat_ngram_size)
            or decode_loop(model.engine, job.ids, job.pad_id, job.steps, prefix, job.row_steps))
    return _passes(job, loop, config, t0, cancel)


def _beams(model: Any, job: Prompts, config: GenerationConfig, t0: float,
           cancel: threading.Event | None) -> Generator[tuple[int, str], None, Generation]:
    """Beam search (:mod:`~slimml.runtime.tasks.generation.beams`): each prompt's text comes whole,
    once the search has chosen it."""
    tokens, passes = search_beams(model.engine, job, config, cancel)
    finish = ["cancelled"] * len(job.ids) if tokens is None else [
        "stop" if t and t[-1] in job.end_ids else "length" for t in tokens]
    tokens = tokens or [[] for _ in job.ids]
    texts = ([TextStream(job.tokenizer, p, config.stop, config.skip_special_tokens) for p in job.ids]
             if job.tokenizer is not None else None)
    for i, answer in enumerate(tokens):
        if texts is None:
            continue
        piece = "".join(texts[i].push(t) for t in answer if t not in job.end_ids) + texts[i].finish()
        if piece:
            yield i, piece
    return Generation(tokens=tokens, texts=[t.text for t in texts] if texts is not None and job.texts else None,
                      seconds=time.perf_counter() - t0, passes=passes, prompt_tokens=sum(map(len, job.ids)),
                      finish_reasons=finish)


def _passes(job: Prompts, loop: CacheLoop | DecodeLoop, config: GenerationConfig, t0: float,
            cancel: threading.Event | None) -> Generator[tuple[int, str], None, Generation]:
    batch = len(job.ids)
    texts = ([TextStream(job.tokenizer, p, config.stop, config.skip_special_tokens) for p in job.ids]
             if job.tokenizer is not None else None)
    new: list[list[int]] = [[] for _ in range(batch)]
    finish = ["length"] * batch
    done = np.zeros(batch, dtype=bool)
    logprobs: list[list[TokenLogprob]] | None = None if config.logprobs is None else [[] for _ in range(batch)]
    sampler: Sampler | None = None
    prefill_s = 0.0
    for step in range(job.steps):
        if cancel is not None and cancel.is_set():
            finish = ["cancelled" if not d else f for f, d in zip(finish, done)]  # as the server's batch says it
            break
        logits = loop.next_logits()  # (B, vocab)
        if step == 0:
            prefill_s = time.perf_counter() - t0
            sampler = Sampler(config, job.ids, logits.shape[-1], job.held_ids, job.constraints)
        nxt = np.where(done, job.pad_id, sampler(logits))  # (B,); a finished prompt's row is ignored
        was = done.copy()
        live = np.flatnonzero(~done)
        if logprobs is not None:
            for i, lp in zip(live, token_logprobs(logits[live], nxt[live], config.logprobs)):
                logprobs[i].append(lp)
        for i in live:
            token = int(nxt[i])
            new[i].append(token)
            if token in job.end_ids:
                finish[i], done[i] = "stop", True
                piece = texts[i].finish() if texts is not None else ""
            elif texts is not None:
                piece = texts[i].push(token)
                if texts[i].stopped:
                    finish[i], done[i] = "stop", True
            else:
                piece = ""
            if piece:
                yield int(i), piece
            if not done[i] and job.row_steps is not None and len(new[i]) >= job.row_steps[i]:
                done[i] = True  # its own room is full: it leaves the passes, its text is closed below ("length")
        if done.all() or step == job.steps - 1:
            break
        loop.finish(np.flatnonzero(done & ~was).tolist())  # the fused loop stops running them
        sampler.add(nxt)
        loop.append(nxt)
    loop.remember(new)  # one prompt's text, for the prompts that begin with it (a chat's next turn)
    for i in (i for i in range(batch) if finish[i] != "stop"):  # max_new_tokens, or the context, reached
        piece = texts[i].finish() if texts is not None else ""
        if texts is not None and texts[i].stopped and finish[i] == "length":  # the held-back text held a stop string
            finish[i] = "stop"
        if piece:
            yield int(i), piece
    return Generation(tokens=new, texts=[t.text for t in texts] if texts is not None and job.texts else None,
                      seconds=time.perf_counter() - t0, passes=loop.passes, prompt_tokens=sum(map(len, job.ids)),
                      cached_tokens=loop.cached, prefill_s=prefill_s, finish_reasons=finish, logprobs=logprobs)
