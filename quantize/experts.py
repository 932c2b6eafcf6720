"""A mixture of experts' expert weights quantized: ONNX Runtime's ``MoE`` node to its ``QMoE``.

The fused and torch exporters write a mixture of experts as one ``com.microsoft.MoE`` node per
layer (``convert/fused_experts.py``, ``convert/trace_experts.py``), its experts' weights float32
initializers: most of such a model's bytes. ``QMoE`` runs the same routing and SwiGLU on integer weights:

- 4 bits, the decoder recipe: asymmetric blocks of 32 with zero points, each expert fitted as the
  recipe fits a dense matrix (equalized, GPTQ over the tokens routed to it: :func:`_fitted_experts`);
  measured on real weights (docs/quantize.md), +14.7% perplexity where round-to-nearest symmetric
  blocks lost +128%;
- 4 bits otherwise: symmetric blocks of 32 along each row's input (one float32 scale a block, as
  llama.cpp's Q4_0), codes offset by 8 and packed two to a byte, low nibble first; rows whose input
  is not a multiple of 32 get one scale a row;
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


def quantize_experts(model: onnx.ModelProto, bits: int, accuracy_level: int | None = None, fitted: bool = False,
                     samples: dict[str, np.ndarray] | None = None) -> dict[str, Any]:
    """Rewrite every ``MoE`` node of ``model`` whose expert weights are initializers as ``QMoE``: at 4
    bits where the scheme's ``bits`` is 4, else at 8, computing as the scheme's dense layers do
    (``accuracy_level`` 4: int8 activations); what was done, for the manifest's notes (``{}`` when
    the model has none).

    ``fitted`` (the decoder recipe at 4 bits with ``accuracy_level`` 4): each expert as the recipe
    fits a dense matrix, in asymmetric blocks of :data:`FIT_BLOCK` (:func:`_fitted_experts`), with
    GPTQ where ``samples`` holds the calibration text's layer inputs and router logits.
    """
    bits = 4 if bits == 4 else 8
    fast = accuracy_level == 4
    inits = {t.name: t for t in model.graph.initializer}
    nodes, add, drop, done, kinds, blocks = [], [], set(), 0, set(), set()
    for node in model.graph.node:
        if node.op_type != "MoE" or node.domain != DOMAIN or not _quantizable(node, inits):
            nodes.append(node)
            continue
        w1, w2 = (numpy_helper.to_array(inits[node.input[i]]).astype(np.float32) for i in (2, 4))
        b1 = numpy_helper.to_array(inits[node.input[3]]).astype(np.float32) if node.input[3] in inits else None
        attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
        names = (node.input[2], node.input[4])
        x, logits = ((samples or {}).get(node.input[i]) for i in (0, 1))
        top = None if x is None or logits is None else np.argsort(-logits, axis=1)[:, :int(attrs.get("k", 1))]
        zeros = []
        if fitted and bits == 4 and fast and all(w.shape[2] % FIT_BLOCK == 0 and w.shape[2] >= 2 * FIT_BLOCK for w in (w1, w2)):
            block = FIT_BLOCK
            fits = _fitted_experts(w1, w2, b1, block, attrs, x, top)
            tensors = [numpy_helper.from_array(a, f"{n}_{part}") for n, (codes, scales, z) in zip(names, fits)
                       for part, a in (("q4", codes), ("scales", scales))]
            zeros = [numpy_helper.from_array(z, f"{n}_zp") for n, (_, _, z) in zip(names, fits)]
            kinds.add("fitted" + (", GPTQ" if top is not None else ""))
        else:
            block = _block(w1, bits, fast)
            if block != _block(w2, bits, fast):  # the op takes one block size for both projections: rows for both
                block = 0
            if block and top is not None and _plain(attrs, b1):  # the down inputs equalized
                for e in range(len(w1)):  # one expert's moments at a time, its SwiGLU output's only
                    _equalize_down(w1[e:e + 1], w2[e:e + 1], [_routed_moments(x, top, e, w1[e], None, attrs, False)], block)
                kinds.add("equalized")
            tensors = [numpy_helper.from_array(a, f"{n}_{part}") for n, w in zip(names, (w1, w2))
                       for part, a in zip((f"q{bits}", "scales"), _symmetric(w, bits, block))]
            kinds.add("symmetric")
        biases = [node.input[i] if i < len(node.input) and _nonzero(inits.get(node.input[i])) else "" for i in (3, 5)]
        inputs = [node.input[0], node.input[1], tensors[0].name, tensors[1].name, biases[0],
                  tensors[2].name, tensors[3].name, biases[1], *(("", "", "", zeros[0].name, zeros[1].name) if zeros else ())]
        attrs["expert_weight_bits"] = bits
        if block:
            attrs["block_size"] = block
        blocks.add(block or "row")
        if fast:
            attrs["accuracy_level"] = 4
        nodes.append(helper.make_node("QMoE", inputs, list(node.output), name=node.name, domain=DOMAIN, **attrs))
        add += tensors + zeros
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
    return {"moe_nodes": done, "bits": bits, "grid": " and ".join(sorted(kinds)),
            "block": blocks.pop() if len(blocks) == 1 else sorted(blocks, key=str),
            **({"accuracy_level": 4} if fast else {})}


FIT_BLOCK = 32  # measured on real weights (docs/quantize.md): blocks of 64 lost 7 points more perplexity
MIN_ROUTED = 64  # calibration tokens an expert needs for moments of its own (else every token's)
GPTQ_BYTES = 1 << 28  # the float64 moments (and their inverses) of one group of experts


def _fitted_experts(w1: np.ndarray, w2: np.ndarray, b1: np.ndarray | None, block: int, attrs: dict[str, Any],
                    x: np.ndarray | None, top: np.ndarray | None) -> list[tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """Both projections' (codes, scales, zero points) in asymmetric 4-bit blocks, as the decoder
    recipe fits a dense matrix (:func:`~slimml.quantize.grids.fit_blocks`), the op's layout: codes
    and zero points two a byte (low nibble first), scales float32.

    With the calibration text's layer input ``x`` (tokens, hidden) and each token's ``top`` k experts: each
    expert's second moments over the tokens routed to it (:func:`_routed_moments`), then

    - where the SwiGLU is plain (``silu(gate) * up``), its down projection's input channels are
      scaled as the dense recipe scales an FFN's (:func:`~slimml.quantize.equalize.down_scales`),
      the up rows divided by the same factors: the same function, rounded with less error;
    - GPTQ on both projections (:func:`~slimml.quantize.gptq.gptq_blocks`), a group of experts at
      a time (``GPTQ_BYTES``).
    """
    from slimml.quantize.gptq import gptq_blocks
    from slimml.quantize.grids import fit_blocks, pack_nibbles

    experts = w1.shape[0]
    plain = _plain(attrs, b1)
    group = max(1, GPTQ_BYTES // (8 * max(w1.shape[2], w2.shape[2]) ** 2))
    fits: list[list[tuple]] = [[], []]
    for g0 in range(0, experts, group):
        idx = range(g0, min(experts, g0 + group))
        a1, a2 = w1[g0:idx.stop], w2[g0:idx.stop]  # views: equalized in place
        moments = None if x is None or top is None else [
            _routed_moments(x, top, e, w1[e], None if b1 is None else b1[e], attrs) for e in idx]
        if moments is not None and plain:
            moments = _equalize_down(a1, a2, moments, block)
        for j, a in enumerate((a1, a2)):
            n, rows, width = a.shape
            if moments is None:
                fits[j].append(fit_blocks(a.reshape(n, rows, width // block, block), True))
            else:
                fits[j].append(gptq_blocks(a, np.stack([m[j] for m in moments]), block, True))
    out = []
    for j, w in enumerate((w1, w2)):
        q, s, z = (np.concatenate(parts) for parts in zip(*fits[j]))
        out.append((pack_nibbles(q.reshape(w.shape)), s.astype(np.float32), pack_nibbles(z)))
    return out


def _plain(attrs: dict[str, Any], b1: np.ndarray | None) -> bool:
    """``silu(gate) * up`` without biases: scaling an up row scales its SwiGLU output alike."""
    plain = float(attrs.get("activation_beta", 0.0)) == 0.0 and float(attrs.get("swiglu_limit", np.inf)) == np.inf
    return plain and (b1 is None or not b1.any())


def _equalize_down(a1: np.ndarray, a2: np.ndarray, moments: list[tuple[np.ndarray, np.ndarray]],
                   block: int) -> list[tuple[np.ndarray, np.ndarray]]:
    """Scale each expert's down-projection input channels (``a2``'s columns) as the dense recipe scales
    an FFN's (:func:`~slimml.quantize.equalize.down_scales`) and divide its up rows (``a1``'s odd rows,
    interleaved with the gate's) by the same factors, in place: the same function, rounded with less
    error. Returns the moments with the SwiGLU output's rescaled to match."""
    from slimml.quantize.equalize import down_scales

    out = []
    for j, (inputs, act) in enumerate(moments):
        s = down_scales(a2[j].T, np.diag(act).astype(np.float32), block)
        if s is not None:
            a1[j, 1::2] /= s[:, None]
            a2[j] *= s[None, :]
            act = act / np.outer(s, s)
        out.append((inputs, act))
    return out


