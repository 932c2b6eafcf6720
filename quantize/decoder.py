"""Weight-only quantization for language models (``backend="lm"``): llama.cpp's grids in MatMulNBits.

Dynamic int8 activations cost SmolLM2-135M +71% perplexity; ONNX Runtime's int4 quantizer
(symmetric, integer zero points) +35%. This backend writes, for each MatMul with a float weight,
a ``MatMulNBits`` whose blocks follow llama.cpp's formats, with float16 scales on disk (as
llama.cpp stores them; a Cast that ONNX Runtime folds at load feeds the float32 kernel):

* 4 bits: blocks of 32 along the input dimension, min/max per block, ``w = d * q + m``
  (llama.cpp's Q4_1). Weights that came from a Q4_1 GGUF file sit exactly on that grid and come
  back unchanged (SmolLM2: +0.00% perplexity). See :func:`_matmul_nbits` for how ``m`` is applied.
* 8 bits: blocks of 32, symmetric (Q8_0: ``w = d * q``, ``d = max|w| / 127``).

The output projection (``lm_head``, the widest matrix and the most sensitive) gets 8 bits in both
schemes, as llama.cpp keeps its output tensor at 6-8 bits; the token embedding (a ``Gather``) is
stored as 8-bit rows in the same layout, dequantized after the lookup (only the looked-up rows),
so that a tied embedding is stored once (``quantize/tied.py``).
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from slimml.quantize.registry import ShardContext, register, weight_matmuls
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
    new_nodes, drop, add, sums = [], set(), [], {}
    done = {tuple(n.output) for n in nodes}
    for node in model.graph.node:
        if tuple(node.output) not in done:
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
            if bits == 4 and w.shape[0] % config.block_size:
                bits = 8  # a 4-bit block needs whole blocks of the input: this one stays 8-bit
            made, tensors = _matmul_nbits(node, w, bits, config.block_size, config.accuracy_level, sums)
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
    """Blocks of ``block`` values along the last axis of ``w`` (rows, K): codes (rows, K/block, block)
    uint8, float16 scales ``d`` (rows, K/block) and, for 4 bits, float16 block minimums ``m``.

    4 bits: min/max per block, ``w ~ d * q + m`` (llama.cpp's Q4_1); 8 bits: symmetric,
    ``w ~ d * (q - 128)`` (Q8_0). ``d`` and ``m`` are rounded to float16 (as llama.cpp stores them)
    before the codes are chosen, so the codes fit the stored values.
    """
    rows, k = w.shape
    b = w.reshape(rows, k // block, block).astype(np.float32)
    if bits == 8:
        d = (np.abs(b).max(axis=-1) / 127.0).astype(np.float16)
        d = np.where(d == 0, np.float16(1), d)
        q = np.clip(np.rint(b / d.astype(np.float32)[..., None]), -127, 127) + 128
        return q.astype(np.uint8), d, None
    lo, hi = b.min(axis=-1), b.max(axis=-1)
    m = lo.astype(np.float16)
    d = ((hi - m.astype(np.float32)) / 15.0).astype(np.float16)
    d = np.where(d == 0, np.float16(1), d)
    q = np.clip(np.rint((b - m.astype(np.float32)[..., None]) / d.astype(np.float32)[..., None]), 0, 15)
    return q.astype(np.uint8), d, m


def _matmul_nbits(node: onnx.NodeProto, w: np.ndarray, bits: int, block: int, level: int | None, sums: dict[str, str]):
    """MatMulNBits for ``x @ w``, reading float16 ``d`` (and ``m``) through Casts ONNX Runtime folds at load.

    4 bits: ``w = d * q + m`` per block is computed as ``MatMulNBits(x, q, d)`` (its default zero
    point 8: ``d * (q - 8)``) plus ``blocksum(x) @ (m + 8 d)``, a matmul 32x smaller: MatMulNBits'
    float zero points would represent ``m`` directly but run ~20x slower (ORT 1.32), and integer
    zero points cannot hold ``m`` (+32% perplexity on SmolLM2 instead of +0%). ``sums`` caches one
    block sum per input (q, k and v read the same one).
    """
    k, n = w.shape
    pad = (-k) % block
    if bits == 4 and pad:
        raise ValueError(f"4-bit blocks need K divisible by {block}")
    wt = np.pad(w.T, ((0, 0), (0, pad)))  # (N, K padded): MatMulNBits stores B transposed
    q, d, m = quantize_blocks(wt, bits, block)
    if bits == 4:
        q = (q[..., 0::2] | (q[..., 1::2] << 4)).astype(np.uint8)  # two codes a byte, the first in the low nibble
    base = f"{node.input[1]}_q{bits}"
    tensors = [numpy_helper.from_array(q, base), numpy_helper.from_array(d, base + "_d16"),
               numpy_helper.from_array(np.array([-1], np.int64), base + "_flat")]
    made = [helper.make_node("Cast", [base + "_d16"], [base + "_d32"], to=TensorProto.FLOAT),
            helper.make_node("Reshape", [base + "_d32", base + "_flat"], [base + "_scales"])]
    attrs = {"K": k, "N": n, "bits": bits, "block_size": block}
    if level is not None:
        attrs["accuracy_level"] = level
    out = node.output[0] if m is None else base + "_main"
    made.append(helper.make_node("MatMulNBits", [node.input[0], base, base + "_scales"], [out],
                                 name=(node.name or base) + "_Q", domain="com.microsoft", **attrs))
    if m is None:
        return made, tensors
    x = node.input[0]
    if x not in sums:  # (..., K) -> (..., K / block): each block's sum of the input
        sums[x] = f"{x}_blocksum{block}"
        tensors.append(numpy_helper.from_array(np.array([0, 0, k // block, block], np.int64), sums[x] + "_shape"))
        tensors.append(numpy_helper.from_array(np.array([-1], np.int64), sums[x] + "_axis"))
        made += [helper.make_node("Reshape", [x, sums[x] + "_shape"], [sums[x] + "_b"]),
                 helper.make_node("ReduceSum", [sums[x] + "_b", sums[x] + "_axis"], [sums[x]], keepdims=0)]
    tensors += [numpy_helper.from_array(np.ascontiguousarray(m.T), base + "_m16"),  # (blocks, N)
                numpy_helper.from_array(np.array(8.0, np.float32), base + "_eight")]
    made += [helper.make_node("Cast", [base + "_m16"], [base + "_m32"], to=TensorProto.FLOAT),
             helper.make_node("Transpose", [base + "_d32"], [base + "_dT"], perm=[1, 0]),
             helper.make_node("Mul", [base + "_dT", base + "_eight"], [base + "_8d"]),
             helper.make_node("Add", [base + "_m32", base + "_8d"], [base + "_offset"]),  # m + 8 d: (blocks, N)
             helper.make_node("MatMul", [sums[x], base + "_offset"], [base + "_corr"]),
             helper.make_node("Add", [out, base + "_corr"], [node.output[0]])]
    return made, tensors


def _gather_int8(node: onnx.NodeProto, w: np.ndarray, block: int):
    """Gather the int8 rows and their scales, then dequantize only those: (..., hidden) float.

    The table is stored as the output projection's MatMulNBits stores its weight ((vocab,
    blocks, block) uint8 and (vocab, blocks) float16 scales), so a tied embedding can be stored once.
    """
    vocab, hidden = w.shape
    q, d, _ = quantize_blocks(w, 8, block)
    base = f"{node.input[0]}_q8"
    tensors = [numpy_helper.from_array(q, base), numpy_helper.from_array(d, base + "_d16"),
               numpy_helper.from_array(np.array([128.0], np.float32), base + "_zero"),
               numpy_helper.from_array(np.array([-1], np.int64), base + "_axis"),
               numpy_helper.from_array(np.array([0, 0, hidden], np.int64), base + "_shape")]
    axis = [a for a in node.attribute if a.name == "axis"]
    if axis and axis[0].i != 0:
        raise ValueError("an embedding Gather on an axis other than 0")
    ids = node.input[1]
    made = [
        helper.make_node("Gather", [base, ids], [base + "_rows"], axis=0),  # (B, S, blocks, block) uint8
        helper.make_node("Gather", [base + "_d16", ids], [base + "_rd16"], axis=0),  # (B, S, blocks)
        helper.make_node("Cast", [base + "_rows"], [base + "_f"], to=TensorProto.FLOAT),
        helper.make_node("Cast", [base + "_rd16"], [base + "_rd"], to=TensorProto.FLOAT),
        helper.make_node("Sub", [base + "_f", base + "_zero"], [base + "_c"]),
        helper.make_node("Unsqueeze", [base + "_rd", base + "_axis"], [base + "_s"]),
        helper.make_node("Mul", [base + "_c", base + "_s"], [base + "_m"]),
        helper.make_node("Reshape", [base + "_m", base + "_shape"], [node.output[0]]),
    ]
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
    if isinstance(config, WeightOnlyConfig) and config.backend == "ort" and (config.block_size, config.accuracy_level) != (32, None):
        return config  # blocks or a compute type chosen in Python (e.g. block 128, accuracy_level 4: the fastest decode) are honoured
    if isinstance(config, WeightOnlyConfig) and config.backend == "ort":
        return WeightOnlyConfig(bits=config.bits, block_size=32, symmetric=config.bits == 8, backend="lm",
                                accuracy_level=config.accuracy_level, **common)
    return config
