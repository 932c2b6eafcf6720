"""An artifact of several components (manifest format 2): one loaded :class:`Model` per component.

CLIP's text and vision towers are two components: texts run through the text tower alone,
images through the vision tower alone, and zero-shot classification scores images against
label texts from the two embeddings. Each component is a chain of shards with its own
execution plan, so streaming, budgets and integrity checks apply per component.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from slimml.errors import FeedError, SlimmlError
from slimml.runtime.artifact.manifest import Manifest
from slimml.runtime.loader import Model


class Components:
    """A loaded multi-component artifact, with the :class:`Model` API where it has a meaning.

    Attributes:
        parts: component name -> its :class:`Model` (``model.parts["text"]``).
    """

    def __init__(self, folder: Path, manifest: Manifest, parts: dict[str, Model]):
        self.folder = folder
        self.manifest = manifest
        self.parts = parts
        self.device = next(iter(parts.values())).device
        self._log_mel = None  # a speech model's feature extractor, read on first use (runtime.audio)

    @property
    def inputs(self):
        return self.manifest.inputs

    @property
    def outputs(self):
        return self.manifest.outputs

    @property
    def max_sequence_length(self) -> int | None:
        return next((p.max_sequence_length for p in self.parts.values() if p.max_sequence_length), None)

    @property
    def plan(self) -> Plans:
        """The components' execution plans, described together."""
        return Plans({name: p.plan for name, p in self.parts.items()})

    @property
    def stats(self) -> dict[str, Any]:
        """Streaming counters per component."""
        return {name: p.stats for name, p in self.parts.items()}

    def run(self, feeds: Mapping[str, np.ndarray], component: str | None = None) -> dict[str, np.ndarray]:
        """Run ``component`` on ``feeds``; without one, every component whose inputs the feeds hold.

        Raises:
            FeedError: feeds that no component takes, or that complete no component's inputs.
        """
        if component is not None:
            return self._part(component).run(feeds)
        if not isinstance(feeds, Mapping):
            raise FeedError(f"run() takes a dict of input name -> array, got {type(feeds).__name__}.")
        chosen = [n for n, p in self.parts.items() if {t.name for t in p.inputs} <= set(feeds)]
        taken = {t.name for n in chosen for t in self.parts[n].inputs}
        unused = sorted(set(feeds) - taken)
        if not chosen or unused:
            wants = "; ".join(f"{n}: {', '.join(t.name for t in p.inputs)}" for n, p in self.parts.items())
            raise FeedError(
                f"the feeds {sorted(feeds)} are not the inputs of this artifact's components ({wants}); "
                "give every input of the components to run, or run(feeds, component=NAME)."
            )
        out: dict[str, np.ndarray] = {}
        for name in chosen:
            out |= self.parts[name].run({k: feeds[k] for k in (t.name for t in self.parts[name].inputs)})
        return out

    def embed_texts(self, texts: list[str], batch_size: int = 32, show_progress: bool = False) -> np.ndarray:
        """Text embeddings from the text tower, (len(texts), dim) float32, L2-normalised."""
        return self._part(self._zero_shot("text")).encode(texts, batch_size=batch_size, show_progress=show_progress)

    encode = embed_texts  # the sentence-embedding API (and `slimml serve`'s /v1/embeddings) for the text tower

    def embed_images(self, images, batch_size: int = 32, normalize: bool = True) -> np.ndarray:
        """Image embeddings from the vision tower, (len(images), dim) float32, L2-normalised."""
        return self._part(self._zero_shot("image")).embed_images(images, batch_size=batch_size, normalize=normalize)

    def classify(self, images, labels: list[str] | None = None, top_k: int | None = None,
                 batch_size: int = 32) -> list[list[dict[str, Any]]]:
        """Zero-shot classification: per image, ``labels`` scored as CLIP scores them.

        Scores are the softmax over the labels of ``scale * cos(image, label text)``, with the
        model's own ``exp(logit_scale)``. Prompt templates are the caller's choice (for example
        ``"a photo of a cat"`` rather than ``"cat"``).

        Example:
            >>> clip.classify(["cat.jpg"], labels=["a photo of a cat", "a photo of a dog"])
            [[{'label': 'a photo of a cat', 'score': 0.98}, {'label': 'a photo of a dog', 'score': 0.02}]]
        """
        if isinstance(labels, str) or not isinstance(labels, (list, tuple)) or not labels:
            raise FeedError("zero-shot classify() needs labels=[text, ...]: the candidate texts to score each image against.")
        if top_k is not None and (not isinstance(top_k, int) or isinstance(top_k, bool) or top_k < 1):
            raise FeedError(f"top_k must be a whole number >= 1 (or None for every label), got {top_k!r}.")
        texts = self.embed_texts(list(labels), batch_size=batch_size)
        pictures = self.embed_images(images, batch_size=batch_size)
        logits = float(self.manifest.zero_shot["scale"]) * (pictures.astype(np.float64) @ texts.astype(np.float64).T)
        logits -= logits.max(axis=1, keepdims=True)
        scores = np.exp(logits) / np.exp(logits).sum(axis=1, keepdims=True)
        k = len(labels) if top_k is None else min(top_k, len(labels))
        return [[{"label": labels[i], "score": float(row[i])} for i in np.argsort(-row, kind="stable")[:k]] for row in scores]

    def tokenize(self, texts: list[str], pad_to: int | None = None) -> dict[str, np.ndarray]:
        return self._part(self._zero_shot("text")).tokenize(texts, pad_to=pad_to)

    def encode_with_counts(self, texts: list[str], batch_size: int = 32) -> tuple[np.ndarray, list[int]]:
        return self._part(self._zero_shot("text")).encode_with_counts(texts, batch_size)

    def count_tokens(self, texts: list[str]) -> list[int]:
        return self._part(self._zero_shot("text")).count_tokens(texts)

    def preprocess(self, images) -> dict[str, np.ndarray]:
        return self._part(self._zero_shot("image")).preprocess(images)

    def generate(self, prompts, max_new_tokens: int = 32):
        """Greedy generation for encoder-decoder artifacts (T5, BART; Whisper from audio): see
        :mod:`slimml.runtime.tasks.seq2seq`. Returns a :class:`~slimml.runtime.tasks.generate.Generation`."""
        if not self.manifest.seq2seq:
            raise SlimmlError(f"the artifact {self.folder} has components {', '.join(self.parts)}, not an encoder "
                              "and a decoder; it cannot generate.")
        from slimml.runtime.tasks.seq2seq import generate_seq2seq

        return generate_seq2seq(self, prompts, max_new_tokens=max_new_tokens)

    def verify(self) -> None:
        """Re-hash every file of every component (see :meth:`Model.verify`)."""
        for p in self.parts.values():
            p.verify()

    def check_files(self) -> None:
        for p in self.parts.values():
            p.check_files()

    def close(self) -> None:
        for p in self.parts.values():
            p.close()

    def _part(self, name: str) -> Model:
        if name not in self.parts:
            raise SlimmlError(f"the artifact {self.folder} has no component {name!r}; it has {', '.join(self.parts)}.")
        return self.parts[name]

    def _zero_shot(self, key: str) -> str:
        zs = self.manifest.zero_shot
        if not zs:
            raise SlimmlError(
                f"the artifact {self.folder} has components {', '.join(self.parts)} but no text/image towers; "
                "use run(feeds, component=NAME)."
            )
        return zs[key]


class Plans:
    """Each component's execution plan: ``plans[name]``; ``streaming`` if any of them streams."""

    def __init__(self, plans: dict):
        self.plans = plans

    def __getitem__(self, name: str):
        return self.plans[name]

    @property
    def streaming(self) -> bool:
        return any(p.streaming for p in self.plans.values())

    def describe(self) -> str:
        return "\n".join(f"component {name}: {p.describe()}" for name, p in self.plans.items())
