"""A mixture-of-experts decoder's experts, traced as ONNX Runtime's ``MoE`` op (transformers 5).

Tracing transformers' own experts cannot give a correct graph: its eager experts loop over the
experts the example happens to route to, its batched ones copy each token's expert weights. So
while the torch exporter traces, each experts module (transformers 5's ``@use_experts_implementation``
classes: Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE, PhiMoE, DeepSeek-V3, ...) computes through one
``com.microsoft.MoE`` node, which routes every token at run time:

- the model's own router runs as traced ops (softmax, top-k, renormalising, DeepSeek's groups and
  bias: whatever the family does) and gives each token its experts and weights;
- the MoE node takes those as router logits: ``log(weight)`` at the chosen experts, -1e9 elsewhere.
  ONNX Runtime picks the same experts and, normalising, weighs them ``w / sum(w)``; the output is
  multiplied by ``sum(w)`` again, so any weights (renormalised or not) come out as the model's;
- the gate and up projections go in as the op's SwiGLU wants them (``swiglu_fusion=1``: rows
  interleaved gate, up, gate, up; weights ``(experts, rows, input)``): a family that stores
  ``[gate; up]`` is interleaved, one that stores them transposed (gpt-oss) is transposed, biases
  come along. The gate function is read by probing the module's own ``_apply_gate``: the plain
  ``silu(gate) * up`` (alpha 1, beta 0, no clamp), or gpt-oss's clamped
  ``(clamp(up, -l, l) + 1) * g * sigmoid(alpha * g)`` with ``g = min(gate, l)`` (alpha, beta 1, limit l).

Measured against ONNX Runtime 1.32's CPU kernel: equal to a per-token loop in numpy to 1e-7. Experts
of other shapes (ungated, a norm after each expert, a gate function other than those two) are
refused by name.
"""

from __future__ import annotations

import contextlib
import math
import types
from collections.abc import Iterator
from typing import Any

DOMAIN = "com.microsoft"


def experts_modules(model: Any) -> list[Any]:
    """The model's experts modules (3-D ``gate_up_proj`` and ``down_proj`` parameters)."""
    return [m for m in model.modules() if getattr(getattr(m, "gate_up_proj", None), "ndim", 0) == 3
            and getattr(getattr(m, "down_proj", None), "ndim", 0) == 3]


def unsupported(model: Any) -> str | None:
    """Why the experts of ``model`` cannot be written as the MoE op (one line), or None."""
    import transformers

    for m in experts_modules(model):
        name = type(m).__name__
        if not hasattr(m, "is_concatenated"):
            if int(transformers.__version__.split(".")[0]) < 5:
                return f"{name} is not a transformers 5 experts module (install transformers 5 to convert this model)"
            return f"{name} computes its experts in code of its own, not through transformers' experts interface"
        if not m.has_gate or getattr(m, "has_post_expert_norm", False):
            return f"{name} stores its experts in a layout slimml does not write yet (ungated, or a norm after each expert)"
        if gate_function(m) is None:
            return (f"{name}'s experts gate with a function ONNX Runtime's MoE op does not compute (it computes SiLU's "
                    "SwiGLU, clamped or not)")
    return None


def gate_function(module: Any) -> tuple[bool, float, float, float] | None:
    """How ``module._apply_gate`` reads its (tokens, 2 * inner) input, found by probing it:
    (interleaved, alpha, beta, limit) with ``out = (clamp(up, -limit, limit) + beta) * g * sigmoid(alpha * g)``,
    ``g = min(gate, limit)``, gate and up interleaved (gpt-oss) or in halves ``[gate; up]``; None for
    any other function."""
    import torch

    probe = torch.linspace(-12.0, 12.0, 48)[torch.randperm(48, generator=torch.Generator().manual_seed(0))][None]
    with torch.no_grad():
        got = module._apply_gate(probe.clone())
    alpha, limit = float(getattr(module, "alpha", 1.0)), float(getattr(module, "limit", math.inf))
    for interleaved in (False, True):
        gate, up = (probe[..., 0::2], probe[..., 1::2]) if interleaved else probe.chunk(2, dim=-1)
        for a, b, lim in ((1.0, 0.0, math.inf), (alpha, 1.0, limit), (alpha, 0.0, limit)):
            g = gate.clamp(max=lim)
            want = (up.clamp(-lim, lim) + b) * g * torch.sigmoid(a * g)
            if got.shape == want.shape and torch.allclose(got, want, atol=1e-5, rtol=1e-5):
                return interleaved, a, b, lim
    return None


