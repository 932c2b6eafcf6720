"""Load an artifact into an execution plan and run it with ONNX Runtime."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from slimml.errors import FeedError, SlimmlError
from slimml.runtime.artifact.manifest import Manifest, read_manifest, safe_path, verify_files
from slimml.runtime.engine.budget import StreamPlan, plan_stream
from slimml.runtime.engine.engine import Engine
from slimml.runtime.engine.plan import ExecutionPlan
from slimml.runtime.engine.session import resolve_device
from slimml.runtime.tasks.inputs.image import ImageProcessor
from slimml.runtime.tasks.inputs.text import TextEncoder, check_batch_size, encode_texts, sorted_batches
from slimml.runtime.tasks.lanes import lane_batch_size, lane_count, possible_batches


class Model(Engine):
    """A loaded artifact: its :class:`~slimml.runtime.engine.engine.Engine` (``run``, ``verify``,
    ``plan``) and what the artifact is for. Use :func:`load` to make one.
    """

    def __init__(self, folder: Path, manifest: Manifest, device: str, threads: int | None,
                 memory: StreamPlan | None = None, verify: bool = True, pack: bool | None = None,
                 cache_dir: str | os.PathLike | None = None, plan: ExecutionPlan | None = None):
        super().__init__(folder, manifest, device, threads, memory, verify, pack, cache_dir, plan)
        self._text: TextEncoder | None = None
        if manifest.tokenizer:
            self._text = TextEncoder(
                safe_path(folder, manifest.tokenizer["file"]), manifest.tokenizer, [t.name for t in manifest.inputs]
            )
        # images -> pixel tensors, for artifacts with pixel inputs and a shipped preprocessor config
        self.images: ImageProcessor | None = None
        self.image_input = next((t.name for t in manifest.inputs if t.name == "pixel_values" or len(t.shape) == 4), None)
        if manifest.preprocessor and manifest.preprocessor.get("kind") == "image" and self.image_input is not None:
            self.images = ImageProcessor.from_file(safe_path(folder, manifest.preprocessor["file"]))

    @property
    def engine(self) -> Engine:
        """The engine that runs the shards (this model itself, until tasks hold an engine)."""
        return self

    @property
    def text(self) -> TextEncoder | None:
        """The artifact's tokenizer (``.tokenizer`` is a ``tokenizers.Tokenizer``), or None."""
        return self._text

    def generate(self, prompts, max_new_tokens: int | None = None, config=None, **options):
        """Continue prompts with a decoder artifact: greedy, or sampled (``temperature``, ``top_k``,
        ``top_p``, ``repetition_penalty``, ``seed``), with ``stop`` strings and ``stop_token_ids``;
        see :func:`slimml.runtime.tasks.generate.generate`."""
        from slimml.runtime.tasks.generate import generate

        if max_new_tokens is not None:
            options["max_new_tokens"] = max_new_tokens
        return generate(self, prompts, config, **options)

    def stream(self, prompt, config=None, **options):
        """One prompt's continuation as text pieces, yielded as they are produced; see
        :func:`slimml.runtime.tasks.generate.stream`."""
        from slimml.runtime.tasks.generate import stream

        return stream(self, prompt, config, **options)

    def chat(self, messages, config=None, stream: bool = False, **options):
        """The assistant's reply to ``messages`` through the model's chat template (an iterator of
        text pieces with ``stream=True``); see :func:`slimml.runtime.tasks.generate.chat`."""
        from slimml.runtime.tasks.generate import chat

        return chat(self, messages, config, stream=stream, **options)

    def classify(self, inputs, top_k: int | None = 5, batch_size: int = 32) -> list[list[dict]]:
        """Labels and scores for classifier artifacts: images (paths, PIL images or HxWx3 uint8
        arrays) for an image classifier, texts for a text classifier.

        Returns, per input, its ``top_k`` classes (all when None) as ``{"label", "score"}``, best
        first; scores are the softmax of the logits, labels the source config's ``id2label``.

        Example:
            >>> load("artifacts/vit-base-patch16-224").classify(["cat.jpg"], top_k=1)
            [[{'label': 'tabby, tabby cat', 'score': 0.93}]]
        """
        from slimml.runtime.tasks.classify import classify

        return classify(self, inputs, top_k=top_k, batch_size=batch_size)

    def embed_images(self, images, batch_size: int = 32, normalize: bool = True) -> np.ndarray:
        """Image embeddings, (len(images), hidden) float32, L2-normalised unless ``normalize=False``."""
        from slimml.runtime.tasks.classify import embed_images

        return embed_images(self, images, batch_size=batch_size, normalize=normalize)

    def preprocess(self, images) -> dict[str, np.ndarray]:
        """Feeds for ``images`` (the pixel input), made as the source's Hugging Face image processor makes them."""
        from slimml.runtime.tasks.classify import _image_batches

        return next(_image_batches(self, images if isinstance(images, (list, tuple)) else [images], 1 << 30))

    def tokenize(self, texts: list[str], pad_to: int | None = None) -> dict[str, np.ndarray]:
        """Feeds for ``texts`` from the artifact's tokenizer, padded to the longest (or ``pad_to``)."""
        self._check_unicode(texts)
        return self._text_encoder()(list(texts) if not isinstance(texts, str) else texts, pad_to=pad_to)

    def count_tokens(self, texts: list[str]) -> list[int]:
        """Tokens per text as the model sees them (after truncation to its maximum length)."""
        self._check_unicode(texts)
        return [len(e.ids) for e in self._text_encoder().encodings(list(texts))]

    def _text_encoder(self) -> TextEncoder:
        if self._text is None:
            raise SlimmlError(
                f"the artifact {self.folder} has no tokenizer, so it cannot take text; call "
                "run() with arrays instead."
            )
        return self._text

    @staticmethod
    def _check_unicode(texts) -> None:
        for i, t in enumerate(texts if isinstance(texts, (list, tuple)) else []):
            try:
                isinstance(t, str) and t.encode("utf-8")
            except UnicodeEncodeError as e:  # a lone surrogate, e.g. from a bad decode upstream
                raise FeedError(
                    f"text {i} is not valid Unicode ({e.reason} at position {e.start}); decode your input with "
                    "errors='replace' or clean it first."
                ) from None

    def encode(self, texts: list[str], batch_size: int = 32, show_progress: bool = False,
               workers: int | None = None) -> np.ndarray:
        """Sentence embeddings, (len(texts), hidden) float32, pooled and normalised as the source model does.

        Texts are tokenized once, sorted by token count and run ``batch_size`` at a time, each
        batch padded only to its own longest text (as sentence-transformers does); the result
        is in input order. Several batches run side by side, one per core, each on one thread
        (:mod:`slimml.runtime.tasks.lanes`), where the model is resident on CPU and small beside the
        memory available; the lanes share one more session of the model, made on first use.
        A short list is then cut into smaller batches (two a lane, 8 texts or more), so that
        every core has work.

        Args:
            texts: the sentences.
            batch_size: the most texts in one model call (default 32).
            show_progress: draw a progress bar over the batches (on stderr).
            workers: batches run at once (default: one per core of ``load(threads=)``, else of
                the machine, where lanes apply; 1 runs each batch on all the model's threads).

        Example:
            >>> model = load("artifacts/all-MiniLM-L6-v2")
            >>> model.encode(["A man is eating.", "Someone eats."]).shape
            (2, 384)
        """
        return self.encode_with_counts(texts, batch_size, show_progress, workers)[0]

    def encode_with_counts(self, texts: list[str], batch_size: int = 32, show_progress: bool = False,
                           workers: int | None = None) -> tuple[np.ndarray, list[int]]:
        """:meth:`encode`, and the tokens of each text as the model saw them (what OpenAI's
        ``usage`` counts), from one tokenization."""
        pooling = self.manifest.pooling
        if isinstance(texts, str) or not isinstance(texts, (list, tuple)):
            raise FeedError(f"encode() takes a list of strings, got {type(texts).__name__}; wrap a single text as [text].")
        if pooling is None:
            raise SlimmlError(
                f"the artifact {self.folder} is a {self.manifest.task!r} model, not a sentence-embedding "
                "model; use run() for its raw outputs."
            )
        self._check_unicode(texts)
        check_batch_size(batch_size)
        text = self._text_encoder()
        encs = text.encodings(list(texts))
        lengths = [len(e.ids) for e in encs]
        unfit = ("runs on " + self.device if self.device != "cpu" else "streams" if self.plan.streaming
                 else "runs in pipeline stages" if not self.owns_files else None)
        lanes, lane_threads = lane_count(workers, possible_batches(len(texts), batch_size), unfit=unfit,
                                         threads=self.threads, model_bytes=self.plan.model_bytes,
                                         memory_budget=self.plan.memory.budget)
        batches = sorted_batches(lengths, lane_batch_size(len(texts), batch_size, lanes))
        run = self.run if lanes == 1 else self.lane(lane_threads)
        return encode_texts(run, text, pooling, encs, batches, show_progress, lanes), lengths


