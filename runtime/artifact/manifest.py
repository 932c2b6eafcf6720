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
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from slimml.errors import ArtifactError, IntegrityError
from slimml.runtime.artifact.files import FileEntry, safe_path, utf8_path
from slimml.runtime.artifact.records import (
    ASSETS, Pooling, Preprocessor, Seq2Seq, Tokenizer, ZeroShot, assets_problems, derived_assets, is_int,
)

FORMAT = "slimml.artifact"
FORMAT_VERSION = 4  # the newest this slimml reads and writes
# 2 added components, 3 projections and a cut after pooling (``pooling.dense``, ``truncate_dim``), 4 the ``requires`` list
# (what a reader must apply, else refuse the artifact); each artifact is written as the oldest version that reads it
# right (one chain without projections: 1)
READS_VERSIONS = (1, 2, 3, 4)
# what this slimml applies of the fields a version-4 manifest may require; a name not here is refused (a newer record)
APPLIES = frozenset({"seq2seq.search", "seq2seq.prompt_ids", "seq2seq.bad_words_ids", "seq2seq.forced_eos_token_id",
                     "seq2seq.language_id", "seq2seq.language_task_id", "zero_shot.bias", "zero_shot.activation", "zero_shot.text_length"})
MANIFEST_NAME = "manifest.json"
MAX_MANIFEST_BYTES = 64 << 20  # a manifest is a few KB per shard; anything this big is not one

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


def tensor_list(tensors: list[TensorSpec], types: bool = True) -> str:
    """Tensors as ``name dtype[shape]`` (or names alone), one entry per numbered family: a decoder's
    60 cache tensors read ``past_key_values.{0..29}.key float32[...]`` (the indices as a range where
    they run without a gap). Names are joined as they are, whatever characters they hold."""
    groups: dict[tuple, list[int]] = {}
    for t in tensors:
        numbered = re.fullmatch(r"(.*?\.)(\d+)(\..*)", t.name)
        family = (numbered[1], numbered[3]) if numbered else (t.name, None)
        groups.setdefault((family, t.dtype, str(t.shape)) if types else (family, "", ""), []).append(
            int(numbered[2]) if numbered else -1)
    shown = []
    for ((head, tail), dtype, shape), idx in groups.items():
        typed = f" {dtype}{shape}" if types else ""
        if tail is None:
            shown += [head + typed] * len(idx)
        elif len(idx) > 2:
            span = f"{idx[0]}..{idx[-1]}" if idx == list(range(idx[0], idx[0] + len(idx))) else ",".join(map(str, idx))
            shown.append(head + "{" + span + "}" + tail + typed)
        else:
            shown += [head + str(i) + tail + typed for i in idx]
    return ", ".join(shown)