@contextlib.contextmanager
def experts_as_moe_op(model: Any) -> Iterator[None]:
    """Every experts module of ``model`` computes through :func:`_moe_forward` while this is held."""
    modules = experts_modules(model)
    for m in modules:
        m.forward = types.MethodType(_moe_forward, m)  # the instance's, over the class's dispatching forward
        m.slimml_gate = gate_function(m)  # probed before the tracer records anything
    try:
        yield
    finally:
        for m in modules:
            del m.forward, m.slimml_gate


def _moe_forward(self: Any, hidden_states: Any, top_k_index: Any, top_k_weights: Any) -> Any:
    """An experts module's output for (tokens, hidden) states routed to ``top_k_index`` with
    ``top_k_weights`` (module docstring)."""
    import torch

    interleaved, alpha, beta, limit = self.slimml_gate
    w1, w2 = self.gate_up_proj, self.down_proj
    if self.is_transposed:  # (experts, input, rows) -> (experts, rows, input)
        w1, w2 = w1.transpose(1, 2), w2.transpose(1, 2)
    experts, double, hidden = w1.shape
    b1 = self.gate_up_proj_bias if self.has_bias else w1.new_zeros(experts, double)
    b2 = self.down_proj_bias if self.has_bias else w1.new_zeros(experts, hidden)
    if not interleaved:  # [gate; up] -> gate0, up0, gate1, up1, ...
        inner = double // 2
        w1 = torch.stack([w1[:, :inner], w1[:, inner:]], dim=2).reshape(experts, double, hidden)
        b1 = torch.stack([b1[:, :inner], b1[:, inner:]], dim=2).reshape(experts, double)
    zero_rows = (hidden_states[:, :1] * 0.0).float()  # (tokens, 1): the token count, traced
    weights = top_k_weights.float()
    logits = (zero_rows.expand(-1, experts) - 1e9).scatter(1, top_k_index, torch.log(weights.clamp_min(1e-30)))
    out = _moe_op().apply(hidden_states, logits.to(hidden_states.dtype), w1.contiguous(), b1.contiguous(),
                          w2.contiguous(), b2.contiguous(), int(top_k_index.shape[-1]), alpha, beta, limit)
    return out * weights.sum(dim=-1, keepdim=True).to(out.dtype)


def _moe_op() -> Any:
    import torch

    class MoE(torch.autograd.Function):
        """``com.microsoft.MoE`` in the traced graph; computed here (for the tracer's example) as the
        kernel computes it: softmax over the router logits, the top k renormalised, SwiGLU experts
        (``act = g * sigmoid(alpha * g) * (clamp(up, -limit, limit) + beta)``, ``g = min(gate, limit)``)."""

        @staticmethod
        def forward(ctx, x, router, w1, b1, w2, b2, k, alpha, beta, limit):
            top, chosen = torch.softmax(router.float(), dim=-1).topk(k, dim=-1)
            top = top / top.sum(dim=-1, keepdim=True)
            up = torch.einsum("tkoh,th->tko", w1[chosen], x) + b1[chosen]  # (tokens, k, 2 * inner) interleaved
            gate = up[..., 0::2].clamp(max=limit)
            act = gate * torch.sigmoid(alpha * gate) * (up[..., 1::2].clamp(-limit, limit) + beta)
            out = torch.einsum("tkhi,tki->tkh", w2[chosen], act) + b2[chosen]
            return (out * top[..., None].to(out.dtype)).sum(dim=1)

        @staticmethod
        def symbolic(g, x, router, w1, b1, w2, b2, k, alpha, beta, limit):
            return g.op(f"{DOMAIN}::MoE", x, router, w1, b1, w2, b2, k_i=k, activation_type_s="swiglu",
                        normalize_routing_weights_i=1, swiglu_fusion_i=1, activation_alpha_f=alpha,
                        activation_beta_f=beta, swiglu_limit_f=limit).setType(x.type())

    return MoE
