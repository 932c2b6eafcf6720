"""The teacher's side of distillation: its outputs, computed once by the slimml runtime and kept on disk.

The teacher runs as a slimml artifact (the one ``convert`` writes for it), so it can stream under a
memory budget: a teacher bigger than the machine passes over the data shard by shard. What the loss
needs from it is stored in a cache folder of memory-mapped arrays, and every epoch (and a resumed
run) reads them instead of running the teacher again:

- ``embedding-cosine``: the embedding of each text as the teacher's pooling makes it (its mode and
  projections, before the normalisation and any Matryoshka cut), ``(texts, width)``;
- ``hidden-mse``: the last hidden state of each token, ``(tokens, hidden)`` with per-text offsets;
- ``logits-kl``: a classifier's logits, ``(texts, classes)``;
- ``lm-kl``: for each token the teacher's ``top_k`` logits, their token ids and the log-sum-exp of
  all its logits, so the loss knows each top token's probability and the mass of the rest.

The cache is keyed by a sha256 of the teacher artifact's manifest, the objective and the token ids;
a cache made for another teacher or other data is rebuilt (and the report says so). The pass is
written batch by batch with its progress in ``meta.json``, so a killed pass resumes where it stopped.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from slimml.errors import ArtifactError, ConfigError
from slimml.runtime.engine.budget import available_memory, fmt_bytes, parse_bytes

META = "meta.json"
MIN_BATCH, MAX_BATCH = 8, 512
CACHE_FORMAT = 2  # 2: embeddings pooled as the teacher pools (1 took every teacher's mean)
SAFETY = 512 * 2**20  # what the batch estimate leaves for everything else


@dataclass
class TeacherOutputs:
    """The cached arrays (memory-mapped) and what building them cost."""

    kind: str
    arrays: dict[str, np.ndarray]
    sha256: str
    folder: Path
    bytes: int
    rebuilt: str | None = None  # why an existing cache was not used
    stats: dict[str, Any] = field(default_factory=dict)

    def rows(self, index: list[int]) -> dict[str, np.ndarray]:
        """The targets of texts ``index``: per text, or per token as a list of arrays."""
        if "offsets" not in self.arrays:
            return {k: self.arrays[k][index] for k in self.arrays}
        off = self.arrays["offsets"]
        return {k: [v[off[i]: off[i + 1]] for i in index] for k, v in self.arrays.items() if k != "offsets"}


def cache_key(artifact: Path, kind: str, top_k: int, ids: list[list[int]]) -> str:
    h = hashlib.sha256()
    h.update((artifact / "manifest.json").read_bytes())
    h.update(f"{kind}:{top_k}:{CACHE_FORMAT}".encode())
    for s in ids:
        h.update(np.asarray(s, dtype=np.int64).tobytes() + b"|")
    return h.hexdigest()


def teacher_outputs(artifact: Path, kind: str, ids: list[list[int]], pad_id: int, cache_dir: Path,
                    memory_budget: int | str | None = None, top_k: int = 32,
                    progress: Callable[[int, int], None] | None = None, max_batch: int | None = None,
                    pooler: Any = None) -> TeacherOutputs:
    """The teacher's targets for every text in ``ids``, from the cache in ``cache_dir`` or computed into it.

    Args:
        artifact: the teacher's slimml artifact folder.
        kind: the distillation objective (see the module docstring).
        ids: each text's token ids (unpadded), in the order the trainer indexes them.
        pad_id: the id padding is filled with.
        cache_dir: the cache folder (made, reused, or rebuilt when made for something else).
        memory_budget: bytes of teacher shards loaded at once (``"2GB"``); ``None``: all resident.
        top_k: for ``lm-kl``, logits kept per token.
        progress: called as ``progress(texts_done, texts)`` during the pass.
        max_batch: texts per teacher batch at most; ``None``: as many as the memory left holds.
        pooler: for ``embedding-cosine``, the :class:`~slimml.runtime.tasks.inputs.pooling.Pooler`
            the targets are made with (default: :func:`teacher_pooler`).
    """
    if kind == "embedding-cosine" and pooler is None:
        pooler = teacher_pooler(artifact)
    key = cache_key(artifact, kind, top_k, ids)
    meta = _read_meta(cache_dir)
    rebuilt = None
    if meta is not None and meta.get("key") != key:
        rebuilt = "it was made for another teacher or other data"
    elif meta is not None and meta.get("complete") and _sha256(cache_dir, meta) != meta.get("sha256"):
        rebuilt = "its files do not match their sha256 (changed or damaged)"
    if rebuilt:
        _clear(cache_dir)
        meta = None
    lengths = np.array([len(s) for s in ids], dtype=np.int64)
    if meta is None:
        meta = {"key": key, "kind": kind, "top_k": top_k, "texts": len(ids), "done": 0, "complete": False}
    t0 = time.perf_counter()
    passed = 0
    if not meta["complete"]:
        passed = _fill(artifact, kind, ids, lengths, pad_id, cache_dir, meta, memory_budget, top_k, progress,
                       max_batch or MAX_BATCH, pooler)
    arrays = _open(cache_dir, meta, "r")
    size = sum(int(a.nbytes) for a in arrays.values())
    stats = {"teacher_batches": passed, "teacher_seconds": round(time.perf_counter() - t0, 1),
             "cache_bytes": size, "computed": passed > 0, "batch_texts": meta.get("batch_texts")}
    return TeacherOutputs(kind, arrays, meta["sha256"], cache_dir, size, rebuilt, stats)


def teacher_pooler(artifact: Path) -> Any:
    """The teacher artifact's pooling (mode, projections), which the targets and the student's
    embedding are made with; a teacher converted without it (``--task feature-extraction``) pools
    by its mean, the library's default."""
    from slimml.runtime.artifact.manifest import read_manifest
    from slimml.runtime.tasks.inputs.pooling import Pooler

    manifest = read_manifest(artifact)
    return (Pooler.of(manifest.pooling, artifact, manifest.files)
            or Pooler({"mode": "mean", "output": "last_hidden_state", "normalize": True}))


