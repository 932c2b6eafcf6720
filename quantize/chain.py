"""Running a mix of float and quantized shards, and recording what each shard reads.

Calibration for shard i needs the activations that reach it, which come from running shards
0..i-1 on the calibration inputs. :func:`advance` runs the *float* shards one at a time over the
calibration batches, so each shard is calibrated on exactly the activations the whole float
graph would give it (a sharded model quantizes as the whole graph would), while memory holds
only the tensors that cross the current boundary.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from slimml.runtime.tools.bench import sample_feeds
from slimml.runtime.artifact.manifest import Manifest
from slimml.runtime.engine.session import make_session
from slimml.quantize.calibration import ImagePaths
from slimml.quantize.classifier_guard import query_passage_pairs, reads_pairs
from slimml.runtime.tasks.inputs.pooling import Pooler
from slimml.runtime.tasks.inputs.text import TextEncoder, check_batch_size, encode_texts, sorted_batches


class Chain:
    """The artifact's shards run in order, each from its own file (float or quantized).

    Args:
        manifest: the artifact's manifest (shard order, inputs, outputs, pooling).
        files: one ONNX path per shard.
        text: the tokenizer, for :meth:`encode`.
        pooler: the pooling (:class:`~slimml.runtime.tasks.inputs.pooling.Pooler`), for :meth:`encode`.
    """

    def __init__(self, manifest: Manifest, files: list[Path], text: TextEncoder | None = None, device: str = "cpu",
                 pooler: Pooler | None = None):
        from slimml.runtime.engine.budget import bigger_than_memory

        self.manifest = manifest
        self.files, self.device = list(files), device
        size = sum(p.stat().st_size for f in files for p in (Path(f), Path(f"{f}.data")) if p.is_file())
        # a model bigger than memory: each shard's session made for its turn in a pass, then dropped
        self.sessions = None if bigger_than_memory(size) else [make_session(f, device) for f in files]
        self.text, self.pooler = text, pooler

    def _sessions(self):
        if self.sessions is not None:
            yield from self.sessions
        else:
            for f in self.files:
                yield make_session(f, self.device)

    def run(self, feeds: dict[str, np.ndarray], keep_all: bool = False) -> dict[str, np.ndarray]:
        env = dict(feeds)
        for session in self._sessions():
            wanted = [o.name for o in session.get_outputs()]
            values = session.run(wanted, {i.name: _as(env[i.name], i.type) for i in session.get_inputs()})
            env.update(zip(wanted, values))
        if keep_all:
            return env
        return {t.name: env[t.name] for t in self.manifest.outputs}

    def encode(self, texts: list[str], batch_size: int = 32, show_progress: bool = False) -> np.ndarray:
        """Pooled sentence embeddings, batched as ``Model.encode`` (for the accuracy guard's STS check)."""
        check_batch_size(batch_size)
        encs = self.text.encodings(list(texts))
        batches = sorted_batches([len(e.ids) for e in encs], batch_size)
        return encode_texts(self.run, self.text, self.pooler, encs, batches, show_progress)


_FLOATS = {"tensor(float)": np.float32, "tensor(float16)": np.float16}


def _as(value, onnx_type: str):
    """``value`` in the float type the session takes: the float model's feeds (a decoder's KV cache)
    given to an fp16 graph whose cache is float16."""
    want = _FLOATS.get(onnx_type)
    if want is not None and isinstance(value, np.ndarray) and value.dtype.kind == "f" and value.dtype != want:
        return value.astype(want)
    return value


def text_encoder(folder: Path, manifest: Manifest) -> TextEncoder | None:
    if not manifest.tokenizer:
        return None
    return TextEncoder(folder / manifest.tokenizer["file"], manifest.tokenizer, [t.name for t in manifest.inputs])


def image_feeds(folder: Path, manifest: Manifest):
    """``(pixel input name, image processor)`` of a chain that takes images and ships its
    processor config, else None."""
    from slimml.runtime.tasks.base import image_input

    name, processor = image_input(folder, manifest)
    return (name, processor) if name is not None and processor is not None else None


def batches(manifest: Manifest, text: TextEncoder | None, texts: list[str], batch_size: int = 8, seed: int = 0,
            images=None) -> list[dict[str, np.ndarray]]:
    """Model feeds for ``texts`` (tokenized), for image files (:class:`ImagePaths`, made into pixels
    by ``images``, :func:`image_feeds`), or, for a model without a tokenizer, sample inputs."""
    if isinstance(texts, ImagePaths):
        name, processor = images
        return [{name: processor(texts[i : i + batch_size])} for i in range(0, len(texts), batch_size)]
    if text is not None:
        inputs = query_passage_pairs(texts) if reads_pairs(manifest) else texts  # a cross-encoder reads pairs
        # sort by length so padding stays small and every batch looks like real traffic
        ordered = sorted(inputs, key=lambda t: len(t) if isinstance(t, str) else len(t[0]) + len(t[1]))
        return [text(ordered[i : i + batch_size]) for i in range(0, len(ordered), batch_size)]
    count = max(1, len(texts) // batch_size)
    out = []
    for i in range(count):
        feeds = sample_feeds(manifest.inputs, batch=2, seq=16, seed=seed + i, source=manifest.source)
        for name, value in feeds.items():
            if name.endswith("ids") and "type" not in name and "position" not in name:
                # token ids from the bottom of the vocabulary: valid for any vocabulary size
                feeds[name] = np.random.default_rng(seed + i).integers(0, 100, size=value.shape).astype(value.dtype)
        if manifest.source.get("exporter") == "fused":  # GroupQueryAttention: batched prompts read an empty cache
            feeds = {n: v[:, :, :0] if n.startswith("past_key_values.") else v for n, v in feeds.items()}
            feeds["attention_mask"] = np.ones_like(feeds["input_ids"], dtype=feeds["attention_mask"].dtype)
        out.append(feeds)
    return out


def advance(envs: list[dict[str, np.ndarray]], float_shard: Path, index: int, last_read: dict[str, int]) -> None:
    """Run one float shard on every batch's tensors, add its outputs, and drop what no later shard reads."""
    session = make_session(float_shard, "cpu")
    wanted = [o.name for o in session.get_outputs()]
    for env in envs:
        env.update(zip(wanted, session.run(wanted, {i.name: env[i.name] for i in session.get_inputs()})))
        for name in [n for n in env if last_read.get(n, -1) <= index and n not in wanted]:
            del env[name]


class RecordedReader:
    """An ONNX Runtime ``CalibrationDataReader`` over recorded activations, for one shard's inputs."""

    def __init__(self, recorded: list[dict[str, np.ndarray]], input_names: list[str]):
        self._rows = [{n: env[n] for n in input_names} for env in recorded]
        self._it: Iterator | None = None

    def get_next(self):
        if self._it is None:
            self._it = iter(self._rows)
        return next(self._it, None)

    def rewind(self):
        self._it = None

    @property
    def rows(self) -> list[dict[str, np.ndarray]]:
        """Every recorded feed for this shard, in order (for tools that take a list, such as NNCF)."""
        return list(self._rows)


def outputs_agreement(a: dict[str, np.ndarray], b: dict[str, np.ndarray], mask: np.ndarray | None = None,
                      pooler: Pooler | None = None) -> float:
    """Mean cosine similarity between two runs' float outputs.

    With ``pooler`` (a sentence-embedding model) the pooled embeddings are compared, since they
    are what users consume; otherwise each token's vector, skipping padded positions (``mask``),
    whose values no one reads and which fused attention leaves different, or each row's outputs.
    """
    cos = []
    if pooler is not None and mask is not None:
        x, y = pooler(a, mask).astype(np.float64), pooler(b, mask).astype(np.float64)
        pairs = [(x, y)]
    else:
        pairs = []
        for name, x in a.items():
            y = b[name]
            if x.dtype.kind != "f":
                continue
            if mask is not None and x.ndim >= 2 and x.shape[:2] == mask.shape:
                keep = mask.astype(bool)
                pairs.append((x[keep].reshape(int(keep.sum()), -1), y[keep].reshape(int(keep.sum()), -1)))
            else:
                pairs.append((x.reshape(x.shape[0], -1), y.reshape(y.shape[0], -1)))
    for x, y in pairs:
        x, y = x.astype(np.float64), y.astype(np.float64)
        den = np.clip(np.linalg.norm(x, axis=1) * np.linalg.norm(y, axis=1), 1e-30, None)
        cos.extend(((x * y).sum(1) / den).tolist())
    return float(np.mean(cos)) if cos else 1.0


def shard_paths(folder: str | os.PathLike, manifest: Manifest) -> list[Path]:
    return [Path(folder) / s.file for s in manifest.shards]
