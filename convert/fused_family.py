"""What a decoder family changes in the fused graph (``convert/fused_llama.py``), read from its config.json.

The fused graph is one shape (RMSNorm, packed q/k/v, GroupQueryAttention with the rotary embedding
inside, packed gate/up, the down projection); a family is the handful of values that shape takes:

- Llama, Mistral, Qwen2, Qwen3, Phi-3, SmolLM3: SiLU, attention scale ``head_dim ** -0.5``, one RoPE
  for every layer (default, linear, Llama 3, YaRN or LongRoPE; over part of each head where
  ``partial_rotary_factor`` says so; none in SmolLM3's NoPE layers), sliding windows where Mistral
  and Qwen2 slide; Granite's multipliers (embeddings, attention scale, each block's output, logits);
  OLMo 2's norms after attention and MLP (none before) and q/k norms over all heads at once;
- Gemma (``GemmaForCausalLM``): embeddings times ``sqrt(hidden)``, RMSNorm ``x * (1 + w)`` (the 1
  folded into the stored weight: the same float32 product transformers computes), GELU with the tanh
  approximation (``FastGelu``, ONNX Runtime's fused kernel; matches torch to 1e-6);
- Gemma 2: also four norms per layer (after attention and around the MLP), attention scale
  ``query_pre_attn_scalar ** -0.5``, soft-capped attention scores (GQA's ``softcap``) and logits
  (``tanh(x / c) * c``), a sliding window on alternate layers;
- Gemma 3 (text, ``Gemma3ForCausalLM``): Gemma 2 without the soft-capping, a per-head q/k RMSNorm
  (as Qwen3, with Gemma's ``1 + w``), five sliding layers to one global, and two RoPEs: local layers
  ``rope_local_base_freq`` (10000) without scaling, global layers ``rope_theta`` with ``rope_scaling``
  (transformers 5 keeps both under ``rope_parameters``, one entry per layer type);
- mixtures of experts (Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE, Granite MoE, gpt-oss): the attention of the
  families above, and in the layers that route, ONNX Runtime's ``MoE`` op in place of the MLP
  (:class:`Experts`, written by ``convert/fused_experts.py``); gpt-oss adds biases on every attention
  projection and on the router, a sink logit per head (GroupQueryAttention's ``head_sink``), a window
  on alternate layers, YaRN, and experts with biases and a clamped SwiGLU.

Biases are written wherever the checkpoint has them (Qwen2's q/k/v, ``attention_bias`` and
``mlp_bias`` Llamas, gpt-oss).

Each value was checked against transformers' own modeling code, 4.57.6 and 5.24 (both read the same
configs the same way, but for the legacy ``hidden_act: "gelu"`` of Gemma 1 checkpoints, exact GELU in
4.57 and the tanh approximation in 5: the installed version's reading is followed).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

LLAMA_LIKE = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "Phi3ForCausalLM",
              "SmolLM3ForCausalLM", "GraniteForCausalLM", "Olmo2ForCausalLM", "Olmo3ForCausalLM")
GEMMA = ("GemmaForCausalLM", "Gemma2ForCausalLM", "Gemma3ForCausalLM")
MIXTURES = ("MixtralForCausalLM", "Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM", "OlmoeForCausalLM", "GraniteMoeForCausalLM",
            "GraniteMoeSharedForCausalLM", "GptOssForCausalLM")
GRANITE = ("GraniteForCausalLM", "GraniteMoeForCausalLM", "GraniteMoeSharedForCausalLM")
ARCHITECTURES = LLAMA_LIKE + GEMMA + MIXTURES
NAMES = ("Llama, Mistral, Qwen2, Qwen3, Phi-3, SmolLM3, Granite, OLMo 2, OLMo 3, Gemma, Gemma 2 and Gemma 3 (text), and the "
         "mixtures of experts Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE, Granite MoE and gpt-oss")
# transformers' activation names -> the op that computes them
ACTIVATIONS = {"silu": "silu", "swish": "silu", "gelu_pytorch_tanh": "gelu_tanh", "gelu_new": "gelu_tanh", "gelu": "gelu"}


@dataclass
class Family:
    """The values the fused graph takes for one decoder (per-layer lists have one entry per layer)."""

    head_dim: int
    scale: float  # attention scale: head_dim ** -0.5; Gemma 2/3 query_pre_attn_scalar ** -0.5
    windows: list[int]  # GroupQueryAttention's local_window_size: -1 full attention, else the window
    ropes: list[dict[str, Any] | None]  # each layer's RoPE (theta, type, scaling): Gemma 3's local and global
    # differ; None for a layer without one (SmolLM3's NoPE layers)
    activation: str = "silu"  # silu(gate) * up; gelu_tanh (FastGelu) or gelu (erf) of gate, times up
    embed_scale: float | None = None  # Gemma: the looked-up rows times sqrt(hidden), in float32
    norm_offset: float = 0.0  # Gemma's RMSNorm x * (1 + w): 1.0, added to each stored norm weight
    sandwich: bool = False  # Gemma 2/3: norm after attention, before and after the MLP (4 per layer)
    pre_norms: bool = True  # False: no norm before attention and MLP, only after (OLMo 2, with sandwich)
    softcap: float = 0.0  # Gemma 2: attention scores tanh(s / c) * c (GQA's softcap; 0: none)
    final_softcap: float = 0.0  # Gemma 2: logits tanh(x / c) * c
    residual_scale: float = 1.0  # Granite: each block's output times residual_multiplier before its residual add
    logits_divisor: float = 1.0  # Granite: logits / logits_scaling
    experts: Experts | None = None  # a mixture of experts: its routed layers' experts


@dataclass
class Experts:
    """A mixture of experts' routed layers, as transformers computes them: a router (a linear layer, one
    logit an expert), softmax over all experts, the ``top_k`` largest kept, renormalized to sum 1 or not
    (``renormalize``: Mixtral and Granite always, Qwen and OLMoE where ``norm_topk_prob``), each chosen
    expert a SiLU-gated MLP of width ``inner``; Qwen2-MoE adds a shared expert gated by a sigmoid of its
    own linear layer, Granite MoE (shared) a shared MLP, both ``shared_inner`` wide."""

    count: int
    top_k: int
    renormalize: bool
    inner: int
    sparse: list[bool]  # per layer: routed (True) or the dense MLP of ``intermediate_size`` (Qwen's mlp_only_layers)
    layout: str  # where the weights are: "mlp" (Qwen, OLMoE), "mixtral" (w1/w3/w2), "granite" (input/output_linear)
    shared_inner: int = 0
    shared_gated: bool = False  # Qwen2-MoE: the shared expert times sigmoid(shared_expert_gate(x))
    # the op's SwiGLU: (clamp(up, -limit, limit) + beta) * g * sigmoid(alpha * g), g = min(gate, limit);
    # silu(gate) * up is alpha 1, beta 0, no limit; gpt-oss's is alpha 1.702, beta 1, limit 7
    alpha: float = 1.0
    beta: float = 0.0
    limit: float = math.inf


def read_family(config: dict[str, Any], transformers_major: int = 5) -> Family | str:
    """The fused graph's values for ``config``, or why this exporter cannot honour it (one line).

    ``transformers_major``: the installed transformers' major version (Gemma 1's legacy
    ``hidden_act: "gelu"`` is exact GELU in 4.x and the tanh approximation in 5).
    """
    archs = config.get("architectures") or []
    arch = next((a for a in archs if a in ARCHITECTURES), None)
    if arch is None:
        return f"the fused exporter writes {NAMES} decoders; this model is {archs or 'of no named architecture'}"
    hidden, heads = int(config.get("hidden_size", 0)), int(config.get("num_attention_heads", 1))
    head_dim = int(config.get("head_dim") or hidden // heads)
    if head_dim % 16:
        return f"ONNX Runtime's GroupQueryAttention needs a head size that is a multiple of 16, not {head_dim}"
    if arch in GEMMA:
        return _gemma(config, arch, head_dim, transformers_major)
    if arch == "Olmo3ForCausalLM":
        return _olmo3(config, head_dim)
    rope = _rope(config)
    if isinstance(rope, str):
        return rope
    rotated = int(head_dim * rope["partial_rotary_factor"])
    if rotated % 16:
        return (f"ONNX Runtime's GroupQueryAttention rotates a multiple of 16 values of each head, not {rotated} "
                f"(head size {head_dim} x partial_rotary_factor {rope['partial_rotary_factor']})")
    act = config.get("hidden_act", "silu")
    if ACTIVATIONS.get(act) != "silu":
        return f"the fused exporter writes SiLU MLPs for {arch}; this one uses {act!r}"
    layers = int(config["num_hidden_layers"])
    ropes: list[dict[str, Any] | None] = [rope] * layers
    if arch == "SmolLM3ForCausalLM":  # no_rope_layers[i] == 0: layer i attends without a position embedding
        every = int(config.get("no_rope_layer_interval", 4))
        uses = config.get("no_rope_layers") or [int((i + 1) % every != 0) for i in range(layers)]
        ropes = [rope if uses[i] else None for i in range(layers)]
    if arch == "Olmo2ForCausalLM":  # norms after attention and MLP only; q/k normed over all heads (read from the weights)
        return Family(head_dim=head_dim, scale=1.0 / math.sqrt(head_dim), windows=_windows(config), ropes=ropes,
                      sandwich=True, pre_norms=False)
    experts = _experts(config, arch, layers, transformers_major) if arch in MIXTURES else None
    if isinstance(experts, str):
        return experts
    if arch in GRANITE:  # Llama with four multipliers, each applied where transformers applies it
        embed = float(config.get("embedding_multiplier", 1.0))
        return Family(head_dim=head_dim, scale=float(config.get("attention_multiplier", 1.0)), windows=_windows(config),
                      ropes=ropes, embed_scale=embed if embed != 1.0 else None,
                      residual_scale=float(config.get("residual_multiplier", 1.0)),
                      logits_divisor=float(config.get("logits_scaling", 1.0)), experts=experts)
    return Family(head_dim=head_dim, scale=1.0 / math.sqrt(head_dim), windows=_windows(config), ropes=ropes, experts=experts)


def _experts(config: dict[str, Any], arch: str, layers: int, transformers_major: int = 5) -> Experts | str:
    """The routed layers of a mixture of experts (:class:`Experts`), or why they cannot be written.
    Qwen3-MoE's count is ``num_experts`` as 4.57 saves it, ``num_local_experts`` as transformers 5 does.
    gpt-oss's SwiGLU constants: 4.57 fixes them (1.702, 7), transformers 5 reads ``swiglu_alpha`` and
    ``swiglu_limit`` (same defaults); the installed version's reading is followed."""
    count = int(config.get("num_local_experts") or config.get("num_experts") or 0)
    top_k = int(config.get("num_experts_per_tok") or 0)
    if count < 2 or not 0 < top_k <= count:
        return f"{arch}'s config names {count} experts, {top_k} a token: not a mixture the MoE op computes"
    if config.get("clip_qkv"):
        return "OLMoE's clip_qkv (q, k and v clamped) is not written by the fused exporter yet"
    if arch == "GptOssForCausalLM":  # renormalized top k (softmax over the top logits), every layer routed
        read = transformers_major >= 5
        return Experts(count, top_k, True, int(config["intermediate_size"]), [True] * layers, "gpt_oss",
                       alpha=float(config.get("swiglu_alpha", 1.702) if read else 1.702), beta=1.0,
                       limit=float(config.get("swiglu_limit", 7.0) if read else 7.0))
    if arch in ("MixtralForCausalLM", "OlmoeForCausalLM") or arch in GRANITE:
        inner, layout = int(config["intermediate_size"]), "granite" if arch in GRANITE else (
            "mixtral" if arch == "MixtralForCausalLM" else "mlp")
        renormalize = arch != "OlmoeForCausalLM" or bool(config.get("norm_topk_prob", False))
        return Experts(count, top_k, renormalize, inner, [True] * layers, layout,
                       shared_inner=int(config.get("shared_intermediate_size") or 0))
    step, dense = int(config.get("decoder_sparse_step") or 1), set(config.get("mlp_only_layers") or ())
    sparse = [i not in dense and (i + 1) % step == 0 for i in range(layers)]  # Qwen2/3-MoE's rule, 4.57 and 5
    shared = int(config.get("shared_expert_intermediate_size") or 0) if arch == "Qwen2MoeForCausalLM" else 0
    return Experts(count, top_k, bool(config.get("norm_topk_prob", False)), int(config["moe_intermediate_size"]), sparse,
                   "mlp", shared_inner=shared, shared_gated=bool(shared))