@dataclass
class ShardSpec:
    """One shard of a chain: its ONNX file, its weights' data file and size, and the tensors it
    takes (each with ``source``: ``"input"`` or the shard that makes it) and hands on."""

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
    """What ``manifest.json`` holds: the model's name and task, its inputs and outputs, its chain
    of shards (``shards``; ``components`` for a model of several chains), every file with its size
    and sha256 (``files``), the records its inputs are made with (``tokenizer``, ``preprocessor``,
    ``pooling``, ``labels``, ...), and how it was made (``source``, ``steps``, ``checks``).

    Example:
        >>> m = read_manifest("artifacts/all-MiniLM-L6-v2")
        >>> m.task, m.shard_count, [t.name for t in m.outputs]
        ('sentence-embedding', 7, ['last_hidden_state'])
    """

    name: str
    task: str  # "sentence-embedding", "feature-extraction", "text-generation", "generic", ...
    source: dict[str, Any]
    steps: list[dict[str, Any]]
    inputs: list[TensorSpec]
    outputs: list[TensorSpec]
    shards: list[ShardSpec]
    files: list[FileEntry]
    # the records (see .records): in a component, tokenizer and preprocessor are set when its
    # inputs are made with them (the component's "assets")
    tokenizer: Tokenizer | None = None
    pooling: Pooling | None = None
    preprocessor: Preprocessor | None = None  # how raw images or audio become tensors
    labels: list[str] | None = None  # class names by output index (classifiers)
    # a model of several graphs (CLIP's text and vision towers, an encoder and a decoder): each
    # component is a chain of shards of its own, held as a manifest of its own (see component())
    components: dict[str, Manifest] = field(default_factory=dict)
    zero_shot: ZeroShot | None = None  # CLIP-style scoring
    seq2seq: Seq2Seq | None = None  # encoder-decoder generation
    checks: dict[str, Any] = field(default_factory=dict)
    slimml_version: str = ""
    format_version: int = FORMAT_VERSION
    sha256: str = field(default="", compare=False)  # of the manifest.json bytes read (read_manifest)
    stage_of: str = field(default="", compare=False)  # a stage (stage()): the task of the artifact it was cut from

    def __post_init__(self) -> None:  # records given as dicts (older code, tests) become records
        self.tokenizer = Tokenizer.coerce(self.tokenizer)
        self.pooling = Pooling.coerce(self.pooling)
        self.preprocessor = Preprocessor.coerce(self.preprocessor)
        self.zero_shot = ZeroShot.coerce(self.zero_shot)
        self.seq2seq = Seq2Seq.coerce(self.seq2seq)

    @property
    def assets(self) -> list[str]:
        """The artifact-level records this manifest (or component) takes its inputs through."""
        return [a for a in ASSETS if getattr(self, a) is not None]

    def header(self) -> dict[str, Any]:
        """The fields that are not chains of shards or files: what a rewrite (quantize) carries over."""
        return {k: getattr(self, k) for k in ("name", "task", "source", "steps", "tokenizer", "preprocessor", "labels",
                                             "zero_shot", "seq2seq", "checks", "slimml_version")}

    def component(self, name: str) -> Manifest:
        """One component as a manifest of its own (the whole artifact when it has no components)."""
        if not self.components:
            return self
        if name not in self.components:
            raise ArtifactError(
                f"the artifact {self.name} has no component {name!r}; its components are {', '.join(self.components)}."
            )
        return self.components[name]

    def asset_files(self) -> list[str]:
        """The files beside the shards that the runtime reads (tokenizer, preprocessor config, the
        pooling's projections)."""
        poolings = [c.pooling for c in (self.components.values() if self.components else [self])]
        return [p for a in (self.tokenizer, self.preprocessor, *poolings) if a for p in a.files]

    @property
    def requires(self) -> list[str]:
        """Fields a reader must apply, else refuse the artifact (format version 4; see :data:`APPLIES`)."""
        return [*(self.seq2seq.requires if self.seq2seq else []), *(self.zero_shot.requires if self.zero_shot else [])]

    @property
    def needs_version(self) -> int:
        """The oldest format version that reads this manifest right: 4 where it ``requires`` fields;
        3 for a classifier's multi-label or cross-encoder scores (a slimml of format 1 and 2 took
        softmax), as for projections after pooling."""
        if self.requires:
            return 4
        poolings = [c.pooling for c in (self.components.values() if self.components else [self])]
        scored = self.source.get("problem_type") == "multi_label_classification" or \
            self.source.get("cross_encoder_activation") is not None
        return max([2 if self.components else 1, 3 if scored else 1, *(p.needs_version for p in poolings if p is not None)])

    @property
    def shard_count(self) -> int:
        """Shards of the artifact, every component's counted."""
        return sum(len(c.shards) for c in self.components.values()) if self.components else len(self.shards)

    @property
    def total_bytes(self) -> int:
        """Bytes of every file the manifest lists."""
        return sum(f.bytes for f in self.files)

    def last_uses(self) -> dict[int, list[str]]:
        """For each shard index, the activations no later shard reads and that are not model
        outputs: a runner can free them once that shard has run."""
        keep = {t.name for t in self.outputs}
        last: dict[str, int] = {}
        for s in self.shards:
            for t in s.inputs:
                last[t.name] = s.index
        drop: dict[int, list[str]] = {s.index: [] for s in self.shards}
        for name, idx in last.items():
            if name not in keep:
                drop[idx].append(name)
        return drop

    def segment_io(self, indices: list[int]) -> tuple[list[TensorSpec], list[TensorSpec]]:
        """What a run of consecutive shards takes from outside it, and what it must hand on.

        Inputs: model inputs and earlier shards' outputs that its shards read. Outputs: what its
        shards produce that is a model output or is read by a shard after it.
        """
        inside = set(indices)
        last = max(indices)
        ins: dict[str, TensorSpec] = {}
        for i in indices:
            for t in self.shards[i].inputs:
                if t.source == "input" or t.source not in inside:
                    ins.setdefault(t.name, t)
        later = {t.name for s in self.shards[last + 1:] for t in s.inputs}
        model_outputs = {t.name for t in self.outputs}
        outs = [t for i in indices for t in self.shards[i].outputs if t.name in later or t.name in model_outputs]
        return list(ins.values()), outs

    def stage(self, first: int, last: int) -> Manifest:
        """Shards ``first..last`` (inclusive) as a manifest of their own: a pipeline stage.

        Its inputs are what those shards read from outside (model inputs and earlier shards'
        activations), its outputs what they hand on (activations later shards read, and model
        outputs); its shards are renumbered from 0 and its files are theirs alone, so loading it
        hashes and maps only them. It has no tokenizer or pooling (the caller does text), and its task
        is ``generic``: it runs tensors, as ``run`` takes them (a mask between shards is no image).
        """
        whole = all(isinstance(i, int) and not isinstance(i, bool) for i in (first, last))
        if not whole or not 0 <= first <= last < len(self.shards):
            raise ArtifactError(
                f"shards {first}-{last} are not a range of this artifact's {len(self.shards)} shards "
                f"(0-{len(self.shards) - 1}); give first <= last inside it."
            )
        indices = list(range(first, last + 1))
        ins, outs = self.segment_io(indices)

        def local(t: TensorSpec) -> TensorSpec:
            inside = isinstance(t.source, int) and first <= t.source <= last
            return TensorSpec(t.name, t.dtype, list(t.shape), t.source - first if inside else "input")

        shards = [ShardSpec(index=s.index - first, file=s.file, data=s.data, weight_bytes=s.weight_bytes,
                            inputs=[local(t) for t in s.inputs], outputs=list(s.outputs), layers=list(s.layers))
                  for s in self.shards[first:last + 1]]
        paths = {p for s in shards for p in (s.file, s.data) if p}
        return Manifest(
            name=f"{self.name} (shards {first}-{last})", task="generic", source=self.source, steps=self.steps,
            inputs=[TensorSpec(t.name, t.dtype, list(t.shape)) for t in ins], outputs=list(outs), shards=shards,
            files=[f for f in self.files if f.path in paths], checks={}, slimml_version=self.slimml_version,
            format_version=self.format_version, stage_of=self.task,
        )

    def chain_json(self, component: bool = False) -> dict[str, Any]:
        """The chain of shards: inputs, outputs, shards and pooling (and, for a component, its assets)."""
        return {
            "inputs": [t.to_json() for t in self.inputs],
            "outputs": [t.to_json() for t in self.outputs],
            "shards": [s.to_json() for s in self.shards],
            "pooling": self.pooling.to_json() if self.pooling else None,
            **({"assets": self.assets} if component else {}),
        }

    def to_json(self) -> dict[str, Any]:
        """The manifest as ``manifest.json`` holds it (as the oldest version that reads it right)."""
        chains = ({"components": {n: c.chain_json(component=True) for n, c in self.components.items()}}
                  if self.components else self.chain_json())
        return {
            "format": FORMAT,
            "format_version": self.needs_version,
            **({"requires": self.requires} if self.requires else {}),
            "slimml_version": self.slimml_version,
            "name": self.name,
            "task": self.task,
            "source": self.source,
            "steps": self.steps,
            **chains,
            "files": [asdict(f) for f in self.files],
            "tokenizer": self.tokenizer.to_json() if self.tokenizer else None,
            **({"preprocessor": self.preprocessor.to_json()} if self.preprocessor else {}),
            **({"labels": self.labels} if self.labels is not None else {}),
            **({"zero_shot": self.zero_shot.to_json()} if self.zero_shot else {}),
            **({"seq2seq": self.seq2seq.to_json()} if self.seq2seq else {}),
            "checks": self.checks,
        }

    def write(self, folder: str | os.PathLike) -> Path:
        """Write ``manifest.json`` into ``folder`` (replacing it in one rename, under a name no one can
        predict). Artifacts are written with :class:`slimml.runtime.artifact.writer.ArtifactWriter`,
        which hashes the files first."""
        from slimml.runtime.artifact.replace import replace_file

        return replace_file(Path(folder) / MANIFEST_NAME, json.dumps(self.to_json(), indent=2) + "\n")


