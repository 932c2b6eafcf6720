"""Backends: one function per config type, found through a small registry.

Each backend takes one shard's graph (weights loaded) and returns the quantized graph, or
``None`` when the shard holds nothing it can quantize (the shard then stays as it is). Adding a
backend adds a function with ``@register(SomeConfig)``, not an ``if``.
"""

from __future__ import annotations

import contextlib
import logging
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import onnx

from slimml.errors import ConfigError
from slimml.quantize.config import Fp16Config, Int8DynamicConfig, Int8StaticConfig, QuantizeConfig, WeightOnlyConfig

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


def _roundtrip(fn: Callable[[Path, Path], None], model: onnx.ModelProto) -> onnx.ModelProto:
    """Run a file-to-file ORT tool on ``model`` in a scratch folder and load the result."""
    with tempfile.TemporaryDirectory(prefix="slimml-q-") as d:
        src, dst = Path(d) / "in.onnx", Path(d) / "out.onnx"
        onnx.save_model(model, str(src), save_as_external_data=True, location="in.onnx.data", size_threshold=1024)
        with _quiet():
            fn(src, dst)
        return onnx.load(str(dst))


@contextlib.contextmanager
def _quiet():
    """ORT's quantizers log advice ("consider pre-processing") on the root logger, and the int8
    weight quantizer an ERROR line for each embedding it leaves float: not the user's business."""
    loggers = [logging.getLogger(n) for n in ("", "onnxruntime.quantization.matmul_nbits_quantizer", "onnxruntime.quantization")]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)


@register(Int8DynamicConfig)
def int8_dynamic(model: onnx.ModelProto, config: Int8DynamicConfig, ctx: ShardContext) -> onnx.ModelProto | None:
    from onnxruntime.quantization import QuantType, quantize_dynamic

    from slimml.quantize.fuse import fuse_transformer

    if ctx.fuse:
        model, stats = fuse_transformer(model)
        ctx.notes["fused"] = stats
    if not weight_matmuls(model, ("MatMul", "Attention", "Gather", "EmbedLayerNormalization")):
        return None
    def run(src: Path, dst: Path) -> None:
        quantize_dynamic(
            src, dst, op_types_to_quantize=list(config.op_types), per_channel=config.per_channel,
            reduce_range=config.reduce_range, weight_type=QuantType.QInt8, use_external_data_format=True,
            # activation x activation products (Q.K^T, P.V) stay float: quantizing them costs
            # accuracy and, at these sizes, saves nothing
            extra_options={"MatMulConstBOnly": True, "DefaultTensorType": onnx.TensorProto.FLOAT,
                           "WeightSymmetric": True, "ActivationSymmetric": config.activation_symmetric},
        )

    return _roundtrip(run, model)


@register(Int8StaticConfig)
def int8_static(model: onnx.ModelProto, config: Int8StaticConfig, ctx: ShardContext) -> onnx.ModelProto | None:
    from onnxruntime.quantization import CalibrationMethod, QuantFormat, QuantType, quantize_static

    if not weight_matmuls(model, config.op_types):
        return None
    method = {"minmax": CalibrationMethod.MinMax, "entropy": CalibrationMethod.Entropy,
              "percentile": CalibrationMethod.Percentile}[config.method]

    def run(src: Path, dst: Path) -> None:
        ctx.reader.rewind()
        quantize_static(
            src, dst, ctx.reader, quant_format=QuantFormat.QDQ, op_types_to_quantize=list(config.op_types),
            per_channel=config.per_channel, reduce_range=config.reduce_range, activation_type=QuantType.QUInt8,
            weight_type=QuantType.QInt8, calibrate_method=method, use_external_data_format=True,
            extra_options={"MatMulConstBOnly": True, "DefaultTensorType": onnx.TensorProto.FLOAT},
        )

    return _roundtrip(run, model)


@register(WeightOnlyConfig)
def weight_only(model: onnx.ModelProto, config: WeightOnlyConfig, ctx: ShardContext) -> onnx.ModelProto | None:
    from onnxruntime.quantization.matmul_nbits_quantizer import DefaultWeightOnlyQuantConfig, MatMulNBitsQuantizer

    op_types = ("MatMul", "Gather")
    if not weight_matmuls(model, op_types):
        return None
    algo = DefaultWeightOnlyQuantConfig(
        block_size=config.block_size, is_symmetric=config.symmetric, accuracy_level=config.accuracy_level,
        bits=config.bits, op_types_to_quantize=op_types, quant_axes=(("MatMul", 0), ("Gather", 1)),
    )
    q = MatMulNBitsQuantizer(model, algo_config=algo)
    with _quiet():
        q.process()
    return q.model.model


@register(Fp16Config)
def fp16(model: onnx.ModelProto, config: Fp16Config, ctx: ShardContext) -> onnx.ModelProto | None:
    from onnxruntime.transformers.float16 import convert_float_to_float16

    if not any(t.data_type == onnx.TensorProto.FLOAT for t in model.graph.initializer):
        return None
    # shape inference on: without the value types, the converter leaves ops kept in fp32
    # (LayerNormalization) reading fp16 values, a graph ONNX Runtime refuses
    out = convert_float_to_float16(
        model, keep_io_types=config.keep_io_types, op_block_list=list(config.op_block_list), disable_shape_infer=False,
    )
    # it also inserts the same Cast once per reader of a value: keep one
    seen, nodes = set(), []
    for node in out.graph.node:
        key = node.SerializeToString()
        if key not in seen:
            seen.add(key)
            nodes.append(node)
    del out.graph.node[:]
    out.graph.node.extend(nodes)
    return out


from slimml.quantize import nncf_backend as _nncf_backend  # noqa: E402,F401  (registers the nncf backends)
from slimml.quantize import decoder as _decoder  # noqa: E402,F401  (registers the language-model backend)
