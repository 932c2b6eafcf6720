"""Classifier and image-embedding heads over a loaded artifact: labels and scores, pooled vectors.

An image classifier (``ViTForImageClassification``) takes images through the artifact's image
preprocessor; a text classifier (``...ForSequenceClassification``) takes texts through its
tokenizer. Either way the scores are the softmax of the ``logits`` output and the labels come
from the source config's ``id2label``, kept in the manifest.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from slimml.errors import FeedError, SlimmlError

if TYPE_CHECKING:
    from slimml.runtime.loader import Model


def classify(model: Model, inputs: Any, top_k: int | None = 5, batch_size: int = 32) -> list[list[dict[str, Any]]]:
    """Per input, its ``top_k`` classes as ``{"label", "score"}``, best first (all when None)."""
    labels = model.manifest.labels
    names = {t.name for t in model.outputs}
    if labels is None or "logits" not in names:
        raise SlimmlError(
            f"the artifact {model.folder} is a {model.manifest.task!r} model, not a classifier (its manifest has no "
            "labels); use run() for its raw outputs, or convert a ...ForImageClassification / "
            "...ForSequenceClassification model."
        )
    if top_k is not None and (not isinstance(top_k, int) or isinstance(top_k, bool) or top_k < 1):
        raise FeedError(f"top_k must be a whole number >= 1 (or None for every class), got {top_k!r}.")
    logits = np.concatenate([model.run(feeds)["logits"] for feeds in _batches(model, inputs, batch_size)])
    if logits.ndim != 2 or logits.shape[1] != len(labels):
        raise SlimmlError(
            f"the artifact's logits have shape {logits.shape} but its manifest lists {len(labels)} labels; "
            "it is damaged: convert the model again."
        )
    scores = _softmax(logits.astype(np.float64))
    k = len(labels) if top_k is None else min(top_k, len(labels))
    out = []
    for row in scores:
        best = np.argsort(-row, kind="stable")[:k]
        out.append([{"label": labels[i], "score": float(row[i])} for i in best])
    return out


def embed_images(model: Model, images: Any, batch_size: int = 32, normalize: bool = True) -> np.ndarray:
    """(len(images), hidden) float32 image embeddings.

    The output used is the first of ``image_embeds`` (CLIP's projected embedding),
    ``pooler_output`` (ViTModel's pooled CLS) or the CLS row of ``last_hidden_state``.
    """
    names = [t.name for t in model.outputs]
    output = next((n for n in ("image_embeds", "pooler_output", "last_hidden_state") if n in names), None)
    if output is None or model.images is None:
        raise SlimmlError(
            f"the artifact {model.folder} does not embed images (it needs pixel inputs, an image preprocessor and "
            "an image_embeds, pooler_output or last_hidden_state output); use run() for its raw outputs."
        )
    parts = []
    for feeds in _image_batches(model, images, batch_size):
        out = model.run(feeds)[output]
        parts.append(out[:, 0] if out.ndim == 3 else out)
    emb = np.concatenate(parts).astype(np.float32)
    if normalize:
        emb /= np.clip(np.linalg.norm(emb, axis=1, keepdims=True), 1e-12, None)
    return emb


def _batches(model: Model, inputs: Any, batch_size: int):
    if model.image_input is not None:  # pixels in: images (or the error that says how to ship a preprocessor)
        return _image_batches(model, inputs, batch_size)
    if model.manifest.tokenizer is None:
        raise SlimmlError(f"the artifact {model.folder} has neither an image preprocessor nor a tokenizer; use run().")
    if isinstance(inputs, str) or not isinstance(inputs, (list, tuple)) or not inputs:
        raise FeedError("this classifier takes a non-empty list of texts; wrap a single text as [text].")
    return (model.tokenize(list(inputs[i:i + batch_size])) for i in range(0, len(inputs), _size(batch_size)))


def _image_batches(model: Model, images: Any, batch_size: int):
    if model.images is None:
        raise SlimmlError(
            f"the artifact {model.folder} has no image preprocessor (preprocessor_config.json), so it cannot take "
            "images: convert from a folder that has one (save the model's image processor there), or call run() "
            "with pixel_values."
        )
    if not isinstance(images, (list, tuple)):
        images = [images]
    if not images:
        raise FeedError("give at least one image.")
    name = model.image_input
    for i in range(0, len(images), _size(batch_size)):
        yield {name: model.images(list(images[i:i + batch_size]))}


def _size(batch_size: int) -> int:
    if not isinstance(batch_size, int) or isinstance(batch_size, bool) or batch_size < 1:
        raise FeedError(f"batch_size must be a whole number >= 1, got {batch_size!r}.")
    return batch_size


def _softmax(x: np.ndarray) -> np.ndarray:
    x = x - x.max(axis=1, keepdims=True)
    e = np.exp(x)
    return e / e.sum(axis=1, keepdims=True)