def load(
    path: str | os.PathLike,
    device: str = "cpu",
    threads: int | None = None,
    verify: bool = True,
    resident: int | None = None,
    prefetch: int | None = None,
    memory_budget: int | str | None = None,
    pin: list[int] | None = None,
    pack: bool | None = None,
    cache_dir: str | os.PathLike | None = None,
    shards: tuple[int, int] | None = None,
) -> Model:
    """Load an artifact folder written by ``slimml convert``.

    Args:
        path: the artifact folder (it holds ``manifest.json``).
        device: ``"cpu"``, ``"cuda"``, or ``"auto"`` (CUDA where onnxruntime-gpu finds a working
            GPU, else CPU; ``model.device`` says which).
        threads: ONNX Runtime intra-op threads (default: ORT's choice, or ``SLIMML_THREADS``).
        verify: check every file's size and sha256 against the manifest first (default). A file
            that does not match is refused, never run; a streamed shard whose file changes after
            that is hashed again when it streams in.
        resident: K, the most shards loaded at once (pinned ones included). Fewer than the
            shard count streams the model: a background thread loads shards ahead and the run
            releases each one after use. Default: all shards (fully resident).
        prefetch: P, shards loaded ahead of the one computing (default: K - pinned - 1).
        memory_budget: bytes of loaded shards allowed, e.g. ``"4GB"``; alone it picks K and P
            (``model.plan.describe()`` says what it chose). Refused, before anything loads, when
            smaller than the largest shard.
        pin: shard indices kept loaded for the model's lifetime, e.g. ``[0, -1]`` for the
            embeddings and the head; only the others stream.
        pack: how streamed shards get their weights on CPU. None (default): ONNX Runtime's
            pre-packed weights, written once to ``cache_dir`` and paged in per pass (Linux), else
            weights fed as inputs. False: always fed (no cache; slower decoding).
        cache_dir: where pre-packed weights are kept (default ``SLIMML_CACHE_DIR`` or
            ``~/.cache/slimml``); about twice the streamed shards' size on disk.
        shards: ``(first, last)``, load only those shards (inclusive), as one stage of a pipeline
            (:mod:`slimml.scale`): the model's inputs are then what they read from outside (model
            inputs and earlier activations) and its outputs what they hand on. Only their files
            are hashed; ``resident``, ``memory_budget`` and ``pin`` apply within the stage.

    Returns:
        A :class:`Model` with ``run(feeds)`` and, for sentence-embedding artifacts, ``encode(texts)``;
        for an artifact of several components (CLIP), a
        :class:`~slimml.runtime.tasks.components.Components` holding one ``Model`` per component.

    Raises:
        ArtifactError / IntegrityError: a missing, malformed or tampered artifact.
        DeviceError: the device is not available.

    Example:
        >>> from slimml.runtime import load
        >>> model = load("artifacts/all-MiniLM-L6-v2", device="cpu")
        >>> emb = model.encode(["Hello world"])
    """
    folder = Path(path)
    manifest = read_manifest(folder)
    if shards is not None:
        if manifest.components:
            raise SlimmlError(
                f"shards=(first, last) picks a stage of one chain of shards, but {folder} has components "
                f"{', '.join(manifest.components)}; load it whole, or serve it with replicas instead of stages."
            )
        manifest = manifest.stage(*shards)
    device = resolve_device(device)  # fail on a missing provider before hashing gigabytes
    parts = manifest.components or {None: manifest}
    # a bad budget fails before loading; streaming settings apply to each component's chain
    plans = {name: plan_stream(m, resident, prefetch, memory_budget, pin) for name, m in parts.items()}
    if verify:
        verify_files(folder, manifest)
    models = {name: Model(folder, m, device, threads, plans[name], verify, pack, cache_dir) for name, m in parts.items()}
    if not manifest.components:
        return models[None]
    from slimml.runtime.tasks.components import Components

    return Components(folder, manifest, models)
