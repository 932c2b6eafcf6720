"""The one way an artifact is written: :class:`ArtifactWriter`.

``convert`` and ``quantize`` both write through it. It owns the folder (built beside the output
and swapped in only when complete, see :mod:`.atomic`), the files put into it (shard graphs,
their data, the tokenizer, the preprocessor config, other assets), the chains of shards, the
weight files two components share, the hashes, and the manifest, which is written last: a
folder with a ``manifest.json`` is always a whole artifact.

Example:
    >>> with ArtifactWriter(Path("artifacts/m")) as w:
    ...     specs = shard(onnx_path, w.folder, ShardConfig())          # shard files into the folder
    ...     w.add_chain(specs, inputs, outputs, pooling=Pooling("mean", "last_hidden_state"))
    ...     w.add_tokenizer(Path("export/tokenizer.json"), Tokenizer("tokenizer.json", 256))
    ...     manifest = w.commit(name="m", task="sentence-embedding", source={}, steps=[])
"""

from __future__ import annotations

import dataclasses
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import TYPE_CHECKING, Any

import slimml
from slimml.errors import ArtifactError
from slimml.runtime.artifact.atomic import atomic_folder
from slimml.runtime.artifact.files import file_entry, safe_path
from slimml.runtime.artifact.manifest import Manifest, ShardSpec, TensorSpec, read_manifest
from slimml.runtime.artifact.records import ASSETS, Pooling, Preprocessor, Seq2Seq, Tokenizer, ZeroShot
from slimml.runtime.artifact.replace import umask

if TYPE_CHECKING:
    import onnx

WEIGHT_MIN_BYTES = 1024  # initializers smaller than this stay inline in the graph (as the splitter does)
WORK = ".work"  # scratch space inside the folder, removed before the swap


@dataclass
class _Chain:
    shards: list[ShardSpec]
    inputs: list[TensorSpec]
    outputs: list[TensorSpec]
    pooling: Pooling | None = None
    assets: list[str] = field(default_factory=list)


