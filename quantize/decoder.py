"""Weight-only quantization for language models (``backend="lm"``): llama.cpp's grids in MatMulNBits.

Dynamic int8 activations cost SmolLM2-135M +71% perplexity; ONNX Runtime's int4 quantizer
(symmetric, integer zero points) +35%. This backend writes, for each MatMul with a float weight,
a ``MatMulNBits`` whose blocks follow llama.cpp's formats:

* 4 bits: blocks of 32 along the input dimension, asymmetric min/max with a float zero point
  (llama.cpp's Q4_1: ``w = d * q + m``). Weights that came from a Q4_1 GGUF file sit exactly on
  that grid and come back unchanged (the float zero point ``-m / d`` represents ``m`` exactly,
  which an integer zero point cannot).
* 8 bits: blocks of 32, symmetric (Q8_0: ``w = d * q``, ``d = max|w| / 127``).

The output projection (``lm_head``, the largest and most sensitive matrix) gets 8 bits in both
schemes, as llama.cpp keeps its output tensor at 6-8 bits; the token embedding (a ``Gather``)
is stored as int8 rows with a scale per block, dequantized after the lookup (only the looked-up
rows), so it shrinks 4x without a custom op.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from slimml.quantize.backends import ShardContext, register, weight_matmuls
from slimml.quantize.config import WeightOnlyConfig

LM_HEAD_MIN_COLUMNS = 16384  # a MatMul this wide (N = vocabulary) is the output projection


@register(WeightOnlyConfig, "lm")
def lm_weights(model: onnx.ModelProto, config: WeightOnlyConfig, ctx: ShardContext) -> onnx.ModelProto | None:
    """Quantize one shard of a decoder: MatMul weights to MatMulNBits, the embedding Gather to int8 rows."""
    nodes = weight_matmuls(model, ("MatMul", "Gather"))
    if not nodes:
        return None
    inits = {t.name: t for t in model.graph.initializer}
    readers: dict[str, int] = {}
    for n in model.graph.node:
        for i in n.input:
            readers[i] = readers.get(i, 0) + 1
    new_nodes, drop, add = [], set(), []
    done = {id(n) for n in nodes}
    for node in model.graph.node:
        if id(node) not in done:
            new_nodes.append(node)
            continue
        if node.op_type == "Gather":
            name = node.input[0]
            w = numpy_helper.to_array(inits[name]).astype(np.float32)  # (vocab, hidden)
            if w.shape[1] % config.block_size:
                new_nodes.append(node)
                continue
            made, tensors = _gather_int8(node, w, config.block_size)
        else:
            name = node.input[1]
            w = numpy_helper.to_array(inits[name]).astype(np.float32)  # (K, N)
            bits = 8 if w.shape[1] >= LM_HEAD_MIN_COLUMNS else config.bits
            made, tensors = _matmul_nbits(node, w, bits, config.block_size, config.accuracy_level)
        new_nodes.extend(made)
        add.extend(tensors)
        readers[name] -= 1
        if readers[name] == 0:
            drop.add(name)
    del model.graph.node[:]
    model.graph.node.extend(new_nodes)
    keep = [t for t in model.graph.initializer if t.name not in drop]
    del model.graph.initializer[:]
    model.graph.initializer.extend(keep + add)
    if not any(o.domain == "com.microsoft" for o in model.opset_import):
        model.opset_import.append(helper.make_opsetid("com.microsoft", 1))
    ctx.notes["lm_weights"] = {"bits": config.bits, "block_size": config.block_size}
    return model


def quantize_blocks(w: np.ndarray, bits: int, block: int) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """Blocks of ``block`` values along the last axis of ``w`` (rows, K): codes (rows, K) uint8,
    scales (rows, K/block) and, for 4 bits, float zero points (rows, K/block); ``w ~ (q - zp) * scale``.

    4 bits: min/max per block (Q4_1); 8 bits: symmetric, codes offset by 128 (Q8_0).
    """
    rows, k = w.shape
    b = w.reshape(rows, k // block, block).astype(np.float64)
    if bits == 8:
        scale = np.abs(b).max(axis=-1) / 127.0
        safe = np.where(scale == 0, 1.0, scale)
        q = np.clip(np.rint(b / safe[..., None]), -127, 127) + 128
        return q.reshape(rows, k).astype(np.uint8), scale.astype(np.float32), None
    lo, hi = b.min(axis=-1), b.max(axis=-1)
    scale = (hi - lo) / 15.0
    safe = np.where(scale == 0, 1.0, scale)
    q = np.clip(np.rint((b - lo[..., None]) / safe[..., None]), 0, 15)
    zp = -lo / safe  # w = scale * q + lo = scale * (q - zp)
    return q.reshape(rows, k).astype(np.uint8), scale.astype(np.float32), zp.astype(np.float32)


def _matmul_nbits(node: onnx.NodeProto, w: np.ndarray, bits: int, block: int, level: int | None):
    k, n = w.shape
    pad = (-k) % block
    wt = np.pad(w.T, ((0, 0), (0, pad)))  # (N, K padded): MatMulNBits stores B transposed
    q, scale, zp = quantize_blocks(wt, bits, block)
    blocks = wt.shape[1] // block
    if bits == 4:
        q = (q[:, 0::2] | (q[:, 1::2] << 4)).astype(np.uint8)  # two codes a byte, the first in the low nibble
    base = f"{node.input[1]}_q{bits}"
    tensors = [numpy_helper.from_array(q.reshape(n, blocks, block * bits // 8), base),
               numpy_helper.from_array(scale.reshape(-1), base + "_scales")]
    inputs = [node.input[0], base, base + "_scales"]
    if zp is not None:
        tensors.append(numpy_helper.from_array(zp.reshape(-1), base + "_zp"))
        inputs.append(base + "_zp")
    attrs = {"K": k, "N": n, "bits": bits, "block_size": block}
    if level is not None:
        attrs["accuracy_level"] = level
    made = helper.make_node("MatMulNBits", inputs, list(node.output), name=(node.name or base) + "_Q", domain="com.microsoft", **attrs)
    return [made], tensors


def _gather_int8(node: onnx.NodeProto, w: np.ndarray, block: int):
    """Gather the int8 rows and their scales, then dequantize only those: (…, hidden) float."""
    vocab, hidden = w.shape
    q, scale, _ = quantize_blocks(w, 8, block)
    base = f"{node.input[0]}_q8"
    out = node.output[0]
    tensors = [numpy_helper.from_array(q.view(np.uint8), base), numpy_helper.from_array(scale, base + "_scales"),
               numpy_helper.from_array(np.array([128.0], np.float32), base + "_zero"),
               numpy_helper.from_array(np.array([0, 0, -1, block], np.int64), base + "_blocked"),
               numpy_helper.from_array(np.array([0, 0, hidden], np.int64), base + "_shape")]
    axis = [a for a in node.attribute if a.name == "axis"]
    if axis and axis[0].i != 0:
        raise ValueError("an embedding Gather on an axis other than 0")
    ids = node.input[1]
    made = [
        helper.make_node("Gather", [base, ids], [base + "_rows"], axis=0),  # (…, hidden) uint8
        helper.make_node("Gather", [base + "_scales", ids], [base + "_rscales"], axis=0),  # (…, blocks)
        helper.make_node("Cast", [base + "_rows"], [base + "_f"], to=TensorProto.FLOAT),
        helper.make_node("Sub", [base + "_f", base + "_zero"], [base + "_c"]),
        helper.make_node("Reshape", [base + "_c", base + "_blocked"], [base + "_b"]),  # (B, S, blocks, block)
        helper.make_node("Unsqueeze", [base + "_rscales", base + "_axis"], [base + "_s"]),
        helper.make_node("Mul", [base + "_b", base + "_s"], [base + "_m"]),
        helper.make_node("Reshape", [base + "_m", base + "_shape"], [out]),
    ]
    tensors.append(numpy_helper.from_array(np.array([-1], np.int64), base + "_axis"))
    return made, tensors


def for_language_model(config, manifest):
    """The config to use on ``manifest``'s artifact: for a language model, the word ``int8`` (dynamic
    int8 activations, +71% perplexity on SmolLM2) and ONNX Runtime's int4/int8 weights become this
    backend's weight-only blocks of 32; other artifacts, and explicit NNCF or static configs, keep theirs."""
    import dataclasses

    from slimml.convert.llm_check import is_language_model
    from slimml.quantize.config import Int8DynamicConfig

    if not is_language_model(manifest):
        return config
    common = {f.name: getattr(config, f.name) for f in dataclasses.fields(config)
              if f.name in ("calibration", "calibration_size", "guard", "exclude_shards", "eval_text")}
    if isinstance(config, Int8DynamicConfig):
        return WeightOnlyConfig(bits=8, block_size=32, symmetric=True, backend="lm", **common)
    if isinstance(config, WeightOnlyConfig) and config.backend == "ort":
        return WeightOnlyConfig(bits=config.bits, block_size=32, symmetric=config.bits == 8, backend="lm",
                                accuracy_level=config.accuracy_level, **common)
    return config
