"""Store weights that two components hold alike once: a decoder and its decoder-with-past.

An encoder-decoder exports its decoder twice, once for the first step and once with the cache,
with the same weights. After sharding, a decoder-with-past shard whose every weight is
byte-identical to one in the same folder's decoder shard is pointed at that shard's data file
(each tensor's location, offset and length rewritten) and its own data file is dropped. Both
shards then read one hashed file; a streamed run still loads each shard on its own.
"""

from __future__ import annotations

import hashlib
from pathlib import Path, PurePosixPath

import onnx
from onnx import external_data_helper

from slimml.runtime.artifact.manifest import ShardSpec


def share_weights(folder: Path, owner: list[ShardSpec], user: list[ShardSpec]) -> int:
    """Point ``user`` shards at ``owner`` shards' data files where every weight matches; returns
    the bytes no longer stored. Shards are changed in place (files and specs)."""
    index: dict[tuple, dict[str, tuple[int, int]]] = {}  # weight -> {data file: (offset, length)}
    for spec in owner:
        if spec.data is None:
            continue
        for t, (offset, length) in _external(folder, spec):
            index.setdefault(_key(folder, spec, t, offset, length), {}).setdefault(spec.data, (offset, length))
    saved = 0
    for spec in user:
        if spec.data is None:
            continue
        model = onnx.load(str(folder / spec.file), load_external_data=False)
        tensors = list(_external_in(model))
        found = [index.get(_key(folder, spec, t, off, n), {}) for t, (off, n) in tensors]
        # one data file must hold them all (a weight alike in many shards, say a fresh norm, is in several)
        common = set.intersection(*(set(f) for f in found)) if found else set()
        beside = sorted(d for d in common if PurePosixPath(d).parent == PurePosixPath(spec.file).parent)
        if not beside:
            continue  # external data must sit beside the graph that reads it
        data = beside[0]
        for (t, _), where in zip(tensors, found):
            offset, length = where[data]
            del t.external_data[:]
            for key, value in (("location", PurePosixPath(data).name), ("offset", str(offset)), ("length", str(length))):
                entry = t.external_data.add()
                entry.key, entry.value = key, value
        old = folder / spec.data
        saved += old.stat().st_size
        tmp = folder / f"{spec.file}.tmp"
        onnx.save_model(model, str(tmp))
        tmp.replace(folder / spec.file)
        old.unlink()
        spec.data = data
    return saved


def _external(folder: Path, spec: ShardSpec):
    return _external_in(onnx.load(str(folder / spec.file), load_external_data=False))


def _external_in(model: onnx.ModelProto):
    for t in model.graph.initializer:
        if external_data_helper.uses_external_data(t):
            info = {e.key: e.value for e in t.external_data}
            yield t, (int(info.get("offset", 0)), int(info["length"]))


def _key(folder: Path, spec: ShardSpec, t: onnx.TensorProto, offset: int, length: int) -> tuple:
    with open(folder / spec.data, "rb") as f:
        f.seek(offset)
        digest = hashlib.sha256(f.read(length)).hexdigest()
    return t.data_type, tuple(t.dims), digest
