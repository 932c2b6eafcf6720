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

        Example:
            >>> model.prefix_cache("256MB")   # long shared documents
            >>> model.prefix_cache(0)         # every prompt prefilled whole
        """
        from slimml.runtime.engine.budget import parse_bytes_or_off

        self.prefix.clear()
        self.prefix = PrefixStore(parse_bytes_or_off(budget))

    def use_chat_template(self, template: str) -> None:
        """Render chats with ``template`` (a Jinja file's path, or the template's text) instead of
        the artifact's own; e.g. a template that knows tools for a GGUF whose own does not.

        Example:
            >>> model.use_chat_template("qwen2.5_chat_template.jinja")
        """
        from slimml.runtime.tasks.generate import use_chat_template

        use_chat_template(self, template)

    def generate(self, prompts: Any, max_new_tokens: int | None = None, config: Any = None, **options: Any):
        """Continue ``prompts`` (texts, or token id lists); see :func:`slimml.runtime.tasks.generate.generate`.

        Returns a :class:`~slimml.runtime.tasks.generate.Generation`.

        Example:
            >>> model = load("artifacts/my-llama", memory_budget="2GB")
            >>> model.generate(["The capital of France is"], max_new_tokens=8).texts
        """
        if max_new_tokens is not None:
            options["max_new_tokens"] = max_new_tokens
        if config is not None:
            options["config"] = config
        return generate(self, prompts, **options)

    def stream(self, prompt: Any, config: Any = None, **options: Any):
        """One prompt's continuation as text pieces, yielded as they are produced; see
        :func:`slimml.runtime.tasks.generate.stream`."""
        from slimml.runtime.tasks.generate import stream

        return stream(self, prompt, config, **options)

    def chat(self, messages: Any, config: Any = None, stream: bool | str = False, **options: Any):
        """The assistant's reply to ``messages`` through the model's chat template (text pieces
        with ``stream=True``, thoughts, text and call pieces with ``stream="deltas"``); see :func:`slimml.runtime.tasks.generate.chat`."""
        from slimml.runtime.tasks.generate import chat

        return chat(self, messages, config, stream=stream, **options)

    def perplexity(self, text: str, window: int | None = None, max_tokens: int | None = None):
        """How well the model predicts ``text``: a
        :class:`~slimml.runtime.tasks.generation.scoring.Perplexity` over its first ``max_tokens``
        tokens (default 32,768) in windows of equal length, at most ``window`` (default 512); see
        :func:`slimml.runtime.tasks.generation.scoring.perplexity`.

        Example:
            >>> load("artifacts/my-llama-int4").perplexity(open("wiki.txt").read()).perplexity
        """
        from slimml.runtime.tasks.generation.scoring import perplexity

        return perplexity(self, text, window, max_tokens)