def teacher_export(folder: str | os.PathLike, opset: int | None = None):
    """How the teacher is exported: a causal LM as its cache-free graph (distillation reads whole
    texts, and layer outputs, from it; never a KV cache), anything else as ``convert`` would.

    Where optimum-onnx, which writes the cache-free graph, does not load (transformers 5) or does not
    know the architecture (Mixtral), a decoder the fused exporter writes is exported with it: run
    from an empty cache with every position in ``logits_index``, it gives the same logits (see
    :func:`_feeds`).
    """
    from slimml.convert.export import ExportConfig, _optimum_loads
    from slimml.convert.folder_facts import is_causal_lm
    from slimml.convert.fused_llama import can_export_fused

    if not is_causal_lm(Path(folder)):
        return ExportConfig(opset=opset, task="auto")
    if can_export_fused(Path(folder)) is None and (_optimum_loads() is not None or not _optimum_knows(Path(folder))):
        return ExportConfig(opset=opset, task="text-generation-with-past", exporter="fused")
    return ExportConfig(opset=opset, task="text-generation")


def _optimum_knows(folder: Path) -> bool:
    """Whether the installed optimum-onnx exports the folder's architecture (its registry of model types)."""
    from slimml.convert.folder_facts import hf_config

    try:
        import optimum.exporters.onnx.model_configs  # noqa: F401  (fills the registry)
        from optimum.exporters.tasks import TasksManager

        kind = str(hf_config(folder).get("model_type") or "").replace("_", "-")
        TasksManager.get_supported_tasks_for_model_type(kind, exporter="onnx", library_name="transformers")
    except Exception:  # KeyError: an architecture it does not know
        return False
    return True


def check_budget(artifact: Path, memory_budget: int | str | None) -> None:
    """A budget too small for the teacher's largest shard is refused before anything trains."""
    if memory_budget is None:
        return
    from slimml.runtime.engine.budget import shard_bytes
    from slimml.runtime.artifact.manifest import read_manifest

    manifest = read_manifest(artifact)
    sizes = shard_bytes(manifest)
    budget = parse_bytes(memory_budget)
    big = int(np.argmax(sizes))
    if budget < sizes[big]:
        raise ConfigError(
            f"--teacher-memory-budget {fmt_bytes(budget)} is smaller than the teacher's largest shard "
            f"({manifest.shards[big].file}, {fmt_bytes(sizes[big])}); give at least {fmt_bytes(sizes[big] * 1.1)}."
        )


