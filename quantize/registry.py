"""The quantization backends' registry: which function quantizes a shard for a given config.

A backend is registered for a config type and a ``backend`` name (``@register(Int8StaticConfig,
"nncf")``), so adding one adds a function, not an ``if``. The ONNX Runtime backends are in
:mod:`.backends`, the NNCF ones in :mod:`.nncf_backend`; importing :mod:`.backends` registers both.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import onnx

from slimml.errors import ConfigError
from slimml.quantize.config import QuantizeConfig

Backend = Callable[[onnx.ModelProto, Any, "ShardContext"], "onnx.ModelProto | None"]
_REGISTRY: dict[tuple[type, str], Backend] = {}


@dataclass
class ShardContext:
    """What a backend may need beyond the graph: calibration data for this shard, fusion stats."""

    index: int
    fuse: bool = False  # run the transformer fusions first (asked for, and the model's family has them)
    reader: Any = None  # a CalibrationDataReader over this shard's recorded inputs (static int8)
    notes: dict[str, Any] = field(default_factory=dict)


def register(config_type: type, backend: str = "ort") -> Callable[[Backend], Backend]:
    """Register ``fn`` as what quantizes ``config_type`` when its ``backend`` field is ``backend``."""

    def add(fn: Backend) -> Backend:
        _REGISTRY[(config_type, backend)] = fn
        return fn

    return add


def backend_for(config: QuantizeConfig) -> Backend:
    key = (type(config), getattr(config, "backend", "ort"))
    try:
        return _REGISTRY[key]
    except KeyError:
        known = ", ".join(f"{t.__name__} ({b})" for t, b in _REGISTRY)
        raise ConfigError(f"no quantization backend for {key[0].__name__} ({key[1]}); use one of: {known}.") from None


def weight_matmuls(model: onnx.ModelProto, op_types=("MatMul",)) -> list[onnx.NodeProto]:
    """Nodes of ``op_types`` whose second input is a float weight (what weight quantization acts on)."""
    weights = {t.name: t for t in model.graph.initializer if t.data_type in (onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16)}
    found = []
    for n in model.graph.node:
        if n.op_type not in op_types:
            continue
        if n.op_type == "Gather":
            ok = n.input[0] in weights and len(weights[n.input[0]].dims) == 2
        else:
            ok = len(n.input) > 1 and n.input[1] in weights and len(weights[n.input[1]].dims) == 2
        if ok:
            found.append(n)
    return found