def _routed_moments(x: np.ndarray, top: np.ndarray, expert: int, w1: np.ndarray, b1: np.ndarray | None,
                    attrs: dict[str, Any], inputs: bool = True) -> tuple[np.ndarray | None, np.ndarray]:
    """Expert ``expert``'s (``w1``: its interleaved gate/up rows) second moments of its two inputs over
    the calibration tokens routed to it (``top``: each token's k experts): the layer input ``x`` (tokens, hidden), and
    its SwiGLU output as the op computes it from the float weights; every token's where fewer than
    ``MIN_ROUTED`` are routed to it. float64 (hidden, hidden) (None unless ``inputs``) and (inner, inner)."""
    alpha, beta = float(attrs.get("activation_alpha", 1.0)), float(attrs.get("activation_beta", 0.0))
    limit = float(attrs.get("swiglu_limit", np.inf))
    routed = (top == expert).any(axis=1)
    rows = (x[routed] if routed.sum() >= MIN_ROUTED else x).astype(np.float64)
    h = rows @ w1.T.astype(np.float64) + (0.0 if b1 is None else b1)
    gate, up = np.minimum(h[:, 0::2], limit), np.clip(h[:, 1::2], -limit, limit)
    act = gate / (1 + np.exp(-alpha * gate)) * (up + beta)
    return (rows.T @ rows / len(rows) if inputs else None), act.T @ act / len(rows)


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


