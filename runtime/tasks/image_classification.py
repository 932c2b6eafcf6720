"""Image classification: images in, labels and scores out (``ViTForImageClassification``)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np

from slimml.runtime.tasks.base import register_task
from slimml.runtime.tasks.classify import Classifier


@register_task("image-classification")
class ImageClassifier(Classifier):
    """An image classifier: ``classify(images)`` (paths, PIL images, HxWx3 uint8 arrays) and
    ``preprocess(images)``, through the image preprocessor shipped in the artifact."""

    methods = frozenset({"classify", "preprocess"})
    suggest = ("classify", "preprocess")

    def batches(self, inputs: Any, batch_size: int) -> Iterator[dict[str, np.ndarray]]:
        return self.image_batches(inputs, batch_size)
