"""Text in, tensors out: the shipped tokenizer and sentence-transformers style pooling."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
from tokenizers import Tokenizer

from slimml.errors import ArtifactError, FeedError


class TextEncoder:
    """Tokenizes a batch of texts into the int64 feeds a transformer expects."""

    def __init__(self, path: Path, spec: dict[str, Any], input_names: list[str]):
        try:
            self.tokenizer = Tokenizer.from_file(str(path))
        except Exception as e:
            raise ArtifactError(f"could not read the tokenizer {path.name}: {e}; re-convert the model.") from None
        self.max_length = int(spec.get("max_length") or 512)
        self.tokenizer.enable_truncation(max_length=self.max_length)
        pad_id = spec.get("pad_id")
        if pad_id is not None:
            self.tokenizer.enable_padding(pad_id=int(pad_id), pad_token=str(spec.get("pad_token") or "[PAD]"))
        else:
            self.tokenizer.enable_padding()
        self.input_names = input_names

    def __call__(self, texts: list[str], pad_to: int | None = None) -> dict[str, np.ndarray]:
        if isinstance(texts, str) or not all(isinstance(t, str) for t in texts):
            raise FeedError("encode() takes a list of strings; wrap a single text as [text].")
        if not texts:
            raise FeedError("encode() got an empty list; give at least one text.")
        encs = self.tokenizer.encode_batch(texts)  # pads to the longest; the tokenizer is never mutated here
        tensors = {
            "input_ids": np.array([e.ids for e in encs], dtype=np.int64),
            "attention_mask": np.array([e.attention_mask for e in encs], dtype=np.int64),
            "token_type_ids": np.array([e.type_ids for e in encs], dtype=np.int64),
        }
        extra = (pad_to or 0) - tensors["input_ids"].shape[1]
        if extra > 0:  # pad further by hand: enable_padding(length=...) would race other threads
            pad_id = self.tokenizer.padding["pad_id"] if self.tokenizer.padding else 0
            for name, value in (("input_ids", pad_id), ("attention_mask", 0), ("token_type_ids", 0)):
                tensors[name] = np.pad(tensors[name], ((0, 0), (0, extra)), constant_values=value)
        return {k: v for k, v in tensors.items() if k in self.input_names}


def pool(hidden: np.ndarray, attention_mask: np.ndarray, mode: str = "mean", normalize: bool = True) -> np.ndarray:
    """Sentence embeddings from token states: (B, T, H) and mask (B, T) -> (B, H)."""
    if mode == "mean":
        mask = attention_mask[..., None].astype(hidden.dtype)  # (B, T, 1)
        summed = (hidden * mask).sum(axis=1)
        emb = summed / np.clip(mask.sum(axis=1), 1e-9, None)
    elif mode == "cls":
        emb = hidden[:, 0]
    elif mode == "max":
        masked = np.where(attention_mask[..., None] > 0, hidden, -np.inf)
        emb = masked.max(axis=1)
    else:
        raise ArtifactError(f"unknown pooling mode {mode!r} in the manifest; use mean, cls or max.")
    emb = emb.astype(np.float32)
    if normalize:
        emb = emb / np.clip(np.linalg.norm(emb, axis=1, keepdims=True), 1e-12, None)
    return emb
