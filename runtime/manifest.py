"""The artifact manifest: what an artifact folder holds and how its shards chain.

An artifact is a folder with ``manifest.json``, one ONNX file per shard (each with its own
external-data file), and the tokenizer files when the source had a tokenizer. The manifest
records every file's size and sha256, so a tampered, truncated or missing file is refused
before anything runs. The format is documented in the README ("The manifest").
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any

from slimml.errors import ArtifactError, IntegrityError

FORMAT = "slimml.artifact"
FORMAT_VERSION = 1
MANIFEST_NAME = "manifest.json"

Dim = int | str | None  # a fixed size, a named dynamic axis, or unknown


@dataclass
class TensorSpec:
    """A named tensor crossing a boundary: a model input/output or a shard input/output."""

    name: str
    dtype: str  # numpy dtype name: "float32", "int64", ...
    shape: list[Dim]
    source: int | str | None = None  # shard inputs only: "input" (a model input) or a shard index

    def to_json(self) -> dict[str, Any]:
        d = {"name": self.name, "dtype": self.dtype, "shape": self.shape}
        if self.source is not None:
            d["from"] = self.source
        return d

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> TensorSpec:
        return cls(name=d["name"], dtype=d["dtype"], shape=list(d["shape"]), source=d.get("from"))


@dataclass
class FileEntry:
    path: str  # relative to the artifact folder, POSIX separators
    bytes: int
    sha256: str


@dataclass
class ShardSpec:
    index: int
    file: str  # the shard's .onnx, relative
    data: str | None  # its external-data file, relative, or None when all weights are inline
    weight_bytes: int
    inputs: list[TensorSpec]
    outputs: list[TensorSpec]
    layers: list[str] = field(default_factory=list)  # layer names it holds, when detected

    def to_json(self) -> dict[str, Any]:
        return {
            "index": self.index,
            "file": self.file,
            "data": self.data,
            "weight_bytes": self.weight_bytes,
            "layers": self.layers,
            "inputs": [t.to_json() for t in self.inputs],
            "outputs": [t.to_json() for t in self.outputs],
        }

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> ShardSpec:
        return cls(
            index=int(d["index"]),
            file=d["file"],
            data=d.get("data"),
            weight_bytes=int(d.get("weight_bytes", 0)),
            layers=list(d.get("layers", [])),
            inputs=[TensorSpec.from_json(t) for t in d["inputs"]],
            outputs=[TensorSpec.from_json(t) for t in d["outputs"]],
        )


@dataclass
class Manifest:
    name: str
    task: str  # "sentence-embedding", "feature-extraction", "text-generation", "generic", ...
    source: dict[str, Any]
    steps: list[dict[str, Any]]
    inputs: list[TensorSpec]
    outputs: list[TensorSpec]
    shards: list[ShardSpec]
    files: list[FileEntry]
    tokenizer: dict[str, Any] | None = None  # {"file", "max_length", "pad_token", "pad_id"}
    pooling: dict[str, Any] | None = None  # {"mode": "mean"|"cls", "normalize", "output"}
    checks: dict[str, Any] = field(default_factory=dict)
    slimml_version: str = ""
    format_version: int = FORMAT_VERSION

    @property
    def total_bytes(self) -> int:
        return sum(f.bytes for f in self.files)

    def to_json(self) -> dict[str, Any]:
        return {
            "format": FORMAT,
            "format_version": self.format_version,
            "slimml_version": self.slimml_version,
            "name": self.name,
            "task": self.task,
            "source": self.source,
            "steps": self.steps,
            "inputs": [t.to_json() for t in self.inputs],
            "outputs": [t.to_json() for t in self.outputs],
            "shards": [s.to_json() for s in self.shards],
            "files": [asdict(f) for f in self.files],
            "tokenizer": self.tokenizer,
            "pooling": self.pooling,
            "checks": self.checks,
        }

    def write(self, folder: str | os.PathLike) -> Path:
        path = Path(folder) / MANIFEST_NAME
        tmp = path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(self.to_json(), indent=2) + "\n")
        os.replace(tmp, path)
        return path


def read_manifest(folder: str | os.PathLike) -> Manifest:
    """Read and check the structure of ``folder/manifest.json`` (not the files' hashes).

    Raises:
        ArtifactError: the folder or manifest is missing, is not JSON, is of another format or
            version, or names a path that escapes the folder.
    """
    folder = Path(folder)
    if not folder.is_dir():
        raise ArtifactError(
            f"{folder} is not an artifact folder: it does not exist or is a file. "
            "Give the folder that `slimml convert` wrote (it holds manifest.json)."
        )
    path = folder / MANIFEST_NAME
    if not path.is_file():
        raise ArtifactError(
            f"{folder} has no {MANIFEST_NAME}: it is not a slimml artifact, or its conversion did "
            "not finish. Run `slimml convert SOURCE -o {folder}` to make one."
        )
    try:
        raw = json.loads(path.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ArtifactError(f"{path} is not valid JSON ({e}); the artifact is damaged: convert again.") from None
    if not isinstance(raw, dict) or raw.get("format") != FORMAT:
        raise ArtifactError(f"{path} is not a slimml manifest (expected \"format\": \"{FORMAT}\").")
    version = raw.get("format_version")
    if version != FORMAT_VERSION:
        raise ArtifactError(
            f"{path} has manifest format version {version!r}, but this slimml reads version "
            f"{FORMAT_VERSION}. Convert the model again with this slimml, or install the slimml "
            "version that wrote it."
        )
    try:
        manifest = Manifest(
            name=str(raw["name"]),
            task=str(raw["task"]),
            source=dict(raw.get("source") or {}),
            steps=list(raw.get("steps") or []),
            inputs=[TensorSpec.from_json(t) for t in raw["inputs"]],
            outputs=[TensorSpec.from_json(t) for t in raw["outputs"]],
            shards=[ShardSpec.from_json(s) for s in raw["shards"]],
            files=[FileEntry(path=f["path"], bytes=int(f["bytes"]), sha256=str(f["sha256"])) for f in raw["files"]],
            tokenizer=raw.get("tokenizer"),
            pooling=raw.get("pooling"),
            checks=dict(raw.get("checks") or {}),
            slimml_version=str(raw.get("slimml_version", "")),
            format_version=version,
        )
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise ArtifactError(f"{path} is malformed ({type(e).__name__}: {e}); convert the model again.") from None
    _check_structure(folder, manifest)
    return manifest


def _check_structure(folder: Path, m: Manifest) -> None:
    if not m.shards:
        raise ArtifactError(f"{folder / MANIFEST_NAME} lists no shards; convert the model again.")
    listed = {f.path for f in m.files}
    for f in m.files:
        safe_path(folder, f.path)
    for s in m.shards:
        for rel in (s.file, s.data):
            if rel is not None and rel not in listed:
                raise ArtifactError(
                    f"shard {s.index} names {rel!r}, which the manifest's file list does not record "
                    "with a hash; the manifest was edited by hand or damaged: convert again."
                )
    if m.tokenizer and m.tokenizer.get("file") not in listed:
        raise ArtifactError("the manifest's tokenizer file is not in its file list; convert again.")
    known = {t.name for t in m.inputs}
    for s in m.shards:
        for t in s.inputs:
            ok = t.source == "input" and t.name in known
            ok = ok or (isinstance(t.source, int) and 0 <= t.source < s.index and t.name in known)
            if not ok:
                raise ArtifactError(
                    f"shard {s.index} input {t.name!r} comes from {t.source!r}, which is neither a model "
                    "input nor an earlier shard's output; the manifest is damaged: convert again."
                )
        known |= {t.name for t in s.outputs}
    missing = [t.name for t in m.outputs if t.name not in known]
    if missing:
        raise ArtifactError(f"no shard produces the model output(s) {missing}; the manifest is damaged.")


def safe_path(folder: Path, rel: str) -> Path:
    """Resolve ``rel`` inside ``folder``, refusing absolute paths, ``..`` and symlinks out."""
    p = PurePosixPath(rel)
    if not rel or p.is_absolute() or ".." in p.parts or "\\" in rel or rel.startswith("~"):
        raise ArtifactError(
            f"the manifest names the path {rel!r}, which leaves the artifact folder; refusing to load it."
        )
    full = folder / Path(*p.parts)
    root = folder.resolve()
    resolved = full.resolve()
    if resolved != root and root not in resolved.parents:
        raise ArtifactError(f"{rel!r} is a link that points outside the artifact folder; refusing to load it.")
    return full


def sha256_file(path: str | os.PathLike, chunk: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def file_entry(folder: Path, path: Path) -> FileEntry:
    return FileEntry(path=path.relative_to(folder).as_posix(), bytes=path.stat().st_size, sha256=sha256_file(path))


def verify_file(folder: Path, entry: FileEntry) -> Path:
    """Check one listed file's presence, size and sha256; return its path.

    Raises:
        IntegrityError: naming the file and what differs.
    """
    path = safe_path(folder, entry.path)
    if not path.is_file():
        raise IntegrityError(
            f"{entry.path} is missing from the artifact {folder}; copy the whole folder again or re-convert."
        )
    size = path.stat().st_size
    if size != entry.bytes:
        raise IntegrityError(
            f"{entry.path} is {size} bytes but the manifest records {entry.bytes}: the file is truncated "
            "or was modified. Copy the artifact again or re-convert; slimml will not run it."
        )
    digest = sha256_file(path)
    if digest != entry.sha256:
        raise IntegrityError(
            f"{entry.path} does not match its sha256 in the manifest: the file is corrupted or was "
            "tampered with. Copy the artifact again or re-convert; slimml will not run it."
        )
    return path


def verify_files(folder: str | os.PathLike, manifest: Manifest) -> None:
    folder = Path(folder)
    for entry in manifest.files:
        verify_file(folder, entry)