def _olmo3(config: dict[str, Any], head_dim: int) -> Family | str:
    """OLMo 3: OLMo 2's norms, three sliding layers to one global; the sliding layers' RoPE plain, the
    global layers' with the config's scaling (YaRN for the long-context models). transformers 5 keeps
    one ``rope_parameters`` entry per layer type; 4.57 reads ``rope_theta`` for both and
    ``rope_scaling`` for the global layers."""
    layers = int(config["num_hidden_layers"])
    types = list(config.get("layer_types") or ["sliding_attention" if (i + 1) % 4 else "full_attention" for i in range(layers)])
    nested = isinstance((config.get("rope_parameters") or {}).get("full_attention"), dict)
    ropes: dict[str, dict[str, Any]] = {}
    for t in set(types):
        if nested:
            rope = _rope(config, t)
        elif t == "sliding_attention":
            rope = {"theta": float(config.get("rope_theta", 500000.0)), "type": "default", "partial_rotary_factor": 1.0}
        else:
            rope = _rope(config, default_theta=500000.0)
        if isinstance(rope, str):
            return rope
        ropes[t] = rope
    window = int(config.get("sliding_window") or 0)
    return Family(head_dim=head_dim, scale=1.0 / math.sqrt(head_dim), ropes=[ropes[t] for t in types],
                  windows=[window if (t == "sliding_attention" and window) else -1 for t in types],
                  sandwich=True, pre_norms=False)


