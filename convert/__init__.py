"""Conversion: export a model to ONNX and split it into layer shards (needs the ``convert`` extra).

The configs import without ONNX or torch (the CLI reads its options from them); ``convert`` and
``ConvertReport`` load the pipeline on first use.

Example:
    >>> from slimml.convert import convert, ConvertConfig, ShardConfig
    >>> report = convert("path/to/hf-model", "artifacts/my-model", ConvertConfig(shard=ShardConfig(mode="count", count=4)))
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from slimml.convert.config import ConvertConfig
from slimml.convert.export import ExportConfig, export
from slimml.convert.shard import ShardConfig, shard
from slimml.convert.sources import DEFAULT_MODEL, Source, resolve

if TYPE_CHECKING:
    from slimml.convert.pipeline import ConvertReport, convert

__all__ = [
    "DEFAULT_MODEL", "ConvertConfig", "ConvertReport", "ExportConfig", "ShardConfig", "Source",
    "convert", "export", "resolve", "shard",
]


def __getattr__(name: str) -> Any:  # the pipeline (ONNX Runtime, the runtime) loads on first use
    if name in ("convert", "ConvertReport"):
        import slimml.convert.pipeline as pipeline

        return getattr(pipeline, name)
    raise AttributeError(f"module 'slimml.convert' has no attribute {name!r}")
