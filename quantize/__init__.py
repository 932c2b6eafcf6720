"""Quantization: a float artifact in, a smaller and faster artifact out.

``quantize(artifact, out, config)`` with a config per scheme: ``Int8Config(target)`` (the best
int8 for the target), ``Int8DynamicConfig``, ``Int8StaticConfig``, ``WeightOnlyConfig`` (int8 or
int4 ``MatMulNBits``) and ``Fp16Config``. ``scheme_config("int8", ...)`` maps the CLI's
``--quantize`` words to configs. Its names load on first use, so ``slimml.quantize.config``
imports without ONNX.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from slimml.quantize.api import QuantizeReport, quantize
    from slimml.quantize.config import (
        SCHEMES, Fp16Config, GuardConfig, Int8Config, Int8DynamicConfig, Int8StaticConfig, WeightOnlyConfig, scheme_config,
    )

_WHERE = {
    "quantize": "api", "QuantizeReport": "api", "SCHEMES": "config", "Int8Config": "config",
    "Int8DynamicConfig": "config", "Int8StaticConfig": "config", "WeightOnlyConfig": "config", "Fp16Config": "config",
    "GuardConfig": "config", "scheme_config": "config",
}

__all__ = list(_WHERE)


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module 'slimml.quantize' has no attribute {name!r}")
    return getattr(importlib.import_module(f"slimml.quantize.{_WHERE[name]}"), name)
