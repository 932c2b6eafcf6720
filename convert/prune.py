"""Structured pruning: remove whole attention heads and FFN neurons, so the weight matrices shrink.

Importance is first-order Taylor (|w * dL/dw| summed over a head's or a neuron's weights, with the
gradient of the distillation loss over a few batches; Molchanov et al. 2019). Every layer loses the
same fraction, so the pruned model is still described by one config (``intermediate_size``,
``pruned_heads``), saves with ``save_pretrained`` and exports with optimum like the original. A
short distillation pass afterwards (``convert.distill``) recovers the accuracy.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from slimml.errors import ConfigError

# model_type -> how its layers are laid out. BERT-like encoders share module names.
BERT_LIKE = ("bert", "roberta", "xlm-roberta", "electra", "camembert")


@dataclass
class PruneConfig:
    """How much to prune.

    Args:
        fraction: share of the attention heads and of the FFN neurons to remove in every layer,
            strictly between 0 and 1 (0.5 keeps half).
        heads: prune attention heads.
        ffn: prune FFN intermediate neurons.
        importance_batches: batches of distillation data the importance scores are summed over.
        vocab: also prune the rarest ``fraction`` of a WordPiece vocabulary (``convert.prune_vocab``):
            the token embedding is most of a small encoder's bytes. Tokens the data uses are kept.
    """

    fraction: float = 0.5
    heads: bool = True
    ffn: bool = True
    importance_batches: int = 16
    vocab: bool = True

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


def check_prunable(config: Any) -> None:
    """Raise before any work if the pruner does not know this architecture."""
    model_type = getattr(config, "model_type", None)
    if model_type not in BERT_LIKE:
        raise ConfigError(
            f"--prune does not support the architecture {model_type!r} (it knows the BERT-like encoders "
            f"{', '.join(BERT_LIKE)}). Leave --prune out; --distill-layers alone works for this model."
        )


def encoder_layers(model: Any) -> Any:
    """The list of transformer blocks of a BERT-like model, head or not."""
    return model.base_model.encoder.layer


def kept_counts(config: Any, prune: PruneConfig) -> tuple[int, int]:
    """Heads and FFN neurons each layer keeps (at least one of each)."""
    heads = config.num_attention_heads
    inter = config.intermediate_size
    keep_heads = max(1, round(heads * (1 - prune.fraction))) if prune.heads else heads
    keep_ffn = max(1, round(inter * (1 - prune.fraction))) if prune.ffn else inter
    return keep_heads, keep_ffn


def importance(model: Any, batches: list[Any], loss_fn) -> tuple[list[Any], list[Any]]:
    """Per-layer head scores (L lists of n_heads) and FFN neuron scores (L lists of intermediate_size).

    ``loss_fn(model, batch)`` returns the distillation loss; its gradients are summed over ``batches``.
    """
    import torch

    model.train()
    model.zero_grad(set_to_none=True)
    for batch in batches:
        loss_fn(model, batch).backward()
    heads_scores, ffn_scores = [], []
    with torch.no_grad():
        for layer in encoder_layers(model):
            att = layer.attention.self
            n, d = att.num_attention_heads, att.attention_head_size
            score = torch.zeros(n)
            for lin in (att.query, att.key, att.value):  # rows = outputs, grouped by head
                t = (lin.weight * lin.weight.grad).abs().sum(1) + (lin.bias * lin.bias.grad).abs()
                score += t.view(n, d).sum(1)
            out = layer.attention.output.dense  # columns = inputs, grouped by head
            score += (out.weight * out.weight.grad).abs().sum(0).view(n, d).sum(1)
            heads_scores.append(score)
            up, down = layer.intermediate.dense, layer.output.dense
            neuron = (up.weight * up.weight.grad).abs().sum(1) + (up.bias * up.bias.grad).abs()
            neuron += (down.weight * down.weight.grad).abs().sum(0)
            ffn_scores.append(neuron)
    model.zero_grad(set_to_none=True)
    return heads_scores, ffn_scores


def plan(model: Any, prune: PruneConfig, heads_scores, ffn_scores) -> dict[str, Any]:
    """Which heads and neurons each layer keeps: ``{"heads": [[...], ...], "ffn": [[...], ...]}``."""
    keep_h, keep_f = kept_counts(model.config, prune)
    heads = [sorted(s.argsort(descending=True)[:keep_h].tolist()) for s in heads_scores]
    ffn = [sorted(s.argsort(descending=True)[:keep_f].tolist()) for s in ffn_scores]
    return {"heads": heads, "ffn": ffn}


def apply_plan(model: Any, kept: dict[str, Any]) -> None:
    """Physically remove the heads and neurons not in ``kept`` (in place)."""
    import torch

    n_heads = model.config.num_attention_heads
    to_prune = {i: sorted(set(range(n_heads)) - set(h)) for i, h in enumerate(kept["heads"])}
    to_prune = {i: h for i, h in to_prune.items() if h}
    if to_prune:
        model.prune_heads(to_prune)  # transformers slices Q, K, V rows and the output columns
    layers = encoder_layers(model)
    for layer, neurons in zip(layers, kept["ffn"]):
        idx = torch.tensor(neurons, dtype=torch.long)
        layer.intermediate.dense = _slice_linear(layer.intermediate.dense, idx, dim=0)
        layer.output.dense = _slice_linear(layer.output.dense, idx, dim=1)
    model.config.intermediate_size = len(kept["ffn"][0])


def _slice_linear(lin: Any, idx: Any, dim: int) -> Any:
    """A new Linear keeping output rows (dim 0) or input columns (dim 1) ``idx``."""
    import torch

    weight = lin.weight.detach().index_select(dim, idx).clone()
    out_f, in_f = weight.shape
    new = torch.nn.Linear(in_f, out_f, bias=lin.bias is not None, dtype=weight.dtype)
    with torch.no_grad():
        new.weight.copy_(weight)
        if lin.bias is not None:
            new.bias.copy_(lin.bias.detach()[idx] if dim == 0 else lin.bias.detach())
    return new
