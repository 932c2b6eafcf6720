"""Conversion: export a model to ONNX and split it into layer shards (needs the ``convert`` extra).

Example:
    >>> from slimml.convert import convert, ConvertConfig, ShardConfig
    >>> report = convert("path/to/hf-model", "artifacts/my-model", ConvertConfig(shard=ShardConfig(mode="count", count=4)))
"""

from __future__ import annotations

from slimml.convert.export import ExportConfig, export
from slimml.convert.pipeline import ConvertConfig, ConvertReport, convert
from slimml.convert.shard import ShardConfig, shard
from slimml.convert.sources import DEFAULT_MODEL, Source, resolve

__all__ = [
    "DEFAULT_MODEL", "ConvertConfig", "ConvertReport", "ExportConfig", "ShardConfig", "Source",
    "convert", "export", "resolve", "shard",
]
