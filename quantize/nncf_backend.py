"""NNCF backends: static QDQ int8 (``nncf.quantize``) and weight compression (``nncf.compress_weights``).

Chosen with ``backend="nncf"`` on :class:`Int8StaticConfig` or :class:`WeightOnlyConfig` (CLI:
``--backend nncf``). Static int8 is calibrated per shard on the same recorded activations the ONNX
Runtime backend uses (shard i sees what float shards 0..i-1 give), so a sharded artifact
quantizes as the whole graph would. ``nncf`` is imported only when one of these runs.
"""

from __future__ import annotations

import collections
import contextlib
import io
import logging
import re

import onnx

from slimml.errors import ConfigError, SlimmlError
from slimml.quantize.registry import ShardContext, register, weight_matmuls
from slimml.quantize.config import Int8StaticConfig, WeightOnlyConfig

# what NNCF 3.4's ONNX backend compresses weights to (its own list minus the float formats)
ONNX_WEIGHT_MODES = ("int8_sym", "int8_asym", "int4_sym", "int4_asym")
_MIN_OPSET = 13  # NNCF needs opset >= 13 for per-channel scales


def _nncf():
    try:
        import nncf
    except ImportError:
        raise ConfigError(
            "--backend nncf needs the nncf package, which is not installed; `pip install nncf`, "
            "or leave --backend out to use ONNX Runtime's quantizers."
        ) from None
    return nncf


@contextlib.contextmanager
def _quiet(nncf, index: int | None = None):
    """NNCF prints progress bars (rich, on stdout) and INFO lines per call; a shard at a time, that is
    noise. Its own errors (a weight whose channels the block size does not divide, ...) become one
    ConfigError line naming the shard."""
    logger = logging.getLogger("nncf")
    level = logger.level
    nncf.set_log_level(logging.ERROR)
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            yield
    except SlimmlError:
        raise
    except Exception as e:  # nncf.errors.* and what it raises from below
        what = " ".join(str(e).split())[:300] or type(e).__name__
        blocks = re.search(r"group.?size|channel", what, re.IGNORECASE)  # NNCF's words for a block that does not fit
        raise ConfigError(
            f"NNCF could not quantize shard {index} ({type(e).__name__}: {what}); use --backend ort (the default: ONNX "
            "Runtime's quantizers, which take every architecture slimml converts)"
            + (", or for int4 a block_size (WeightOnlyConfig) that divides every weight's input channels." if blocks else ".")
        ) from None
    finally:
        nncf.set_log_level(level or logging.INFO)


def _check_opset(model: onnx.ModelProto) -> None:
    version = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 0)
    if version < _MIN_OPSET:
        raise ConfigError(
            f"--backend nncf needs ONNX opset >= {_MIN_OPSET}, the artifact has {version}; "
            f"convert again with --opset {_MIN_OPSET} or higher, or use --backend ort."
        )


@register(Int8StaticConfig, "nncf")
def nncf_static(model: onnx.ModelProto, config: Int8StaticConfig, ctx: ShardContext) -> onnx.ModelProto | None:
    """QDQ int8 by ``nncf.quantize`` (transformer mode), calibrated on this shard's recorded inputs."""
    if not weight_matmuls(model, ("MatMul", "Gemm", "Conv")):
        return None
    _check_opset(model)
    _output_casts_as_identity(model)
    nncf = _nncf()
    from nncf.quantization.advanced_parameters import AdvancedQuantizationParameters, OverflowFix

    rows = ctx.reader.rows
    # reduce_range: 7-bit weights, as the ORT backend (no int16 saturation on CPUs without VNNI)
    advanced = AdvancedQuantizationParameters(overflow_fix=OverflowFix.ENABLE if config.reduce_range else OverflowFix.DISABLE)
    if not config.per_channel:
        from nncf.quantization.advanced_parameters import QuantizationParameters

        advanced.weights_quantization_params = QuantizationParameters(per_channel=False)
    with _quiet(nncf, ctx.index):
        q = nncf.quantize(
            model, nncf.Dataset(rows), model_type=nncf.ModelType.TRANSFORMER, subset_size=len(rows),
            preset=nncf.QuantizationPreset.MIXED, fast_bias_correction=True, advanced_parameters=advanced,
        )
    ctx.notes["nncf"] = {"calibration_batches": len(rows)}
    return q


