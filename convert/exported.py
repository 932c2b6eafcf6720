"""What an exporter hands on: the exported graph and what the runtime needs beside it."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


@dataclass
class Exported:
    """The exported graph and what the runtime needs beside it."""

    onnx_path: Path
    task: str
    pooling: dict[str, Any] | None = None
    pooling_dir: Path | None = None  # where the files pooling["dense"] names are
    tokenizer: dict[str, Any] | None = None  # {"file", "max_length", "pad_token", "pad_id"}; file in tokenizer_dir
    tokenizer_dir: Path | None = None
    preprocessor: Path | None = None  # the source's preprocessor_config.json (images, or audio features)
    labels: list[str] | None = None  # class names by output index, from the config's id2label
    graphs: dict[str, Path] = field(default_factory=dict)  # an encoder-decoder's graphs, by component name
    seq2seq: dict[str, Any] | None = None  # how its generation starts and stops (see runtime.seq2seq)
    layerwise: dict[str, Any] | None = None  # {"template", "folder", "depth"}: onnx_path is a 3-layer template
    info: dict[str, Any] = field(default_factory=dict)
    note: str | None = None  # why "auto" did not choose its first exporter (the fused one, optimum-onnx): one line
    preprocessing_note: str | None = None  # why the source's image processor config was not shipped (one line)
