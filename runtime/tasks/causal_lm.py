"""Causal generation: a decoder (Llama, GPT-2, SmolLM) continues prompts, with a KV cache when it has one."""

from __future__ import annotations

from typing import Any

from slimml.runtime.tasks.base import Task, register_task
from slimml.runtime.tasks.generate import generate
from slimml.runtime.tasks.generation.prefix import PrefixStore

PREFIX_BYTES = 64 << 20  # KV cache kept in process for prompts that begin with text read before


@register_task("text-generation")
class CausalLM(Task):
    """A decoder artifact (``--task text-generation[-with-past]``): :meth:`generate`,
    :meth:`stream`, :meth:`chat` and :meth:`perplexity`.

    The loop (:mod:`slimml.runtime.tasks.generate`) reads ``engine``, ``text``, ``folder``,
    ``manifest`` and ``prefix`` from this object.

    ``prefix`` keeps the KV cache of what one-prompt generations read and wrote (a fused graph's),
    up to 64 MiB (:meth:`prefix_cache`): a prompt that begins with it (a chat's next turn, the same
    system prompt) copies those positions and prefills only the rest.
    """

    methods = frozenset({"generate", "stream", "chat", "perplexity"})
    suggest = ("generate",)

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.prefix = PrefixStore(PREFIX_BYTES)

    def prefix_cache(self, budget: int | str) -> None:
        """Keep up to ``budget`` bytes (``"256MB"``) of KV cache for prompts that begin with
        text this model read before; 0 turns it off and frees what it held.

        What the store held is dropped either way; ``Generation.cached_tokens`` says how many
        prompt tokens a later call copied from it instead of prefilling them.

        Args:
            budget: bytes, or a size as text (``"256MB"``, ``"1.5GiB"``); 0, ``"0"`` or ``""`` turns it off.

        Raises:
            ConfigError: a text that is not a size, or a negative one.

        Example:
            >>> model.prefix_cache("256MB")   # long shared documents
            >>> model.prefix_cache(0)         # every prompt prefilled whole
        """
        from slimml.runtime.engine.budget import parse_bytes_or_off

        size = parse_bytes_or_off(budget)  # a bad size refused before the store is dropped
        self.prefix.clear()
        self.prefix = PrefixStore(size)

    def use_chat_template(self, template: str) -> None:
        """Render chats with ``template`` (a Jinja file's path, or the template's text) instead of
        the artifact's own; e.g. a template that knows tools for a GGUF whose own does not.

        Args:
            template: the path of a Jinja file, or the template's text (the artifact's special
                tokens, ``bos_token`` and the rest, still fill it).

        Raises:
            ConfigError: a path that is not a file, or a template that does not parse.

        Example:
            >>> model.use_chat_template("qwen2.5_chat_template.jinja")
        """
        from slimml.runtime.tasks.generate import use_chat_template

        use_chat_template(self, template)

    def generate(self, prompts: Any, max_new_tokens: int | None = None, config: Any = None, *, cancel: Any = None,
                 **options: Any):
        """Continue ``prompts`` (texts, or token id lists); see :func:`slimml.runtime.tasks.generate.generate`.

        As the model's generation config says where the options say nothing (greedy where it says
        nothing either: ``temperature=0`` is always greedy); prompts of different lengths run as one batch.

        Args:
            prompts: a text or a list of texts, or token id lists (a 2-D id array too).
            max_new_tokens: tokens to add to each prompt at most (default: ``config``'s, else 32).
            config: a :class:`~slimml.runtime.GenerationConfig`; ``options`` override its fields.
            cancel: a ``threading.Event``; set it (from another thread) to stop after the current
                pass, with the tokens so far (a server sets it when its client goes away).
            **options: :class:`~slimml.runtime.GenerationConfig` fields by name (``temperature``,
                ``top_p``, ``seed``, ``stop``, ...), and ``stream`` and ``on_text`` as
                :func:`~slimml.runtime.tasks.generate.generate` takes them.

        Returns:
            A :class:`~slimml.runtime.tasks.generate.Generation`: per prompt, ``tokens``, ``texts``
            (None for id prompts) and ``finish_reasons``; a
            :class:`~slimml.runtime.tasks.generate.GenerationStream` with ``stream=True``.

        Raises:
            ConfigError: an unknown option, or a value out of range.
            FeedError: a prompt that does not fit the model (ids outside the vocabulary, longer than
                its context without ``truncate=True``).

        Example:
            >>> model = load("artifacts/SmolLM2-135M-Instruct")
            >>> model.generate(["The capital of France is"], max_new_tokens=8).texts
            [' Paris.\\n\\nThe answer is:']
        """
        if max_new_tokens is not None:
            options["max_new_tokens"] = max_new_tokens
        if config is not None:
            options["config"] = config
        return generate(self, prompts, cancel=cancel, **options)

    def stream(self, prompt: Any, config: Any = None, *, cancel: Any = None, **options: Any):
        """One prompt's continuation as text pieces, yielded as they are produced; see
        :func:`slimml.runtime.tasks.generate.stream`.

        Args:
            prompt: one text, or one list of token ids.
            config: a :class:`~slimml.runtime.GenerationConfig`; ``options`` override its fields.
            cancel: a ``threading.Event``; set it (from another thread) to end the stream after
                the current pass (finish reason ``"cancelled"``).
            **options: :class:`~slimml.runtime.GenerationConfig` fields by name.

        Returns:
            A :class:`~slimml.runtime.tasks.generate.GenerationStream` of text pieces; once read to
            the end, its ``result`` is the :class:`~slimml.runtime.tasks.generate.Generation`.

        Raises:
            FeedError: several prompts (use ``generate(prompts, stream=True)``), or not a text or ids.
            ConfigError: an unknown option, or a value out of range.

        Example:
            >>> for piece in model.stream("The capital of France is", max_new_tokens=8):
            ...     print(piece, end="", flush=True)
             Paris.
            <BLANKLINE>
            The answer is:
        """
        from slimml.runtime.tasks.generate import stream

        return stream(self, prompt, config, cancel=cancel, **options)

    def chat(self, messages: Any, config: Any = None, stream: bool | str = False, **options: Any):
        """The assistant's reply to ``messages`` through the model's chat template (text pieces
        with ``stream=True``, thoughts, text and call pieces with ``stream="deltas"``); see
        :func:`slimml.runtime.tasks.generate.chat`.

        Args:
            messages: ``[{"role": "user", "content": "..."}, ...]``, or a list of such conversations.
            config: a :class:`~slimml.runtime.GenerationConfig`; ``options`` override its fields.
            stream: False (the default), True (text pieces) or ``"deltas"``.
            **options: :class:`~slimml.runtime.GenerationConfig` fields by name, and ``chat``'s own:
                ``tools``, ``tool_choice``, ``parallel_tool_calls``, ``reasoning``,
                ``add_generation_prompt``, ``continue_final_message``, ``chat_template_kwargs``,
                ``cancel`` (a ``threading.Event``, as ``generate`` takes it).

        Returns:
            A :class:`~slimml.runtime.tasks.generate.Generation` whose ``texts`` are the replies
            (``tool_calls`` and ``reasoning`` where they apply), or a
            :class:`~slimml.runtime.tasks.generate.GenerationStream` when streamed.

        Raises:
            FeedError: messages that are not a list of role/content dicts.
            ConfigError: an unknown option, a value out of range, or options that contradict.
            NoChatTemplateError: the artifact has no chat template (give one with :meth:`use_chat_template`).

        Example:
            >>> model.chat([{"role": "user", "content": "What is 2+2?"}], max_new_tokens=32).texts[0]
            'The answer to this classic math problem is 4.'
        """
        from slimml.runtime.tasks.generate import chat

        return chat(self, messages, config, stream=stream, **options)

    def perplexity(self, text: str, window: int | None = None, max_tokens: int | None = None):
        """How well the model predicts ``text``: a
        :class:`~slimml.runtime.tasks.generation.scoring.Perplexity` over its first ``max_tokens``
        tokens (default 32,768) in windows of equal length, at most ``window`` (default 512); see
        :func:`slimml.runtime.tasks.generation.scoring.perplexity`.

        Args:
            text: the text to score (its tokens, no special tokens added; two at least).
            window: tokens a window holds at most (default 512, at most the model's context).
            max_tokens: tokens of the text scored at most (default 32,768).

        Returns:
            A :class:`~slimml.runtime.tasks.generation.scoring.Perplexity`: ``perplexity``, and the
            ``tokens``, ``windows`` and ``window`` it was measured over.

        Raises:
            FeedError: not a text, a window or token count out of range, or fewer than two tokens.

        Example:
            >>> load("artifacts/my-llama-int4").perplexity(open("wiki.txt").read()).perplexity
        """
        from slimml.runtime.tasks.generation.scoring import perplexity

        return perplexity(self, text, window, max_tokens)
