"""Store a tied embedding once: the output projection reads the token embedding's quantized table.

Small language models tie ``lm_head`` to the token embedding (SmolLM2: 49152 x 576, a fifth of
the model). Exported to ONNX, the two are separate weights in the first and the last shard; the
language-model backend (``quantize/decoder.py``) quantizes both to the same bytes (8-bit blocks of
32 in MatMulNBits' layout, float16 scales). This step points the last shard's copies at the first
shard's data file (offsets rewritten, its own data file dropped; its other weights, a norm, made
inline), as llama.cpp stores one ``token_embd`` for both. A streamed run still loads each shard
on its own; the shared file is listed and hashed once.
"""

from __future__ import annotations

import dataclasses
import hashlib
from pathlib import Path

import onnx
from onnx import external_data_helper

from slimml.runtime.artifact.files import file_entry
from slimml.runtime.artifact.manifest import Manifest, read_manifest


def share_tied_embedding(folder: Path) -> int:
    """Share the quantized embedding table between the first and the last shard of the artifact in
    ``folder`` when their bytes match; rewrite the manifest. Returns the bytes saved (0: nothing shared)."""
    manifest = read_manifest(folder)
    if manifest.components or len(manifest.shards) < 2:
        return 0
    first, last = manifest.shards[0], manifest.shards[-1]
    if first.data is None or last.data is None or first.data == last.data:
        return 0
    owner = {_digest(folder / first.data, t): loc for t, loc in _external(folder / first.file)}
    model = onnx.load(str(folder / last.file), load_external_data=False)
    wanted = {t.name: owner.get(_digest(folder / last.data, t)) for t in model.graph.initializer
              if external_data_helper.uses_external_data(t)}
    shared = {name: loc for name, loc in wanted.items() if loc is not None}
    if not any(loc[1] > 1 << 20 for loc in shared.values()):  # no big table in common: not tied
        return 0
    onnx.load_external_data_for_model(model, str(folder))  # the rest (a norm, ~KB) goes inline
    for t in model.graph.initializer:
        if t.name in shared:
            offset, length = shared[t.name]
            t.ClearField("raw_data")
            t.data_location = onnx.TensorProto.EXTERNAL
            del t.external_data[:]
            for key, value in (("location", Path(first.data).name), ("offset", str(offset)), ("length", str(length))):
                entry = t.external_data.add()
                entry.key, entry.value = key, value
        elif external_data_helper.uses_external_data(t):
            t.data_location = onnx.TensorProto.DEFAULT
            del t.external_data[:]
    old = folder / last.data
    saved = old.stat().st_size
    tmp = folder / f"{last.file}.tmp"
    onnx.save_model(model, str(tmp))
    tmp.replace(folder / last.file)
    old.unlink()
    shards = [*manifest.shards[:-1], dataclasses.replace(last, data=first.data)]
    files = [e for e in manifest.files if e.path != last.data]
    files = [file_entry(folder, folder / e.path) if e.path == last.file else e for e in files]
    new = dataclasses.replace(manifest, shards=shards, files=files)
    _note(new, saved)
    new.write(folder)
    return saved


def _note(manifest: Manifest, saved: int) -> None:
    if manifest.steps and manifest.steps[-1].get("step") == "quantize":
        manifest.steps[-1]["tied_embedding"] = f"stored once (last shard reads shard 0's table; {saved / 1e6:.1f} MB saved)"


def _external(path: Path):
    for t in onnx.load(str(path), load_external_data=False).graph.initializer:
        if external_data_helper.uses_external_data(t):
            info = {e.key: e.value for e in t.external_data}
            yield t, (int(info.get("offset", 0)), int(info["length"]))


def _digest(data: Path, t: onnx.TensorProto) -> tuple:
    info = {e.key: e.value for e in t.external_data}
    with open(data, "rb") as f:
        f.seek(int(info.get("offset", 0)))
        return t.data_type, tuple(t.dims), hashlib.sha256(f.read(int(info["length"]))).hexdigest()