class ArtifactWriter:
    """Write one artifact folder: files in, chains of shards recorded, manifest last.

    Args:
        out: the artifact folder to produce.
        atomic: build it in a temporary folder beside ``out`` and swap it in on success (an error
            or a kill leaves the previous artifact, or nothing). ``False`` writes straight into
            ``out``, which must not exist, and removes it on failure: for a caller that already
            writes inside an atomic folder of its own (``convert --quantize``).

    Use it as a context manager; ``folder`` is where files go while it is open.
    """

    def __init__(self, out: str | os.PathLike, *, atomic: bool = True):
        self.out = Path(out)
        self.atomic = atomic
        self.folder: Path = self.out
        self._chains: dict[str | None, _Chain] = {}
        self._tokenizer: Tokenizer | None = None
        self._preprocessor: Preprocessor | None = None
        self._extra_files: list[str] = []
        self._cm: Any = None

    def __enter__(self) -> ArtifactWriter:
        if self.atomic:
            self._cm = atomic_folder(self.out)
            self.folder = self._cm.__enter__()
        else:
            self.out.mkdir(parents=True)
            self.folder = self.out
        return self

    def __exit__(self, exc_type, exc, tb) -> bool:
        if exc_type is None:
            shutil.rmtree(self.folder / WORK, ignore_errors=True)
        if self._cm is not None:
            return bool(self._cm.__exit__(exc_type, exc, tb))
        if exc_type is not None:
            shutil.rmtree(self.folder, ignore_errors=True)
        return False

    @property
    def work(self) -> Path:
        """A scratch folder inside the artifact's folder (same disk), removed when the writer closes."""
        path = self.folder / WORK
        path.mkdir(exist_ok=True)
        return path

    # files ---------------------------------------------------------------------------------
    def add_file(self, src: str | os.PathLike, rel: str, *, listed: bool = False) -> str:
        """Copy ``src`` into the folder as ``rel``; ``listed``: hash and list it though no chain or
        record names it (an asset a newer runtime reads). Returns ``rel``."""
        dst = safe_path(self.folder, rel)
        dst.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(src, dst)
        if listed:
            self._extra_files.append(rel)
        return rel

    def save_onnx(self, model: onnx.ModelProto, rel: str) -> str | None:
        """Save a shard graph as ``rel`` with its weights in ``rel.data``; returns the data file's
        path, or None when every weight was small enough to stay inline."""
        data = save_onnx(model, safe_path(self.folder, rel))
        return str(PurePosixPath(rel).parent / data) if data else None

    def add_tokenizer(self, src: str | os.PathLike, record: Tokenizer | dict[str, Any]) -> Tokenizer:
        """Ship the tokenizer file ``src`` as ``record.file`` and record how texts are padded and cut."""
        record = Tokenizer.coerce(record)
        self.add_file(src, record.file)
        self._tokenizer = record
        return record

    def add_preprocessor(self, src: str | os.PathLike, kind: str) -> Preprocessor:
        """Ship the preprocessor config ``src`` (images or audio) under its own name."""
        self._preprocessor = Preprocessor(file=Path(src).name, kind=kind)
        self.add_file(src, self._preprocessor.file)
        return self._preprocessor

    def add_chat_template(self, src: str | os.PathLike, rel: str = "chat_template.jinja") -> str:
        """Ship a Jinja chat template as ``rel`` and record it in the tokenizer (add that first)."""
        if self._tokenizer is None:
            raise ArtifactError("a chat template goes with a tokenizer; add the tokenizer first (this is a slimml bug).")
        self.add_file(src, rel)
        self._tokenizer = dataclasses.replace(self._tokenizer, chat_template=rel)
        return rel

    def copy_assets(self, src_folder: Path, manifest: Manifest) -> None:
        """Every file of the artifact ``src_folder`` that is not a shard's: its tokenizer (and chat
        template), its preprocessor config and any other listed asset. A rewrite keeps them."""
        parts = list(manifest.components.values()) or [manifest]
        shard_files = {p for part in parts for s in part.shards for p in (s.file, s.data) if p}
        records = set(manifest.asset_files())
        for f in manifest.files:
            if f.path not in shard_files:
                self.add_file(safe_path(src_folder, f.path), f.path, listed=f.path not in records)
        self._tokenizer, self._preprocessor = manifest.tokenizer, manifest.preprocessor

    # chains --------------------------------------------------------------------------------
    def add_chain(self, shards: list[ShardSpec], inputs: list[TensorSpec], outputs: list[TensorSpec], *,
                  name: str | None = None, pooling: Pooling | dict | None = None,
                  assets: list[str] | tuple[str, ...] = ()) -> None:
        """Record a chain of shards already in the folder: the whole model (``name=None``) or one
        component (CLIP's towers, an encoder and its decoders), with the assets its inputs are made
        with (``"tokenizer"``, ``"preprocessor"``; a whole model takes every asset it ships)."""
        if self._chains and (name is None or None in self._chains):
            raise ArtifactError("an artifact is either one chain of shards or named components, not both; this is a slimml bug.")
        unknown = [a for a in assets if a not in ASSETS]
        if unknown or name in self._chains:
            raise ArtifactError(f"chain {name!r} is added twice or names unknown assets {unknown}; this is a slimml bug.")
        self._chains[name] = _Chain(list(shards), list(inputs), list(outputs), Pooling.coerce(pooling), list(assets))

    def chain(self, name: str | None = None) -> list[ShardSpec]:
        """The shards of a chain added before (to rewrite them, e.g. :meth:`share_weights`)."""
        return self._chains[name].shards

    @property
    def shard_count(self) -> int:
        """Shards in all chains added so far."""
        return sum(len(c.shards) for c in self._chains.values())

    def share_weights(self, owner: str, user: str) -> int:
        """Point chain ``user``'s shards at chain ``owner``'s data files where every weight is the same
        (a decoder and its decoder with past); returns the bytes no longer stored."""
        from slimml.runtime.artifact.share import share_weights

        return share_weights(self.folder, self.chain(owner), self.chain(user))

    # the manifest --------------------------------------------------------------------------
    def commit(self, *, name: str, task: str, source: dict[str, Any], steps: list[dict[str, Any]],
               labels: list[str] | None = None, zero_shot: ZeroShot | dict | None = None,
               seq2seq: Seq2Seq | dict | None = None, checks: dict[str, Any] | None = None,
               tokenizer: Any = None, preprocessor: Any = None, slimml_version: str | None = None) -> Manifest:
        """Hash every file the chains and records name, write ``manifest.json`` last, and return
        the manifest as the runtime reads it back (components as manifests of their own).

        ``tokenizer``, ``preprocessor`` and ``slimml_version`` are accepted so that
        ``commit(**manifest.header())`` works; the assets are the ones added to this writer.
        """
        del tokenizer, preprocessor, slimml_version  # the writer's own assets and version count
        if not self._chains:
            raise ArtifactError("an artifact needs at least one chain of shards; this is a slimml bug.")
        records = {"tokenizer": self._tokenizer, "preprocessor": self._preprocessor}

        def part(c: _Chain, whole: bool) -> Manifest:
            uses = ASSETS if whole else c.assets
            return Manifest(name="", task="", source={}, steps=[], inputs=c.inputs, outputs=c.outputs, shards=c.shards,
                            files=[], pooling=c.pooling, **{a: records[a] if a in uses else None for a in ASSETS})

        whole = part(self._chains[None], True) if None in self._chains else None
        components = {} if whole else {n: part(c, False) for n, c in self._chains.items()}
        paths = [p for c in self._chains.values() for s in c.shards for p in (s.file, s.data) if p]
        paths += [p for r in records.values() if r is not None for p in r.files] + self._extra_files
        paths += [p for c in self._chains.values() if c.pooling is not None for p in c.pooling.files]
        readable = 0o666 & ~umask()  # as any file the user writes (ONNX's external data writer makes 0600)
        for p in dict.fromkeys(paths):
            safe_path(self.folder, p).chmod(readable)
        files = [file_entry(self.folder, safe_path(self.folder, p)) for p in dict.fromkeys(paths)]  # a shared file once
        manifest = Manifest(
            name=name, task=task, source=source, steps=steps,
            inputs=whole.inputs if whole else [], outputs=whole.outputs if whole else [],
            shards=whole.shards if whole else [], files=files, pooling=whole.pooling if whole else None,
            labels=labels, components=components, zero_shot=zero_shot, seq2seq=seq2seq, checks=dict(checks or {}),
            slimml_version=slimml.__version__, **records,
        )
        manifest.write(self.folder)
        return read_manifest(self.folder)

    def update(self, manifest: Manifest) -> None:
        """Write ``manifest`` again after :meth:`commit` (its checks or steps changed; its files did not)."""
        manifest.write(self.folder)

    def adopt(self, folder: Path) -> Manifest:
        """Replace what the writer holds with the finished artifact ``folder`` written beside it by
        another (non-atomic) writer: ``convert --quantize`` puts the quantized artifact in place of
        the float one inside the same atomic write."""
        shutil.rmtree(self.folder)
        os.rename(folder, self.folder)
        return read_manifest(self.folder)


def save_onnx(model: onnx.ModelProto, path: Path) -> str | None:
    """Save ``model`` at ``path`` with its weights in ``path.data`` beside it; returns the data file's
    name relative to ``path``'s folder, or None when every weight stayed inline."""
    import onnx

    path.parent.mkdir(parents=True, exist_ok=True)
    data = f"{path.name}.data"
    onnx.save_model(model, str(path), save_as_external_data=True, all_tensors_to_one_file=True,
                    location=data, size_threshold=WEIGHT_MIN_BYTES)
    if not (path.parent / data).exists():  # every weight was small: nothing went to the data file
        onnx.save_model(onnx.load(str(path)), str(path))
        return None
    return data