def _gemma(config: dict[str, Any], arch: str, head_dim: int, transformers_major: int) -> Family | str:
    layers = int(config["num_hidden_layers"])
    first = arch == "GemmaForCausalLM"
    act = (config.get("hidden_act") if first else config.get("hidden_activation")) or "gelu_pytorch_tanh"
    if first and act == "gelu" and transformers_major >= 5:  # transformers 5 reads the legacy "gelu" as the tanh one
        act = "gelu_pytorch_tanh"
    if ACTIVATIONS.get(act) not in ("gelu_tanh", "gelu"):
        return f"the fused exporter writes Gemma's GELU MLPs; this {arch} uses {act!r}"
    if config.get("use_bidirectional_attention"):
        return "a Gemma with bidirectional attention (an embedding model) is not a decoder the fused exporter writes"
    if arch == "Gemma3ForCausalLM" and config.get("attn_logit_softcapping"):  # transformers' Gemma 3 ignores it
        return "a Gemma 3 config with attn_logit_softcapping set (transformers does not apply it) is not written by the fused exporter"
    if float(config.get("partial_rotary_factor") or 1.0) != 1.0:
        return f"a partial rotary embedding (factor {config['partial_rotary_factor']}) on a Gemma is not written by the fused exporter"
    if first:
        rope = _rope(config)
        if isinstance(rope, str):
            return rope
        return Family(head_dim=head_dim, scale=1.0 / math.sqrt(head_dim), windows=[-1] * layers, ropes=[rope] * layers,
                      activation=ACTIVATIONS[act], embed_scale=math.sqrt(int(config["hidden_size"])), norm_offset=1.0)
    # a key the config leaves out takes transformers' class default (Gemma 2's caps 50 and 30, 1e6 for
    # Gemma 3's rope_theta, a window of 4096, query_pre_attn_scalar 256); one written as null means none
    second = arch == "Gemma2ForCausalLM"
    types = _gemma_layer_types(config, arch, layers)
    window = int(config.get("sliding_window", 4096) or 0)
    ropes = []
    for t in types:
        rope = _rope(config) if second else _rope(config, t, default_theta=1e6)
        if isinstance(rope, str):
            return rope
        if rope["type"] in LIBRARY_ROPES:
            return f"RoPE scaling {rope['type']!r} on a {arch} is not written by the fused exporter yet"
        ropes.append(rope)
    return Family(
        head_dim=head_dim, scale=float(config.get("query_pre_attn_scalar", 256)) ** -0.5,
        windows=[window if (t == "sliding_attention" and window) else -1 for t in types], ropes=ropes,
        activation=ACTIVATIONS[act], embed_scale=math.sqrt(int(config["hidden_size"])), norm_offset=1.0, sandwich=True,
        softcap=float(config.get("attn_logit_softcapping", 50.0) or 0.0) if second else 0.0,
        final_softcap=float(config.get("final_logit_softcapping", 30.0 if second else None) or 0.0))


