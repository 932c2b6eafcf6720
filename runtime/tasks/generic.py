"""The generic task: an artifact whose task slimml has no class for. It runs arrays: ``run(feeds)``
(and ``run(feeds, component=NAME)`` for an artifact of components); ``tokenize`` where it ships
a tokenizer."""

from __future__ import annotations

from slimml.runtime.tasks.base import Task, register_task


@register_task("generic")
class Generic(Task):
    """Arrays in, arrays out: ``run(feeds)``."""

    methods = frozenset()


Components = Generic  # the name this class had for artifacts of components (format 2)
