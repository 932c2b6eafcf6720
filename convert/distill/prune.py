"""Structured pruning: remove whole attention heads and FFN neurons, so the weight matrices shrink.

Importance is first-order Taylor (|w * dL/dw| summed over a head's or a neuron's weights, with the
gradient of the distillation loss over a few batches; Molchanov et al. 2019). Every layer loses the
same fraction, so the pruned model is still described by one config (``intermediate_size``, and
``pruned_heads`` for an encoder, which :mod:`.prune_heads` writes and reads back the same way under
transformers 4.57 and 5; ``head_dim`` and the head counts for a decoder), saves with
``save_pretrained`` and exports like the original. A short distillation pass afterwards
(``convert.distill``) recovers the accuracy.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from slimml.convert.distill.prune_heads import BERT_LIKE, remove_heads, slice_linear
from slimml.errors import ConfigError

# model_type -> how its layers are laid out. BERT-like encoders (prune_heads.BERT_LIKE) share module
# names; Llama-family decoders group their query heads around shared key-value heads (grouped-query attention).
LLAMA_LIKE = ("llama", "mistral", "qwen2")
VOCAB_DEFAULT_MAX = 0.3  # words outside the distillation data need their tokens: 0.5 -> 0.3 gave STSb dev +0.5

@dataclass
class PruneConfig:
    """How much to prune.

    Args:
        fraction: share of the attention heads and of the FFN neurons to remove in every layer,
            strictly between 0 and 1 (0.5 keeps half).
        heads: prune attention heads.
        ffn: prune FFN intermediate neurons.
        importance_batches: batches of distillation data the importance scores are summed over.
        vocab: also prune the rarest tokens of a WordPiece vocabulary (``convert.prune_vocab``):
            the token embedding is most of a small encoder's bytes. Tokens the data uses are kept.
        vocab_fraction: the share of the vocabulary removed; ``None``: ``fraction``, at most
            ``VOCAB_DEFAULT_MAX`` (text unlike the distillation data needs the words it uses).
    """

    fraction: float = field(default=0.5, metadata={
        "help": "Remove this share (0..1) of attention heads and FFN neurons per layer, then recover by distillation.",
        "flags": ("--prune",)})
    heads: bool = True
    ffn: bool = True
    importance_batches: int = 16
    vocab: bool = True
    vocab_fraction: float | None = None

    @property
    def vocab_share(self) -> float:
        return self.vocab_fraction if self.vocab_fraction is not None else min(self.fraction, VOCAB_DEFAULT_MAX)

    def __post_init__(self):
        if not 0.0 < float(self.fraction) < 1.0:
            raise ConfigError(
                f"--prune {self.fraction} is outside (0, 1); give the share of heads and FFN neurons to remove, "
                "e.g. --prune 0.3."
            )
        if not (self.heads or self.ffn):
            raise ConfigError("PruneConfig prunes nothing: set heads=True, ffn=True or both.")
        if self.importance_batches < 1:
            raise ConfigError(f"importance_batches must be >= 1 (got {self.importance_batches}).")


def check_prunable(config: Any, prune: PruneConfig | None = None) -> None:
    """Raise before any work if the pruner does not know this architecture, or the ratio empties a layer."""
    model_type = getattr(config, "model_type", None)
    if model_type not in BERT_LIKE + LLAMA_LIKE:
        raise ConfigError(
            f"--prune does not support the architecture {model_type!r} (it knows the BERT-like encoders "
            f"{', '.join(BERT_LIKE)} and the decoders {', '.join(LLAMA_LIKE)}). Leave --prune out; --distill-layers "
            "alone works for this model."
        )
    if prune is not None and model_type in LLAMA_LIKE and prune.heads:
        groups = _kv_heads(config)
        if round(groups * (1 - prune.fraction)) < 1:
            per = config.num_attention_heads // groups
            most = 1 - 0.5 / groups
            raise ConfigError(
                f"--prune {prune.fraction} would leave every layer with no attention heads: this model has {groups} "
                f"key-value group(s) of {per} query heads, and pruning removes whole groups to keep grouped-query "
                f"attention consistent. Give --prune below {most:.2f}."
            )


def _kv_heads(config: Any) -> int:
    return int(getattr(config, "num_key_value_heads", None) or config.num_attention_heads)


def _is_decoder(model: Any) -> bool:
    return getattr(model.config, "model_type", None) in LLAMA_LIKE


def encoder_layers(model: Any) -> Any:
    """The list of transformer blocks of a BERT-like encoder or a Llama-family decoder, head or not."""
    base = model.base_model
    return base.layers if _is_decoder(model) else base.encoder.layer


def head_groups(config: Any) -> int:
    """The units heads are pruned in, a layer: its heads in an encoder, its key-value groups in a decoder."""
    return _kv_heads(config) if getattr(config, "model_type", None) in LLAMA_LIKE else config.num_attention_heads


def kept_counts(config: Any, prune: PruneConfig) -> tuple[int, int]:
    """Head groups and FFN neurons each layer keeps (a group is one head in an encoder, one KV group in a decoder).

    Groups removed are rounded up, so at least the share asked goes (3 KV groups at 0.5: 2 go, not 1), except
    that every layer keeps one group (1 group at 0.3: none goes; :func:`heads_shortfall` says so).
    """
    groups = head_groups(config)
    inter = config.intermediate_size
    keep_groups = max(1, groups - math.ceil(groups * prune.fraction - 1e-9)) if prune.heads else groups
    keep_ffn = max(1, round(inter * (1 - prune.fraction))) if prune.ffn else inter
    return keep_groups, keep_ffn


def heads_shortfall(config: Any, prune: PruneConfig) -> str | None:
    """In words, where the heads lose less than the share asked (a layer keeps at least one group); None where not."""
    if not prune.heads:
        return None
    groups = head_groups(config)
    removed = 1 - kept_counts(config, prune)[0] / groups
    if removed >= prune.fraction - 1e-9:
        return None
    decoder = getattr(config, "model_type", None) in LLAMA_LIKE
    unit = (f"{groups} key-value group(s) of {config.num_attention_heads // groups} query heads, pruning removes whole "
            "groups," if decoder else f"{groups} attention head(s),")
    ffn = f"; the FFN neurons lose {prune.fraction:.0%}" if prune.ffn else ""
    return (f"--prune {prune.fraction} removes {removed:.0%} of the attention heads, not {prune.fraction:.0%}: this model "
            f"has {unit} and every layer keeps one{ffn}.")


def _taylor(lin: Any, dim: int) -> Any:
    """|w * dL/dw| summed per output row (dim 0) or per input column (dim 1), bias included for rows."""
    t = (lin.weight * lin.weight.grad).abs().sum(1 - dim)
    if dim == 0 and lin.bias is not None:
        t = t + (lin.bias * lin.bias.grad).abs()
    return t


def _head_dim(model: Any) -> int:
    c = model.config
    return int(getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads)


def importance(model: Any, batches: list[Any], loss_fn) -> tuple[list[Any], list[Any]]:
    """Per-layer head-group scores and FFN neuron scores (one list per layer each).

    ``loss_fn(model, batch)`` returns the distillation loss; its gradients are summed over ``batches``.
    In a decoder a group is a key-value head with the query heads that share it.
    """
    import torch

    model.train()
    model.zero_grad(set_to_none=True)
    for batch in batches:
        loss_fn(model, batch).backward()
    heads_scores, ffn_scores = [], []
    decoder = _is_decoder(model)
    with torch.no_grad():
        for layer in encoder_layers(model):
            if decoder:
                att, mlp = layer.self_attn, layer.mlp
                d, groups = _head_dim(model), _kv_heads(model.config)
                q = (_taylor(att.q_proj, 0) + _taylor(att.o_proj, 1)).view(groups, -1).sum(1)
                kv = (_taylor(att.k_proj, 0) + _taylor(att.v_proj, 0)).view(groups, d).sum(1)
                heads_scores.append(q + kv)
                ffn_scores.append(_taylor(mlp.gate_proj, 0) + _taylor(mlp.up_proj, 0) + _taylor(mlp.down_proj, 1))
                continue
            att = layer.attention.self
            n = att.num_attention_heads
            score = sum(_taylor(lin, 0) for lin in (att.query, att.key, att.value)).view(n, -1).sum(1)
            score += _taylor(layer.attention.output.dense, 1).view(n, -1).sum(1)
            heads_scores.append(score)
            ffn_scores.append(_taylor(layer.intermediate.dense, 0) + _taylor(layer.output.dense, 1))
    model.zero_grad(set_to_none=True)
    return heads_scores, ffn_scores


def plan(model: Any, prune: PruneConfig, heads_scores, ffn_scores) -> dict[str, Any]:
    """Which head groups and neurons each layer keeps: ``{"heads": [[...], ...], "ffn": [[...], ...]}``."""
    keep_h, keep_f = kept_counts(model.config, prune)
    heads = [sorted(s.argsort(descending=True)[:keep_h].tolist()) for s in heads_scores]
    ffn = [sorted(s.argsort(descending=True)[:keep_f].tolist()) for s in ffn_scores]
    return {"heads": heads, "ffn": ffn}


def describe(model: Any, kept: dict[str, Any], groups_before: int | None = None) -> dict[str, Any]:
    """What each layer keeps, for the report; with ``groups_before`` (:func:`head_groups` of the unpruned
    model) also ``heads_removed``, the share of the heads actually removed (grouped-query attention
    removes whole groups, so it may differ from the share asked)."""
    removed = {"heads_removed": round(1 - len(kept["heads"][0]) / groups_before, 4)} if groups_before else {}
    if _is_decoder(model):
        return {"heads_per_layer": model.config.num_attention_heads, "kv_heads_per_layer": model.config.num_key_value_heads,
                **removed, "ffn_per_layer": len(kept["ffn"][0])}
    return {"heads_per_layer": len(kept["heads"][0]), **removed, "ffn_per_layer": len(kept["ffn"][0])}


def apply_plan(model: Any, kept: dict[str, Any]) -> None:
    """Physically remove the heads and neurons not in ``kept`` (in place)."""
    if _is_decoder(model):
        _apply_decoder(model, kept)
        return
    import torch

    remove_heads(model, dict(enumerate(kept["heads"])))  # slices Q, K, V rows and the output columns
    for layer, neurons in zip(encoder_layers(model), kept["ffn"]):
        idx = torch.tensor(neurons, dtype=torch.long)
        layer.intermediate.dense = slice_linear(layer.intermediate.dense, idx, dim=0)
        layer.output.dense = slice_linear(layer.output.dense, idx, dim=1)
    model.config.intermediate_size = len(kept["ffn"][0])


def _apply_decoder(model: Any, kept: dict[str, Any]) -> None:
    """Keep whole key-value groups (their K and V heads and every query head reading them) and MLP neurons."""
    import torch

    config = model.config
    d, groups = _head_dim(model), _kv_heads(config)
    per = config.num_attention_heads // groups
    for layer, keep_groups, neurons in zip(encoder_layers(model), kept["heads"], kept["ffn"]):
        att, mlp = layer.self_attn, layer.mlp
        q_rows = torch.tensor([g * per * d + r for g in keep_groups for r in range(per * d)], dtype=torch.long)
        kv_rows = torch.tensor([g * d + r for g in keep_groups for r in range(d)], dtype=torch.long)
        att.q_proj = slice_linear(att.q_proj, q_rows, dim=0)
        att.k_proj = slice_linear(att.k_proj, kv_rows, dim=0)
        att.v_proj = slice_linear(att.v_proj, kv_rows, dim=0)
        att.o_proj = slice_linear(att.o_proj, q_rows, dim=1)
        idx = torch.tensor(neurons, dtype=torch.long)
        mlp.gate_proj = slice_linear(mlp.gate_proj, idx, dim=0)
        mlp.up_proj = slice_linear(mlp.up_proj, idx, dim=0)
        mlp.down_proj = slice_linear(mlp.down_proj, idx, dim=1)
        mlp.intermediate_size = len(neurons)
    kept_groups = len(kept["heads"][0])
    config.head_dim = d  # no longer hidden_size / heads
    config.num_attention_heads = kept_groups * per
    config.num_key_value_heads = kept_groups
    config.intermediate_size = len(kept["ffn"][0])
