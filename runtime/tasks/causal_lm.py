"""Causal generation: a decoder (Llama, GPT-2, SmolLM) continues prompts, with a KV cache when it has one."""

from __future__ import annotations

from typing import Any

from slimml.runtime.tasks.base import Task, register_task
from slimml.runtime.tasks.generate import generate


@register_task("text-generation")
class CausalLM(Task):
    """A decoder artifact (``--task text-generation[-with-past]``): :meth:`generate`.

    The loop (:func:`slimml.runtime.tasks.generate.generate`) reads ``engine``, ``text``,
    ``folder`` and ``manifest`` from this object.
    """

    methods = frozenset({"generate"})
    suggest = ("generate",)

    def generate(self, prompts: Any, max_new_tokens: int = 32, **kwargs):
        """Greedy text generation; see :func:`slimml.runtime.tasks.generate.generate`.

        Returns a :class:`~slimml.runtime.tasks.generate.Generation`.

        Example:
            >>> model = load("artifacts/my-llama", memory_budget="2GB")
            >>> model.generate(["The capital of France is"], max_new_tokens=8).texts
        """
        return generate(self, prompts, max_new_tokens=max_new_tokens, **kwargs)