def read_manifest(folder: str | os.PathLike) -> Manifest:
    """Read and check the structure of ``folder/manifest.json`` (not the files' hashes).

    Args:
        folder: the artifact folder.

    Returns:
        The :class:`Manifest`, its ``sha256`` that of the bytes read.

    Raises:
        ArtifactError: the folder or manifest is missing, is not JSON, is of another format or
            version, or names a path that escapes the folder.
    """
    folder = Path(folder)
    utf8_path(folder)
    if folder.is_file():  # a model file given where its converted artifact belongs
        if folder.name == MANIFEST_NAME:
            raise ArtifactError(f"{folder} is the artifact's manifest; give the folder that holds it: {folder.parent}")
        raise ArtifactError(
            f"{folder} is a file, not an artifact folder; convert it first (`slimml convert {folder} -o FOLDER`) "
            "and give that folder."
        )
    if not folder.is_dir():
        raise ArtifactError(
            f"{folder} is not an artifact folder: it does not exist. "
            "Give the folder that `slimml convert` wrote (it holds manifest.json)."
        )
    path = folder / MANIFEST_NAME
    if not path.is_file():
        raise ArtifactError(
            f"{folder} has no {MANIFEST_NAME}: it is not a slimml artifact, or its conversion did not finish. "
            + (f"It holds a model: convert it into a new folder (`slimml convert {folder} -o OUT`) and give OUT."
               if (folder / "config.json").is_file() else
               "Convert the model into a new folder (`slimml convert SOURCE -o OUT`) and give OUT.")
        )
    safe_path(folder, MANIFEST_NAME)  # a manifest.json that links out of the folder is refused too
    if path.stat().st_size > MAX_MANIFEST_BYTES:
        raise ArtifactError(
            f"{path} is {path.stat().st_size} bytes, far more than any slimml manifest "
            f"(limit {MAX_MANIFEST_BYTES >> 20} MB); it is not one. Convert the model again."
        )
    try:
        data = path.read_bytes()
        raw = json.loads(data.decode("utf-8"))
    except (ValueError, RecursionError) as e:  # ValueError: JSON, UTF-8, or a number of more than 4,300 digits
        why = ("nested too deeply" if isinstance(e, RecursionError) else str(e)
               if isinstance(e, (json.JSONDecodeError, UnicodeDecodeError)) else "a number too long to read")
        raise ArtifactError(f"{path} is not valid JSON ({why}); the artifact is damaged: convert again.") from None
    if not isinstance(raw, dict) or raw.get("format") != FORMAT:
        raise ArtifactError(f"{path} is not a slimml manifest (expected \"format\": \"{FORMAT}\"); give the folder "
                            "`slimml convert` wrote, or convert the model into a new folder.")
    version = raw.get("format_version")
    if version not in READS_VERSIONS or isinstance(version, (bool, float)):
        raise ArtifactError(
            f"{path} has manifest format version {version!r}, but this slimml reads versions "
            f"{', '.join(map(str, READS_VERSIONS[:-1]))} and {READS_VERSIONS[-1]}. Convert the model again with this slimml, or install "
            "the slimml version that wrote it."
        )
    requires = raw.get("requires") if isinstance(raw.get("requires"), list) else []  # other items: malformed, below
    unknown = [r for r in requires if isinstance(r, str) and r not in APPLIES]
    if unknown:
        raise ArtifactError(
            f"{path} needs {', '.join(map(str, unknown))}, which this slimml does not apply, so it would run the model "
            f"otherwise; install the slimml that wrote it ({raw.get('slimml_version') or 'a newer one'}) or newer.")
    problems = validate_raw(raw)
    if problems:
        shown = "; ".join(problems[:8]) + (f"; and {len(problems) - 8} more" if len(problems) > 8 else "")
        raise ArtifactError(f"{path} is malformed: {shown}. Convert the model again.")
    try:
        manifest = _build(raw, version)
    except (KeyError, TypeError, ValueError, AttributeError, OverflowError) as e:
        raise ArtifactError(f"{path} is malformed ({type(e).__name__}: {e}); convert the model again.") from None
    for part in [manifest] if not manifest.components else manifest.components.values():
        _check_structure(folder, part)
    manifest.sha256 = hashlib.sha256(data).hexdigest()
    for part in manifest.components.values():  # each component's engine checks the one file they were all read from
        part.sha256 = manifest.sha256
    return manifest


