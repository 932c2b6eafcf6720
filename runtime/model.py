"""Load an artifact and run its shards in sequence with ONNX Runtime."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

import numpy as np

from slimml.errors import FeedError, SlimmlError
from slimml.runtime.budget import StreamPlan, plan_stream
from slimml.runtime.feeds import check_feeds
from slimml.runtime.integrity import FileWatch, check_shard_file, max_sequence_length, vocab_size
from slimml.runtime.manifest import Manifest, read_manifest, safe_path, verify_files
from slimml.runtime.session import make_session, providers_for, run_shard
from slimml.runtime.text import TextEncoder, pool


class Model:
    """A loaded artifact. Use :func:`load` to make one.

    ``run`` is safe to call from several threads at once: each call keeps its own activations
    and ONNX Runtime sessions accept concurrent ``run`` calls.
    """

    def __init__(self, folder: Path, manifest: Manifest, device: str, threads: int | None,
                 plan: StreamPlan | None = None, verify: bool = True):
        self.folder = folder
        self.manifest = manifest
        self.device = device
        self._watch = FileWatch(folder, manifest)  # files changed after load are refused, not run
        facts = [check_shard_file(folder, s) for s in manifest.shards]  # external data stays inside
        self.max_sequence_length: int | None = max_sequence_length(facts, manifest)
        self.vocab_size: int | None = vocab_size(facts)  # input_ids outside it raise FeedError
        self.allow_nonfinite = False  # NaN/inf in float inputs raise FeedError unless set
        self.plan = plan or plan_stream(manifest)
        self._stream = None
        if self.plan.streaming:  # shards pass through K slots: the streaming engine runs them
            from slimml.runtime.stream import StreamEngine

            self._stream = StreamEngine(folder, manifest, device, threads, self.plan, verify=verify)
        self._sessions = [] if self._stream else [make_session(folder / s.file, device, threads) for s in manifest.shards]
        self._drop_after = manifest.last_uses()
        self._text: TextEncoder | None = None
        if manifest.tokenizer:
            self._text = TextEncoder(
                safe_path(folder, manifest.tokenizer["file"]), manifest.tokenizer, [t.name for t in manifest.inputs]
            )

    @property
    def inputs(self):
        return self.manifest.inputs

    @property
    def outputs(self):
        return self.manifest.outputs

    def run(self, feeds: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Run the whole model on ``feeds`` (input name -> array); return its outputs by name.

        Raises:
            FeedError: names, dtypes or shapes that do not fit the manifest's inputs, or values
                ONNX Runtime rejects (say, a sequence longer than the model allows).
        """
        self._watch.check()
        env: dict[str, np.ndarray] = check_feeds(
            feeds, self.manifest.inputs, self.max_sequence_length, self.allow_nonfinite, self.vocab_size
        )
        if self._stream is not None:
            return self._stream.run(env)
        for shard, session in zip(self.manifest.shards, self._sessions):
            run_shard(shard, session.run, env, self._drop_after[shard.index])
        return {t.name: env[t.name] for t in self.manifest.outputs}

    def verify(self) -> None:
        """Re-hash every file of the artifact against the manifest, as ``load`` did.

        Use it in a health check of a long-running service: a shard corrupted or replaced on disk
        after load raises, and ``run`` refuses to go on until the artifact is loaded again.

        Raises:
            IntegrityError: naming the file that no longer matches.
        """
        self._watch.check()
        verify_files(self.folder, self.manifest)

    @property
    def stats(self):
        """Streaming counters (:class:`slimml.runtime.stream.StreamStats`): passes, bytes loaded,
        time waiting on loads and computing. All zero for a fully resident model."""
        from slimml.runtime.stream import StreamStats

        return self._stream.stats if self._stream is not None else StreamStats()

    def close(self) -> None:
        """Stop the shard loader thread (if streaming) and drop every session."""
        if self._stream is not None:
            self._stream.close()
        self._sessions = []

    def generate(self, prompts, max_new_tokens: int = 32, **kwargs):
        """Greedy text generation for decoder artifacts; see :func:`slimml.runtime.generate.generate`."""
        from slimml.runtime.generate import generate

        return generate(self, prompts, max_new_tokens=max_new_tokens, **kwargs)

    def tokenize(self, texts: list[str], pad_to: int | None = None) -> dict[str, np.ndarray]:
        if self._text is None:
            raise SlimmlError(
                f"the artifact {self.folder} has no tokenizer, so it cannot take text; call "
                "run() with arrays instead."
            )
        for i, t in enumerate(texts if isinstance(texts, (list, tuple)) else []):
            try:
                isinstance(t, str) and t.encode("utf-8")
            except UnicodeEncodeError as e:  # a lone surrogate, e.g. from a bad decode upstream
                raise FeedError(
                    f"text {i} is not valid Unicode ({e.reason} at position {e.start}); decode your input with "
                    "errors='replace' or clean it first."
                ) from None
        return self._text(list(texts) if not isinstance(texts, str) else texts, pad_to=pad_to)

    def encode(self, texts: list[str], batch_size: int = 32) -> np.ndarray:
        """Sentence embeddings, (len(texts), hidden) float32, pooled and normalised as the source model does.

        Example:
            >>> model = load("artifacts/all-MiniLM-L6-v2")
            >>> model.encode(["A man is eating.", "Someone eats."]).shape
            (2, 384)
        """
        pooling = self.manifest.pooling
        if isinstance(texts, str) or not isinstance(texts, (list, tuple)):
            raise FeedError(f"encode() takes a list of strings, got {type(texts).__name__}; wrap a single text as [text].")
        if pooling is None:
            raise SlimmlError(
                f"the artifact {self.folder} is a {self.manifest.task!r} model, not a sentence-embedding "
                "model; use run() for its raw outputs."
            )
        chunks = []
        for i in range(0, len(texts), batch_size):
            feeds = self.tokenize(texts[i : i + batch_size])
            hidden = self.run(feeds)[pooling["output"]]
            chunks.append(pool(hidden, feeds["attention_mask"], pooling["mode"], pooling["normalize"]))
        if not chunks:
            raise FeedError("encode() got an empty list; give at least one text.")
        return np.concatenate(chunks)


def load(
    path: str | os.PathLike,
    device: str = "cpu",
    threads: int | None = None,
    verify: bool = True,
    resident: int | None = None,
    prefetch: int | None = None,
    memory_budget: int | str | None = None,
    pin: list[int] | None = None,
) -> Model:
    """Load an artifact folder written by ``slimml convert``.

    Args:
        path: the artifact folder (it holds ``manifest.json``).
        device: ``"cpu"`` or ``"cuda"``.
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

    Returns:
        A :class:`Model` with ``run(feeds)`` and, for sentence-embedding artifacts, ``encode(texts)``.

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
    providers_for(device)  # fail on a missing provider before hashing gigabytes
    plan = plan_stream(manifest, resident, prefetch, memory_budget, pin)  # a bad budget fails before loading
    if verify:
        verify_files(folder, manifest)
    return Model(folder, manifest, device, threads, plan, verify)
