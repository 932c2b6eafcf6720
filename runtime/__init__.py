"""The slimml runtime: load an artifact and run it with ONNX Runtime. Imports no torch.

Example:
    >>> from slimml.runtime import load
    >>> model = load("artifacts/all-MiniLM-L6-v2", device="cpu")
    >>> model.encode(["A man is playing a guitar."]).shape
    (1, 384)
"""

from __future__ import annotations

from slimml.runtime.artifact.manifest import Manifest, ShardSpec, TensorSpec, read_manifest
from slimml.runtime.loader import Model, load
from slimml.runtime.tasks.base import Task

__all__ = ["Manifest", "Model", "ShardSpec", "TensorSpec", "Task", "load", "read_manifest"]