def check_same_manifest(folder: Path, manifest: Manifest, expected: str | None) -> None:
    """Refuse an artifact whose manifest.json is not the one ``expected`` hashes: the caller pinned
    it (``load(manifest_sha256=)``), or a pipeline stage or a server replica on another node checks
    it holds the artifact the driver read.

    Raises:
        IntegrityError: naming the folder, both hashes and the fix.
    """
    if expected is not None and manifest.sha256 != expected:
        raise IntegrityError(
            f"the artifact {folder} is not the one pinned: its {MANIFEST_NAME} has sha256 {manifest.sha256[:16]}..., not "
            f"the {str(expected)[:16]}... expected (manifest_sha256=, or the driver's on a cluster). Copy the pinned "
            "artifact there again (on a cluster, the same artifact at the same path on every node), or pin the new "
            "hash if you changed it."
        )


def check_manifest_unchanged(folder: Path, manifest: Manifest) -> None:
    """Refuse an artifact whose manifest.json is no longer the one ``manifest`` was read from
    (``Model.verify``: the model runs what it read at load; the folder now says something else).

    Raises:
        IntegrityError: naming the folder and the fix.
    """
    try:
        now = hashlib.sha256((Path(folder) / MANIFEST_NAME).read_bytes()).hexdigest()
    except OSError:
        now = None
    if manifest.sha256 and now != manifest.sha256:  # "": a manifest made in memory, not read from the folder
        raise IntegrityError(
            f"{MANIFEST_NAME} in the artifact {folder} was changed or removed after the model loaded; the model runs what "
            "it read then, and the folder now holds something else. Find out who changed it, then load the artifact again."
        )


