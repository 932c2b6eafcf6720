"""Text classification: texts (or pairs of texts) in, labels and scores out
(``...ForSequenceClassification``); a cross-encoder, one relevance output, also reranks."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np

from slimml.errors import FeedError
from slimml.runtime.tasks.base import register_task
from slimml.runtime.tasks.classify import Classifier, batch_logits, text_batches
from slimml.runtime.tasks.inputs.text import listed
from slimml.runtime.tasks.limits import shown


@register_task("text-classification")
class TextClassifier(Classifier):
    """A text classifier: ``classify(texts)`` with the source config's labels; a cross-encoder
    (one output) also ``rerank(query, documents)``.

    Example:
        >>> load("artifacts/sst2").classify(["a fine film"], top_k=1)
        [[{'label': 'POSITIVE', 'score': 0.98}]]
        >>> load("artifacts/ms-marco-MiniLM-L6-v2").rerank("what is ONNX?", ["ONNX is a format.", "Cats."], top_n=1)
        [{'index': 0, 'score': 0.97}]
    """

    methods = frozenset({"classify", "rerank", "rerank_with_counts"})
    suggest = ("rerank", "classify")  # rerank where the model has one output (supports() decides)

    @property
    def capabilities(self) -> frozenset[str]:
        reranks = self.text is not None and len(self.manifest.labels or ()) == 1  # a cross-encoder's one relevance output
        return super().capabilities - (set() if reranks else {"rerank", "rerank_with_counts"})

    def batches(self, inputs: Any, batch_size: int) -> Iterator[dict[str, np.ndarray]]:
        return text_batches(self, inputs, batch_size)

    def rerank(self, query: str, documents: list[str] | None = None, top_n: int | None = None,
               batch_size: int = 32) -> list[dict[str, Any]]:
        """``documents`` ranked by their relevance to ``query``, as a cross-encoder scores them
        (sentence-transformers' ``CrossEncoder.rank``): each ``(query, document)`` pair read
        together, its score the model's one output through the activation its sentence-transformers
        config names (the sigmoid where it names none; ``Identity``: the logit itself); per document
        ``{"index", "score"}``, best first, the ``top_n`` best (all when None).

        Args:
            query: the query, a non-empty text.
            documents: the texts to rank (a non-empty list).
            top_n: documents returned at most (None: all).
            batch_size: pairs a model call.

        Returns:
            ``[{"index": int, "score": float}, ...]``, best first; ``index`` points into ``documents``.

        Raises:
            TaskError: the classifier is not a cross-encoder (it has more than one output).
            FeedError: an empty query or document list, a document that is not a text, or
                ``top_n`` below 1.
        """
        return self.rerank_with_counts(query, documents, top_n, batch_size)[0]

    def rerank_with_counts(self, query: str, documents: list[str] | None = None, top_n: int | None = None,
                           batch_size: int = 32) -> tuple[list[dict[str, Any]], list[int]]:
        """:meth:`rerank`, and the tokens of each (query, document) pair as the model read it
        (what a server's ``usage`` counts), from one tokenization.

        Returns:
            ``(ranking, tokens)``: :meth:`rerank`'s list, and one token count a document, in the
            order of ``documents``.
        """
        if not self.supports("rerank"):
            raise self.unsupported("rerank")
        if not isinstance(query, str) or not query:
            raise FeedError(f"rerank() needs the query as a non-empty text, got {type(query).__name__}.")
        documents = listed(documents)
        if isinstance(documents, str) or not isinstance(documents, (list, tuple)) or not documents:
            raise FeedError("rerank() takes the documents as a non-empty list of texts; wrap a single one as [text].")
        bad = next((i for i, d in enumerate(documents) if not isinstance(d, str)), None)
        if bad is not None:
            raise FeedError(f"documents[{bad}] must be a text, got {type(documents[bad]).__name__}; give the documents as texts.")
        if top_n is not None and (isinstance(top_n, bool) or not isinstance(top_n, int) or top_n < 1):
            raise FeedError(f"top_n must be a whole number >= 1 (or None for every document), got {shown(top_n)}.")
        batches = list(text_batches(self, [(query, d) for d in documents], batch_size))
        logits = batch_logits(self.engine.run, batches, self.manifest.labels)[:, 0].astype(np.float64)
        relevance = _ACTIVATIONS.get(self.manifest.source.get("cross_encoder_activation"), _sigmoid)(logits)
        order = np.argsort(-relevance, kind="stable")[: top_n or len(documents)]
        tokens = [int(n) for feeds in batches for n in feeds["attention_mask"].sum(axis=1)]
        return [{"index": int(i), "score": float(relevance[i])} for i in order], tokens


def _sigmoid(x: np.ndarray) -> np.ndarray:
    return 1.0 / (1.0 + np.exp(-x))


# a CrossEncoder's activation (its config's sentence_transformers.activation_fn) -> the function
_ACTIVATIONS = {"Sigmoid": _sigmoid, "Identity": lambda x: x, "Tanh": np.tanh}
