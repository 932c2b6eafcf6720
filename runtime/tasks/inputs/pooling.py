"""Token states out, one embedding per text: sentence-transformers' modules after its transformer.

A sentence-transformers model is a pipeline: ``Transformer -> Pooling -> Dense* -> Normalize?``.
The artifact's graph is the transformer; the rest is the manifest's ``pooling`` record, computed
here in numpy, in the library's order: :func:`pool` (one of its modes), each ``Dense`` projection
(``x @ W + b``, then its activation: LaBSE's, distiluse's, GTR's), the L2 normalisation, and a
Matryoshka model's saved cut to its first ``truncate_dim`` values.

:class:`Pooler` is that record made runnable: ``Pooler.of(pooling, folder, files)`` reads the
projections' weights (``.npy`` files, checked against the manifest's sha256 as they are read;
the header's shape must match the bytes, and nothing is unpickled) once, and ``pooler(outputs, attention_mask)`` embeds a batch.
"""

from __future__ import annotations

import copy
import hashlib
import io
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from slimml.errors import ArtifactError, FeedError, IntegrityError
from slimml.runtime.artifact.files import safe_path
from slimml.runtime.artifact.records import POOLING_MODES
from slimml.runtime.tasks.limits import shown

ACTIVATIONS = {  # records.DENSE_ACTIVATIONS, computed
    "identity": lambda x: x,
    "tanh": np.tanh,
    "relu": lambda x: np.maximum(x, 0),
    "sigmoid": lambda x: 0.5 * (1.0 + np.tanh(0.5 * x)),  # 1 / (1 + e^-x), without overflow
}


def pool(hidden: np.ndarray, attention_mask: np.ndarray, mode: str = "mean", normalize: bool = True) -> np.ndarray:
    """Sentence embeddings from token states: (B, T, H) and mask (B, T) -> (B, H), as
    sentence-transformers' ``Pooling`` computes each mode (the texts padded on the right)."""
    if mode in ("mean", "mean_sqrt_len_tokens", "weightedmean"):
        mask = attention_mask.astype(hidden.dtype)  # (B, T)
        if mode == "weightedmean":  # each token weighted by its position, 1 for the first
            mask = mask * np.arange(1, mask.shape[1] + 1, dtype=hidden.dtype)
        summed = np.matmul(mask[:, None, :], hidden)[:, 0, :]  # (B, H), without a (B, T, H) temporary
        count = np.clip(mask.sum(axis=1, keepdims=True), 1e-9, None)
        emb = summed / (np.sqrt(count) if mode == "mean_sqrt_len_tokens" else count)
    elif mode == "lasttoken":  # each text's last token (decoder embedders: Qwen3-Embedding, gte-Qwen2)
        last = attention_mask.shape[1] - 1 - np.argmax(attention_mask[:, ::-1] > 0, axis=1)
        emb = hidden[np.arange(hidden.shape[0]), last]
    elif mode == "cls":
        emb = hidden[:, 0]
    elif mode == "max":
        masked = np.where(attention_mask[..., None] > 0, hidden, -np.inf)
        emb = masked.max(axis=1)
    elif mode == "none":  # the model pooled already (CLIP's text_embeds): (B, H)
        emb = hidden
    else:
        raise ArtifactError(f"unknown pooling mode {mode!r} in the manifest; use one of {', '.join(POOLING_MODES)}.")
    emb = emb.astype(np.float32)
    return normalized(emb) if normalize else emb


def normalized(emb: np.ndarray) -> np.ndarray:
    return emb / np.clip(np.linalg.norm(emb, axis=1, keepdims=True), 1e-12, None)


@dataclass(frozen=True)
class Dense:
    """One sentence-transformers ``Dense`` module: ``activation(x @ weight + bias)``.

    ``weight`` is (in, out) float32 (``nn.Linear``'s weight transposed), ``bias`` (out,) or None.
    """

    weight: np.ndarray
    bias: np.ndarray | None
    activation: str

    def __call__(self, x: np.ndarray) -> np.ndarray:
        if x.shape[-1] != self.weight.shape[0]:
            raise ArtifactError(f"a dense layer of the pooling takes {self.weight.shape[0]} values per text, but it got "
                                f"{x.shape[-1]}; the artifact's pooling does not fit its model: convert it again.")
        y = x @ self.weight
        if self.bias is not None:
            y += self.bias
        return ACTIVATIONS[self.activation](y).astype(np.float32, copy=False)


