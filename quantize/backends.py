"""The ONNX Runtime backends: one function per config type, registered in :mod:`.registry`.

Each backend takes one shard's graph (weights loaded) and returns the quantized graph, or
``None`` when the shard holds nothing it can quantize (the shard then stays as it is). The NNCF
backends live in :mod:`.nncf_backend`; importing this module registers both.
"""

from __future__ import annotations

import contextlib
import logging
import tempfile
from collections.abc import Callable
from pathlib import Path

import numpy as np
import onnx

from slimml.quantize.config import Fp16Config, Int8DynamicConfig, Int8StaticConfig, WeightOnlyConfig
from slimml.quantize.experts import quantize_experts, routers
from slimml.quantize.registry import Backend, ShardContext, backend_for, register, weight_matmuls  # noqa: F401

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
    """ORT's quantizers log advice ("consider pre-processing") on the root logger, the int8
    weight quantizer an ERROR line for each embedding it leaves float, and the 4-bit one numpy's
    "invalid value encountered in divide" for a block of zeros (a padding row: it writes 0 there,
    as it should): not the user's business."""
    loggers = [logging.getLogger(n) for n in ("", "onnxruntime.quantization.matmul_nbits_quantizer", "onnxruntime.quantization")]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.CRITICAL)
    try:
        with np.errstate(divide="ignore", invalid="ignore"):
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
    if experts := quantize_experts(model, 8, 4):  # a mixture of experts' MoE nodes to QMoE (8-bit blocks, int8 activations)
        ctx.notes["experts"] = experts
    if not weight_matmuls(model, ("MatMul", "Attention", "Gather", "EmbedLayerNormalization")):
        return model if experts else None
    kept = routers(model)  # float: they choose the experts

    def run(src: Path, dst: Path) -> None:
        quantize_dynamic(
            src, dst, op_types_to_quantize=list(config.op_types), per_channel=config.per_channel, nodes_to_exclude=kept,
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
    if experts := quantize_experts(model, config.bits, config.accuracy_level):  # a mixture of experts' MoE nodes to QMoE
        ctx.notes["experts"] = experts
    if not weight_matmuls(model, op_types):
        return model if experts else None
    algo = DefaultWeightOnlyQuantConfig(
        block_size=config.block_size, is_symmetric=config.symmetric, accuracy_level=config.accuracy_level,
        bits=config.bits, op_types_to_quantize=op_types, quant_axes=(("MatMul", 0), ("Gather", 1)),
    )
    q = MatMulNBitsQuantizer(_opset_21(model), algo_config=algo, nodes_to_exclude=routers(model))
    with _quiet():
        q.process()
    return q.model.model


def _opset_21(model: onnx.ModelProto) -> onnx.ModelProto:
    """``model`` converted to opset 21 (onnx's version converter) where it is older: quantizing
    ``Gather`` to 4 bits, ONNX Runtime's quantizer declares opset 21 without converting the nodes, so a
    ``ReduceMean`` with opset 17's ``axes`` attribute (an RMSNorm traced by torch) became an invalid
    graph. A model the converter cannot take (over 2 GB, an op it has no adapter for) is left as it is."""
    version = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 21)
    if version >= 21:
        return model
    try:
        return onnx.version_converter.convert_version(model, 21)
    except Exception:
        return model


CACHE_NAMES = ("past_key_values.", "present.")  # a decoder's KV cache, in and out


@register(Fp16Config)
def fp16(model: onnx.ModelProto, config: Fp16Config, ctx: ShardContext) -> onnx.ModelProto | None:
    from onnxruntime.transformers.float16 import convert_float_to_float16

    if not any(t.data_type == onnx.TensorProto.FLOAT for t in model.graph.initializer):
        return None
    keep: bool | list[str] = config.keep_io_types
    if keep:  # a decoder's KV cache goes in and out in fp16: the buffers the engine binds in place are the
        # ones attention reads and writes (no Cast copies the whole cache each pass), at half the memory
        weights = {t.name for t in model.graph.initializer}
        keep = [v.name for v in [*model.graph.input, *model.graph.output]
                if v.name not in weights and not v.name.startswith(CACHE_NAMES)]
    # shape inference on: without the value types, the converter leaves ops kept in fp32
    # (LayerNormalization) reading fp16 values, a graph ONNX Runtime refuses
    out = convert_float_to_float16(
        model, keep_io_types=keep, op_block_list=list(config.op_block_list), disable_shape_infer=False,
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


import slimml.quantize.nncf_backend  # noqa: E402,F401  (registers the nncf backends)
import slimml.quantize.decoder  # noqa: E402,F401  (registers the language-model backend)