def _gemma_layer_types(config: dict[str, Any], arch: str, layers: int) -> list[str]:
    """``layer_types`` as written, else transformers' default: Gemma 2 slides in even layers, Gemma 3
    in all but every ``sliding_window_pattern``-th (6)."""
    types = config.get("layer_types")
    if types:
        return list(types)
    pattern = 2 if arch == "Gemma2ForCausalLM" else int(config.get("sliding_window_pattern") or config.get("_sliding_window_pattern") or 6)
    return ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(layers)]


def _rope(config: dict[str, Any], layer_type: str | None = None, default_theta: float = 10000.0) -> dict[str, Any] | str:
    """theta and scaling, wherever the config keeps them; a string says why they cannot be honoured.

    ``layer_type`` (Gemma 3): transformers 5 keeps one ``rope_parameters`` entry per layer type; 4.57
    reads ``rope_theta`` and ``rope_scaling`` for global layers and ``rope_local_base_freq`` (no
    scaling) for sliding ones.
    """
    nested = (config.get("rope_parameters") or {}).get(layer_type) if layer_type else None
    if isinstance(nested, dict):  # transformers 5's Gemma 3 and OLMo 3: one entry per layer type
        params = {**nested, "layer_type": layer_type}
    elif layer_type == "sliding_attention":  # transformers 4.57's Gemma 3: local layers, no scaling
        params = {"rope_theta": config.get("rope_local_base_freq") or 10000.0}
    else:
        params = dict(config.get("rope_parameters") or {}) if layer_type is None else {}  # transformers 5 (one type)
        params.update(config.get("rope_scaling") or {})
    theta = params.get("rope_theta", config.get("rope_theta", default_theta))
    kind = params.get("rope_type", params.get("type", "default")) or "default"
    if kind not in ("default", "linear", "llama3", *LIBRARY_ROPES):
        return f"RoPE scaling {kind!r} (its frequencies change with the sequence's length) is not written by the fused exporter yet"
    partial = params.get("partial_rotary_factor", config.get("partial_rotary_factor"))  # 5: in rope_parameters; 4.57: top level
    return {"theta": float(theta), "type": kind, **{k: v for k, v in params.items() if k not in ("rope_type", "type")},
            "partial_rotary_factor": float(partial or 1.0)}


