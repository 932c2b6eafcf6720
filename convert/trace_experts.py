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
- the gate and up projections, stored ``[gate; up]`` per expert, are interleaved row by row as the
  op's SwiGLU wants them (``swiglu_fusion=1``, alpha 1, no clamp: ``silu(gate) * up``).

Measured against ONNX Runtime 1.32's CPU kernel: equal to a per-token loop in numpy to 1e-7. Experts
of other shapes (biases, transposed or interleaved storage, activations other than SiLU: gpt-oss)
are refused by name.
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
    import torch

    for m in experts_modules(model):
        name = type(m).__name__
        if not hasattr(m, "is_concatenated"):
            return f"{name} is not a transformers 5 experts module (install transformers 5 to convert this model)"
        if m.is_transposed or m.has_bias or not m.has_gate or getattr(m, "has_post_expert_norm", False):
            return f"{name} stores its experts in a layout slimml does not write yet (biases, transposed or ungated)"
        probe = torch.linspace(-4, 4, 9)
        act = getattr(m, "act_fn", None)
        if act is None or not torch.allclose(act(probe), torch.nn.functional.silu(probe), atol=1e-6):
            return f"{name}'s experts use an activation other than SiLU"
    return None


@contextlib.contextmanager
def experts_as_moe_op(model: Any) -> Iterator[None]:
    """Every experts module of ``model`` computes through :func:`_moe_forward` while this is held."""
    modules = experts_modules(model)
    for m in modules:
        m.forward = types.MethodType(_moe_forward, m)  # the instance's, over the class's dispatching forward
    try:
        yield
    finally:
        for m in modules:
            del m.forward


def _moe_forward(self: Any, hidden_states: Any, top_k_index: Any, top_k_weights: Any) -> Any:
    """An experts module's output for (tokens, hidden) states routed to ``top_k_index`` with
    ``top_k_weights`` (module docstring)."""
    import torch

    experts, double, hidden = self.gate_up_proj.shape
    inner = double // 2
    w1 = self.gate_up_proj
    if self.is_concatenated:  # [gate; up] -> gate0, up0, gate1, up1, ...
        w1 = torch.stack([w1[:, :inner], w1[:, inner:]], dim=2).reshape(experts, double, hidden)
    zero_rows = (hidden_states[:, :1] * 0.0).float()  # (tokens, 1): the token count, traced
    weights = top_k_weights.float()
    logits = (zero_rows.expand(-1, experts) - 1e9).scatter(1, top_k_index, torch.log(weights.clamp_min(1e-30)))
    out = _moe_op().apply(hidden_states, logits.to(hidden_states.dtype), w1, w1.new_zeros(experts, double),
                          self.down_proj, w1.new_zeros(experts, hidden), int(top_k_index.shape[-1]))
    return out * weights.sum(dim=-1, keepdim=True).to(out.dtype)


def _moe_op() -> Any:
    import torch

    class MoE(torch.autograd.Function):
        """``com.microsoft.MoE`` in the traced graph; computed here (for the tracer's example) as the
        kernel computes it: softmax over the router logits, the top k renormalised, SwiGLU experts."""

        @staticmethod
        def forward(ctx, x, router, w1, b1, w2, b2, k):
            top, chosen = torch.softmax(router.float(), dim=-1).topk(k, dim=-1)
            top = top / top.sum(dim=-1, keepdim=True)
            up = torch.einsum("tkoh,th->tko", w1[chosen], x) + b1[chosen]  # (tokens, k, 2 * inner) interleaved
            act = torch.nn.functional.silu(up[..., 0::2]) * up[..., 1::2]
            out = torch.einsum("tkhi,tki->tkh", w2[chosen], act) + b2[chosen]
            return (out * top[..., None].to(out.dtype)).sum(dim=1)

        @staticmethod
        def symbolic(g, x, router, w1, b1, w2, b2, k):
            return g.op(f"{DOMAIN}::MoE", x, router, w1, b1, w2, b2, k_i=k, activation_type_s="swiglu",
                        normalize_routing_weights_i=1, swiglu_fusion_i=1, activation_alpha_f=1.0,
                        activation_beta_f=0.0, swiglu_limit_f=math.inf).setType(x.type())

    return MoE