def _build(raw: dict[str, Any], version: int) -> Manifest:
    files = [FileEntry(path=f["path"], bytes=int(f["bytes"]), sha256=str(f["sha256"])) for f in raw["files"]]
    top = Manifest(
        name=str(raw["name"]), task=str(raw["task"]), source=dict(raw.get("source") or {}),
        steps=list(raw.get("steps") or []), inputs=[], outputs=[], shards=[], files=files,
        tokenizer=Tokenizer.coerce(raw.get("tokenizer")), preprocessor=Preprocessor.coerce(raw.get("preprocessor")),
        labels=raw.get("labels"), zero_shot=ZeroShot.coerce(raw.get("zero_shot")), seq2seq=Seq2Seq.coerce(raw.get("seq2seq")), checks=dict(raw.get("checks") or {}),
        slimml_version=str(raw.get("slimml_version", "")), format_version=version,
    )
    if "components" not in raw:
        return _with_chain(top, raw, name=None)
    top.components = {name: _with_chain(top, chain, name) for name, chain in raw["components"].items()}
    top.inputs = list({t.name: t for c in top.components.values() for t in c.inputs}.values())
    top.outputs = [t for c in top.components.values() for t in c.outputs]
    return top


def _with_chain(top: Manifest, chain: dict[str, Any], name: str | None) -> Manifest:
    """``top`` with one chain of shards: the whole manifest, or the component ``name``."""
    inputs = [TensorSpec.from_json(t) for t in chain["inputs"]]
    shards = [ShardSpec.from_json(s) for s in chain["shards"]]
    if name is None:
        files, tokenizer, preprocessor = top.files, top.tokenizer, top.preprocessor
    else:  # a component owns its shards' files, and the assets (tokenizer, preprocessor) its inputs are made with
        paths = {p for s in shards for p in (s.file, s.data) if p}
        assets = chain.get("assets")
        if assets is None:  # written before components recorded their assets (versions 1 and 2)
            assets = derived_assets({t.name for t in inputs}, [len(t.shape) for t in inputs])
        tokenizer = top.tokenizer if "tokenizer" in assets else None
        preprocessor = top.preprocessor if "preprocessor" in assets else None
        pooling = Pooling.coerce(chain.get("pooling"))
        paths |= {p for a in (tokenizer, preprocessor, pooling) if a for p in a.files}
        files = [f for f in top.files if f.path in paths]
    return Manifest(
        name=top.name if name is None else f"{top.name}/{name}", task=top.task, source=top.source, steps=top.steps,
        inputs=inputs, outputs=[TensorSpec.from_json(t) for t in chain["outputs"]], shards=shards, files=files,
        tokenizer=tokenizer, pooling=Pooling.coerce(chain.get("pooling")), preprocessor=preprocessor,
        labels=top.labels, checks=top.checks, slimml_version=top.slimml_version, format_version=top.format_version,
    )


