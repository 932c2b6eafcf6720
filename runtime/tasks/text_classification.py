"""Text classification: texts in, labels and scores out (``...ForSequenceClassification``)."""

from __future__ import annotations

from typing import Any

from slimml.runtime.tasks.base import Task, register_task
from slimml.runtime.tasks.classify import check_top_k, classify_batches, text_batches


@register_task("text-classification")
class TextClassifier(Task):
    """A text classifier: :meth:`classify` texts with the source config's labels."""

    methods = frozenset({"classify"})
    suggest = ("classify",)

    def classify(self, inputs: list[str], top_k: int | None = 5, batch_size: int = 32) -> list[list[dict[str, Any]]]:
        """Per text, its ``top_k`` classes (all when None) as ``{"label", "score"}``, best first;
        scores are the softmax of the logits, labels the source config's ``id2label``.

        Example:
            >>> load("artifacts/sst2").classify(["a fine film"], top_k=1)
            [[{'label': 'POSITIVE', 'score': 0.98}]]
        """
        check_top_k(top_k, "class")
        return classify_batches(self.engine.run, text_batches(self, inputs, batch_size), self.manifest.labels, top_k)