def _feeds(inputs: list[Any], ids: list[list[int]], pad_id: int) -> dict[str, np.ndarray]:
    """One batch of texts, right-padded, for the teacher's ``inputs``; a fused decoder's cache starts
    empty and it computes the logits of every position."""
    from slimml.convert.llm_check import past_shapes

    names = [t.name for t in inputs]
    width = max(len(s) for s in ids)
    batch = np.full((len(ids), width), pad_id, dtype=np.int64)
    mask = np.zeros((len(ids), width), dtype=np.int64)
    for r, s in enumerate(ids):
        batch[r, : len(s)] = s
        mask[r, : len(s)] = 1
    all_feeds = {"input_ids": batch, "attention_mask": mask, "token_type_ids": np.zeros_like(batch),
                 "position_ids": np.clip(np.cumsum(mask, axis=1) - 1, 0, None),
                 "logits_index": np.broadcast_to(np.arange(width, dtype=np.int64), batch.shape).copy()}
    for name, (heads, dim, dtype) in past_shapes(inputs).items():
        all_feeds[name] = np.zeros((len(ids), heads, 0, dim), dtype=np.dtype(dtype))
    missing = [n for n in names if n not in all_feeds]
    if missing:
        raise ConfigError(f"the teacher artifact needs inputs {missing} that text distillation cannot give; distil a text "
                          "model (one that takes input_ids), or leave --distill-layers and --prune out.")
    return {n: all_feeds[n] for n in names}


def _batches(model: Any, lengths: np.ndarray, order: np.ndarray, budget: int, max_batch: int) -> list[int]:
    """Start offsets (into ``order``, shortest text first) of batches as large as the memory left holds.

    The teacher streams all its shards once per batch, so fewer, larger batches read its weights
    fewer times. ``budget`` is what the teacher's shards will take beside what is loaded now. A
    token costs about its output row (the logits) twice over (the output and one row being ranked)
    plus a dozen hidden-sized activations; a batch is padded to its longest (last) text. The
    offsets are fixed when the cache is created, so a resumed pass batches as the first one did.
    """
    hidden = max((int(t.shape[-1]) for s in model.manifest.shards for t in s.outputs
                  if t.dtype == "float32" and isinstance(t.shape[-1], int)), default=1024)
    out = max((int(t.shape[-1]) for t in model.manifest.outputs if isinstance(t.shape[-1], int)), default=hidden)
    per_token = 4 * (2 * out + 16 * hidden)
    room = max(available_memory() - budget - SAFETY, 0)
    starts, n = [0], 0
    for i in range(len(order)):
        width = int(lengths[order[i]])
        if n >= min(MIN_BATCH, max_batch) and (n >= max_batch or (n + 1) * width * per_token > room):
            starts.append(i)
            n = 0
        n += 1
    return starts


def _fill(artifact, kind, ids, lengths, pad_id, cache_dir: Path, meta, memory_budget, top_k, progress, max_batch,
          pooler) -> int:
    from slimml.runtime import load

    cache_dir.mkdir(mode=0o700, parents=True, exist_ok=True)  # the teacher's outputs: this user's only
    model = load(artifact, device="cpu", memory_budget=memory_budget)
    order = np.argsort(lengths, kind="stable")  # similar lengths together: less padding
    if "shapes" not in meta:
        meta["shapes"] = _shapes(model, kind, lengths, top_k, pooler)
        budget = parse_bytes(memory_budget) if memory_budget is not None else 0  # resident: loaded already
        meta["starts"] = _batches(model, lengths, order, budget, max_batch)
        meta["batch_texts"] = int(np.diff([*meta["starts"], len(ids)]).max())
        _create(cache_dir, meta)
    arrays = _open(cache_dir, meta, "r+")
    offsets = np.concatenate([[0], np.cumsum(lengths)]) if kind in ("hidden-mse", "lm-kl") else None
    bounds = [*meta["starts"], len(ids)]
    batches = 0
    try:
        for start, stop in zip(bounds[:-1], bounds[1:]):
            if stop <= meta["done"]:
                continue
            rows = order[start:stop]
            out = model.run(_feeds(model.inputs, [ids[i] for i in rows], pad_id))
            _store(kind, arrays, out, rows, lengths, offsets, top_k, pooler)
            for a in arrays.values():
                a.flush()
            meta["done"] = stop
            _write_meta(cache_dir, meta)  # after the arrays: a kill never marks unwritten rows done
            batches += 1
            if progress is not None:
                progress(meta["done"], len(ids))
    finally:
        model.close()
    if offsets is not None:
        arrays["offsets"][:] = offsets
        arrays["offsets"].flush()
    del arrays
    meta["complete"] = True
    meta["sha256"] = _sha256(cache_dir, meta)
    _write_meta(cache_dir, meta)
    return batches


