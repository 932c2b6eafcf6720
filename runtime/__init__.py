"""The slimml runtime: load an artifact and run it with ONNX Runtime. Imports no torch.

Example:
    >>> from slimml.runtime import load
    >>> model = load("artifacts/all-MiniLM-L6-v2", device="cpu")
    >>> model.encode(["A man is playing a guitar."]).shape
    (1, 384)
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from slimml.runtime.artifact.manifest import Manifest, ShardSpec, TensorSpec, read_manifest

if TYPE_CHECKING:
    from slimml.runtime.engine.config import LoadConfig
    from slimml.runtime.loader import Model, load
    from slimml.runtime.tasks.generation import GenerationConfig
    from slimml.runtime.tasks.base import Task

__all__ = ["GenerationConfig", "LoadConfig", "Manifest", "Model", "ShardSpec", "TensorSpec", "Task", "load", "read_manifest"]


def __getattr__(name: str) -> Any:
    """``load``, ``Model`` and ``Task`` bring in ONNX Runtime on first use, so the artifact layer
    (``slimml.runtime.artifact``: what convert and the CLI read and write) imports without it."""
    if name in ("load", "Model"):
        import slimml.runtime.loader as loader

        return getattr(loader, name)
    if name == "Task":
        from slimml.runtime.tasks.base import Task

        return Task
    if name == "LoadConfig":
        from slimml.runtime.engine.config import LoadConfig

        return LoadConfig
    if name == "GenerationConfig":  # a language model's options, as generate(config=...) takes them
        from slimml.runtime.tasks.generation import GenerationConfig

        return GenerationConfig
    raise AttributeError(f"module 'slimml.runtime' has no attribute {name!r}")
