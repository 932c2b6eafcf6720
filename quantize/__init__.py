"""Quantization: a float artifact in, a smaller and faster artifact out.

``quantize(artifact, out, config)`` with a config per scheme: ``Int8Config(target)`` (the best
int8 for the target), ``Int8DynamicConfig``, ``Int8StaticConfig``, ``WeightOnlyConfig`` (int8 or
int4 ``MatMulNBits``) and ``Fp16Config``. ``scheme_config("int8", ...)`` maps the CLI's
``--quantize`` words to configs. The configs import without ONNX (the CLI reads its options from
them); ``quantize`` loads the quantizer on first use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from slimml.quantize.config import (
    SCHEMES,
    Fp16Config,
    GuardConfig,
    Int8Config,
    Int8DynamicConfig,
    Int8StaticConfig,
    WeightOnlyConfig,
    scheme_config,
)

if TYPE_CHECKING:
    from slimml.quantize.api import QuantizeReport, quantize

__all__ = [
    "quantize", "QuantizeReport", "SCHEMES", "Int8Config", "Int8DynamicConfig", "Int8StaticConfig",
    "WeightOnlyConfig", "Fp16Config", "GuardConfig", "scheme_config",
]


def __getattr__(name: str) -> Any:  # the quantizer (ONNX, ONNX Runtime's tools) loads on first use
    if name in ("quantize", "QuantizeReport"):
        import slimml.quantize.api as api

        return getattr(api, name)
    raise AttributeError(f"module 'slimml.quantize' has no attribute {name!r}")
