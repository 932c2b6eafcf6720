"""Activation-aware scaling of a decoder's FFN down projection before 4-bit blocks (AWQ's idea).

A block of 128 input channels shares one scale, so a channel whose weights are small beside its
neighbours' (or whose activations are large) loses the most. ``silu(gate) * up`` is linear in
``up``, so channel ``k`` of the down projection's input can be scaled freely: ``up[:, k] / s_k``
and ``down[k, :] * s_k`` compute the same function, and ``up``'s own blocks (along its input)
do not see a per-column factor. ``s_k = a_k^alpha / r_k^(1 - alpha)`` (``a``: the channel's RMS
activation on the calibration text, ``r``: its down-projection row's largest weight), ``alpha``
chosen per matrix from 0 (equal rows, data-free cross-layer equalization) to 1 by the activation-
weighted error of a quick round-to-nearest trial; no scaling stays a candidate.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import numpy_helper

ALPHAS = (0.0, 0.25, 0.5, 0.75, 1.0)


def ffn_pairs(model: onnx.ModelProto, inits: dict[str, onnx.TensorProto]) -> list[tuple[onnx.NodeProto, str, slice]]:
    """``(down MatMul, up weight name, up columns)`` for each ``MatMul(Mul(a, b), W_down)`` whose
    ``b`` comes from a MatMul with an initializer weight read once, directly or through a ``Split``
    of its output along the last axis (a fused gate/up)."""
    producer = {o: n for n in model.graph.node for o in n.output}
    readers: dict[str, int] = {}
    for n in model.graph.node:
        for i in n.input:
            readers[i] = readers.get(i, 0) + 1
    pairs = []
    for node in model.graph.node:
        if node.op_type != "MatMul" or node.input[1] not in inits:
            continue
        mul = producer.get(node.input[0])
        if mul is None or mul.op_type != "Mul" or readers.get(node.input[0]) != 1:
            continue
        for x in mul.input:
            found = _up_weight(x, producer, inits, readers)
            if found is not None:
                pairs.append((node, *found))
                break
    return pairs


def _up_weight(x, producer, inits, readers):
    p = producer.get(x)
    if p is not None and p.op_type == "MatMul" and p.input[1] in inits and readers.get(p.input[1]) == 1:
        return p.input[1], slice(None)
    if p is None or p.op_type != "Split" or len(p.input) < 2 or p.input[1] not in inits:
        return None
    axis = next((a.i for a in p.attribute if a.name == "axis"), 0)
    mm = producer.get(p.input[0])
    if mm is None or mm.op_type != "MatMul" or mm.input[1] not in inits or readers.get(mm.input[1]) != 1:
        return None
    width = inits[mm.input[1]].dims[1]
    if axis not in (-1, len(inits[mm.input[1]].dims) - 1) and axis != 2:
        return None
    sizes = numpy_helper.to_array(inits[p.input[1]]).tolist()
    if sum(sizes) != width:
        return None
    j = list(p.output).index(x)
    start = sum(sizes[:j])
    return mm.input[1], slice(start, start + sizes[j])


def _rtn_error(w: np.ndarray, block: int) -> np.ndarray:
    """Squared error per input row of asymmetric 4-bit round-to-nearest blocks along K of ``w`` (K, N)."""
    k, n = w.shape
    b = w.T.reshape(n, k // block, block)
    lo, hi = np.minimum(b.min(-1, keepdims=True), 0), np.maximum(b.max(-1, keepdims=True), 0)
    s = np.where(hi > lo, (hi - lo) / 15, 1)
    z = np.rint(-lo / s)
    err = (s * (np.clip(np.rint(b / s) + z, 0, 15) - z) - b) ** 2
    return err.reshape(n, k).sum(axis=0)


def down_scales(down: np.ndarray, mean_square: np.ndarray | None, block: int) -> np.ndarray | None:
    """The per-input-channel factors ``s`` (K,) for ``down`` (K, N), or None when no scaling measures best."""
    k = down.shape[0]
    if k % block:
        return None
    a = np.sqrt(mean_square) if mean_square is not None else np.ones(k, np.float32)
    r = np.maximum(np.abs(down).max(axis=1), 1e-12)
    weight = a * a

    def cost(s):
        return float((weight / (s * s) * _rtn_error(down * s[:, None], block)).sum())

    best, best_cost = None, cost(np.ones(k, np.float32))
    for alpha in ALPHAS if mean_square is not None else (0.0,):
        s = (a ** alpha) / (r ** (1 - alpha))
        s = (s / np.exp(np.log(s).mean())).astype(np.float32)  # geometric mean 1
        c = cost(s)
        if c < best_cost:
            best, best_cost = s, c
    return best


def equalize_ffn(model: onnx.ModelProto, inits: dict[str, onnx.TensorProto], importance: dict[str, np.ndarray],
                 block_of) -> int:
    """Scale each FFN down projection's input channels (and its up projection's columns) in place in
    ``inits``; ``importance`` (MatMul input name -> (K, K) second moments) follows the scaling. Returns how many."""
    done = 0
    for down_node, up_name, cols in ffn_pairs(model, inits):
        down = numpy_helper.to_array(inits[down_node.input[1]]).astype(np.float32)
        moments = importance.get(down_node.input[0])  # (K, K) second moments of down's input, or None
        ms = None if moments is None else np.diag(moments).astype(np.float32)
        s = down_scales(down, ms, block_of(down.shape[0]))
        if s is None:
            continue
        up = numpy_helper.to_array(inits[up_name]).astype(np.float32).copy()
        up[:, cols] /= s[None, :]
        inits[up_name].CopyFrom(numpy_helper.from_array(up, up_name))
        inits[down_node.input[1]].CopyFrom(numpy_helper.from_array(down * s[:, None], down_node.input[1]))
        if moments is not None:  # x' = x / s
            importance[down_node.input[0]] = moments / np.outer(s, s)
        done += 1
    return done