class Pooler:
    """The manifest's ``pooling`` record, runnable: pool, project (each :class:`Dense`), normalise.

    Args:
        pooling: the record (:class:`~slimml.runtime.artifact.records.Pooling` or its JSON form).
        dense: its projections, read (:meth:`of`) or built in memory (``convert``'s reference).
    """

    def __init__(self, pooling: Mapping[str, Any], dense: Iterable[Dense] = (), hidden: int | None = None):
        self.mode = str(pooling["mode"])
        self.output = str(pooling["output"])
        self.normalize = bool(pooling.get("normalize", True))
        self.dense = tuple(dense)
        self.truncate_dim = pooling.get("truncate_dim")
        self.hidden = hidden  # the pooled output's size, where the model's outputs say it

    @classmethod
    def of(cls, pooling: Mapping[str, Any] | None, folder: str | Path,
           files: Iterable[Any] | None = None, hidden: int | None = None) -> Pooler | None:
        """The pooler of ``pooling`` (None stays None), its projections' weights read from
        ``folder``. With ``files`` (the manifest's file entries) each weight file is checked
        against its listed sha256 from the very bytes that are used; with ``hidden`` (the pooled
        output's size), the first projection must take it.

        Raises:
            IntegrityError: a weight file that is not the one listed.
            ArtifactError: one that is not a float32 array of the sizes its record needs, or
                projections that do not fit one another or the model.
        """
        if pooling is None:
            return None
        hashes = {f.path: f.sha256 for f in files} if files is not None else None
        dense = []
        for i, layer in enumerate(pooling.get("dense") or ()):
            weight = _read_array(Path(folder), layer["weight"], hashes, 2)
            bias = _read_array(Path(folder), layer["bias"], hashes, 1) if layer.get("bias") else None
            if bias is not None and bias.shape[0] != weight.shape[1]:
                raise ArtifactError(f"pooling dense layer {i} has {weight.shape[1]} outputs but {bias.shape[0]} biases; "
                                    "the artifact is damaged: convert it again.")
            takes = dense[-1].weight.shape[1] if dense else hidden
            if takes is not None and weight.shape[0] != takes:
                raise ArtifactError(f"pooling dense layer {i} takes {weight.shape[0]} values, but what comes before it gives "
                                    f"{takes}; the artifact is damaged: convert it again.")
            dense.append(Dense(weight, bias, layer["activation"]))
        return cls(pooling, dense, hidden)

    def __call__(self, outputs: Mapping[str, np.ndarray], attention_mask: np.ndarray) -> np.ndarray:
        """Embeddings (B, size) of a batch from the chain's ``outputs`` and its ``attention_mask``."""
        emb = self.pooled(outputs, attention_mask)
        emb = normalized(emb) if self.normalize else emb
        return emb[:, : self.truncate_dim] if self.truncate_dim else emb  # as the library cuts: not normalised again

    def cut(self, truncate_dim: Any = None) -> Pooler:
        """This pooler with its embeddings cut to ``truncate_dim`` values instead of the model's own
        cut (sentence-transformers' ``encode(truncate_dim=)``); None: as it is.

        Raises:
            FeedError: ``truncate_dim`` is not a whole number >= 1, or is more than the model's
                embeddings hold (sentence-transformers gives them whole: a caller that asked for
                more than there is would not see that it got less).
        """
        if truncate_dim is None:
            return self
        if not isinstance(truncate_dim, int) or isinstance(truncate_dim, bool) or truncate_dim < 1:
            raise FeedError(f"truncate_dim must be a whole number >= 1, got {shown(truncate_dim)}; give the number of "
                            "values to keep, or leave it out for the model's own.")
        width = self.width(self.hidden)
        if width is not None and truncate_dim > width:
            raise FeedError(f"truncate_dim is {truncate_dim}, more than this model's {width} values; ask for at most "
                            f"{width}, or leave it out for the model's own.")
        other = copy.copy(self)
        other.truncate_dim = truncate_dim
        return other

    def pooled(self, outputs: Mapping[str, np.ndarray], attention_mask: np.ndarray) -> np.ndarray:
        """The pooled and projected embeddings (B, width), before the normalisation and the cut
        (what a distilled student learns to match)."""
        emb = pool(outputs[self.output], attention_mask, self.mode, normalize=False)
        for layer in self.dense:
            emb = layer(emb)
        return emb

    def width(self, hidden: int | None) -> int | None:
        """:meth:`pooled`'s size for an output of ``hidden`` values (the last projection's outputs)."""
        return int(self.dense[-1].weight.shape[1]) if self.dense else hidden

    def size(self, hidden: int | None) -> int | None:
        """The embedding's size for an output of ``hidden`` values (:meth:`width`, at most ``truncate_dim``)."""
        width = self.width(hidden)
        if not self.truncate_dim:
            return width
        return self.truncate_dim if width is None else min(width, self.truncate_dim)


def _read_array(folder: Path, rel: str, hashes: Mapping[str, str] | None, ndim: int) -> np.ndarray:
    try:
        data = safe_path(folder, rel).read_bytes()
    except OSError as e:
        raise IntegrityError(f"the pooling's weight file {rel} in {folder} could not be read ({e.strerror}); restore "
                             "the artifact or convert it again.") from None
    if hashes is not None and hashes.get(rel) != hashlib.sha256(data).hexdigest():
        raise IntegrityError(f"the pooling's weight file {rel} in {folder} is not the one its manifest lists (modified, "
                             "replaced, or not listed); slimml will not run it. Restore the artifact or convert it again.")
    fmt = np.lib.format
    buf = io.BytesIO(data)
    try:  # the header first: its shape must be what the file holds, before anything is made of it
        version = fmt.read_magic(buf)
        if version not in ((1, 0), (2, 0)):  # what numpy writes for a float array
            raise ValueError(f"format version {version} is not 1.0 or 2.0")
        shape, fortran, dtype = (fmt.read_array_header_1_0 if version == (1, 0) else fmt.read_array_header_2_0)(buf)
    except (ValueError, OSError, EOFError) as e:
        raise ArtifactError(f"the pooling's weight file {rel} is not a numpy array ({e}); convert the model again.") from None
    sizes = [d for d in shape if type(d) is int and d > 0]  # plain ints (not bools), each at least 1
    if dtype != np.dtype("<f4") or len(shape) != ndim or len(sizes) != ndim \
            or len(data) - buf.tell() != math.prod(sizes) * 4:
        raise ArtifactError(f"the pooling's weight file {rel} holds {dtype} {shape} in {len(data)} bytes, which is not a "
                            f"whole {ndim}-D float32 array; convert the model again.")
    return np.frombuffer(data, np.float32, offset=buf.tell()).reshape(sizes, order="F" if fortran else "C")