@register(WeightOnlyConfig, "nncf")
def nncf_weights(model: onnx.ModelProto, config: WeightOnlyConfig, ctx: ShardContext) -> onnx.ModelProto | None:
    """Data-free weight compression by ``nncf.compress_weights``: int8 per channel, int4 in blocks."""
    if not weight_matmuls(model, ("MatMul", "Gemm", "Gather")):
        return None
    _check_opset(model)
    _output_casts_as_identity(model)
    nncf = _nncf()
    mode = f"int{config.bits}_{'sym' if config.symmetric else 'asym'}"
    if mode not in ONNX_WEIGHT_MODES:
        raise ConfigError(
            f"NNCF cannot compress ONNX weights to {mode}; it supports {', '.join(ONNX_WEIGHT_MODES)}."
        )
    # a Conv's weight (a vision model's patch embedding) stays float: NNCF 3.4 gives its
    # DequantizeLinear a 4-d per-channel scale, which ONNX Runtime refuses ("scale must be 1D tensor")
    float_convs = nncf.IgnoredScope(types=["Conv"], validate=False)
    with _quiet(nncf, ctx.index):
        if config.bits == 8:
            return nncf.compress_weights(model, mode=nncf.CompressWeightsMode(mode), ignored_scope=float_convs)
        _declare_contrib(model)  # NNCF writes MatMulNBits (com.microsoft) and infers shapes before it returns
        # every MatMul in int4 blocks: NNCF's default keeps the last weight in int8, which per shard
        # would be every shard's last MatMul. Embedding Gathers go to int8 in a second pass (NNCF
        # 3.4 turns an int4 Gather into a MatMulNBits that ONNX Runtime rejects).
        from nncf.quantization.advanced_parameters import AdvancedCompressionParameters, GroupSizeFallbackMode

        # a weight whose input channels the block size does not divide (a small Swin stage's 16) gets
        # the largest block that does, as ONNX Runtime's quantizer pads such a weight instead of failing
        adjust = AdvancedCompressionParameters(group_size_fallback_mode=GroupSizeFallbackMode.ADJUST)
        model = nncf.compress_weights(model, mode=nncf.CompressWeightsMode(mode), group_size=config.block_size,
                                      ratio=1.0, all_layers=True, ignored_scope=nncf.IgnoredScope(types=["Gather", "Conv"], validate=False),
                                      advanced_parameters=adjust)
        if any(n.op_type == "Gather" for n in weight_matmuls(model, ("Gather",))):
            model = nncf.compress_weights(model, mode=nncf.CompressWeightsMode.INT8_ASYM, ignored_scope=float_convs)
        _flat_biases(model)
        return model


def _flat_biases(model: onnx.ModelProto) -> None:
    """Undo NNCF 3.4's bias fold where it is wrong: it gives a ``MatMulNBits`` the bias of the ``Add``
    after the MatMul and keeps the ``Add`` (the bias added twice), as the bias's shape, which ONNX
    Runtime refuses unless it is ``[N]`` (BART's ``final_logits_bias``, (1, vocab): an lm_head that
    would not load). Where the ``Add`` is still there the node loses its copy; a lone bias is given
    the shape ``[N]``."""
    inits = {t.name: t for t in model.graph.initializer}
    adds = {frozenset(n.input) for n in model.graph.node if n.op_type == "Add"}
    readers = collections.Counter(x for node in model.graph.node for x in node.input)
    for node in model.graph.node:
        if node.op_type != "MatMulNBits" or len(node.input) < 6 or not node.input[5]:
            continue
        if frozenset((node.output[0], node.input[5])) in adds:  # added again after the node
            del node.input[5:]
            while node.input and not node.input[-1]:
                del node.input[-1]
            continue
        bias = inits.get(node.input[5])
        if bias is not None and readers[bias.name] == 1 and len(bias.dims) > 1 and all(d == 1 for d in bias.dims[:-1]):
            bias.dims[:] = bias.dims[-1:]


def _output_casts_as_identity(model: onnx.ModelProto) -> None:
    """Turn each ``Cast`` to the type it already has whose result leaves the shard into an
    ``Identity`` (the same values): NNCF 3.4 removes no-op Casts first, and one that writes a graph
    output has no ``value_info`` entry, so it failed with a KeyError on every ModernBERT and Swin
    shard (their rotary and window code casts int64 to int64)."""
    outputs = {o.name for o in model.graph.output}
    casts = [n for n in model.graph.node if n.op_type == "Cast" and n.output[0] in outputs]
    if not casts:
        return
    inferred = onnx.shape_inference.infer_shapes(model).graph
    types = {v.name: v.type.tensor_type.elem_type
             for v in (*inferred.value_info, *inferred.input, *inferred.output)}
    types.update({t.name: t.data_type for t in model.graph.initializer})
    for node in casts:
        to = next((a.i for a in node.attribute if a.name == "to"), None)
        if to is not None and types.get(node.input[0]) == to:
            node.op_type = "Identity"
            del node.attribute[:]


def _declare_contrib(model: onnx.ModelProto) -> None:
    """Import ONNX Runtime's ``com.microsoft`` domain where the shard does not: NNCF writes
    ``MatMulNBits`` there without importing it and then fails its own shape inference ("No opset
    import for domain com.microsoft": every T5 shard, which holds no contrib op before)."""
    if not any(o.domain == "com.microsoft" for o in model.opset_import):
        model.opset_import.append(onnx.helper.make_opsetid("com.microsoft", 1))
