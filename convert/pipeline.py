"""``convert``: source model -> ONNX -> layer shards -> checked artifact folder, written atomically."""

from __future__ import annotations

import contextlib
import os
import shutil
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

import slimml
from slimml.convert.check_seq2seq import check_seq2seq
from slimml.convert.distill import DistillConfig
from slimml.convert.export import ExportConfig, Exported, export
from slimml.convert.layerwise import write_layerwise
from slimml.convert.prune import PruneConfig
from slimml.convert.reference import reference_for
from slimml.convert.shard import ShardConfig, shard
from slimml.convert.share import share_weights
from slimml.convert.sources import Source, resolve
from slimml.convert.towers import split_towers
from slimml.runtime.artifact.atomic import atomic_folder, check_output
from slimml.errors import ConfigError, ExportError, SlimmlError
from slimml.runtime.tools.bench import sample_feeds, time_runs
from slimml.runtime.artifact.manifest import Manifest, TensorSpec, file_entry, read_manifest, verify_files
from slimml.runtime.loader import load
from slimml.runtime.engine.session import make_session
from slimml.runtime.tasks.inputs.text import TextEncoder

SAMPLE_TEXTS = [
    "A man is playing a guitar on the street.",
    "The quick brown fox jumps over the lazy dog.",
    "Quantized models run faster on small machines.",
    "Short.",
]


@dataclass
class ConvertConfig:
    """Everything ``convert`` does, stage by stage.

    Args:
        export: how to export to ONNX.
        shard: how to split the graph.
        verify: compare the artifact with the unsharded graph and the torch model.
        measure_latency: time the artifact (batch 1) for the report.
        distill: train a student with fewer layers before export (``convert.distill``).
        prune: remove attention heads and FFN neurons before export (``convert.prune``).
        quantize: a ``slimml.quantize`` config, applied to the sharded artifact after the
            checks (``None``: stay float).
        compare_on: with ``distill``/``prune``, an STS CSV on which the report scores the teacher
            and the student (``measure_latency`` also times the two side by side).
    """

    export: ExportConfig = field(default_factory=ExportConfig)
    shard: ShardConfig = field(default_factory=ShardConfig)
    verify: bool = True
    measure_latency: bool = True
    distill: DistillConfig | None = None
    prune: PruneConfig | None = None
    quantize: Any = None
    compare_on: str | os.PathLike | None = None


@dataclass
class ConvertReport:
    out: Path
    name: str
    task: str
    shards: int
    size_mb: float
    checks: dict[str, Any]
    latency_ms: float | None = None
    seconds: float = 0.0
    steps: list[dict[str, Any]] = field(default_factory=list)
    teacher: dict[str, Any] | None = None  # the student against its teacher (distill / prune only)

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["out"] = str(self.out)
        return d