LATTICE = 120  # a largest code every e2m1 block fits exactly: 120 / v * 0.5 is whole for v in 0.5, 1, ..., 6


def _lattice_scales(groups: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """``scales`` (max / 127), or max / :data:`LATTICE` for the blocks that the latter holds exactly and
    the former does not: an MXFP4 block (gpt-oss: e2m1 values, +-{0, 0.5, 1, 1.5, 2, 3, 4, 6}, times
    2 ** e) is a multiple of max / 120 in every value whatever its largest is, so its 8-bit codes
    reproduce it to float32 rounding, where max / 127 rounds each value by up to half a step."""
    lattice = scales * (127 / LATTICE)
    use = _exact(groups, lattice) & ~_exact(groups, scales)
    return np.where(use, lattice, scales)


def _exact(groups: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """Which blocks of ``groups`` (..., blocks, block) are whole multiples of their scale."""
    q = groups / scales[..., None]
    return (np.abs(q - np.rint(q)) <= 1e-3).all(axis=-1)


def _symmetric(w: np.ndarray, bits: int, block: int) -> tuple[np.ndarray, np.ndarray]:
    """(codes, scales) of ``w`` (experts, rows, input): round to nearest on a symmetric grid, one scale
    a block (``block``) or a row (0); codes offset to unsigned, two 4-bit codes a byte."""
    experts, rows, width = w.shape
    top = 2 ** (bits - 1) - 1
    groups = w.reshape(experts, rows, width // block if block else 1, block or width)
    scales = np.abs(groups).max(axis=-1) / top
    scales[scales == 0] = 1.0
    if bits == 8 and block:  # blocks on a coarser lattice (MXFP4's e2m1 times a power of two) kept exactly
        scales = _lattice_scales(groups, scales)
    codes = np.clip(np.rint(groups / scales[..., None]), -top - 1, top).astype(np.int16) + 2 ** (bits - 1)
    codes = codes.reshape(experts, rows, width).astype(np.uint8)
    if bits == 4:
        codes = (codes[..., 0::2] | (codes[..., 1::2] << 4)).astype(np.uint8)
    return codes, (scales if block else scales[..., 0]).astype(np.float32)
