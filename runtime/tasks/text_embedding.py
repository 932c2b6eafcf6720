"""Text embedding: sentences in, one pooled vector each out, as sentence-transformers makes them."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from slimml.errors import ConfigError, FeedError
from slimml.runtime.tasks.base import Task, check_unicode, register_task
from slimml.runtime.tasks.inputs.pooling import Pooler
from slimml.runtime.tasks.inputs.text import TextEncoder, check_batch_size, encode_texts, listed, prompt_text, sorted_batches
from slimml.runtime.tasks.lanes import lane_batch_size, lane_count, possible_batches

if TYPE_CHECKING:
    from slimml.runtime.artifact.manifest import Manifest
    from slimml.runtime.engine.engine import Engine


# sentence-transformers' encode() arguments, and how to get the same here
ST_ARGUMENTS = {
    "show_progress_bar": "it is show_progress here",
    "normalize_embeddings": "encode normalises where the model does (its Normalize module); to normalise others, "
                            "divide each row by np.linalg.norm(row)",
    "convert_to_numpy": "encode always returns a float32 numpy array",
    "convert_to_tensor": "encode returns a float32 numpy array; torch.from_numpy(array) makes a tensor of it",
    "precision": "encode returns float32; quantize the artifact (slimml quantize) to make the model smaller",
    "device": "the device is chosen when loading: load(folder, device='cuda')",
    "output_value": "encode gives the pooled sentence embeddings; run() gives the raw token outputs",
    "chunk_size": "batch_size sets the texts per model call",
}


@register_task("sentence-embedding")
class TextEmbedding(Task):
    """A sentence-embedding artifact (``all-MiniLM-L6-v2``): :meth:`encode` texts to vectors."""

    methods = frozenset({"encode", "encode_with_counts"})
    suggest = ("encode",)

    def __init__(self, folder: Path, manifest: Manifest, engines: Mapping[str | None, Engine]):
        super().__init__(folder, manifest, engines)
        hidden = next((t.shape[-1] for t in manifest.outputs if manifest.pooling and t.name == manifest.pooling.output), None)
        self.pooler = Pooler.of(manifest.pooling, self.folder, manifest.files,  # its projections read (and checked) once
                                hidden if isinstance(hidden, int) else None)

    @property
    def max_seq_length(self) -> int | None:
        """The tokens :meth:`encode` keeps of a text (its tokenizer's truncation length, prompt and
        special tokens included), as sentence-transformers' ``max_seq_length``: 256 for
        all-MiniLM-L6-v2, whose position table (``max_sequence_length``, what :meth:`run` takes)
        has 512 rows. None without a tokenizer."""
        return self.text.max_length if self.text is not None else None

    def encode(self, texts: list[str], batch_size: int = 32, show_progress: bool = False,
               workers: int | None = None, *, prompt_name: str | None = None, prompt: str | None = None,
               truncate_dim: int | None = None, **others) -> np.ndarray:
        """Sentence embeddings, (len(texts), hidden) float32, pooled and normalised as the source model does.

        Texts are tokenized once, sorted by token count and run ``batch_size`` at a time, each
        batch padded only to its own longest text (as sentence-transformers does); the result
        is in input order. Several batches run side by side, one per core, each on one thread
        (:mod:`slimml.runtime.tasks.lanes`), where the model is resident on CPU and small beside the
        memory available; the lanes share one more session of the model, made on first use.
        A short list is then cut into smaller batches (two a lane, 8 texts or more), so that
        every core has work.

        Args:
            texts: the sentences; one text (a ``str``) gives one ``(dim,)`` vector, and an empty list
                a ``(0, dim)`` array, as sentence-transformers gives them. Each is cut to
                :attr:`max_seq_length` tokens.
            batch_size: the most texts in one model call (default 32).
            show_progress: draw a progress bar over the batches (on stderr).
            workers: batches run at once (default: one per core of ``load(threads=)``, else of
                the machine, where lanes apply; 1 runs each batch on all the model's threads).
            prompt_name: one of the model's prompts (``manifest.pooling.prompts``, from its
                sentence-transformers config: ``"query"`` for a retrieval model), put before
                each text, as sentence-transformers' ``encode(prompt_name=)`` does.
            prompt: a prompt's text itself (``""``: none, not even the model's default).
                Neither given: the model's default prompt, where its config names one.
            truncate_dim: keep each embedding's first values (a Matryoshka-trained model's
                shorter embeddings), as sentence-transformers' ``encode(truncate_dim=)``: after the
                normalisation, not normalised again. None: the model's own (its saved
                ``truncate_dim``, else every value).

        Returns:
            A (len(texts), dim) float32 array, row i the embedding of ``texts[i]`` (``(dim,)`` for one
            text); ``dim`` is the model's embedding size, or ``truncate_dim``.

        Raises:
            FeedError: not a text or a list of texts, a text that is not valid Unicode, a
                ``batch_size`` below 1, a ``prompt_name`` the model does not have, or a
                ``truncate_dim`` past its embedding size.
            ConfigError: ``workers`` below 1, or above 1 for a model that streams or runs on CUDA;
                an argument it does not take (sentence-transformers' ``show_progress_bar``,
                ``normalize_embeddings``, ...: the message says what to do instead).

        Example:
            >>> model = load("artifacts/all-MiniLM-L6-v2")
            >>> model.encode(["A man is eating.", "Someone eats."]).shape
            (2, 384)
            >>> load("artifacts/Qwen3-Embedding-0.6B").encode(["What is slimml?"], prompt_name="query")
        """
        if others:
            raise ConfigError(f"encode() has no {next(iter(others))!r}; " + ST_ARGUMENTS.get(next(iter(others)), (
                "its options are batch_size, show_progress, workers, prompt_name, prompt and truncate_dim")) + ".")
        if isinstance(texts, str):  # one text: one vector, as sentence-transformers' encode(text)
            return self.encode([texts], batch_size, show_progress, workers, prompt_name=prompt_name, prompt=prompt,
                               truncate_dim=truncate_dim)[0]
        texts = listed(texts)  # an array of texts, a generator
        if isinstance(texts, (list, tuple)) and not texts:  # nothing to embed: an empty (0, dim) array, its width and
            return self.encode([""], batch_size, False, workers, prompt_name=prompt_name,  # every setting as for a text
                               prompt=prompt, truncate_dim=truncate_dim)[:0]
        return self.encode_with_counts(texts, batch_size, show_progress, workers, prompt_name=prompt_name, prompt=prompt,
                                       truncate_dim=truncate_dim)[0]

    def encode_with_counts(self, texts: list[str], batch_size: int = 32, show_progress: bool = False,
                           workers: int | None = None, *, prompt_name: str | None = None,
                           prompt: str | None = None, truncate_dim: int | None = None) -> tuple[np.ndarray, list[int]]:
        """:meth:`encode`, and the tokens of each text as the model saw them (what OpenAI's
        ``usage`` counts), from one tokenization.

        Args:
            texts, batch_size, show_progress, workers, prompt_name, prompt, truncate_dim: as :meth:`encode`.

        Returns:
            ``(embeddings, tokens)``: :meth:`encode`'s array, and one token count a text (its
            prompt and special tokens included, after truncation).

        Example:
            >>> emb, tokens = model.encode_with_counts(["A man is playing a guitar.", "Someone plays music."])
            >>> emb.shape, tokens
            ((2, 384), [9, 6])
        """
        return embed_texts(self, self.engine, self.text, self.pooler.cut(truncate_dim), texts, batch_size, show_progress, workers,
                           prompt_text(self.manifest.pooling, prompt_name, prompt))


def embed_texts(task: Task, engine: Engine, text: TextEncoder | None, pooler: Pooler, texts: list[str],
                batch_size: int = 32, show_progress: bool = False,
                workers: int | None = None, prompt: str = "") -> tuple[np.ndarray, list[int]]:
    """Pooled embeddings of ``texts`` through ``engine`` (one chain), each after ``prompt``, and
    each text's token count (its prompt's included)."""
    texts = listed(texts)
    if isinstance(texts, str) or not isinstance(texts, (list, tuple)):
        raise FeedError(f"encode() takes a list of strings, got {type(texts).__name__}; wrap a single text as [text].")
    check_unicode(texts)
    if prompt:
        check_unicode([prompt])
        texts = [prompt + t if isinstance(t, str) else t for t in texts]
    check_batch_size(batch_size)
    if text is None:
        raise task.unsupported("tokenize")
    encs = text.encodings(list(texts))
    lengths = [len(e.ids) for e in encs]
    plan = engine.plan
    unfit = ("runs on " + engine.device if not engine.backend.on_host else "streams" if plan.streaming
             else "runs in pipeline stages" if not engine.owns_files else None)
    lanes, lane_threads = lane_count(workers, possible_batches(len(texts), batch_size), unfit=unfit,
                                     threads=engine.threads, model_bytes=plan.model_bytes,
                                     memory_budget=plan.memory.budget)
    batches = sorted_batches(lengths, lane_batch_size(len(texts), batch_size, lanes))
    run = engine.run if lanes == 1 else engine.lane(lane_threads)
    return encode_texts(run, text, pooler, encs, batches, show_progress, lanes), lengths