def convert(
    source: Any = None,
    out: str | os.PathLike | None = None,
    config: ConvertConfig | None = None,
    example_inputs: Any = None,
    on_step: Callable[[str], None] | None = None,
    on_progress: Callable[[int, int, float], None] | None = None,
) -> ConvertReport:
    """Convert a model into a sharded, checked artifact folder.

    Args:
        source: a Hugging Face model folder, an ``.onnx`` file, a ``.py`` file defining ``model``
            and ``example_inputs``, a torch checkpoint, a ``torch.nn.Module``, or ``None`` for the
            embedded default model (all-MiniLM-L6-v2).
        out: the artifact folder (default ``artifacts/<name>``; for a student
            ``artifacts/<name>-d3-p50``, for a quantized model ``artifacts/<name>-int8``). It is
            written in a temporary folder beside it and renamed at the end, so an interrupted
            convert leaves the previous artifact, or nothing, at ``out``.
        config: the stages' settings.
        example_inputs: for an ``nn.Module`` source, what to call it with during export.
        on_step: called with a short description as each stage starts (for progress display).
        on_progress: called as ``on_progress(step, total, loss)`` while a student trains.

    Returns:
        A :class:`ConvertReport`: size, shard count, differences from the original, latency.

    Example:
        >>> from slimml.convert import convert
        >>> report = convert()  # the default model into artifacts/all-MiniLM-L6-v2
        >>> report.checks["max_abs_diff"] <= 1e-5
        True
    """
    t0 = time.perf_counter()
    config = config or ConvertConfig()
    current = ["starting"]

    def step(msg: str) -> None:
        current[0] = msg
        if on_step is not None:
            on_step(msg)
    if config.quantize is not None:
        from slimml.quantize.api import check_inputs

        check_inputs(config.quantize)  # a bad calibration or eval file fails before the export
    if config.compare_on is not None:
        if config.distill is None and config.prune is None:
            raise ConfigError("compare_on (--compare-on) compares a student with its teacher; set distill or prune with it.")
        from slimml.runtime.tools.evaluate import read_sts

        read_sts(config.compare_on)  # a missing or malformed STS file fails before any training
    step("reading the source")
    src = resolve(source, example_inputs)
    out = Path(out) if out is not None else Path("artifacts") / (src.name + _default_suffix(config))
    check_output(out)
    with _one_line_errors(src.name, current), atomic_folder(out) as tmp:  # disk errors: atomic_folder words them
        teacher, shrunk = src, []
        if config.distill is not None or config.prune is not None:
            src, shrunk = _shrink(src, out, tmp / ".work", config, step, on_progress)
        step("exporting to ONNX")
        exported = export(src, tmp / ".work", config.export)
        step("splitting into shards")
        parts, zero_shot = split_towers(exported.onnx_path, src.path if src.kind == "huggingface" else None)
        if exported.layerwise:  # a decoder too big to trace whole: its shards are written layer by layer
            lw = exported.layerwise
            chains = {None: (exported.onnx_path, write_layerwise(exported.onnx_path, lw["template"], lw["folder"],
                                                                  lw["depth"], tmp / ".work", tmp))}
        elif exported.graphs:  # an encoder-decoder: encoder, decoder and decoder with past, each a component
            # both decoders in one folder, so the one with past can read the other's data files
            places = {"encoder": ("encoder", "shard"), "decoder": ("decoder", "shard"), "decoder_with_past": ("decoder", "past")}
            chains = {n: (path, _shard_into(path, tmp, *places[n], config.shard)) for n, path in exported.graphs.items()}
            share_weights(tmp, chains["decoder"][1], chains["decoder_with_past"][1])
        elif parts:  # a two-tower model: each tower a component, sharded into a folder of its own
            chains = {c.name: (c.onnx_path, _shard_into(c.onnx_path, tmp, c.name, "shard", config.shard)) for c in parts}
        else:
            chains = {None: (exported.onnx_path, shard(exported.onnx_path, tmp, config.shard))}
        manifest = _write_manifest(tmp, src, exported, chains, config, zero_shot)
        if shrunk:  # the steps before export, and the teacher as the source (the student folder is temporary)
            manifest.steps[:0] = shrunk
            manifest.source |= {"path": str(teacher.path), "student_of": teacher.name}
        if config.verify:
            step("checking against the original model")
            if manifest.seq2seq:
                manifest.checks = check_seq2seq(tmp, manifest, src, exported, SAMPLE_TEXTS)
            elif exported.layerwise:
                manifest.checks = verify_layerwise(tmp, manifest, exported)
            elif exported.info.get("exporter") == "fused":
                from slimml.convert.check_decoder import verify_decoder

                manifest.checks = verify_decoder(tmp, manifest, src, exported)
            else:
                manifest.checks = verify(tmp, manifest, src, exported)
        else:
            verify_files(tmp, manifest)
        if config.quantize is not None:
            manifest = _quantize_step(tmp, manifest, config.quantize, step)
        against = None
        if shrunk and (config.measure_latency or config.compare_on is not None):
            step("comparing with the teacher")
            against = _against_teacher(out, tmp, manifest, config.compare_on,
                                       config.distill.teacher_memory_budget if config.distill else None)
            manifest.checks["vs_teacher"] = against
        latency = None
        if config.measure_latency and not manifest.seq2seq:  # an encoder-decoder's speed is per token: bench generate
            step("measuring latency")
            model = load(tmp, device="cpu")
            seq = min(128, model.max_sequence_length or 128)  # CLIP's text tower takes 77
            feeds = sample_feeds(model.inputs, batch=1, seq=seq, source=model.manifest.source)
            latency = float(np.median(time_runs(lambda: model.run(feeds), runs=10, warmup=3)))
            manifest.checks["latency_ms_b1_s128"] = round(latency, 3)
            del model
        manifest.write(tmp)
        shutil.rmtree(tmp / ".work", ignore_errors=True)
    if shrunk:  # the artifact is in place: the student's checkpoint and the teacher's cache are done with
        checkpoint, cache, teacher_art = _resume_files(out)
        for leftover in (checkpoint, cache, teacher_art, teacher_art.with_name(teacher_art.name + ".source")):
            shutil.rmtree(leftover, ignore_errors=True) if leftover.is_dir() else leftover.unlink(missing_ok=True)
    return ConvertReport(
        out=out, name=manifest.name, task=manifest.task, shards=manifest.shard_count,
        size_mb=manifest.total_bytes / 1e6, checks=manifest.checks, latency_ms=latency,
        seconds=time.perf_counter() - t0, steps=manifest.steps, teacher=against,
    )


