"""Text classification: texts in, labels and scores out (``...ForSequenceClassification``)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np

from slimml.runtime.tasks.base import register_task
from slimml.runtime.tasks.classify import Classifier, text_batches


@register_task("text-classification")
class TextClassifier(Classifier):
    """A text classifier: ``classify(texts)`` with the source config's labels.

    Example:
        >>> load("artifacts/sst2").classify(["a fine film"], top_k=1)
        [[{'label': 'POSITIVE', 'score': 0.98}]]
    """

    def batches(self, inputs: Any, batch_size: int) -> Iterator[dict[str, np.ndarray]]:
        return text_batches(self, inputs, batch_size)
