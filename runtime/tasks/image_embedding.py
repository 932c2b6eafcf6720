"""Image embedding: images in, one vector each out (``ViTModel``'s pooled CLS, CLIP's vision tower)."""

from __future__ import annotations

from typing import Any

import numpy as np

from slimml.runtime.tasks.base import Task, register_task
from slimml.runtime.tasks.classify import embed_image_batches, image_output


@register_task("image-embedding")
class ImageEmbedding(Task):
    """An image encoder: :meth:`embed_images`."""

    methods = frozenset({"embed_images", "preprocess"})
    suggest = ("embed_images", "preprocess")

    def embed_images(self, images: Any, batch_size: int = 32, normalize: bool = True) -> np.ndarray:
        """Image embeddings, (len(images), hidden) float32, L2-normalised unless ``normalize=False``.

        The output used is the first of ``image_embeds`` (CLIP's projected embedding),
        ``pooler_output`` (ViTModel's pooled CLS) or the CLS row of ``last_hidden_state``.

        Args:
            images: an image or a list of them: file paths, PIL images or HxWx3 uint8 arrays.
            batch_size: images a model call.
            normalize: divide each embedding by its L2 norm.

        Returns:
            A (len(images), dim) float32 array, in the order given.

        Raises:
            FeedError: no image, one that cannot be read, or a ``batch_size`` below 1.
        """
        output = image_output(t.name for t in self.outputs)
        return embed_image_batches(self.engine.run, output, self.image_batches(images, batch_size), normalize)
