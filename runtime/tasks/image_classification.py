"""Image classification: images in, labels and scores out (``ViTForImageClassification``)."""

from __future__ import annotations

from typing import Any

from slimml.runtime.tasks.base import Task, register_task
from slimml.runtime.tasks.classify import check_top_k, classify_batches, image_batches


@register_task("image-classification")
class ImageClassifier(Task):
    """An image classifier: :meth:`classify` images (paths, PIL images, HxWx3 uint8 arrays)."""

    methods = frozenset({"classify", "preprocess"})
    suggest = ("classify", "preprocess")

    def classify(self, inputs: Any, top_k: int | None = 5, batch_size: int = 32) -> list[list[dict[str, Any]]]:
        """Per image, its ``top_k`` classes (all when None) as ``{"label", "score"}``, best first;
        scores are the softmax of the logits, labels the source config's ``id2label``.

        Example:
            >>> load("artifacts/vit-base-patch16-224").classify(["cat.jpg"], top_k=1)
            [[{'label': 'tabby, tabby cat', 'score': 0.93}]]
        """
        check_top_k(top_k, "class")
        return classify_batches(self.engine.run, image_batches(self, inputs, batch_size), self.manifest.labels, top_k)