def _windows(config: dict[str, Any]) -> list[int]:
    """Per layer, GroupQueryAttention's ``local_window_size``: -1 for full attention, else the sliding
    window (the same number of positions as transformers' mask: measured equal logits, 14 tokens
    through a window of 8). Mistral slides in every layer when ``sliding_window`` is set; Qwen2 (and
    SmolLM3) only with ``use_sliding_window``, in the layers ``layer_types`` names (by default those from
    ``max_window_layers`` on), as transformers 4.57 reads the config."""
    layers = int(config["num_hidden_layers"])
    window = config.get("sliding_window")
    if config.get("model_type") in ("qwen2", "qwen3", "smollm3") and not config.get("use_sliding_window"):
        window = None
    if not window:
        return [-1] * layers
    types = config.get("layer_types")
    if types is None and config.get("model_type") == "gpt_oss":  # its config's default: alternate layers slide
        types = ["sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(layers)]
    if types is None and config.get("model_type") in ("qwen2", "qwen3"):
        first = int(config.get("max_window_layers", 28))
        types = ["sliding_attention" if i >= first else "full_attention" for i in range(layers)]
    return [int(window) if (types is None or types[i] == "sliding_attention") else -1 for i in range(layers)]


@dataclass
class Rotary:
    """One RoPE as the fused graph computes it: angles = position x ``inv`` ((rotary_dim / 2,) float32),
    cos and sin times ``scale`` (YaRN's and LongRoPE's attention factor). LongRoPE's ``inv_long`` takes
    over at every position of a prompt pass whose sequence is longer than ``switch``, and in a decoding
    pass at the positions from ``switch`` on (``convert.fused_llama._longrope_angles``). A rotary dimension below the head's (a partial
    rotary embedding) rotates the first ``2 * len(inv)`` values of each head, as GroupQueryAttention does
    for a cos table narrower than half the head."""

    inv: np.ndarray
    inv_long: np.ndarray | None = None
    switch: int = 0
    scale: float = 1.0

    def key(self) -> bytes:
        """Equal for two layers that can share one pair of tables."""
        long = b"" if self.inv_long is None else self.inv_long.tobytes()
        return self.inv.tobytes() + long + np.array([self.switch, self.scale], np.float64).tobytes()


# computed by the installed transformers' own function (their details differ between 4.57 and 5)
LIBRARY_ROPES = ("yarn", "longrope")


def rotary(rope: dict[str, Any], config: dict[str, Any], head_dim: int) -> Rotary:
    """The tables' values for one of :func:`read_family`'s ropes of the model whose config.json is ``config``.

    default, linear and llama3 as transformers computes them (:func:`inv_freq`); YaRN and LongRoPE by the
    installed transformers' ``ROPE_INIT_FUNCTIONS`` on the config as it reads it; LongRoPE's switch is
    the original context (``original_max_position_embeddings``), where transformers switches.
    """
    if rope["type"] not in LIBRARY_ROPES:
        dim = int(head_dim * float(rope.get("partial_rotary_factor") or 1.0))
        return Rotary(inv_freq(rope, dim).astype(np.float32))
    import torch
    from transformers import AutoConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    cfg = AutoConfig.for_model(config["model_type"], **{k: v for k, v in config.items() if k != "model_type"})
    init = ROPE_INIT_FUNCTIONS[rope["type"]]
    with torch.no_grad():
        layer = {"layer_type": rope["layer_type"]} if rope.get("layer_type") else {}  # transformers 5, per layer type
        inv, scale = init(cfg, None, **layer)
        if rope["type"] != "longrope":
            return Rotary(inv.float().numpy(), scale=float(scale))
        params = getattr(cfg, "rope_parameters", None)  # transformers 5 keeps the original context there; 4.57 at the top
        if isinstance(params, dict) and params.get("original_max_position_embeddings"):
            switch = int(params["original_max_position_embeddings"])
        else:
            switch = int(getattr(cfg, "original_max_position_embeddings", None) or cfg.max_position_embeddings)
        long, _ = init(cfg, None, seq_len=switch + 1, **layer)
    return Rotary(inv.float().numpy(), long.float().numpy(), switch, float(scale))


def inv_freq(rope: dict[str, Any], dim: int) -> np.ndarray:
    """RoPE's inverse frequencies (dim / 2,) as transformers computes them for ``rope``'s type."""
    inv = 1.0 / (rope["theta"] ** (np.arange(0, dim, 2, dtype=np.float64) / dim))
    if rope["type"] == "linear":
        inv = inv / float(rope["factor"])
    elif rope["type"] == "llama3":  # transformers' _compute_llama3_parameters
        factor, low, high = float(rope["factor"]), float(rope["low_freq_factor"]), float(rope["high_freq_factor"])
        old = float(rope["original_max_position_embeddings"])
        wavelen = 2 * math.pi / inv
        smooth = (old / wavelen - low) / (high - low)
        scaled = np.where(wavelen > old / low, inv / factor, inv)
        mid = (wavelen <= old / low) & (wavelen >= old / high)
        inv = np.where(mid, (1 - smooth) * inv / factor + smooth * inv, scaled)
    return inv


def reference_kwargs(folder: str | Path) -> dict[str, Any]:
    """``from_pretrained`` keywords that make transformers compute the model in ``folder`` as it was
    trained, for the checks that compare against it: eager attention where the config soft-caps the
    attention scores (Gemma 2), which transformers 4.57's default SDPA path drops without a word
    (measured: logits 4.1 apart on a tiny Gemma 2 with a cap of 1; transformers 5 runs Gemma 2 eagerly)."""
    try:
        config = json.loads((Path(folder) / "config.json").read_text())
    except (OSError, ValueError):
        return {}
    capped = config.get("model_type") == "gemma2" or config.get("attn_logit_softcapping")  # Gemma 2's default cap: 50
    return {"attn_implementation": "eager"} if capped else {}