@contextlib.contextmanager
def _one_line_errors(name: str, current: list[str]):
    """A dependency's exception (torch, optimum, onnx, ONNX Runtime) becomes one ExportError naming
    the step it broke; slimml's own errors pass as they are. ``SLIMML_DEBUG=1`` shows the cause."""
    try:
        yield
    except SlimmlError:
        raise
    except Exception as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        raise ExportError(
            f"converting {name} failed while {current[0]} ({type(e).__name__}: {first}). If slimml does not support "
            "this architecture yet, export it to ONNX yourself and convert the .onnx file; SLIMML_DEBUG=1 shows the cause."
        ) from e


def _against_teacher(out: Path, tmp: Path, manifest: Manifest, sts_file: Any,
                     teacher_budget: int | str | None = None) -> dict[str, Any]:
    """Compare the student in ``tmp`` with the teacher's artifact (float) converted for distillation."""
    from slimml.convert.compare import compare, student_params

    manifest.write(tmp)
    budget = teacher_budget
    t_model = load(_resume_files(out)[2], device="cpu", memory_budget=budget)  # streamed as in distillation
    s_model = load(tmp, device="cpu")
    try:  # a streamed teacher reads all its shards each run: fewer rounds
        return compare(t_model, s_model, *student_params(manifest.steps), sts_file=sts_file,
                       rounds=20 if budget is None else 3)
    finally:
        t_model.close()
        s_model.close()


def _default_suffix(config: ConvertConfig) -> str:
    """What the default folder adds to the model's name, so it never replaces the plain float
    artifact: ``-d3-p50`` for a student (quantized or not, as the README names it), else the
    quantization scheme (``-int8``), else nothing."""
    suffix = f"-d{config.distill.layers}" if config.distill is not None and config.distill.layers else ""
    suffix += f"-p{round(config.prune.fraction * 100):02d}" if config.prune is not None else ""
    if not suffix and config.quantize is not None:
        from slimml.quantize.config import scheme_tag

        suffix = f"-{scheme_tag(config.quantize)}"
    return suffix


def _shrink(src: Source, out: Path, work: Path, config: ConvertConfig, step, on_progress):
    """Distil and/or prune a Hugging Face source into a student folder; the student is the new source.

    The teacher is converted first (float, unchecked) into ``work/teacher``: its outputs for the
    distillation data come from that artifact through the runtime, streamed under
    ``distill.teacher_memory_budget``, and the report compares the student with it.
    """
    from slimml.convert.distill import check, shrink

    if src.kind != "huggingface":
        raise ConfigError(
            f"--distill-layers and --prune need a Hugging Face model folder (or no SOURCE for the default model); "
            f"{src.name} is a {src.kind} source."
        )
    distill = config.distill or DistillConfig()
    checked = check(src.path, distill, config.prune)  # a bad request fails before the teacher is converted
    checkpoint, cache, teacher_art = _resume_files(out)  # outside the temp dir: they survive a kill
    stamp = teacher_art.with_name(teacher_art.name + ".source")
    fingerprint = _folder_fingerprint(src.path)
    if not (teacher_art.is_dir() and stamp.is_file() and stamp.read_text() == fingerprint):
        step("converting the teacher")
        stamp.unlink(missing_ok=True)
        convert(src.path, teacher_art, ConvertConfig(export=ExportConfig(opset=config.export.opset), verify=False,
                                                     measure_latency=False))
        stamp.write_text(fingerprint)
    what = " and ".join(w for w, c in (("distilling", config.distill and config.distill.layers), ("pruning", config.prune)) if c)
    step(what)
    steps = shrink(src.path, work / "student", config.distill, config.prune, checkpoint=checkpoint, progress=on_progress,
                   teacher_artifact=teacher_art, cache_dir=cache, on_step=step, keep_checkpoint=True,
                   checked=checked)
    return Source(kind="huggingface", name=src.name, path=work / "student", extra=src.extra), steps


def _resume_files(out: Path) -> tuple[Path, Path, Path]:
    """The student's checkpoint, the teacher's output cache and the teacher's artifact of a convert into
    ``out``: kept beside it until the convert completes, so a killed run resumes where it stopped."""
    return (out.parent / f".{out.name}.distill-checkpoint.pt", out.parent / f".{out.name}.teacher-cache",
            out.parent / f".{out.name}.teacher")


