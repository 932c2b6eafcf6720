"""A mixture of experts' routed layer in the fused graph (``convert/fused_llama.py``): ONNX Runtime's
``MoE`` op in place of the MLP, its experts' weights read from the checkpoint one expert at a time.

What transformers computes (Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE, Granite MoE, gpt-oss; 4.57 and 5 alike):
the router's logits ``x @ W_r^T``, softmax over all experts, the ``top_k`` largest, renormalized to
sum 1 or not, and the sum of the chosen experts' ``down(silu(gate(x)) * up(x))`` weighed by them.
The op computes exactly that from the router's logits (measured equal to a numpy loop to 2e-6):

- ``normalize_routing_weights=1``: softmax over the top k logits, which is the top k of the softmax
  renormalized (Mixtral, Granite, ``norm_topk_prob: true``); ``0``: the top k of the softmax over
  all experts, as they are (Qwen2-MoE's and OLMoE's default);
- ``activation_type="swiglu"`` with ``swiglu_fusion=1``: each expert's gate and up rows interleaved
  (gate row 0, up row 0, gate row 1, ...) in one ``(experts, 2 * inner, hidden)`` tensor, the down
  projection ``(experts, hidden, inner)``: the layout ``quantize/experts.py`` turns into ``QMoE``;
- the router stays a float MatMul (one column an expert), which the quantizers leave in float:
  4-bit router logits would send tokens to other experts.

Qwen2-MoE's shared expert (an MLP every token takes, times ``sigmoid(x @ w_g)``) and Granite MoE's
shared MLP are written beside the op, as the dense layers' MLP is.

Weights, by layout: ``mlp.gate`` and ``mlp.experts.E.{gate,up,down}_proj`` (Qwen, OLMoE; or
transformers 5's stacked ``mlp.experts.gate_up_proj`` / ``down_proj``), ``block_sparse_moe.gate``
and ``experts.E.w1/w3/w2`` (Mixtral: gate, up, down), ``block_sparse_moe.router.layer`` and the
stacked ``input_linear`` ``[gate; up]`` / ``output_linear`` (Granite), ``mlp.router`` (with a bias) and
the stacked, transposed, already interleaved ``mlp.experts.gate_up_proj`` / ``down_proj`` with their
biases (gpt-oss), or OpenAI's MXFP4 ``_blocks`` / ``_scales`` of them, decoded here. gpt-oss's SwiGLU
is the op's clamped form: ``(clamp(up, -7, 7) + 1) * g * sigmoid(1.702 g)``, ``g = min(gate, 7)``
(``activation_alpha``, ``activation_beta``, ``swiglu_limit``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import numpy as np

from slimml.convert.fused_family import Experts

_MS = "com.microsoft"
ROUTER = "/moe/router"  # in the router MatMul's node name: the quantizers keep it float


class Graph(NamedTuple):
    """What the fused exporter lends a routed layer: its weights, the data writer, and its node makers."""

    weights: Any  # name -> float32 array (``fused_llama._Weights``)
    data: Any  # ``fused_llama._Writer``
    node: Callable[..., list[str]]
    linear: Callable[..., str]
    gated: Callable[..., str]  # a dense gated MLP (the shared expert's)


def routed_experts(h: str, hf: str, p: str, e: Experts, g: Graph) -> str:
    """The output of layer ``hf``'s experts for the normed input ``h`` (batch, sequence, hidden)."""
    prefix = f"{hf}.mlp" if e.layout in ("mlp", "gpt_oss") else f"{hf}.block_sparse_moe"
    router = {"granite": f"{prefix}.router.layer", "gpt_oss": f"{prefix}.router"}.get(e.layout, f"{prefix}.gate")
    logits = g.linear(h, [router], router, f"{p}{ROUTER}")  # (batch, sequence, experts), gpt-oss's with its bias
    rows = g.node("Reshape", [logits, g.data.add(f"router_rows_{e.count}", np.array([-1, e.count], np.int64))],
                  [f"{p}/moe/router_rows"], f"{p}/moe/Reshape")[0]  # the op takes the logits as (tokens, experts)
    up, down = _expert_weights(g.weights, prefix, e)
    hidden = g.weights.shape(router + ".weight")[1]
    w1 = g.data.add_parts(f"{prefix}.experts.gate_up", (e.count, 2 * e.inner, hidden), up)
    w2 = g.data.add_parts(f"{prefix}.experts.down", (e.count, hidden, e.inner), down)
    b1 = b2 = ""
    if e.layout == "gpt_oss":  # (experts, 2 * inner) interleaved as the rows are, (experts, hidden)
        b1 = g.data.add(f"{prefix}.experts.gate_up_proj_bias", g.weights[f"{prefix}.experts.gate_up_proj_bias"])
        b2 = g.data.add(f"{prefix}.experts.down_proj_bias", g.weights[f"{prefix}.experts.down_proj_bias"])
    clamp = {"swiglu_limit": e.limit} if e.limit != float("inf") else {}
    out = g.node("MoE", [h, rows, w1, b1, w2, b2], [f"{p}/moe/output"], f"{p}/moe/MoE", domain=_MS, k=e.top_k,
                 activation_type="swiglu", normalize_routing_weights=int(e.renormalize), swiglu_fusion=1,
                 activation_alpha=e.alpha, activation_beta=e.beta, **clamp)[0]
    if not e.shared_inner:
        return out
    if e.layout == "granite":  # Granite MoE (shared): an MLP every token takes, [gate; up] stored packed
        shared = g.gated(h, [f"{hf}.shared_mlp.input_linear"], f"{hf}.shared_mlp.input_linear",
                         f"{hf}.shared_mlp.output_linear", e.shared_inner, f"{p}/shared_mlp")
    else:  # Qwen2-MoE: the shared expert, times sigmoid(x @ w_g)
        s = f"{prefix}.shared_expert"
        shared = g.gated(h, [f"{s}.gate_proj", f"{s}.up_proj"], f"{s}.gate_up_proj", f"{s}.down_proj", e.shared_inner,
                         f"{p}/shared_expert")
        gate = g.linear(h, [f"{prefix}.shared_expert_gate"], f"{prefix}.shared_expert_gate", f"{p}/shared_expert{ROUTER}")
        g.node("Sigmoid", [gate], [f"{p}/shared_expert/gate_sigmoid"], f"{p}/shared_expert/Sigmoid_gate")
        shared = g.node("Mul", [shared, f"{p}/shared_expert/gate_sigmoid"], [f"{p}/shared_expert/output"],
                        f"{p}/shared_expert/Mul_gate")[0]
    return g.node("Add", [out, shared], [f"{p}/moe/shared_output"], f"{p}/moe/Add")[0]


