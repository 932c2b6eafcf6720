"""``convert``: source model -> ONNX -> layer shards -> checked artifact folder, written atomically.

:func:`convert` reads as its steps: load the source, (distil and/or prune it), export it to ONNX,
shard it as its family needs (:mod:`.families`), write the artifact (one
:class:`~slimml.runtime.artifact.writer.ArtifactWriter`), check it against the source
(:mod:`.check`), then optionally quantize it and time it.
"""

from __future__ import annotations

import logging
import os
import shutil
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from slimml.convert.config import ConvertConfig
from slimml.convert.distill.distill import DistillConfig
from slimml.convert.export import Exported, export
from slimml.convert.families import check, times_batches, write_chains
from slimml.convert.llm_check import check_language_model, is_language_model, read_eval_text
from slimml.convert.sources import Source, resolve
from slimml.errors import ConfigError, ExportError, SourceError, extras_for
from slimml.runtime.artifact.atomic import check_output, one_line_errors
from slimml.runtime.artifact.files import verify_files
from slimml.runtime.artifact.manifest import Manifest
from slimml.runtime.artifact.writer import ArtifactWriter
from slimml.runtime.engine.budget import bigger_than_memory, fmt_bytes
from slimml.runtime.loader import load
from slimml.runtime.tools.bench import sample_feeds, seq_matters, time_runs


# what a teacher of each distillation objective is, for a --compare-on that needs a sentence embedder
NOT_EMBEDDERS = {"logits-kl": ("a text-classification model ({})", ""), "lm-kl": ("a text-generation model ({})", ""),
                 "hidden-mse": ("a plain encoder ({}: token states, no pooling)",
                                ", or save it as sentence-transformers does (a pooling module) and distil that folder")}
# what a GGUF file (llama.cpp's: a decoder) converts as: its language model, or its token states
GGUF_TASKS = ("auto", "text-generation-with-past", "text-generation", "feature-extraction")


