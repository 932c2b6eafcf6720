"""A sentence-embedding student's embedding in torch, made as its teacher's artifact makes one.

The teacher's targets are its artifact's pooled embeddings
(:meth:`slimml.runtime.tasks.inputs.pooling.Pooler.pooled`: the pooling mode, then its projections,
before the normalisation and any Matryoshka cut). The student is trained to match them through the
same computation, differentiable: this module is that computation in torch, with the teacher's
projections frozen (the student's folder ships them unchanged). ``tests/test_st_pooling.py``
holds the two equal for every mode.
"""

from __future__ import annotations

from typing import Any

import torch

ACTIVATIONS = {"identity": lambda x: x, "tanh": torch.tanh, "relu": torch.relu, "sigmoid": torch.sigmoid}


class StudentPooling:
    """``pooling(hidden, attention_mask) -> (B, width)`` for token states (B, T, H) padded on the right.

    Args:
        pooler: the teacher artifact's :class:`~slimml.runtime.tasks.inputs.pooling.Pooler`.
    """

    def __init__(self, pooler: Any):
        self.mode = pooler.mode
        self._dense = [(torch.from_numpy(d.weight.copy()), None if d.bias is None else torch.from_numpy(d.bias.copy()),
                        ACTIVATIONS[d.activation]) for d in pooler.dense]

    def __call__(self, hidden: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        emb = pool(hidden, attention_mask, self.mode)
        for weight, bias, activation in self._dense:
            y = emb @ weight.to(emb.device, emb.dtype)
            emb = activation(y + bias.to(emb.device, emb.dtype) if bias is not None else y)
        return emb


def pool(hidden: torch.Tensor, attention_mask: torch.Tensor, mode: str) -> torch.Tensor:
    """sentence-transformers' pooling ``mode`` of token states (B, T, H) -> (B, H), as the runtime's ``pool``."""
    mask = attention_mask.to(hidden.dtype)
    if mode in ("mean", "mean_sqrt_len_tokens", "weightedmean"):
        if mode == "weightedmean":
            mask = mask * torch.arange(1, mask.shape[1] + 1, dtype=hidden.dtype, device=hidden.device)
        count = mask.sum(1, keepdim=True).clamp(min=1e-9)
        summed = (hidden * mask.unsqueeze(-1)).sum(1)
        return summed / (count.sqrt() if mode == "mean_sqrt_len_tokens" else count)
    if mode == "lasttoken":
        last = attention_mask.shape[1] - 1 - torch.argmax(attention_mask.flip(1).gt(0).to(torch.int64), dim=1)
        return hidden[torch.arange(hidden.shape[0], device=hidden.device), last]
    if mode == "cls":
        return hidden[:, 0]
    if mode == "max":
        return hidden.masked_fill(attention_mask.unsqueeze(-1) <= 0, float("-inf")).max(1).values
    return hidden  # "none": pooled by the model