def _expert_weights(w: Any, prefix: str, e: Experts) -> tuple[Iterator[np.ndarray], Iterator[np.ndarray]]:
    """Each expert's gate/up rows interleaved (2 * inner, hidden) and its down projection (hidden, inner), in order."""
    if e.layout == "gpt_oss":  # (experts, hidden, 2 * inner) gate/up interleaved, (experts, inner, hidden): transposed
        return _gpt_oss_experts(w, f"{prefix}.experts.gate_up_proj", e), _gpt_oss_experts(w, f"{prefix}.experts.down_proj", e)
    stacked = {"granite": (f"{prefix}.input_linear.weight", f"{prefix}.output_linear.weight"),
               "mlp": (f"{prefix}.experts.gate_up_proj", f"{prefix}.experts.down_proj")}.get(e.layout)
    if stacked and stacked[0] in w:  # (experts, 2 * inner, hidden) [gate; up] and (experts, hidden, inner)
        gate_up = (w.part(stacked[0], i) for i in range(e.count))  # one expert read at a time
        return (_interleaved(x[:e.inner], x[e.inner:]) for x in gate_up), (w.part(stacked[1], i) for i in range(e.count))
    names = ("w1", "w3", "w2") if e.layout == "mixtral" else ("gate_proj", "up_proj", "down_proj")
    up = (_interleaved(*(w[f"{prefix}.experts.{i}.{n}.weight"] for n in names[:2])) for i in range(e.count))
    down = (w[f"{prefix}.experts.{i}.{names[2]}.weight"] for i in range(e.count))
    return up, down


def _interleaved(gate: np.ndarray, up: np.ndarray) -> np.ndarray:
    """(inner, hidden) gate and up rows as the op's SwiGLU reads them: gate 0, up 0, gate 1, up 1, ..."""
    return np.stack([gate, up], axis=1).reshape(2 * gate.shape[0], gate.shape[1])


# MXFP4's 4-bit codes (e2m1): the value of each nibble, as OpenAI's checkpoints store gpt-oss's experts
FP4_VALUES = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0], np.float32)


def mxfp4_values(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """OpenAI's MXFP4 ``_blocks`` (..., in / 32, 16 bytes, two codes a byte, low nibble first) and
    ``_scales`` (..., in / 32) as float32 (..., in): each code's e2m1 value times ``2 ** (scale - 127)``."""
    codes = np.stack([blocks & 0x0F, blocks >> 4], axis=-1).reshape(*blocks.shape[:-1], -1)  # (..., in / 32, 32)
    return np.ldexp(FP4_VALUES[codes], scales.astype(np.int32)[..., None] - 127).reshape(*blocks.shape[:-2], -1)


def _gpt_oss_experts(w: Any, name: str, e: Experts) -> Iterator[np.ndarray]:
    """Each expert's ``name`` weight as the op reads it (out, in): a float checkpoint's (in, out) transposed,
    or an MXFP4 one's ``_blocks`` (out, in / 32, 16 bytes, two codes a byte, low nibble first) times
    ``2 ** (scale - 127)`` per block of 32 (``_scales``), which OpenAI stores already (out, in)."""
    if name not in w and f"{name}_blocks" in w:
        for i in range(e.count):
            yield mxfp4_values(w.codes(f"{name}_blocks", i), w.codes(f"{name}_scales", i))
        return
    for i in range(e.count):
        yield w.part(name, i).T