@dataclass
class ConvertReport:
    """What :func:`convert` did, as ``slimml convert`` prints it (``to_json()``: ``--json``).

    Attributes:
        out: the artifact folder written.
        name, task: the model's name and the artifact's task (``"sentence-embedding"``, ...).
        shards: shards written, every component's counted.
        size_mb: bytes of the artifact's files / 1e6.
        checks: the artifact against its source, as the manifest records them
            (``max_abs_diff``, ``cosine_vs_torch``, a language model's perplexity, ...).
        latency_ms: median latency on CPU, batch 1 (None where not measured).
        seconds: wall time of the whole conversion.
        steps: the manifest's record of each step (export, shard, quantize, ...).
        teacher: with ``distill`` or ``prune``, the student scored against its teacher.
    """

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
        """The report as a JSON-able dict (``out`` as a string)."""
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
        source: a Hugging Face model folder, a GGUF file (llama.cpp's), an ``.onnx`` file, a
            ``.py`` file defining ``model`` and ``example_inputs``, a torch checkpoint, a
            ``torch.nn.Module``, or ``None`` for the embedded default model (all-MiniLM-L6-v2).
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

    Raises:
        SourceError: a source that is missing or of a kind slimml does not take.
        ConfigError: settings that contradict, or an ``out`` that cannot be written.
        ExportError: the exporter failed (the message names the step and keeps its first line).
        MissingExtraError: the ``convert`` extra (torch, transformers) is not installed.
        DataError: a bad calibration, evaluation or comparison file.

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

    _check_inputs(config)  # a bad calibration, evaluation or STS file fails before any work
    step("reading the source")
    with extras_for("convert"):  # on the base install: one line naming the extra, not an ImportError
        src = resolve(source, example_inputs)
        try:
            return _convert(src, out, config, step, current, on_progress, t0)
        finally:
            src.restore()  # a torch module the caller gave is put back in train mode if it was in it


def _convert(src: Source, out: Any, config: ConvertConfig, step: Callable[[str], None], current: list[str],
             on_progress: Callable[[int, int, float], None] | None, t0: float) -> ConvertReport:
    """:func:`convert`'s stages, from the resolved source on."""
    if src.kind == "gguf" and config.export.task not in GGUF_TASKS:  # a decoder's file: no other head in it
        raise SourceError(f"{src.name} is a GGUF file, a language model with no {config.export.task} head in it; "
                          f"convert it with --task {' or '.join(GGUF_TASKS[1:3])} (or leave --task out).")
    if src.kind != "onnx":  # an ONNX file needs neither transformers nor torch (importing them: 5 s)
        _quiet_transformers()
    stem = src.path.stem if src.kind == "gguf" else src.name  # a GGUF file's own folder: X.Q4_1 and X.Q8_0 apart
    out = Path(out) if out is not None else Path("artifacts") / (stem + _default_suffix(config))
    check_output(out)
    with one_line_errors(f"converting {src.name}", current, out, ExportError,
                         "If slimml does not support this architecture yet, export it to ONNX yourself and convert "
                         "the .onnx file"), _resume_files_named(out, config), \
            ArtifactWriter(out) as w:  # disk errors: the writer words them
        source_checks: dict[str, Any] = {}
        if src.kind == "gguf":  # read into a Hugging Face folder, then exported as one
            from slimml.convert.gguf import as_huggingface, quantization_note

            step("reading the GGUF file")
            src = as_huggingface(src, w.work)
            source_checks["source_quantization"] = quantization_note(src.extra["gguf"])
        teacher, shrunk = src, []
        if config.distill is not None or config.prune is not None:
            src, shrunk = _shrink(src, out, w.work, config, step, on_progress)
        step("exporting to ONNX")
        exported = export(src, w.work, config.export)
        step("splitting into shards")
        family, zero_shot = write_chains(w, src, exported, config.shard)
        source = src.describe() | exported.info
        if shrunk:  # the teacher is the source (the student folder is temporary)
            source |= {"path": str(teacher.path), "student_of": teacher.name}
        manifest = w.commit(name=src.name, task=exported.task, source=source,
                            steps=[*shrunk, *_steps(config, exported, src, w)], labels=exported.labels,
                            zero_shot=zero_shot, seq2seq=exported.seq2seq)
        if config.verify:
            step("checking against the original model")
            manifest.checks = check(family, w.folder, manifest, src, exported)
            if src.kind == "huggingface" and not exported.layerwise and is_language_model(manifest):
                step("scoring the language model on held-out text")
                manifest.checks |= check_language_model(w.folder, manifest, src.path, config.eval_text)
        else:
            verify_files(w.folder, manifest)
        if str(manifest.task).startswith("text-generation") and manifest.tokenizer is None:  # ids only: said now
            source_checks["tokenizer_note"] = ("the source has no tokenizer, so the artifact takes token ids only (no text, "
                                               "no chat, no perplexity check); convert a folder that has its tokenizer "
                                               "(tokenizer.json) to give it text")
        big = oversized(manifest, config.shard)
        if big:  # --shard-size could not be met: said, not left for a streamed load to find
            source_checks["shard_note"] = big
        if exported.note:  # why a decoder did not get the fast graph: shown with the report
            source_checks["exporter_note"] = exported.note
        if exported.preprocessing_note:  # an image processor slimml does not reproduce: images refused, not misread
            source_checks["preprocessing_note"] = exported.preprocessing_note
        manifest.checks = {**source_checks, **manifest.checks}
        if config.quantize is not None:
            manifest = _quantize_step(w, manifest, config.quantize, step)
        against = None
        if shrunk and (config.measure_latency or config.compare_on is not None):
            step("comparing with the teacher")
            w.update(manifest)
            against = _against_teacher(out, w.folder, manifest, config.compare_on,
                                       config.distill.teacher_memory_budget if config.distill else None)
            manifest.checks["vs_teacher"] = against
        latency = None
        if config.measure_latency and times_batches(family) and bigger_than_memory(manifest.total_bytes):
            manifest.checks["latency_note"] = ("not measured: bigger than a third of the memory available, it would run "
                                               "streamed; time it with `slimml bench ART --memory-budget SIZE`")
        elif config.measure_latency and times_batches(family):
            step("measuring latency")
            latency, key, why = _latency(w.folder, src)
            if latency is not None:
                manifest.checks[key] = round(latency, 3)
            else:  # the artifact is converted and checked: a timing that failed is reported, never fatal
                manifest.checks["latency_note"] = why
        w.update(manifest)
    if shrunk:  # the artifact is in place: the student's checkpoint and the teacher's cache are done with
        checkpoint, cache, teacher_art = _resume_files(out)
        for leftover in (checkpoint, cache, teacher_art, teacher_art.with_name(teacher_art.name + ".source")):
            shutil.rmtree(leftover, ignore_errors=True) if leftover.is_dir() else leftover.unlink(missing_ok=True)
    return ConvertReport(
        out=out, name=manifest.name, task=manifest.task, shards=manifest.shard_count,
        size_mb=manifest.total_bytes / 1e6, checks=manifest.checks, latency_ms=latency,
        seconds=time.perf_counter() - t0, steps=manifest.steps, teacher=against,
    )


def _quiet_transformers() -> None:
    """transformers' warnings and progress bars (transformers 5 draws one for every model it loads)
    off: the report says what matters."""
    try:
        from transformers.utils import logging as hf_logging
    except ImportError:
        return
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()


def _check_inputs(config: ConvertConfig) -> None:
    """Read the files the later stages need now, so a bad one fails before the export."""
    if config.quantize is not None:
        from slimml.quantize.api import check_inputs

        check_inputs(config.quantize)
    if config.eval_text is not None:
        read_eval_text(config.eval_text)  # a missing or short text fails before the export
    if config.compare_on is not None:  # ConvertConfig checked that it comes with distill or prune
        from slimml.runtime.tools.evaluate import read_sts

        read_sts(config.compare_on)
        data = config.distill.data if config.distill is not None else None
        if data is not None and _same_file(data, config.compare_on):  # scored on what it trained on
            logging.getLogger("slimml").warning(
                "slimml: --compare-on %s is the --distill-data file: the student trained on those texts, so its score "
                "there flatters it; compare on an STS file kept out of training.", config.compare_on)


def _same_file(a: Any, b: Any) -> bool:
    """Whether two paths name one file (a link, ``./``, a relative path and an absolute one alike)."""
    try:
        return os.path.samefile(a, b)
    except OSError:
        return Path(a).resolve() == Path(b).resolve()


def oversized(manifest: Manifest, shard: Any) -> str | None:
    """What ``--shard-size`` could not meet, in words: the shards past it, each a piece with no cut
    point inside (one weight matrix: the token embedding, the output head, a projection); None
    where all fit."""
    if getattr(shard, "mode", None) != "size" or not shard.max_mb:
        return None
    chains = manifest.components or {None: manifest}
    over = [(name, s.index, s.weight_bytes) for name, m in chains.items() for s in m.shards
            if s.weight_bytes > shard.max_mb * 1e6]
    if not over:
        return None
    said = ", ".join(f"{f'{name} ' if name else ''}shard {i} ({fmt_bytes(b)})" for name, i, b in over[:4])
    more = f" and {len(over) - 4} more" if len(over) > 4 else ""
    return (f"{said}{more} above --shard-size {shard.max_mb:g} MB: each is a piece with no cut point inside (one weight "
            "matrix: the token embedding, the output head, a projection); a streamed load needs a budget of at least the "
            "largest")


def _steps(config: ConvertConfig, exported: Exported, src: Source, w: ArtifactWriter) -> list[dict[str, Any]]:
    """The manifest's records of the export and the shard steps."""
    exporter = "layerwise (optimum-onnx template)" if exported.layerwise else _exporter(src, exported.info.get("exporter"))
    return [
        {"step": "export", **{k: v for k, v in asdict(config.export).items() if v is not None}, "exporter": exporter,
         **({"note": exported.note} if exported.note else {})},
        {"step": "shard", **{k: v for k, v in asdict(config.shard).items() if v is not None},
         "shards": w.shard_count},
    ]


def _latency(folder: Path, src: Source | None = None) -> tuple[float | None, str, str | None]:
    """The artifact's median latency (ms) on the CPU: ``(ms, the checks' key, None)``, or
    ``(None, "", why not)`` where the artifact failed on the inputs timed.

    A torch module is timed on its example inputs (the inputs the check ran: an embedding's ids are
    bounded by its table); any other model at batch 1 and up to 128 tokens of sample inputs.
    """
    from slimml.convert.check import example_feeds

    model = load(folder, device="cpu")
    try:
        feeds = example_feeds(src, model.manifest) if src is not None else None
        key = "latency_ms_example_inputs"
        if feeds is None:
            past = any("past" in str(d) for t in model.inputs for d in t.shape)  # its one cached token counts too
            seq = min(128, (model.max_sequence_length or 129) - past)  # CLIP's text tower takes 77
            feeds = sample_feeds(model.inputs, batch=1, seq=seq, source=model.manifest.source)
            key = f"latency_ms_b1_s{seq}"  # the tokens timed: 127 for a 128-position decoder with one cached
            if not seq_matters(model.inputs, model.manifest.source):  # an image's or a recording's: no tokens
                key = "latency_ms_b1"
        try:
            return float(np.median(time_runs(lambda: model.run(feeds), runs=10, warmup=3))), key, None
        except Exception as e:  # noqa: BLE001 -- onnxruntime's and the feeds' errors: the inputs, not the artifact
            first = str(e).strip().splitlines()[0][:200] if str(e).strip() else type(e).__name__
            return None, "", (f"not measured: the artifact refused the sample inputs timed ({first}); time it on inputs "
                              "of your own with `slimml bench ART`")
    finally:
        model.close()


def _against_teacher(out: Path, tmp: Path, manifest: Manifest, sts_file: Any,
                     teacher_budget: int | str | None = None) -> dict[str, Any]:
    """Compare the student in ``tmp`` with the teacher's artifact (float) converted for distillation."""
    from slimml.convert.distill.compare import compare, student_params

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
    from slimml.convert.distill.distill import check, shrink
    from slimml.convert.distill.teacher import teacher_export

    if src.kind != "huggingface":
        raise ConfigError(
            f"--distill-layers and --prune need a Hugging Face model folder (or no SOURCE for the default model); "
            f"{src.name} is a {src.kind} source."
        )
    distill = config.distill or DistillConfig()
    checked = check(src.path, distill, config.prune)  # a bad request fails before the teacher is converted
    if config.compare_on is not None and checked["kind"] != "embedding-cosine":  # its artifact has no encode()
        what, fix = NOT_EMBEDDERS.get(checked["kind"], ("a {} model", ""))
        raise ConfigError(f"--compare-on scores sentence embeddings on an STS file; {src.name} is "
                          f"{what.format(checked['model_class'])}, not a sentence embedder: leave --compare-on out{fix}.")
    checkpoint, cache, teacher_art = _resume_files(out)  # outside the temp dir: they survive a kill
    stamp = teacher_art.with_name(teacher_art.name + ".source")
    fingerprint = _folder_fingerprint(src.path)
    if not (teacher_art.is_dir() and stamp.is_file() and stamp.read_text() == fingerprint):
        step("converting the teacher")
        stamp.unlink(missing_ok=True)
        convert(src.path, teacher_art, ConvertConfig(export=teacher_export(src.path, config.export.opset), verify=False,
                                                     measure_latency=False))
        stamp.write_text(fingerprint)
    what = " and ".join(w for w, c in (("distilling", config.distill and config.distill.layers), ("pruning", config.prune)) if c)
    step(what)
    steps = shrink(src.path, work / "student", config.distill, config.prune, checkpoint=checkpoint, progress=on_progress,
                   teacher_artifact=teacher_art, cache_dir=cache, on_step=step, keep_checkpoint=True,
                   checked=checked)
    return Source(kind="huggingface", name=src.name, path=work / "student", extra=src.extra), steps


@contextmanager
def _resume_files_named(out: Path, config: ConvertConfig) -> Iterator[None]:
    """A stop (Ctrl-C, SIGTERM) of a convert that distils or prunes leaves its resume files beside ``out``
    on purpose: the interrupt carries the ones there as ``resume_files`` (and ``out`` as ``resume_out``), so
    the CLI can say to run the command again or which files to delete, not that nothing is left."""
    try:
        yield
    except (KeyboardInterrupt, SystemExit) as e:
        if config.distill is None and config.prune is None:  # a plain convert leaves nothing: said as it is
            raise
        checkpoint, cache, teacher_art = _resume_files(out)
        left = [p for p in (checkpoint, cache, teacher_art, teacher_art.with_name(teacher_art.name + ".source"))
                if p.exists()]
        if left:
            e.resume_out, e.resume_files = out, left
        raise


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


def _quantize_step(w: ArtifactWriter, manifest: Manifest, qconfig: Any, step: Callable[[str], None]) -> Manifest:
    """Quantize the float artifact in the writer's folder; the quantized one takes its place."""
    from slimml.quantize.api import quantize_into

    w.update(manifest)
    shutil.rmtree(w.work, ignore_errors=True)
    qtmp = w.folder.parent / f"{w.folder.name}-q"
    shutil.rmtree(qtmp, ignore_errors=True)
    quantize_into(w.folder, qtmp, qconfig, on_step=step)
    return w.adopt(qtmp)


def _exporter(src: Source, name: str | None) -> str:
    """The export step's ``exporter`` entry: what wrote the graph."""
    if name == "fused":
        return "fused (slimml, GroupQueryAttention)"
    if name == "static":
        return "static (slimml, the table's Gather)"
    if name == "torch" or src.kind == "torch":
        return "torch.onnx"
    return {"huggingface": "optimum-onnx", "onnx": "none (ONNX source)"}[src.kind]