def _shapes(model, kind: str, lengths: np.ndarray, top_k: int, pooler=None) -> dict[str, list]:
    n, tokens = len(lengths), int(lengths.sum())
    by_name = {t.name: t for t in model.manifest.outputs}
    spec = by_name[_output_name(list(by_name), kind)]
    last = int(spec.shape[-1]) if isinstance(spec.shape[-1], int) else None
    if last is None:
        raise ArtifactError("the teacher artifact's output has no fixed last dimension; distillation cannot size its cache.")
    if kind == "embedding-cosine":
        return {"embeddings": ["float32", n, pooler.width(last)]}
    if kind == "logits-kl":
        return {"logits": ["float32", n, last]}
    if kind == "hidden-mse":
        return {"hidden": ["float32", tokens, last], "offsets": ["int64", n + 1]}
    k = min(top_k, last)
    return {"top_values": ["float32", tokens, k], "top_ids": ["int32", tokens, k], "lse": ["float32", tokens],
            "offsets": ["int64", n + 1]}


def _output_name(names: list[str], kind: str) -> str:
    """The output the objective reads: the logits of a head, else the last hidden state."""
    want = "logits" if kind in ("lm-kl", "logits-kl") else "last_hidden_state"
    return want if want in names else names[0]


def _store(kind, arrays, out, rows, lengths, offsets, top_k, pooler=None) -> None:
    first = out[_output_name(list(out), kind)]
    if kind == "embedding-cosine":
        mask = np.zeros(first.shape[:2], dtype=np.int64)
        for r, i in enumerate(rows):
            mask[r, : lengths[i]] = 1
        arrays["embeddings"][rows] = pooler.pooled(out, mask)
        return
    if kind == "logits-kl":
        arrays["logits"][rows] = first
        return
    for r, i in enumerate(rows):
        lo, hi, n = offsets[i], offsets[i + 1], lengths[i]
        if kind == "hidden-mse":
            arrays["hidden"][lo:hi] = first[r, :n]
            continue
        logits = first[r, :n].astype(np.float32)  # (n, V)
        k = arrays["top_ids"].shape[1]
        top = np.argpartition(-logits, k - 1, axis=1)[:, :k]
        arrays["top_ids"][lo:hi] = top
        arrays["top_values"][lo:hi] = np.take_along_axis(logits, top, axis=1)
        m = logits.max(1, keepdims=True)
        arrays["lse"][lo:hi] = (m + np.log(np.exp(logits - m).sum(1, keepdims=True)))[:, 0]


def _create(cache_dir: Path, meta) -> None:
    for name, (dtype, *shape) in meta["shapes"].items():
        np.lib.format.open_memmap(cache_dir / f"{name}.npy", mode="w+", dtype=dtype, shape=tuple(shape)).flush()
    _write_meta(cache_dir, meta)


def _open(cache_dir: Path, meta, mode: str) -> dict[str, np.ndarray]:
    try:
        return {name: np.load(cache_dir / f"{name}.npy", mmap_mode=mode) for name in meta["shapes"]}
    except (OSError, ValueError) as e:
        raise ArtifactError(f"the teacher cache {cache_dir} is unreadable ({e}); delete it and run again.") from None


def _sha256(cache_dir: Path, meta) -> str:
    h = hashlib.sha256()
    for name in sorted(meta.get("shapes", {})):
        path = cache_dir / f"{name}.npy"
        if not path.is_file():
            return ""
        with open(path, "rb") as f:
            while chunk := f.read(1 << 22):
                h.update(chunk)
    return h.hexdigest()


def _read_meta(cache_dir: Path) -> dict | None:
    try:
        return json.loads((cache_dir / META).read_text())
    except (OSError, ValueError):
        return None


def _write_meta(cache_dir: Path, meta) -> None:
    from slimml.runtime.artifact.replace import replace_file

    replace_file(cache_dir / META, json.dumps(meta), mode=0o600)


def _clear(cache_dir: Path) -> None:
    for p in cache_dir.glob("*"):
        if p.is_file():
            p.unlink()
