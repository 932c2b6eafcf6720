"""slimml: make trained models smaller and faster, and run them in layer shards.

The package is split by pipeline stage:

- ``slimml.convert``: export a model to ONNX and split it into layer shards (needs the
  ``convert`` extra: torch, transformers, optimum-onnx).
- ``slimml.quantize``: int8 and weight-only quantization of ONNX graphs.
- ``slimml.runtime``: load an artifact and run it with ONNX Runtime (no torch).
"""

from __future__ import annotations

from slimml.errors import SlimmlError

__version__ = "0.1.0"
__all__ = ["SlimmlError", "__version__"]
