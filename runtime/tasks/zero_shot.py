"""Zero-shot image classification (CLIP): a text tower and a vision tower, two components.

Texts run through the text tower alone, images through the vision tower alone, and
:meth:`ZeroShot.classify` scores images against label texts from the two embeddings. Each tower
is a chain of shards with its own execution plan, so streaming, budgets and integrity checks
apply per tower.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from slimml.errors import FeedError
from slimml.runtime.artifact.manifest import Manifest
from slimml.runtime.tasks.base import Task, image_input, register_task, text_encoder
from slimml.runtime.tasks.classify import check_top_k, embed_image_batches, image_output, top_classes
from slimml.runtime.tasks.inputs.pooling import Pooler
from slimml.runtime.tasks.inputs.text import prompt_text
from slimml.runtime.tasks.text_embedding import embed_texts

if TYPE_CHECKING:
    from slimml.runtime.engine.engine import Engine


@register_task("zero-shot-image-classification")
class ZeroShot(Task):
    """An image-text model: :meth:`embed_texts` (also :meth:`encode`), :meth:`embed_images`, and
    :meth:`classify` of images against ``labels=`` texts. ``parts`` holds the two towers' engines."""

    methods = frozenset({"encode", "encode_with_counts", "embed_texts", "embed_images", "classify"})
    suggest = ("embed_texts", "embed_images", "classify")

    def __init__(self, folder: Path, manifest: Manifest, engines: Mapping[str | None, Engine]):
        super().__init__(folder, manifest, engines)
        spec = manifest.zero_shot
        self.text_part, self.image_part = spec["text"], spec["image"]
        self.scale = float(spec["scale"])  # CLIP's exp(logit_scale)
        self.bias = float(spec.bias or 0.0)  # SigLIP's logit_bias
        self.sigmoid = spec.activation == "sigmoid"  # SigLIP: each label scored alone
        texts, images = manifest.component(self.text_part), manifest.component(self.image_part)
        self.pooling = texts.pooling
        self.pooler = Pooler.of(texts.pooling, self.folder, manifest.files)
        self.text = text_encoder(self.folder, texts, self.limits)
        if self.text is not None and spec.text_length:
            self.text.pad_to = int(spec.text_length)
        self.image_input, self.images = image_input(self.folder, images)

    def embed_texts(self, texts: list[str], batch_size: int = 32, show_progress: bool = False) -> np.ndarray:
        """Text embeddings from the text tower, (len(texts), dim) float32, L2-normalised.

        Args:
            texts: a list of texts.
            batch_size: texts a model call.
            show_progress: draw a progress bar over the batches (on stderr).
        """
        return self.encode_with_counts(texts, batch_size, show_progress)[0]

    def encode(self, texts: list[str], batch_size: int = 32, show_progress: bool = False,
               workers: int | None = None, *, prompt_name: str | None = None, prompt: str | None = None,
               truncate_dim: int | None = None) -> np.ndarray:
        """The text tower's embeddings (the sentence-embedding API, and ``slimml serve``'s /v1/embeddings).

        Takes :meth:`TextEmbedding.encode`'s arguments; returns (len(texts), dim) float32.
        """
        return self.encode_with_counts(texts, batch_size, show_progress, workers, prompt_name=prompt_name, prompt=prompt,
                                       truncate_dim=truncate_dim)[0]

    def encode_with_counts(self, texts: list[str], batch_size: int = 32, show_progress: bool = False,
                           workers: int | None = None, *, prompt_name: str | None = None,
                           prompt: str | None = None, truncate_dim: int | None = None) -> tuple[np.ndarray, list[int]]:
        """:meth:`encode` and each text's token count."""
        return embed_texts(self, self.part(self.text_part), self.text, self.pooler.cut(truncate_dim), texts, batch_size,
                           show_progress, workers, prompt_text(self.pooling, prompt_name, prompt))

    def text_prompt(self, prompt_name: str | None = None, prompt: str | None = None) -> str:
        return prompt_text(self.pooling, prompt_name, prompt)  # the text tower's

    def embed_images(self, images: Any, batch_size: int = 32, normalize: bool = True) -> np.ndarray:
        """Image embeddings from the vision tower, (len(images), dim) float32, L2-normalised.

        Args:
            images: an image or a list of them: file paths, PIL images or HxWx3 uint8 arrays.
            batch_size: images a model call.
            normalize: divide each embedding by its L2 norm (default).
        """
        engine = self.part(self.image_part)
        output = image_output(t.name for t in engine.outputs)
        return embed_image_batches(engine.run, output, self.image_batches(images, batch_size), normalize)

    def classify(self, images: Any, labels: list[str] | None = None, top_k: int | None = None,
                 batch_size: int = 32) -> list[list[dict[str, Any]]]:
        """Zero-shot classification: per image, ``labels`` scored as CLIP scores them.

        Scores are the softmax over the labels of ``scale * cos(image, label text)``, with the
        model's own ``exp(logit_scale)``; for SigLIP, each label's sigmoid of that plus the model's
        ``logit_bias`` (as transformers' zero-shot pipeline scores them: they need not sum to 1).
        Prompt templates are the caller's choice (for example ``"a photo of a cat"`` rather than ``"cat"``).

        Args:
            images: an image or a list of them: file paths, PIL images or HxWx3 uint8 arrays.
            labels: the candidate texts, a non-empty list.
            top_k: labels kept per image, best first (None: all).
            batch_size: texts or images a model call.

        Returns:
            Per image, a list of ``{"label": str, "score": float}``, best first.

        Raises:
            FeedError: no ``labels``, ``top_k`` below 1, or an image that cannot be read.

        Example:
            >>> clip.classify(["cat.jpg"], labels=["a photo of a cat", "a photo of a dog"])
            [[{'label': 'a photo of a cat', 'score': 0.98}, {'label': 'a photo of a dog', 'score': 0.02}]]
        """
        if isinstance(labels, str) or not isinstance(labels, (list, tuple)) or not labels:
            raise FeedError("zero-shot classify() needs labels=[text, ...]: the candidate texts to score each image against.")
        check_top_k(top_k, "label")
        texts = self.embed_texts(list(labels), batch_size=batch_size)
        pictures = self.embed_images(images, batch_size=batch_size)
        logits = self.scale * (pictures.astype(np.float64) @ texts.astype(np.float64).T) + self.bias
        if self.sigmoid:
            scores = 1.0 / (1.0 + np.exp(-logits))
        else:
            logits -= logits.max(axis=1, keepdims=True)
            scores = np.exp(logits) / np.exp(logits).sum(axis=1, keepdims=True)
        return top_classes(scores, list(labels), top_k)
