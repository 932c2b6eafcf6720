"""slimml: make trained models smaller and faster, and run them in layer shards.

The package is split by pipeline stage:

- ``slimml.convert``: export a model to ONNX and split it into layer shards (needs the
  ``convert`` extra: torch, transformers, optimum-onnx).
- ``slimml.quantize``: int8 and weight-only quantization of ONNX graphs.
- ``slimml.runtime``: load an artifact and run it with ONNX Runtime (no torch).
- ``slimml.serve`` and ``slimml.scale``: HTTP serving and pipeline stages on Ray (the ``serve`` extra).
"""

from __future__ import annotations

import os

# ONNX Runtime's official Linux builds (1.29 and later) carry telemetry to Microsoft's collector,
# on by default, and keep an event store under ~/.cache.
# slimml is for private and offline deployments, so it is off unless the user decides
# otherwise: ORT_DISABLE_TELEMETRY=0 in the environment keeps it on. Set before onnxruntime
# creates its environment; processes slimml starts (Ray workers, servers) inherit it.
os.environ.setdefault("ORT_DISABLE_TELEMETRY", "1")

from slimml.errors import SlimmlError  # noqa: E402

__version__ = "0.2.0"
__all__ = ["SlimmlError", "__version__"]