_HEX = frozenset("0123456789abcdef")
_DTYPES = frozenset(
    ["float16", "float32", "float64", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64", "bool"]
)


def validate_raw(raw: dict[str, Any]) -> list[str]:
    """Every way the parsed ``manifest.json`` departs from the format, as ``where: what`` strings.

    Types are checked before anything is built from them, so a hand-edited or hostile manifest
    gets one :class:`ArtifactError` listing its problems instead of a stray TypeError later.
    """
    problems: list[str] = []

    def need(ok: bool, where: str, what: str) -> bool:
        if not ok:
            problems.append(f"{where} {what}")
        return ok

    def tensors(v: Any, where: str, shard: int | None = None) -> None:
        if not need(isinstance(v, list), where, "must be a list"):
            return
        for i, t in enumerate(v):
            w = f"{where}[{i}]"
            if not need(isinstance(t, dict), w, "must be an object"):
                continue
            need(isinstance(t.get("name"), str) and t.get("name") != "", f"{w}.name", "must be a non-empty string")
            need(isinstance(t.get("dtype"), str) and t["dtype"] in _DTYPES, f"{w}.dtype", f"is {t.get('dtype')!r}, not one of {sorted(_DTYPES)}")
            shape = t.get("shape")
            ok = isinstance(shape, list) and len(shape) <= 16
            ok = ok and all(d is None or isinstance(d, str) or is_int(d) for d in shape)
            need(ok, f"{w}.shape", "must be a list of sizes (int >= 0), axis names or null")
            if "from" in t:
                src = t["from"]
                ok = src == "input" or (is_int(src) and shard is not None and src < shard)
                need(ok, f"{w}.from", f"is {src!r}, neither \"input\" nor an earlier shard's index")

    def chain(c: dict[str, Any], at: str) -> None:
        tensors(c.get("inputs"), f"{at}inputs")
        tensors(c.get("outputs"), f"{at}outputs")
        shards = c.get("shards")
        if need(isinstance(shards, list), f"{at}shards", "must be a list"):
            for i, sh in enumerate(shards):
                w = f"{at}shards[{i}]"
                if not need(isinstance(sh, dict), w, "must be an object"):
                    continue
                need(sh.get("index") == i and is_int(sh.get("index")), f"{w}.index", f"must be {i} (shards are listed in order)")
                need(isinstance(sh.get("file"), str), f"{w}.file", "must be a string")
                need(sh.get("data") is None or isinstance(sh.get("data"), str), f"{w}.data", "must be a string or null")
                need(is_int(sh.get("weight_bytes", 0)), f"{w}.weight_bytes", "must be an int >= 0")
                layers = sh.get("layers", [])
                need(isinstance(layers, list) and all(isinstance(x, str) for x in layers), f"{w}.layers", "must be a list of strings")
                tensors(sh.get("inputs"), f"{w}.inputs", shard=i)
                tensors(sh.get("outputs"), f"{w}.outputs")
        if c.get("pooling") is not None:
            problems.extend(Pooling.problems(c["pooling"], f"{at}pooling"))
            for key in ("dense", "truncate_dim"):  # an older slimml would skip them, and embed otherwise
                if isinstance(c["pooling"], dict) and c["pooling"].get(key) and raw.get("format_version") in (1, 2):
                    problems.append(f"{at}pooling.{key} needs format_version 3")
        if at and c.get("assets") is not None:
            problems.extend(assets_problems(c["assets"], f"{at}assets"))

    requires = raw.get("requires")
    if requires is not None:
        need(isinstance(requires, list) and all(isinstance(r, str) for r in requires), "requires", "must be a list of names")
        need(raw.get("format_version") not in (1, 2, 3), "requires", "needs format_version 4")
    for key in ("name", "task"):
        need(isinstance(raw.get(key), str), key, "must be a string")
    for key in ("source", "checks"):
        need(raw.get(key) is None or isinstance(raw.get(key), dict), key, "must be an object")
    need(raw.get("steps") is None or isinstance(raw.get("steps"), list), "steps", "must be a list")
    comps = raw.get("components")
    if comps is None:
        chain(raw, "")
    elif raw.get("format_version") == 1:
        problems.append("components need format_version 2 or later")
    elif need(isinstance(comps, dict) and len(comps) > 0, "components", "must be an object of named chains"):
        for name, c in comps.items():
            ok = need(isinstance(name, str) and name.replace("_", "").replace("-", "").isalnum(),
                      f"components[{name!r}]", "must be named with letters, digits, - and _")
            if ok and need(isinstance(c, dict), f"components.{name}", "must be an object"):
                chain(c, f"components.{name}.")
        for record in (ZeroShot, Seq2Seq):
            if raw.get(record.KEY) is not None:
                problems.extend(record.problems(raw[record.KEY], record.KEY, components=comps))
    files = raw.get("files")
    if need(isinstance(files, list), "files", "must be a list"):
        for i, f in enumerate(files):
            w = f"files[{i}]"
            if not need(isinstance(f, dict), w, "must be an object"):
                continue
            need(isinstance(f.get("path"), str), f"{w}.path", "must be a string")
            need(is_int(f.get("bytes")), f"{w}.bytes", "must be an int >= 0")
            sha = f.get("sha256")
            need(isinstance(sha, str) and len(sha) == 64 and set(sha) <= _HEX, f"{w}.sha256", "must be 64 hex digits")
    for record in (Tokenizer, Preprocessor):
        if raw.get(record.KEY) is not None:
            problems.extend(record.problems(raw[record.KEY], record.KEY))
    labels = raw.get("labels")
    need(labels is None or isinstance(labels, list) and all(isinstance(x, str) for x in labels), "labels",
         "must be a list of strings or null")
    return problems


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
    for what, asset in (("tokenizer", m.tokenizer), ("preprocessor", m.preprocessor)):
        if asset and any(p not in listed for p in asset.files):
            raise ArtifactError(f"the manifest's {what} file is not in its file list; convert again.")
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
        raise ArtifactError(f"no shard produces the model output(s) {missing}; the manifest is damaged: convert again.")
    names = [t.name for t in m.inputs]
    if len(set(names)) != len(names):
        raise ArtifactError(f"the manifest lists a model input twice ({names}); it is damaged: convert again.")
    if m.pooling and m.pooling.output not in {t.name for t in m.outputs}:
        raise ArtifactError(f"the manifest pools {m.pooling.output!r}, which is not a model output; convert again.")
    if m.pooling and any(p not in listed for p in m.pooling.files):
        raise ArtifactError("the manifest's pooling names a weight file its file list does not record with a hash; "
                            "the manifest was edited by hand or damaged: convert again.")
