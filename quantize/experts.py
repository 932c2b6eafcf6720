"""A mixture of experts' expert weights quantized: ONNX Runtime's ``MoE`` node to its ``QMoE``.

The torch exporter writes a mixture of experts as one ``com.microsoft.MoE`` node per layer
(``convert/trace_experts.py``), its experts' weights float32 initializers: most of such a model's
bytes. ``QMoE`` runs the same routing and SwiGLU on symmetric integer weights:

- 4 bits: blocks of 32 along each row's input (one float32 scale a block, as llama.cpp's Q4_0),
  codes offset by 8 and packed two to a byte, low nibble first; rows whose input is not a multiple
  of 32 get one scale a row;
- 8 bits: blocks of 32 (Q8_0's) where the recipe computes with int8 activations (``accuracy_level``
  4, the decoder recipes and dynamic int8), else one scale a row; codes offset by 128.

ONNX Runtime 1.32 runs block-wise experts on MatMulNBits' kernels (MLAS QNBit GEMM), with int8
activations at ``accuracy_level`` 4 (always at 8 bits), where a row-wise layout dequantizes the
chosen experts to float first. Measured on its CPU kernel, one layer of 8 experts (1024 -> 2 x 2048),
2 threads: 4-bit blocks 0.28 ms a token at level 0, **0.11 ms** at level 4 (0.93 against 3.6 ms for 8
tokens); 8-bit blocks 0.12 ms against 2.3 ms for rows. What they compute: the float MoE over the
dequantized weights to 1e-7 at level 0 (and per row); at level 4, that MoE with each expert's input
and SwiGLU output rounded to int8 in blocks of 32 (one scale a block, max / 127) to 5e-7, the same
rounding MatMulNBits applies to the dense layers at level 4 (``tests/test_torch_decoder.py``).

The routers stay float (:func:`routers`): a router is a MatMul of one column an expert, a few
kilobytes a layer, and its logits choose the experts; at 4 bits a token whose two best experts are
close goes to another one.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import onnx
from onnx import helper, numpy_helper

DOMAIN = "com.microsoft"
BLOCK = 32


def quantize_experts(model: onnx.ModelProto, bits: int, accuracy_level: int | None = None) -> dict[str, Any]:
    """Rewrite every ``MoE`` node of ``model`` whose expert weights are initializers as ``QMoE``: at 4
    bits where the scheme's ``bits`` is 4, else at 8, computing as the scheme's dense layers do
    (``accuracy_level`` 4: int8 activations); what was done, for the manifest's notes (``{}`` when
    the model has none)."""
    bits = 4 if bits == 4 else 8
    fast = accuracy_level == 4
    inits = {t.name: t for t in model.graph.initializer}
    nodes, add, drop, done = [], [], set(), 0
    for node in model.graph.node:
        if node.op_type != "MoE" or node.domain != DOMAIN or not _quantizable(node, inits):
            nodes.append(node)
            continue
        w1, w2 = (numpy_helper.to_array(inits[node.input[i]]).astype(np.float32) for i in (2, 4))
        block1, block2 = _block(w1, bits, fast), _block(w2, bits, fast)
        if block1 != block2:  # the op takes one block size for both projections: rows for both
            block1 = block2 = 0
        tensors = []
        for name, w, block in ((node.input[2], w1, block1), (node.input[4], w2, block2)):
            codes, scales = _symmetric(w, bits, block)
            tensors += [numpy_helper.from_array(codes, f"{name}_q{bits}"), numpy_helper.from_array(scales, f"{name}_scales")]
        biases = [node.input[i] if i < len(node.input) and _nonzero(inits.get(node.input[i])) else "" for i in (3, 5)]
        inputs = [node.input[0], node.input[1], tensors[0].name, tensors[1].name, biases[0],
                  tensors[2].name, tensors[3].name, biases[1]]
        attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
        attrs["expert_weight_bits"] = bits
        if block1:
            attrs["block_size"] = block1
        if fast:
            attrs["accuracy_level"] = 4
        nodes.append(helper.make_node("QMoE", inputs, list(node.output), name=node.name, domain=DOMAIN, **attrs))
        add += tensors
        drop |= {n for i, n in enumerate(node.input) if i in (2, 3, 4, 5) and n not in biases}
        done += 1
    if not done:
        return {}
    still = {i for n in nodes for i in n.input}
    del model.graph.node[:]
    model.graph.node.extend(nodes)
    keep = [t for t in model.graph.initializer if t.name not in drop or t.name in still]
    del model.graph.initializer[:]
    model.graph.initializer.extend(keep + add)
    return {"moe_nodes": done, "bits": bits, "block": BLOCK if bits == 4 or fast else "row",
            **({"accuracy_level": 4} if fast else {})}


def routers(model: onnx.ModelProto) -> list[str]:
    """The router MatMuls of a graph holding a mixture of experts (``MoE`` or ``QMoE`` nodes): weight
    MatMuls with no more columns than the mixture has experts (the router, one logit an expert;
    Qwen2-MoE's one-column shared-expert gate). Empty for a graph without experts."""
    inits = {t.name: t for t in model.graph.initializer}
    experts = max((inits[n.input[2]].dims[0] for n in model.graph.node
                   if n.op_type in ("MoE", "QMoE") and n.domain == DOMAIN and n.input[2] in inits), default=0)
    if not experts:
        return []
    return [n.name for n in model.graph.node if n.op_type == "MatMul" and len(n.input) > 1 and n.input[1] in inits
            and len(inits[n.input[1]].dims) == 2 and inits[n.input[1]].dims[1] <= experts]


def _quantizable(node: onnx.NodeProto, inits: dict[str, onnx.TensorProto]) -> bool:
    """An MoE node of the torch exporter's form: two float32 weight initializers, no ``fc3``."""
    if len(node.input) < 5 or any(n for n in node.input[6:]):
        return False
    return all(node.input[i] in inits and inits[node.input[i]].data_type == onnx.TensorProto.FLOAT for i in (2, 4))


def _nonzero(t: onnx.TensorProto | None) -> bool:
    return t is not None and bool(np.any(numpy_helper.to_array(t)))


def _block(w: np.ndarray, bits: int, fast: bool = False) -> int:
    """The block along each row's input for ``w`` (experts, rows, input): 32 at 4 bits, or at 8 with
    int8 activations (``fast``), where it divides; else 0 (a row)."""
    return BLOCK if (bits == 4 or fast) and w.shape[2] % BLOCK == 0 else 0


def _symmetric(w: np.ndarray, bits: int, block: int) -> tuple[np.ndarray, np.ndarray]:
    """(codes, scales) of ``w`` (experts, rows, input): round to nearest on a symmetric grid, one scale
    a block (``block``) or a row (0); codes offset to unsigned, two 4-bit codes a byte."""
    experts, rows, width = w.shape
    top = 2 ** (bits - 1) - 1
    groups = w.reshape(experts, rows, width // block if block else 1, block or width)
    scales = np.abs(groups).max(axis=-1) / top
    scales[scales == 0] = 1.0
    codes = np.clip(np.rint(groups / scales[..., None]), -top - 1, top).astype(np.int16) + 2 ** (bits - 1)
    codes = codes.reshape(experts, rows, width).astype(np.uint8)
    if bits == 4:
        codes = (codes[..., 0::2] | (codes[..., 1::2] << 4)).astype(np.uint8)
    return codes, (scales if block else scales[..., 0]).astype(np.float32)