def _folder_fingerprint(folder: Path) -> str:
    """Names, sizes and modification times of a model folder's files: a changed teacher is converted again."""
    import hashlib

    h = hashlib.sha256()
    for p in sorted(folder.rglob("*")):
        if p.is_file():
            st = p.stat()
            h.update(f"{p.relative_to(folder)}:{st.st_size}:{st.st_mtime_ns}\n".encode())
    return h.hexdigest()


def verify(folder: Path, manifest: Manifest, src: Source, exported: Exported) -> dict[str, Any]:
    """Compare the sharded artifact in ``folder`` with the unsharded ONNX graph and the torch model.

    The three run one after the other, each freed before the next loads, so checking needs
    about one copy of the model in memory, not three.
    """
    feeds = _check_feeds(folder, manifest)
    names = [t.name for t in manifest.outputs]
    full = make_session(exported.onnx_path, "cpu")
    try:
        want = dict(zip(names, full.run(names, feeds)))
    except Exception as e:  # onnxruntime's own exception classes: sample inputs this graph refuses
        raise ExportError(
            f"checking the conversion failed: the exported graph refused slimml's sample inputs "
            f"({str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__}). Convert with --no-verify "
            "to skip the check, then run the artifact on inputs of your own."
        ) from None
    del full
    torch_out, theirs = {}, None
    ref = reference_for(src, exported, names)
    if ref is not None:
        torch_out = ref(feeds)
        if exported.pooling is not None:
            theirs = ref.embed(feeds)
        del ref
    model = load(folder, device="cpu")  # the artifact's own integrity check runs here
    got = model.run(feeds)
    checks: dict[str, Any] = {"max_abs_diff": max(float(np.abs(got[n] - want[n]).max()) for n in names)}
    common = [n for n in names if n in torch_out]
    if common:
        checks["max_abs_diff_vs_torch"] = max(float(np.abs(got[n] - torch_out[n]).max()) for n in common)
        checks["cosine_vs_torch"] = min(_min_cosine(got[n], torch_out[n]) for n in common)
    if theirs is not None:
        ours = model.encode(SAMPLE_TEXTS)
        checks["embedding_cosine_vs_torch"] = float((ours * theirs).sum(axis=1).min())
    return {k: round(v, 8) if isinstance(v, float) else v for k, v in checks.items()}


def verify_layerwise(folder: Path, manifest: Manifest, exported: Exported) -> dict[str, Any]:
    """A layer-by-layer export against the torch model run layer by layer (neither holds the whole model)."""
    from slimml.convert.layerwise import streamed_reference

    feeds = _check_feeds(folder, manifest)
    want = streamed_reference(exported.layerwise["folder"])(feeds)["logits"]
    model = load(folder, device="cpu")
    got = model.run(feeds)["logits"]
    model.close()
    return {"max_abs_diff_vs_torch": round(float(np.abs(got - want).max()), 8),
            "cosine_vs_torch": round(_min_cosine(got, want), 8), "reference": "torch, layer by layer"}


def _quantize_step(tmp: Path, manifest: Manifest, qconfig: Any, step: Callable[[str], None]) -> Manifest:
    """Quantize the float artifact in ``tmp`` in place (via a sibling folder); return the new manifest."""
    from slimml.quantize.api import quantize_into
    from slimml.runtime.artifact.manifest import read_manifest

    manifest.write(tmp)
    shutil.rmtree(tmp / ".work", ignore_errors=True)
    qtmp = tmp.parent / f"{tmp.name}-q"
    shutil.rmtree(qtmp, ignore_errors=True)
    quantize_into(tmp, qtmp, qconfig, on_step=step)
    shutil.rmtree(tmp)
    os.rename(qtmp, tmp)
    return read_manifest(tmp)


def _check_feeds(folder: Path, manifest: Manifest) -> dict[str, np.ndarray]:
    feeds: dict[str, np.ndarray] = {}
    if manifest.tokenizer is not None:
        text = TextEncoder(folder / manifest.tokenizer["file"], manifest.tokenizer, [t.name for t in manifest.inputs])
        feeds = text(SAMPLE_TEXTS)
        if not manifest.components:
            return feeds
    rest = [t for t in manifest.inputs if t.name not in feeds]  # a vision tower's pixels beside the texts
    return feeds | sample_feeds(rest, batch=2, seq=16, source=manifest.source) if rest else feeds


