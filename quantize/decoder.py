"""Weight-only quantization for language models (``backend="lm"``): MatMulNBits on a chosen grid.

Dynamic int8 activations cost SmolLM2-135M +71% perplexity; ONNX Runtime's int4 quantizer
(symmetric, blocks of 32) +35%. This backend writes, for each MatMul with a float weight, a
``MatMulNBits`` whose blocks follow a :class:`~slimml.quantize.grids.Recipe` (``quantize/grids.py``):

* ``grid="gguf"`` (a 4-bit GGUF source): the file's own 4-bit blocks of 32 (Q4_1, Q4_K) kept
  (SmolLM2's Q4_1: +0.00% perplexity), its tensors of more bits at 8; see :func:`matmul_nbits_node`
  for how ``m`` is applied.
* ``grid="fitted"`` (any other weights): ONNX Runtime's own format, an integer zero point and a
  searched scale per block of 128, accuracy_level 4: the fast kernel at batch-1 decode; with a
  tokenizer, the calibration text's activations drive the FFN scaling (``quantize/equalize.py``)
  and GPTQ's error feedback (``quantize/gptq.py``); FFN down, O and V of as many layers as fit in
  llama.cpp's Q4_K_M size stay 8-bit (``quantize/budget.py``).
* 8 bits: symmetric blocks (Q8_0's scheme), accuracy_level 4.

Scales are float16 on disk (as llama.cpp stores them; a Cast that ONNX Runtime folds at load feeds
the float32 kernel). The output projection (``lm_head``, the widest matrix and the most
sensitive) gets 8 bits, as llama.cpp keeps its output tensor at 6-8 bits; the token embedding (a
``Gather``) is stored as 8-bit rows in the same layout, dequantized after the lookup (only the
looked-up rows), so that a tied embedding is stored once (``quantize/tied.py``).
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from slimml.quantize.config import LM_BACKEND, WeightOnlyConfig
from slimml.quantize.equalize import equalize_ffn
from slimml.quantize.experts import quantize_experts, routers
from slimml.quantize.gptq import gptq_blocks
from slimml.quantize.grids import (LM_HEAD_MIN_COLUMNS, Recipe, block_for, fit_blocks, is_sensitive, layer_of, more_bits_layers,
                                   gguf_blocks, pack_nibbles, q8_blocks)
from slimml.quantize.registry import ShardContext, register, weight_matmuls

INT4_BLOCK, INT8_BLOCK = 128, 128  # the decoder defaults, chosen at M=1 (docs/quantize.md, "Decoder recipes")
FAST_LEVEL = 4  # MatMulNBits' int8 compute: 2.8x fp32's speed at M=1
CALIBRATION_TOKENS, CALIBRATION_WINDOW = 4096, 256  # GPTQ's second moments: 1024 tokens left H short of full rank (+15.8% against +10.8% on smol_rot)


def activation_aware(config) -> bool:
    """The fitted 4-bit grid weighs each block's error by its input channels' mean squared activation."""
    return isinstance(config, WeightOnlyConfig) and config.backend == "lm" and config.bits == 4 and (config.grid or "fitted") == "fitted"


def calibration_feeds(folder, manifest, texts: list[str]) -> list[dict[str, np.ndarray]]:
    """Decoder feeds over the calibration text (not the evaluation text): windows of
    :data:`CALIBRATION_WINDOW` tokens, :data:`CALIBRATION_TOKENS` in all."""
    from slimml.convert.llm_check import artifact_context, decoder_feeds, past_shapes, token_windows

    context = artifact_context(folder, manifest)  # a window never passes the model's positions
    window = min(CALIBRATION_WINDOW, context) if context else CALIBRATION_WINDOW
    windows = token_windows(folder / manifest.tokenizer["file"], "\n\n".join(texts), window, CALIBRATION_TOKENS)
    names, past = [t.name for t in manifest.inputs], past_shapes(manifest.inputs)
    return [decoder_feeds(names, w[None, :], past) for w in windows]


def input_moments(model: onnx.ModelProto, rows: list[dict[str, np.ndarray]], names: list[str]) -> dict[str, np.ndarray]:
    """Each of ``names`` (MatMul inputs inside the shard ``model``): its second moments ``X^T X / n``
    over the calibration ``rows`` (the shard's recorded inputs), float64 (K, K); the diagonal is
    each channel's mean square."""
    sums: dict[str, np.ndarray] = {}
    counts: dict[str, int] = {}
    for values in _captured(model, rows, names):
        for n, v in values.items():
            v = v.reshape(-1, v.shape[-1]).astype(np.float64)
            sums[n] = sums.get(n, 0.0) + v.T @ v
            counts[n] = counts.get(n, 0) + v.shape[0]
    return {n: v / max(counts[n], 1) for n, v in sums.items()}


def input_samples(model: onnx.ModelProto, rows: list[dict[str, np.ndarray]], names: list[str]) -> dict[str, np.ndarray]:
    """Each of ``names`` (tensors inside the shard ``model``) over the calibration ``rows``: every
    position's vector, (positions, width) float32 (a mixture of experts' input and router logits)."""
    parts: dict[str, list[np.ndarray]] = {}
    for values in _captured(model, rows, names):
        for n, v in values.items():
            parts.setdefault(n, []).append(v.reshape(-1, v.shape[-1]).astype(np.float32))
    return {n: np.concatenate(v) for n, v in parts.items()}


def _captured(model: onnx.ModelProto, rows: list[dict[str, np.ndarray]], names: list[str]):
    """For each calibration row, ``{name: value}`` of ``names`` as the shard computes them."""
    import onnxruntime as ort

    graph_inputs = {i.name for i in model.graph.input}
    wanted = [n for n in dict.fromkeys(names) if n not in graph_inputs]
    outputs = list(model.graph.output)  # the shard's own outputs, put back below (no copy of its weights)
    try:
        del model.graph.output[:]
        model.graph.output.extend(helper.make_tensor_value_info(n, TensorProto.FLOAT, None) for n in wanted)
        session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    finally:
        del model.graph.output[:]
        model.graph.output.extend(outputs)
    for row in rows:
        feeds = {i.name: row[i.name] for i in session.get_inputs()}
        values = dict(zip(wanted, session.run(wanted, feeds))) if wanted else {}
        values.update({n: row[n] for n in names if n in graph_inputs})
        yield values


def recipe_of(config: WeightOnlyConfig) -> Recipe:
    """The :class:`Recipe` a ``backend="lm"`` config asks for."""
    grid = config.grid or "fitted"
    return Recipe(bits=config.bits, block_size=32 if grid == "gguf" else config.block_size,
                  accuracy_level=config.accuracy_level, grid=grid, zero_points=not config.symmetric,
                  sensitive_layers=config.sensitive_layers, embedding_bits=config.embedding_bits)


@register(WeightOnlyConfig, "lm")
def lm_weights(model: onnx.ModelProto, config: WeightOnlyConfig, ctx: ShardContext) -> onnx.ModelProto | None:
    """Quantize one shard of a decoder: MatMul weights to MatMulNBits, the embedding Gather to int8 rows."""
    recipe = recipe_of(config)
    routed = {}  # the experts' inputs and router logits over the calibration text: GPTQ for each expert
    if ctx.reader is not None:
        moe_inputs = [i for n in model.graph.node if n.op_type == "MoE" and n.domain == "com.microsoft" for i in n.input[:2]]
        if moe_inputs:
            routed = input_samples(model, ctx.reader.rows, moe_inputs)
    if experts := quantize_experts(model, recipe.bits, recipe.accuracy_level, fitted=recipe.bits == 4, samples=routed):
        ctx.notes["experts"] = experts
    kept = set(routers(model))  # float: they choose the experts
    nodes = [n for n in weight_matmuls(model, ("MatMul", "Gather")) if n.name not in kept]
    if not nodes:
        return model if experts else None
    inits = {t.name: t for t in model.graph.initializer}
    readers: dict[str, int] = {}
    for n in model.graph.node:
        for i in n.input:
            readers[i] = readers.get(i, 0) + 1
    new_nodes, drop, add, sums, counts = [], set(), [], {}, {}
    done = {tuple(n.output) for n in nodes}
    importance = {}
    if ctx.reader is not None and activation_aware(config):  # the calibration text's activations reach this shard
        importance = input_moments(model, ctx.reader.rows, [n.input[0] for n in nodes if n.op_type == "MatMul"])
    scaled = 0
    if recipe.bits == 4 and recipe.grid == "fitted":  # FFN down's input channels scaled before its blocks
        scaled = equalize_ffn(model, inits, importance, lambda k: block_for(k, recipe.block_size))
    for node in model.graph.node:
        if tuple(node.output) not in done:
            new_nodes.append(node)
            continue
        if node.op_type == "Gather":
            name = node.input[0]
            w = numpy_helper.to_array(inits[name]).astype(np.float32)  # (vocab, hidden)
            block = block_for(w.shape[1], recipe.block_size)
            if w.shape[1] % block or _gather_axis(node) != 0:  # not rows of a table: left in float
                new_nodes.append(node)
                continue
            on_grid = None
            if recipe.embedding_bits == 4 and recipe.grid == "gguf" and w.shape[1] % 32 == 0:
                on_grid = gguf_blocks(w.reshape(w.shape[0], -1, 32))
            if recipe.embedding_bits == 4 and (recipe.grid != "gguf" or on_grid is not None):
                made, tensors = _gather_int4(node, w, block, on_grid)
            else:
                made, tensors = _gather_int8(node, w, block)
        else:
            name = node.input[1]
            w = numpy_helper.to_array(inits[name]).astype(np.float32)  # (K, N)
            bits = recipe.bits
            if w.shape[1] >= LM_HEAD_MIN_COLUMNS or (bits == 4 and is_sensitive(f"{node.name} {name}", recipe)):
                bits = 8
            if bits == 4 and recipe.grid == "gguf" and w.shape[0] % 32:
                bits = 8  # the block-sum correction needs whole blocks of the input: this one stays 8-bit
            made, tensors = matmul_nbits_node(node, w, recipe, bits, sums, importance.get(node.input[0]))
            if recipe.grid == "gguf" and recipe.bits == 4 and w.shape[1] < LM_HEAD_MIN_COLUMNS:
                key = "grid_kept" if any(a.name == "bits" and a.i == 4 for n in made for a in n.attribute) else "grid_8bit"
                counts[key] = counts.get(key, 0) + 1
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
    ctx.notes["lm_weights"] = {"recipe": recipe.describe(), "activation_aware": bool(importance), "scaled_ffn": scaled, **counts}
    return model


def matmul_nbits_node(node: onnx.NodeProto, w: np.ndarray, recipe: Recipe, bits: int, sums: dict[str, str],
                      importance: np.ndarray | None = None):
    """The nodes and initializers computing ``x @ w`` (``w``: (K, N) float32) as ``recipe`` stores it at ``bits``.

    MatMulNBits reads float16 ``d`` through a Cast that ONNX Runtime folds at load. The GGUF grid
    (``w = d * q + m``, :func:`~slimml.quantize.grids.gguf_blocks`; a weight off it is stored at 8
    bits in blocks of 128) is computed as ``MatMulNBits(x, q, d, z)`` with the integer zero point
    ``z`` nearest ``-m / d`` (``d * (q - z)``) plus ``blocksum(x) @ r``, ``r = m + d z`` (what ``z``
    leaves of ``m``, at most half a step where ``-m / d`` is in 0..15), a matmul 32x smaller. ``r``
    is itself an 8-bit MatMulNBits at the recipe's accuracy level (float32 when the level is
    unset: MLAS has no fast float 8-bit kernel): a float32 ``r`` took a quarter of the kept grid's
    MatMul time at M=1. MatMulNBits' float zero points would represent ``m`` directly but run ~20x
    slower (ORT 1.32). ``sums`` caches one block sum per input (q, k and v read the same one).
    ``importance``: the input's second moments (K, K) from the calibration text: the fitted grid's
    blocks are then chosen by GPTQ's error feedback (``quantize/gptq.py``), its search weighed by them.
    """
    k, n = w.shape
    gguf = bits == 4 and recipe.grid == "gguf"
    block = 32 if gguf else block_for(k, recipe.block_size)
    pad = (-k) % block
    wt = np.pad(w.T, ((0, 0), (0, pad))).reshape(n, (k + pad) // block, block)  # MatMulNBits stores B transposed
    m = z = None
    found = gguf_blocks(wt) if gguf else None
    if gguf and found is None:  # not on a 4-bit grid (the source gave it more bits): 8-bit blocks of 128
        bits, block = 8, block_for(k, INT8_BLOCK)
        pad = (-k) % block
        wt = np.pad(w.T, ((0, 0), (0, pad))).reshape(n, (k + pad) // block, block)
    if bits == 8:
        q, d = q8_blocks(wt)
    elif found is not None:
        q, d, m = found
        d32 = d.astype(np.float32)
        zq = np.clip(np.rint(-m.astype(np.float32) / d32), 0, 15)
        m = m.astype(np.float32) + d32 * zq  # r: what the integer zero point leaves of m, (N, blocks)
        z = pack_nibbles(zq.astype(np.uint8)).reshape(-1)
    else:
        if importance is not None and not pad:
            q, d, z = gptq_blocks(wt.reshape(n, k), importance, block, recipe.zero_points)
        else:
            q, d, z = fit_blocks(wt, recipe.zero_points)
        z = pack_nibbles(z).reshape(-1) if recipe.zero_points else None
    if bits == 4:
        q = pack_nibbles(q)  # two codes a byte, the first in the low nibble
    base = f"{node.input[1]}_q{bits}"
    tensors = [numpy_helper.from_array(q, base), numpy_helper.from_array(d, base + "_d16"),
               numpy_helper.from_array(np.array([-1], np.int64), base + "_flat")]
    made = [helper.make_node("Cast", [base + "_d16"], [base + "_d32"], to=TensorProto.FLOAT),
            helper.make_node("Reshape", [base + "_d32", base + "_flat"], [base + "_scales"])]
    inputs = [node.input[0], base, base + "_scales"]
    if z is not None:
        tensors.append(numpy_helper.from_array(z, base + "_zp"))
        inputs.append(base + "_zp")
    attrs = {"K": k, "N": n, "bits": bits, "block_size": block}
    if recipe.accuracy_level is not None:
        attrs["accuracy_level"] = recipe.accuracy_level
    out = node.output[0] if m is None else base + "_main"
    made.append(helper.make_node("MatMulNBits", inputs, [out], name=(node.name or base) + "_Q", domain="com.microsoft", **attrs))
    if m is None:
        return made, tensors
    x = node.input[0]
    if x not in sums:  # (..., K) -> (..., K / block): each block's sum of the input
        sums[x] = f"{x}_blocksum{block}"
        tensors.append(numpy_helper.from_array(np.array([0, 0, k // block, block], np.int64), sums[x] + "_shape"))
        tensors.append(numpy_helper.from_array(np.array([-1], np.int64), sums[x] + "_axis"))
        made += [helper.make_node("Reshape", [x, sums[x] + "_shape"], [sums[x] + "_b"]),
                 helper.make_node("ReduceSum", [sums[x] + "_b", sums[x] + "_axis"], [sums[x]], keepdims=0)]
    blocks = k // block
    if recipe.accuracy_level is None:  # r as float32: exact, and the fast path without int8 compute
        tensors.append(numpy_helper.from_array(np.ascontiguousarray(m.T), base + "_r"))  # (blocks, N)
        made.append(helper.make_node("MatMul", [sums[x], base + "_r"], [base + "_corr"]))
    else:  # r as 8-bit blocks along the block sums
        rb = block_for(blocks, INT8_BLOCK)
        rb = rb if blocks % rb == 0 else 16  # no power of two divides the count: the least padding
        rpad = (-blocks) % rb
        rq, rd = q8_blocks(np.pad(m, ((0, 0), (0, rpad))).reshape(n, (blocks + rpad) // rb, rb))
        tensors += [numpy_helper.from_array(rq, base + "_r"), numpy_helper.from_array(rd, base + "_r_d16")]
        made += [helper.make_node("Cast", [base + "_r_d16"], [base + "_r_d32"], to=TensorProto.FLOAT),
                 helper.make_node("Reshape", [base + "_r_d32", base + "_flat"], [base + "_r_scales"]),
                 helper.make_node("MatMulNBits", [sums[x], base + "_r", base + "_r_scales"], [base + "_corr"],
                                  name=(node.name or base) + "_R", domain="com.microsoft", K=blocks, N=n, bits=8,
                                  block_size=rb, accuracy_level=recipe.accuracy_level)]
    made.append(helper.make_node("Add", [out, base + "_corr"], [node.output[0]]))
    return made, tensors


def _gather_axis(node: onnx.NodeProto) -> int:
    """The axis a Gather reads along (ONNX's default 0: rows of a table)."""
    return next((a.i for a in node.attribute if a.name == "axis"), 0)


def _gather_int8(node: onnx.NodeProto, w: np.ndarray, block: int):
    """Gather the int8 rows and their scales, then dequantize only those: (..., hidden) float.

    The table is stored as the output projection's MatMulNBits stores its weight ((vocab,
    blocks, block) uint8 and (vocab, blocks) float16 scales), so a tied embedding can be stored once.
    """
    vocab, hidden = w.shape
    q, d = q8_blocks(w.reshape(vocab, hidden // block, block))
    base = f"{node.input[0]}_q8"
    tensors = [numpy_helper.from_array(q, base), numpy_helper.from_array(d, base + "_d16"),
               numpy_helper.from_array(np.array([128.0], np.float32), base + "_zero"),
               numpy_helper.from_array(np.array([-1], np.int64), base + "_axis"),
               numpy_helper.from_array(np.array([0, 0, hidden], np.int64), base + "_shape")]
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


def _gather_int4(node: onnx.NodeProto, w: np.ndarray, block: int, gguf: tuple | None = None):
    """An untied embedding at 4 bits: gather the packed rows, scales and zero points (``s (q - z)``,
    the fitted grid) or offsets (``d q + m``, a GGUF source's own grid: ``gguf`` is its
    :func:`~slimml.quantize.grids.gguf_blocks` in blocks of 32), unpack the two nibbles of each
    byte, dequantize only those rows: (..., hidden) float."""
    vocab, hidden = w.shape
    if gguf is not None:
        (q, d, z), block = gguf, 32  # z: the float16 offset m
    else:
        q, d, z = fit_blocks(w.reshape(vocab, hidden // block, block).astype(np.float32))
    base = f"{node.input[0]}_q4"
    tensors = [numpy_helper.from_array(pack_nibbles(q), base), numpy_helper.from_array(d, base + "_d16"),
               numpy_helper.from_array(z, base + "_z"),
               numpy_helper.from_array(np.array(16.0, np.float32), base + "_16"),
               numpy_helper.from_array(np.array([-1], np.int64), base + "_axis"),
               numpy_helper.from_array(np.array([0, 0, hidden // block, block], np.int64), base + "_blocks"),
               numpy_helper.from_array(np.array([0, 0, hidden], np.int64), base + "_shape")]
    ids, b = node.input[1], base
    made = [
        helper.make_node("Gather", [b, ids], [b + "_rows"], axis=0),  # (B, S, blocks, block / 2) uint8
        helper.make_node("Gather", [b + "_d16", ids], [b + "_rd16"], axis=0),  # (B, S, blocks)
        helper.make_node("Gather", [b + "_z", ids], [b + "_rz8"], axis=0),
        helper.make_node("Cast", [b + "_rows"], [b + "_f"], to=TensorProto.FLOAT),
        helper.make_node("Div", [b + "_f", b + "_16"], [b + "_f16"]),
        helper.make_node("Floor", [b + "_f16"], [b + "_hi"]),  # the second value of each byte
        helper.make_node("Mul", [b + "_hi", b + "_16"], [b + "_hi16"]),
        helper.make_node("Sub", [b + "_f", b + "_hi16"], [b + "_lo"]),  # the first
        helper.make_node("Unsqueeze", [b + "_lo", b + "_axis"], [b + "_lo1"]),
        helper.make_node("Unsqueeze", [b + "_hi", b + "_axis"], [b + "_hi1"]),
        helper.make_node("Concat", [b + "_lo1", b + "_hi1"], [b + "_pairs"], axis=-1),  # (B, S, blocks, block / 2, 2)
        helper.make_node("Reshape", [b + "_pairs", b + "_blocks"], [b + "_q"]),  # (B, S, blocks, block)
        helper.make_node("Cast", [b + "_rz8"], [b + "_rz"], to=TensorProto.FLOAT),
        helper.make_node("Cast", [b + "_rd16"], [b + "_rd"], to=TensorProto.FLOAT),
        helper.make_node("Unsqueeze", [b + "_rz", b + "_axis"], [b + "_z1"]),
        helper.make_node("Unsqueeze", [b + "_rd", b + "_axis"], [b + "_s1"]),
    ]
    if gguf is not None:  # d q + m
        made += [helper.make_node("Mul", [b + "_q", b + "_s1"], [b + "_c"]),
                 helper.make_node("Add", [b + "_c", b + "_z1"], [b + "_m"])]
    else:  # s (q - z)
        made += [helper.make_node("Sub", [b + "_q", b + "_z1"], [b + "_c"]),
                 helper.make_node("Mul", [b + "_c", b + "_s1"], [b + "_m"])]
    made.append(helper.make_node("Reshape", [b + "_m", b + "_shape"], [node.output[0]]))
    return made, tensors


def for_language_model(config, manifest, folder=None):
    """The config to use on ``manifest``'s artifact (in ``folder``): for a language model, the CLI's
    words become this backend's decoder recipes; other artifacts, and explicit configs, keep theirs.

    * ``int8`` (dynamic int8 activations: +71% perplexity on SmolLM2) and ``int8-weights``:
      symmetric 8-bit blocks of :data:`INT8_BLOCK`, accuracy_level 4.
    * ``int4-weights``: a source read from a GGUF file of mostly Q4_0, Q4_1 or Q4_K tensors keeps
      their grid (blocks of 32; its tensors of more bits, Q4_K_M's Q6_K, at 8);
      other weights get the fitted grid (integer zero points, searched scales, blocks of
      :data:`INT4_BLOCK`, accuracy_level 4), with as many layers' FFN down, O and V at 8 bits as
      fit in llama.cpp's Q4_K_M size of the same model (``quantize/budget.py``).

    Only a config with one of those words as its ``preset`` (``Int8Config``, :func:`scheme_config`,
    the CLI's ``--quantize``) takes the recipe, and only with ONNX Runtime as its backend (``--backend
    nncf`` is NNCF's); any other config is honoured as written (``Int8DynamicConfig()``:
    dynamic int8 activations, ``WeightOnlyConfig(bits=4, symmetric=True)``: ONNX Runtime's blocks).

    A decoder without a tokenizer (no text to calibrate or score with) keeps the CLI's blocks, at
    accuracy_level 4: a decoded token is one row a MatMul, where MLAS's fp32 compute (level unset)
    took 2x the time (a Mixtral-shaped 701M, 4-bit: 114 tokens/s against 231 for the recipe).
    """
    from slimml.convert.llm_check import is_language_model
    from slimml.errors import ConfigError
    from slimml.quantize.config import Int8DynamicConfig, Int8StaticConfig

    if isinstance(config, Int8StaticConfig) and manifest is not None and str(manifest.task).startswith("text-generation"):
        cached = any(t.name.startswith("past_key_values") for t in manifest.inputs)
        why = ("calibrates activations on recorded inputs, which a decoder's KV-cache inputs are not" if cached else
               "is not one of the language-model recipes (each keeps perplexity within its bound: docs/quantize.md)")
        raise ConfigError(f"--quantize int8-static {why}; quantize a language model with --quantize int8 (8-bit "
                          "weights, int8 compute) or int4-weights.")
    if not is_language_model(manifest):
        if getattr(config, "backend", None) == LM_BACKEND and not str(manifest.task).startswith("text-generation"):
            raise ConfigError(f'backend="{LM_BACKEND}" is the language-model recipe; {manifest.task!r} is not a decoder. '
                              'Use backend="ort" or "nncf".')
        if _recipe(config) and isinstance(config, WeightOnlyConfig) and str(manifest.task).startswith("text-generation"):
            return dataclasses.replace(config, accuracy_level=4)  # a decoder with no tokenizer: int8 compute, one row a pass
        return config
    if not _recipe(config):
        return config  # as written: NNCF, static, fp16, the lm backend, or a config made in Python
    common = {f.name: getattr(config, f.name) for f in dataclasses.fields(config)
              if f.name in ("calibration", "calibration_size", "guard", "exclude_shards", "eval_text", "preset")}
    return decoder_config(8 if isinstance(config, Int8DynamicConfig) else config.bits, manifest, folder, **common)


def _recipe(config) -> bool:
    """``config`` stands for a scheme word (its ``preset``) that a decoder turns into its recipe: the
    int8 of ``Int8Config``, or ``int8-weights`` / ``int4-weights`` with ONNX Runtime as the backend."""
    from slimml.quantize.config import Int8DynamicConfig

    if getattr(config, "preset", None) is None:
        return False
    return isinstance(config, Int8DynamicConfig) or (isinstance(config, WeightOnlyConfig) and config.backend == "ort")


GGUF_GRIDS = ("Q4_1", "Q4_K")  # GGUF tensor types whose blocks of 32 are w = d * q + m: the "gguf" grid keeps them


def gguf_tensor_types(manifest) -> dict[str, int]:
    """How many of a GGUF source's weight tensors each type holds (``{"Q4_K": 135, "Q6_K": 21}``); {} for other sources."""
    if manifest is None:
        return {}
    found = (manifest.source.get("gguf") or {}).get("gguf_tensor_types") or {}
    if not found:  # the report's line: "Q4_1 (Q4_1 x210, F32 x61, Q8_0 x1)"
        found = dict(re.findall(r"(\w+) x(\d+)", str(manifest.checks.get("source_quantization", ""))))
    return {t: int(n) for t, n in found.items() if t not in ("F32", "F16", "BF16")}


def decoder_config(bits: int, manifest=None, folder=None, keep_grid: bool = True, **common) -> WeightOnlyConfig:
    """The default decoder recipe (``backend="lm"``) at ``bits`` for the float artifact ``manifest`` in
    ``folder`` (its layers, its weights' shapes, and its source's quantization as convert recorded it).

    ``keep_grid=False`` fits a 4-bit GGUF source's weights again as any other weights, at the
    Q4_K_M size: smaller and faster than keeping its blocks of 32, and further from the source
    (docs/quantize.md, "A GGUF source keeps its grid").

    Example:
        >>> m = read_manifest("art_fp32")
        >>> quantize("art_fp32", "art_int4", decoder_config(4, m, Path("art_fp32")))
    """
    if bits == 8:  # blocks of 128 even for a Q8_0 source: its own blocks of 32 run 1.25-2.2x slower at M=1
        return WeightOnlyConfig(bits=8, block_size=INT8_BLOCK, accuracy_level=FAST_LEVEL, backend="lm", **common)
    from slimml.quantize.budget import q4_k_m_plan

    student = manifest is not None and bool(manifest.source.get("student_of"))  # distilled or pruned: new weights
    types = gguf_tensor_types(manifest) if keep_grid and not student else {}

    def mostly(kinds: tuple[str, ...]) -> bool:
        return sum(types.get(t, 0) for t in kinds) > sum(types.values()) / 2

    if mostly(GGUF_GRIDS):  # keep them; the embedding bits as the budget's (a tied table is stored once, 8-bit)
        embedding = q4_k_m_plan(Path(folder), manifest, 32).embedding_bits if folder is not None else 8
        return WeightOnlyConfig(bits=4, block_size=32, accuracy_level=FAST_LEVEL, backend="lm", grid="gguf",
                                symmetric=False, embedding_bits=embedding, **common)
    if mostly(("Q4_0",)):  # an integer-zero-point grid of 32: the fitted search finds each block exactly
        return WeightOnlyConfig(bits=4, block_size=32, accuracy_level=FAST_LEVEL, backend="lm", grid="fitted",
                                symmetric=False, **common)
    if keep_grid and folder is not None and not student and floats_on_grid(Path(folder), manifest):
        embedding = q4_k_m_plan(Path(folder), manifest, 32).embedding_bits  # weights dequantized from Q4_1/Q4_K
        return WeightOnlyConfig(bits=4, block_size=32, accuracy_level=FAST_LEVEL, backend="lm", grid="gguf",
                                symmetric=False, embedding_bits=embedding, **common)
    if folder is not None:
        plan = q4_k_m_plan(Path(folder), manifest, INT4_BLOCK)
        layers, embedding = plan.sensitive_layers, plan.embedding_bits
    else:
        layers, embedding = more_bits_layers(int(manifest.source.get("num_hidden_layers") or 0) if manifest else 0), 8
    return WeightOnlyConfig(bits=4, block_size=INT4_BLOCK, accuracy_level=FAST_LEVEL, backend="lm", grid="fitted",
                            symmetric=False, sensitive_layers=layers, embedding_bits=embedding, **common)


def floats_on_grid(folder: Path, manifest, layers: int = 2) -> bool:
    """Whether a float artifact's layer weights already sit on a 4-bit grid of 32-value blocks
    (``w = d * q + m``, :func:`~slimml.quantize.grids.gguf_blocks`): a model saved in fp32 after being
    dequantized from a Q4_1 or Q4_K file, or trained on such a grid, or a copy of one at 5 bits or
    more: float16, bfloat16, Q8_0, Q6_K, Q5_x). Every weight MatMul of the first
    ``layers`` layers is checked (a few MB); the "gguf" grid then keeps those blocks as they are,
    where fitting blocks of 128 across four of them would lose a quarter of the model's quality."""
    from slimml.quantize.budget import weight_array

    checked = 0
    for spec in manifest.shards:
        model = onnx.load(str(folder / spec.file), load_external_data=False)
        inits = {t.name: t for t in model.graph.initializer}
        shard_layers = {layer_of(node.name) for node in model.graph.node} - {None}
        if checked and shard_layers and min(shard_layers) >= layers:
            break  # past the layers checked
        for node in model.graph.node:
            w = inits.get(node.input[1]) if node.op_type == "MatMul" and len(node.input) > 1 else None
            layer = layer_of(node.name)
            if w is None or len(w.dims) != 2 or layer is None or layer >= layers or w.dims[0] % 32 or w.dims[1] >= LM_HEAD_MIN_COLUMNS:
                continue
            k, n = w.dims
            values = weight_array(folder, w).astype(np.float32).T.reshape(n, k // 32, 32)  # blocks along the input
            if gguf_blocks(values) is None:
                return False
            checked += 1
    return checked > 0
