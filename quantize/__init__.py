"""Quantization: a float artifact in, a smaller and faster artifact out.

``quantize(artifact, out, config)`` with a config per scheme: ``Int8Config(target)`` (the best
int8 for the target), ``Int8DynamicConfig``, ``Int8StaticConfig``, ``WeightOnlyConfig`` (int8 or
int4 ``MatMulNBits``) and ``Fp16Config``. ``scheme_config("int8", ...)`` maps the CLI's
``--quantize`` words to configs.
"""

from slimml.quantize.api import QuantizeReport, quantize
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

__all__ = [
    "quantize", "QuantizeReport", "SCHEMES", "Int8Config", "Int8DynamicConfig", "Int8StaticConfig",
    "WeightOnlyConfig", "Fp16Config", "GuardConfig", "scheme_config",
]