def _min_cosine(a: np.ndarray, b: np.ndarray) -> float:
    a = a.reshape(a.shape[0], -1).astype(np.float64)
    b = b.reshape(b.shape[0], -1).astype(np.float64)
    cos = (a * b).sum(1) / np.clip(np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1), 1e-30, None)
    return float(cos.min())


def _shard_into(onnx_path: Path, folder: Path, name: str, prefix: str, config: ShardConfig) -> list:
    """Shard one component into ``folder/name/`` as ``prefix_NNN.onnx``; its specs name files relative to ``folder``."""
    (folder / name).mkdir(exist_ok=True)
    specs = shard(onnx_path, folder / name, config, prefix=prefix)
    for s in specs:
        s.file = f"{name}/{s.file}"
        s.data = f"{name}/{s.data}" if s.data else None
    return specs


def _chain(onnx_path: Path, specs: list, pooling: dict | None) -> Manifest:
    """One chain of shards (the whole model, or a component) as a manifest of its inputs, outputs and shards."""
    import onnx

    graph = onnx.load(str(onnx_path), load_external_data=False).graph
    weights = {t.name for t in graph.initializer}
    by_name = {t.name: t for s in specs for t in [*s.inputs, *s.outputs]}
    inputs = [_strip(by_name[i.name]) for i in graph.input if i.name not in weights and i.name in by_name]
    outputs = [_strip(by_name[o.name]) for o in graph.output]
    return Manifest(name="", task="", source={}, steps=[], inputs=inputs, outputs=outputs, shards=specs, files=[],
                    pooling=pooling)


def _write_manifest(folder: Path, src: Source, exported: Exported, chains: dict, config: ConvertConfig,
                    zero_shot: dict | None = None) -> Manifest:
    if None in chains:
        whole = _chain(*chains[None], exported.pooling)
        components = {}
    else:  # the text tower's embeddings come pooled and normalised by the model
        text = (zero_shot or {}).get("text")
        none = {"mode": "none", "output": "text_embeds", "normalize": True}
        components = {n: _chain(path, specs, none if n == text else None) for n, (path, specs) in chains.items()}
        whole = Manifest(name="", task="", source={}, steps=[], inputs=[], outputs=[], shards=[], files=[])
    paths = [p for _, specs in chains.values() for s in specs for p in (s.file, s.data) if p]
    files = [file_entry(folder, folder / p) for p in dict.fromkeys(paths)]  # a shared data file is listed once
    if exported.tokenizer is not None:
        shutil.copy2(exported.tokenizer_dir / exported.tokenizer["file"], folder / exported.tokenizer["file"])
        files.append(file_entry(folder, folder / exported.tokenizer["file"]))
    preprocessor = None
    if exported.preprocessor is not None:
        shutil.copy2(exported.preprocessor, folder / exported.preprocessor.name)
        files.append(file_entry(folder, folder / exported.preprocessor.name))
        kind = "audio" if exported.info.get("hf_task", "").startswith("automatic-speech-recognition") else "image"
        preprocessor = {"file": exported.preprocessor.name, "kind": kind}
    manifest = Manifest(
        name=src.name,
        task=exported.task,
        source=src.describe() | exported.info,
        steps=[
            {"step": "export", **{k: v for k, v in asdict(config.export).items() if v is not None},
             "exporter": "layerwise (optimum-onnx template)" if exported.layerwise
             else "fused (slimml, GroupQueryAttention)" if exported.info.get("exporter") == "fused" else _exporter(src)},
            {"step": "shard", **{k: v for k, v in asdict(config.shard).items() if v is not None},
             "shards": sum(len(specs) for _, specs in chains.values())},
        ],
        inputs=whole.inputs,
        outputs=whole.outputs,
        shards=whole.shards,
        files=files,
        tokenizer=exported.tokenizer,
        pooling=whole.pooling,
        preprocessor=preprocessor,
        labels=exported.labels,
        components=components,
        zero_shot=zero_shot,
        seq2seq=exported.seq2seq,
        slimml_version=slimml.__version__,
    )
    manifest.write(folder)
    return read_manifest(folder)  # components come back as full manifests of their own


def _exporter(src: Source) -> str:
    return {"huggingface": "optimum-onnx", "torch": "torch.onnx", "onnx": "none (ONNX source)"}[src.kind]


def _strip(t: TensorSpec) -> TensorSpec:
    return TensorSpec(name=t.name, dtype=t.dtype, shape=t.shape)
