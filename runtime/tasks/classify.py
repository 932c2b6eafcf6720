"""What classifiers and image embedders share: the classifier base, labels and scores, pooled vectors.

An image classifier (``ViTForImageClassification``) takes images through the artifact's image
preprocessor; a text classifier (``...ForSequenceClassification``) takes texts through its
tokenizer. Either way the scores come from the ``logits`` output as transformers' classification
pipelines make them (:func:`scores`: the softmax over the labels, or each label's sigmoid for a
model with one label, a cross-encoder, or a multi-label one) and the labels from the source
config's ``id2label``, kept in the manifest. The task classes
(:mod:`.image_classification`, :mod:`.text_classification`, :mod:`.image_embedding`,
:mod:`.zero_shot`) call these.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import Any

import numpy as np

from slimml.errors import FeedError, SlimmlError
from slimml.runtime.tasks.base import Task, check_batch
from slimml.runtime.tasks.inputs.text import listed
from slimml.runtime.tasks.limits import shown

Run = Callable[[dict[str, np.ndarray]], dict[str, np.ndarray]]
IMAGE_OUTPUTS = ("image_embeds", "pooler_output", "last_hidden_state")  # first found is the embedding


class Classifier(Task):
    """A classifier over one chain: :meth:`classify` inputs with the source config's labels. A
    subclass says how inputs become batches of feeds (:meth:`batches`)."""

    methods = frozenset({"classify"})
    suggest = ("classify",)

    def classify(self, inputs: Any, top_k: int | None = 5, batch_size: int = 32, labels: Any = None) -> list[list[dict[str, Any]]]:
        """Per input, its ``top_k`` classes (all when None) as ``{"label", "score"}``, best first;
        scores as transformers' pipelines make them (:func:`scores`), labels the source config's
        ``id2label``.

        Args:
            inputs: a text classifier's texts, or ``[text, text]`` pairs (read together); an image
                classifier's images (paths, PIL images or HxWx3 uint8 arrays). A list, even of one.
            top_k: classes kept per input, best first (default 5; None: every class).
            batch_size: inputs a model call.
            labels: for CLIP only (:meth:`ZeroShot.classify`); a classifier refuses it.

        Returns:
            Per input, a list of ``{"label": str, "score": float}``, best first.

        Raises:
            FeedError: an empty list or an item that is not an input, ``top_k`` or ``batch_size``
                below 1, or ``labels`` given.

        Example:
            >>> load("artifacts/vit-base-patch16-224").classify(["cat.jpg"], top_k=1)
            [[{'label': 'tabby, tabby cat', 'score': 0.93}]]
        """
        if labels is not None:  # a raw TypeError before
            raise FeedError("labels= names the classes of an image-text (CLIP) artifact; this classifier has its own "
                            f"({len(self.manifest.labels or [])}, from its config): drop labels=.")
        check_top_k(top_k, "class")
        return classify_batches(self.engine.run, self.batches(inputs, batch_size), self.manifest.labels, top_k,
                                self.manifest.source.get("problem_type"))

    def batches(self, inputs: Any, batch_size: int) -> Iterator[dict[str, np.ndarray]]:
        """Feeds per ``batch_size`` inputs (texts through the tokenizer, images through the preprocessor)."""
        raise NotImplementedError


def classify_batches(run: Run, batches: Iterable[dict[str, np.ndarray]], labels: list[str],
                     top_k: int | None, problem_type: str | None = None) -> list[list[dict[str, Any]]]:
    """Per input, its ``top_k`` classes as ``{"label", "score"}``, best first (all when None)."""
    return top_classes(scores(batch_logits(run, batches, labels), problem_type), labels, top_k)


def batch_logits(run: Run, batches: Iterable[dict[str, np.ndarray]], labels: list[str]) -> np.ndarray:
    """The ``logits`` of every batch, (inputs, labels), checked against the manifest's labels."""
    logits = np.concatenate([run(feeds)["logits"] for feeds in batches])
    if logits.ndim != 2 or logits.shape[1] != len(labels):
        raise SlimmlError(
            f"the artifact's logits have shape {logits.shape} but its manifest lists {len(labels)} labels; "
            "it is damaged: convert the model again."
        )
    return logits


def scores(logits: np.ndarray, problem_type: str | None = None) -> np.ndarray:
    """Scores from (inputs, labels) logits, as transformers' classification pipelines make them by
    default: the logits themselves for a regression (``problem_type`` ``regression``), each label's
    sigmoid for a model with one label or a multi-label one (``multi_label_classification``), else
    the softmax over the labels (a softmax over one label would be 1 for every input)."""
    x = logits.astype(np.float64)
    if problem_type == "regression":  # the value itself
        return x
    if x.shape[1] == 1 or problem_type == "multi_label_classification":
        return 1.0 / (1.0 + np.exp(-x))
    return softmax(x)


def top_classes(scores: np.ndarray, labels: list[str], top_k: int | None) -> list[list[dict[str, Any]]]:
    """Per row of ``scores`` (inputs x labels), the ``top_k`` labels and scores, best first."""
    k = len(labels) if top_k is None else min(top_k, len(labels))
    return [[{"label": labels[i], "score": float(row[i])} for i in np.argsort(-row, kind="stable")[:k]] for row in scores]


def embed_image_batches(run: Run, output: str, batches: Iterable[dict[str, np.ndarray]],
                        normalize: bool = True) -> np.ndarray:
    """(images, hidden) float32 embeddings from ``output`` (its CLS row for a 3-D hidden state)."""
    parts = []
    for feeds in batches:
        out = run(feeds)[output]
        parts.append(out[:, 0] if out.ndim == 3 else out)
    emb = np.concatenate(parts).astype(np.float32)
    if normalize:
        emb /= np.clip(np.linalg.norm(emb, axis=1, keepdims=True), 1e-12, None)
    return emb


def image_output(names: Iterable[str]) -> str | None:
    """The output an image embedding is read from: the first of :data:`IMAGE_OUTPUTS` present."""
    names = set(names)
    return next((n for n in IMAGE_OUTPUTS if n in names), None)


def text_batches(task: Task, texts: Any, batch_size: int) -> Iterator[dict[str, np.ndarray]]:
    """Tokenized feeds per ``batch_size`` inputs: texts, or pairs of texts (``[query, passage]``,
    tokenized together as a pair, as a cross-encoder reads them)."""
    texts = listed(texts)
    if isinstance(texts, str) or not isinstance(texts, (list, tuple)) or not texts:
        raise FeedError("this classifier takes a non-empty list of texts (or of [text, text] pairs); wrap a single "
                        "text as [text].")
    for i, t in enumerate(texts):
        if not isinstance(t, str) and not (isinstance(t, (list, tuple)) and len(t) == 2 and all(isinstance(x, str) for x in t)):
            raise FeedError(f"input {i} is neither a text nor a pair of texts ([text, text]), got {type(t).__name__}; "
                            "give texts, or pairs for a cross-encoder.")
    size = check_batch(batch_size)
    return (task.tokenize([t if isinstance(t, str) else tuple(t) for t in texts[i:i + size]])
            for i in range(0, len(texts), size))


def check_top_k(top_k: Any, what: str) -> None:
    if top_k is not None and (not isinstance(top_k, int) or isinstance(top_k, bool) or top_k < 1):
        raise FeedError(f"top_k must be a whole number >= 1 (or None for every {what}), got {shown(top_k)}.")


def softmax(x: np.ndarray) -> np.ndarray:
    x = x - x.max(axis=1, keepdims=True)
    e = np.exp(x)
    return e / e.sum(axis=1, keepdims=True)

