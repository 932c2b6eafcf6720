"""``quantize``: a float artifact (or one ONNX file) in, a quantized one out, written atomically."""

from __future__ import annotations

import logging
import os
import shutil
import time
from collections.abc import Callable
import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import onnx

import slimml
from slimml.errors import ArtifactError, ConfigError, IntegrityError, QuantizeError, SlimmlError, extras_for
from slimml.convert.llm_check import is_language_model
import slimml.quantize.backends  # noqa: F401  (registers the ONNX Runtime and NNCF backends)
import slimml.quantize.chain as ch
from slimml.quantize.calibration import AudioPaths, ImagePaths, calibration_texts
from slimml.quantize.config import Fp16Config, Int8StaticConfig, QuantizeConfig, WeightOnlyConfig, describe
from slimml.quantize.decoder import activation_aware, calibration_feeds, for_language_model
from slimml.quantize.fuse import fusable, rematerialize_inputs
from slimml.quantize.gemm import gemms_as_matmuls
from slimml.quantize.registry import ShardContext, backend_for
from slimml.runtime.artifact.atomic import check_output, one_line_errors
from slimml.runtime.artifact.files import check_unchanged, verify_files
from slimml.runtime.artifact.integrity import check_shard_file
from slimml.runtime.artifact.manifest import MANIFEST_NAME, Manifest, ShardSpec, TensorSpec, read_manifest
from slimml.runtime.artifact.writer import ArtifactWriter, save_onnx
from slimml.runtime.tasks.inputs.pooling import Pooler
from slimml.runtime.tasks.limits import a_or_an


@dataclass
class QuantizeReport:
    """What :func:`quantize` did (``to_json()``: what ``slimml quantize --json`` prints).

    Attributes:
        out: the artifact folder written.
        scheme: the config's class name (``"Int8DynamicConfig"``, ``"WeightOnlyConfig"``, ...).
        size_mb, float_size_mb: the new artifact's size and the float one's, in MB (1e6 bytes).
        quantized_shards: the shard indices quantized.
        float_shards: shard index -> why it stayed float (the guard kept it, nothing to quantize).
        checks: the quantized model against the float one (agreement, the guard's measurements).
        seconds: wall time.
        components: per component, its own report (an artifact of components).
    """

    out: Path
    scheme: str
    size_mb: float
    float_size_mb: float
    quantized_shards: list[int]  # with components: numbered across them, in the manifest's order
    float_shards: dict[int, str]  # shard index -> why it stayed float
    checks: dict[str, Any] = field(default_factory=dict)
    seconds: float = 0.0
    components: dict[str, QuantizeReport] = field(default_factory=dict)  # per component, when the artifact has them

    def to_json(self) -> dict[str, Any]:
        """The report as a JSON-able dict (paths and shard indices as strings)."""
        d = dict(self.__dict__)
        d["out"] = str(self.out)
        d["float_shards"] = {str(k): v for k, v in self.float_shards.items()}
        d["components"] = {n: r.to_json() for n, r in self.components.items()}
        return d


def quantize(
    source: str | os.PathLike,
    out: str | os.PathLike,
    config: QuantizeConfig,
    on_step: Callable[[str], None] | None = None,
) -> QuantizeReport:
    """Quantize a float artifact folder into a new artifact folder.

    Each shard is quantized on its own, with calibration activations from running the float
    shards before it, so the result is what quantizing the whole graph would give; fusions that
    need a side input (the attention mask) get it recomputed inside the shard.

    Args:
        source: an artifact folder written by ``slimml convert`` (float).
        out: the new artifact folder; written beside it in a temporary folder and renamed.
        config: :class:`Int8DynamicConfig`, :class:`Int8StaticConfig`, :class:`WeightOnlyConfig`,
            :class:`Fp16Config` or the result of ``Int8Config(target)``.
        on_step: called with a short description as each stage starts.

    Returns:
        A :class:`QuantizeReport` (sizes, which shards stayed float and why, agreement with float).

    Raises:
        ConfigError: the artifact is already quantized, or holds nothing quantizable, or the
            guard's ``max_drop`` cannot be met (unless ``keep_best``); ``source`` is an ONNX file
            (convert it first), or ``out`` is the source, inside it, or a folder that is not an artifact.
        DataError: a bad calibration or evaluation file.
        ArtifactError / IntegrityError: a missing, malformed or tampered source artifact.
        QuantizeError: the quantizer (ONNX Runtime's, NNCF) failed; the message names the step.

    Example:
        >>> from slimml.quantize import quantize, Int8Config
        >>> quantize("artifacts/all-MiniLM-L6-v2", "artifacts/minilm-int8", Int8Config("cpu"))
    """
    src, out = Path(source), Path(out)
    if out.resolve() == src.resolve():
        raise ConfigError(f"the output {out} is the input artifact; give another folder with -o.")
    if src.resolve() in out.resolve().parents:  # it would be written among the input's files
        raise ConfigError(f"the output {out} is inside the input artifact {src}; give a folder outside it with -o.")
    if out.exists() and (not out.is_dir() or (any(out.iterdir()) and not (out / MANIFEST_NAME).is_file())):
        raise ConfigError(
            f"the output {out} exists and is not a slimml artifact; refusing to replace it. Give another folder with -o."
        )
    check_output(out)  # a link, a read-only place, a path under a file
    source = _read_float_artifact(src)  # a bad source fails before a temporary folder appears
    current = ["starting"]

    def step(msg: str) -> None:
        current[0] = msg
        if on_step is not None:
            on_step(msg)

    with (extras_for("quantize"),  # on the base install: one line naming the extra
          one_line_errors(f"quantizing {src}", current, out, QuantizeError,
                          "Quantize it with another scheme (--quantize) or backend (--backend), or keep it float"),
          ArtifactWriter(out) as w):
        result = _quantize_with(w, src, config, step, source)
    result.out = out
    for part in result.components.values():  # each component's is this artifact too, not the temporary folder
        part.out = out
    return result


def quantize_into(src: Path, dst: Path, config: QuantizeConfig, on_step: Callable[[str], None] | None = None) -> QuantizeReport:
    """Quantize the artifact ``src`` into the new folder ``dst`` (which must not exist); on failure ``dst`` is removed.

    ``convert --quantize`` calls this inside its own temporary folder; users call :func:`quantize`.
    """
    with ArtifactWriter(dst, atomic=False) as w:
        return _quantize_with(w, Path(src), config, on_step)


def _quantize_with(w: ArtifactWriter, src: Path, config: QuantizeConfig, on_step: Callable[[str], None] | None = None,
                   source: tuple[Manifest, dict] | None = None) -> QuantizeReport:
    """Quantize the artifact ``src`` through the writer ``w``: every chain, then the manifest
    (``source``: what :func:`_read_float_artifact` gave, where the caller read it already)."""
    t0 = time.perf_counter()
    step = on_step or (lambda _msg: None)
    manifest, seen = source or _read_float_artifact(src)
    shards = max(len(p.shards) for p in (manifest.components or {None: manifest}).values())
    if any(i >= shards for i in config.exclude_shards):
        raise ConfigError(f"exclude_shards {list(config.exclude_shards)} names a shard past the artifact's last "
                          f"({shards - 1}); give indices from 0 to {shards - 1}.")
    config = for_language_model(config, manifest, src)  # a decoder gets weight-only blocks (quantize/decoder.py)
    _check_eval_inputs(config, manifest)
    step("reading calibration data")
    calib, held, origin = calibration_texts(config.calibration, config.calibration_size)
    if isinstance(calib, ImagePaths) and not any(ch.image_feeds(src, part) for part in
                                                 (manifest.components or {None: manifest}).values()):
        raise ConfigError(f"--calibration {config.calibration} is a folder of images, and {src} takes no images (or ships "
                          "no image preprocessor config); give a text file (one sentence per line), or leave "
                          "--calibration out.")
    if isinstance(calib, AudioPaths) and not (manifest.seq2seq and manifest.preprocessor
                                              and manifest.preprocessor.get("kind") == "audio"):
        raise ConfigError(f"--calibration {config.calibration} is a folder of recordings, and {src} is not a speech model "
                          "(Whisper, shipped with its feature extractor config); give a text file (one sentence per "
                          "line), or leave --calibration out.")
    if config.guard is not None and config.guard.eval_file is not None:
        from slimml.runtime.tools.evaluate import read_sts

        read_sts(config.guard.eval_file)  # a bad eval file fails before any work
    w.copy_assets(src, manifest)
    if manifest.components:
        result = _quantize_components(w, src, manifest, config, calib, held, origin, step)
    else:
        result, record = _quantize_artifact(w, src, manifest, None, config, calib, held, origin, step)
        new = w.commit(**{**manifest.header(), "steps": [*manifest.steps, record],
                          "checks": {**float_checks(manifest.checks), **{f"quantize_{k}": v for k, v in result.checks.items()}}})
        result.size_mb = new.total_bytes / 1e6
        if getattr(config, "backend", None) == "lm":  # a tied embedding's table, quantized alike twice: stored once
            from slimml.quantize.tied import share_tied_embedding

            if share_tied_embedding(w.folder):
                result.size_mb = read_manifest(w.folder).total_bytes / 1e6
    check_unchanged(src, seen, "it was quantized",  # a file swapped as it was read: discarded, not hashed anew
                    "the output is discarded. Quantize again once the artifact stays as it is.")
    result.seconds = time.perf_counter() - t0
    return result


KEPT_CHECKS = ("exporter_note", "preprocessing_note", "tokenizer_note")  # true of the quantized artifact too


def float_checks(checks: dict[str, Any]) -> dict[str, Any]:
    """The float artifact's checks, as the quantized one keeps them: what was measured of the float
    model (its sizes and notes on them too) named so (``float_perplexity_artifact``,
    ``float_latency_ms_b1_s128``, ``float_shard_note``), so that no figure of the float model reads as
    the quantized one's; what describes the source and the export (``source_...``, the exporter's
    note) as it was."""
    return {k if k.startswith(("source_", "float_")) or k in KEPT_CHECKS else f"float_{k}": v for k, v in checks.items()}


def check_inputs(config: QuantizeConfig) -> None:
    """Read the calibration and evaluation files now, so a bad one fails before any long work."""
    calibration_texts(config.calibration, config.calibration_size)
    if config.guard is not None and config.guard.eval_file is not None:
        from slimml.runtime.tools.evaluate import read_sts

        read_sts(config.guard.eval_file)


def _check_eval_inputs(config: QuantizeConfig, manifest: Manifest) -> None:
    """A language model's evaluation text read, and an STS CSV refused for it, before any long work
    (they failed after every shard was quantized)."""
    from slimml.convert.llm_check import read_eval_text

    if not is_language_model(manifest):
        if getattr(config, "eval_text", None) is not None:  # it was ignored, and recorded as used
            raise ConfigError(f"--eval-text {config.eval_text} is a language model's held-out text; this artifact is "
                              f"{a_or_an(repr(manifest.task))} model, whose guard measures output agreement on held-out calibration "
                              "data (or Spearman on --eval STS.csv for a sentence-embedding model): drop it.")
        if config.guard is not None and config.guard.eval_file is not None and (manifest.components or
                                                                                manifest.pooling is None):
            raise ConfigError(  # as the guard says it, but before every shard is quantized
                f"--eval {config.guard.eval_file} needs a sentence-embedding artifact, but this one is "
                f"{a_or_an(repr(manifest.task))} model; leave --eval out and the guard measures output agreement on held-out "
                "calibration data.")
        return
    if config.guard is not None and config.guard.eval_file is not None:
        raise ConfigError(f"--eval {config.guard.eval_file} is an STS CSV for sentence-embedding artifacts; a language "
                          "model's guard scores perplexity on plain text: give it with --eval-text FILE.")
    if getattr(config, "eval_text", None) is not None:
        read_eval_text(config.eval_text)


def _read_float_artifact(src: Path) -> tuple[Manifest, dict[str, tuple[int, int, int, int]]]:
    """The float artifact's manifest, its files hashed and its shards' external data checked, and the
    identity of each file hashed (what :func:`check_unchanged` compares once the work is done)."""
    if src.is_file() and src.suffix == ".onnx":
        raise ConfigError(
            f"{src} is an ONNX file; quantize works on artifacts. Convert it first: "
            f"`slimml convert {src} --quantize int8`, or `slimml convert {src} -o ART` then `slimml quantize ART -o OUT`."
        )
    manifest = read_manifest(src)
    done = [s for s in manifest.steps if s.get("step") == "quantize"]
    if done:
        raise ConfigError(
            f"the artifact {src} is already quantized ({done[0].get('scheme')}); quantize the float artifact "
            "it came from instead (quantizing twice loses accuracy for nothing)."
        )
    seen = verify_files(src, manifest)
    for part in (manifest.components or {None: manifest}).values():
        for shard in part.shards:  # each shard's weights confined to its own data file, as load confines them
            check_shard_file(src, shard)
            if shard.data and os.stat(src / shard.data).st_nlink > 1:  # onnx, which reads them here, refuses these
                raise ArtifactError(f"{shard.data} in {src} has several hard links, and onnx will not read weights "
                                    "through one (a guard against hard-link attacks); copy the artifact with `cp -r` "
                                    "(not `cp -al` or `ln`) and quantize the copy.")
    return manifest, seen


def _quantize_components(w, src, manifest, config, calib, held, origin, step) -> QuantizeReport:
    """Each component quantized as an artifact of its own (its own guard), then one manifest."""
    reports, records = {}, []
    feeds = _seq2seq_feeds(src, calib, held, step) if manifest.seq2seq else {}
    for name, part in manifest.components.items():
        step(f"component {name}")
        t0 = time.perf_counter()
        reports[name], record = _quantize_artifact(w, src, part, name, config, calib, held, origin, step, feeds.get(name))
        reports[name].seconds = time.perf_counter() - t0
        records.append({"component": name, **record})
    if manifest.seq2seq:  # identical quantized weights of the two decoders: stored once again
        w.share_weights("decoder", "decoder_with_past")
    record = {k: v for k, v in records[0].items() if k not in ("component", "quantized_shards", "float_shards", "fused")}
    record["components"] = {r["component"]: {k: r[k] for k in ("quantized_shards", "float_shards", "fused") if k in r}
                            for r in records}
    for r in records:  # CLIP's towers: texts for one, a folder of images for the other
        if r.get("calibration") != record.get("calibration"):
            record["components"][r["component"]]["calibration"] = r.get("calibration")
    checks = {f"{name}_{k}": v for name, r in reports.items() for k, v in r.checks.items()}
    new = w.commit(**{**manifest.header(), "steps": [*manifest.steps, record],
                      "checks": {**float_checks(manifest.checks), **{f"quantize_{k}": v for k, v in checks.items()}}})
    if manifest.seq2seq:  # each component was guarded on its own inputs; what matters is what the whole generates
        step(f"generating from held-out {'recordings' if isinstance(held, AudioPaths) else 'texts'} with the float and "
             "the quantized model")
        whole = generation_agreement(src, w.folder, held)
        if whole:
            checks.update(whole)
            if whole.get("generation_token_agreement", 1.0) < 0.9:
                logging.getLogger("slimml").warning(
                    "slimml: the quantized model generates otherwise than the float one from held-out %s (%s the "
                    "same, %.0f%% of the tokens before they part); check it on your own data, or keep shards float with "
                    "--max-drop", "recordings" if isinstance(held, AudioPaths) else "texts", whole["generation_same"],
                    100 * whole["generation_token_agreement"])
            new = w.commit(**{**manifest.header(), "steps": [*manifest.steps, record],
                              "checks": {**float_checks(manifest.checks), **{f"quantize_{k}": v for k, v in checks.items()}}})
    for name, r in reports.items():
        r.size_mb = new.components[name].total_bytes / 1e6
    offsets, n = {}, 0
    for name, part in manifest.components.items():
        offsets[name], n = n, n + len(part.shards)
    return QuantizeReport(
        out=w.folder, scheme=_scheme_name(config), size_mb=new.total_bytes / 1e6, float_size_mb=manifest.total_bytes / 1e6,
        quantized_shards=[offsets[name] + i for name, r in reports.items() for i in r.quantized_shards],
        float_shards={offsets[name] + i: why for name, r in reports.items() for i, why in r.float_shards.items()},
        checks=checks, components=reports,
    )


# tasks whose Gemms are a classifier's pooler and output (on the pooled or [CLS] state): kept float
CLASSIFIER_TASKS = frozenset({"text-classification", "image-classification", "audio-classification"})


def generation_agreement(float_folder: Path, quantized_folder: Path, texts: list[str], count: int = 8,
                         max_new_tokens: int = 32) -> dict[str, Any]:
    """How closely an encoder-decoder's quantized artifact generates as its float one, greedy, from
    ``count`` held-out texts: ``generation_same`` (outputs token for token the same, "k of n") and
    ``generation_token_agreement`` (the float output's tokens the quantized one gives before it first
    differs, over them all). From held-out recordings (:class:`AudioPaths`) for a speech model; empty
    for one given texts (Whisper calibrated on generated features: no held-out audio)."""
    from slimml.runtime.loader import load

    audio = isinstance(texts, AudioPaths)
    prompts = list(texts[:count]) if audio else [" ".join(t.split()[:48]) for t in texts[:count]]  # a text may be long
    models: list = []
    try:
        for f in (float_folder, quantized_folder):
            models.append(load(f, verify=False))  # hashed by the caller
        if ("audio" if audio else "text") not in models[0].accepts or not prompts:
            return {}
        a, b = (m.generate(prompts, max_new_tokens=max_new_tokens).tokens for m in models)
    except SlimmlError as e:  # a measure only: the quantized artifact is written whatever it says
        return {"generation_same": f"not measured ({str(e).rstrip('.')})"}
    finally:
        for m in models:
            m.close()
    same = sum(x == y for x, y in zip(a, b))
    agreed = sum(next((i for i, (s, t) in enumerate(zip(x, y)) if s != t), min(len(x), len(y))) for x, y in zip(a, b))
    return {"generation_same": f"{same} of {len(a)}",
            "generation_token_agreement": round(agreed / max(1, sum(len(x) for x in a)), 4)}


def _seq2seq_feeds(src: Path, calib: list[str], held: list[str], step) -> dict[str, tuple[list, list]]:
    """Per component of an encoder-decoder, what it is fed while the float model generates from
    the calibration texts and from the held-out ones: the decoders' real inputs (encoder states,
    caches), which texts alone cannot give."""
    from slimml.runtime.loader import load
    from slimml.runtime.tasks.seq2seq import record_feeds, sample_encoder_batches

    step("running the float model to record each component's inputs")
    model = load(src, verify=False)  # hashed by the caller
    try:
        if isinstance(calib, AudioPaths):  # a speech model's own recordings, not noise
            fit = record_feeds(model, _recording_batches(model, calib))
            check = record_feeds(model, _recording_batches(model, held, limit=4))
        else:
            fit = record_feeds(model, sample_encoder_batches(model, calib))
            check = record_feeds(model, sample_encoder_batches(model, held, limit=4))
    finally:
        model.close()
    return {name: (fit[name], check[name]) for name in fit}


def _recording_batches(model, paths: list[str], batch_size: int = 8, limit: int = 16) -> list[dict]:
    """A speech model's encoder inputs for WAV ``paths``, each recording's first window (30 s)."""
    from slimml.runtime.tasks.inputs.audio import read_wav

    out = []
    for i in range(0, min(len(paths), batch_size * limit), batch_size):  # at most ``limit`` batches read
        waves = [read_wav(p, model.sampling_rate)[: model.window_samples].copy() for p in paths[i : i + batch_size]]
        out.append(model.features(waves))  # each recording's own samples dropped once its window is kept
    return out


def _quantize_artifact(w, src, manifest, name, config, calib, held, origin, step, feeds=None) -> tuple[QuantizeReport, dict]:
    """Quantize one chain of shards (the whole model, or the component ``name``) into the writer;
    the report and the chain's record of the quantize step.

    ``feeds``: (calibration, held-out) feed lists for a chain that text alone cannot feed (a decoder).
    """
    from slimml.quantize.guard import GuardResult, apply_guard

    work = w.work / "quantize"
    work.mkdir()
    text = ch.text_encoder(src, manifest)
    pixels = ch.image_feeds(src, manifest)
    if isinstance(calib, ImagePaths) and pixels is None:  # images for the other tower (CLIP's): texts for this one
        calib, held, origin = calibration_texts(None, config.calibration_size)
    float_files = ch.shard_paths(src, manifest)
    # static calibration: each batch's tensors, advanced one float shard at a time, so memory
    # holds only what crosses the current boundary, not every layer's activations
    envs = ([dict(f) for f in (feeds[0] if feeds else ch.batches(manifest, text, calib, images=pixels))]
            if isinstance(config, Int8StaticConfig) else None)
    firsts = [onnx.load(str(p), load_external_data=False) for p in float_files]
    experts = getattr(config, "backend", None) == "lm" and any(n.op_type == "MoE" for m in firsts for n in m.graph.node)
    if envs is None and (activation_aware(config) or experts) and manifest.tokenizer:
        envs = calibration_feeds(src, manifest, calib)  # the fitted 4-bit grid, and experts, weigh by activations
    last_read = {t.name: s.index for s in manifest.shards for t in s.inputs}
    backend = backend_for(config)
    model_inputs = {vi.name: vi for m in firsts for vi in m.graph.input if vi.name in {t.name for t in manifest.inputs}}
    fuse = getattr(config, "fuse", False) and fusable(manifest.source)  # asked for, and the family has them
    heads = manifest.task in CLASSIFIER_TASKS  # its Gemms are a pooler and an output: small and the most sensitive
    quant_files: dict[int, Path] = {}
    notes: dict[int, dict] = {}
    float_why: dict[int, str] = {}
    held_ops = sorted({n.op_type for m in firsts for n in m.graph.node if n.op_type in QUANTIZED_OPS})
    if held_ops:  # quantized by another tool before convert: the manifest's steps do not say so
        raise ConfigError(f"the artifact {src} is already quantized (its graph holds {', '.join(held_ops[:3])}); "
                          "quantize the float model it came from instead.")
    for spec, path in zip(manifest.shards, float_files):
        step(f"quantizing shard {spec.index + 1}/{len(manifest.shards)}")
        if spec.index in config.exclude_shards:
            float_why[spec.index] = "excluded by the config"
            if envs is not None:
                ch.advance(envs, path, spec.index, last_read)
            continue
        model = onnx.load(str(path))
        if fuse and spec.index > 0:
            rematerialize_inputs(model, firsts[: spec.index], model_inputs, path.parent)
        if not heads:  # GPT-2's layers (Conv1D), an MLP: the quantizers take MatMul, not Gemm
            gemms_as_matmuls(model)
        ctx = ShardContext(index=spec.index, fuse=fuse)
        if envs is not None:
            ctx.reader = ch.RecordedReader(envs, [vi.name for vi in model.graph.input if vi.name not in {t.name for t in model.graph.initializer}])
        before = _made(model)  # counted first: a backend may change its input in place
        q = backend(model, config, ctx)
        unchanged = q is not None and not _more(_made(q), before)  # the backend gave its input back
        if envs is not None:
            step(f"running float shard {spec.index + 1} on the calibration data")
            ch.advance(envs, path, spec.index, last_read)
        if q is None or unchanged:
            float_why[spec.index] = _unchanged_why(model, config, ran=unchanged, heads=heads)
            continue
        qpath = work / spec.file
        save_onnx(q, qpath)
        quant_files[spec.index] = qpath
        notes[spec.index] = ctx.notes
    if not quant_files:
        said = sorted({why.removeprefix("left float: ") for why in float_why.values()
                       if why.startswith("left float: ") and not why.endswith("found nothing it changes in it")})
        convs = any(n.op_type == "Conv" for m in firsts for n in m.graph.node)
        if convs and not any(n.op_type == "MatMul" for m in firsts for n in m.graph.node):  # a CNN: no scheme helps
            raise ConfigError(f"the artifact {src} would come out of {type(config).__name__} unchanged: its weights are in "
                              "Conv layers (a CNN), which slimml's schemes do not quantize (they quantize transformers' "
                              "MatMul and Gather); keep it float (--quantize none), or give a GPU fp16 (--quantize fp16 "
                              "--target cuda).")
        if said:  # the scheme's own reason
            raise ConfigError(f"the artifact {src} would come out of {type(config).__name__} unchanged: "
                              f"{'; '.join(said[:2])}. Keep it float (--quantize none), or pick a scheme that quantizes "
                              "its ops.")
        raise ConfigError(
            f"the artifact {src} has no op that {type(config).__name__} quantizes (MatMul/Gather with float "
            "weights, or Attention); it would come out unchanged. Keep it float (--quantize none)."
        )
    held_feeds = feeds[1] if feeds else ch.batches(manifest, text, held, images=pixels)
    here = isinstance(config, Fp16Config) and "CUDAExecutionProvider" not in _providers()  # fp16 measured on this CPU
    if here and config.guard is not None:
        raise ConfigError("the accuracy guard runs the fp16 model, which needs CUDA; leave --max-drop out on this machine.")
    step("checking against the float model" + (" (fp16 on this CPU: no CUDA here)" if here else ""))
    device = "cuda" if isinstance(config, Fp16Config) and not here else "cpu"
    pooler = Pooler.of(manifest.pooling, src, manifest.files)  # a component's manifest lists its own files
    try:
        guard = apply_guard(manifest, text, float_files, quant_files, held_feeds, config.guard, step, device,
                            getattr(config, "eval_text", None), pooler)
    except ConfigError as e:  # --max-drop not met: which component's shards it counted (fp16 here: no guard)
        if name is None:
            raise
        raise ConfigError(f"the {name} component (shards numbered within it): {e}") from None
    except Exception as e:  # fp16 here: an op the CPU provider has no fp16 kernel for; a measure only
        if not here or isinstance(e, IntegrityError):
            raise
        why = " ".join(str(e).split())[:160] or type(e).__name__
        guard = GuardResult({}, {"agreement": f"not measured: this CPU could not run the fp16 model here ({why}); "
                                              "measure it where it runs (slimml eval, slimml bench)"})
    else:
        if here:  # ONNX Runtime's CPU provider runs fp16 graphs too, slowly; a GPU's kernels may round apart
            guard.checks["agreement_device"] = "cpu (no CUDA on this machine; a GPU's fp16 kernels may round differently)"
    for i, why in guard.kept_float.items():
        quant_files.pop(i, None)
        notes.pop(i, None)  # a shard kept float records none of its quantized graph's fusions
        float_why[i] = why
    if not quant_files:  # the guard's choice is every shard float: that is the float model, not a quantized one
        raise ConfigError(f"--max-drop {config.guard.max_drop:g} is met only with every shard float, so nothing would be "
                          "quantized; raise --max-drop, or keep the model float (--quantize none).")
    final = [quant_files.get(s.index, p) for s, p in zip(manifest.shards, float_files)]
    shards = _write_chain(w, src, manifest, final, quant_files)
    w.add_chain(shards, _model_io(manifest.inputs, shards), _model_io(manifest.outputs, shards), name=name, pooling=manifest.pooling,
                assets=manifest.assets if name is not None else ())
    shutil.rmtree(work, ignore_errors=True)
    report = QuantizeReport(
        out=w.folder, scheme=_scheme_name(config), size_mb=0.0,
        float_size_mb=manifest.total_bytes / 1e6, quantized_shards=sorted(quant_files),
        float_shards=dict(sorted(float_why.items())), checks=guard.checks,
    )
    record = _record(manifest, config, origin, quant_files, float_why, notes,
                     reads_text=text is not None or bool(feeds) or isinstance(calib, ImagePaths), images=pixels is not None)
    if "recipe" in record:  # a decoder's recipe (and block size) in the report and the manifest's checks
        report.checks["recipe"] = record["recipe"]
    return report, record


def _providers() -> list[str]:
    import onnxruntime

    return onnxruntime.get_available_providers()


def _write_chain(w: ArtifactWriter, src: Path, manifest: Manifest, final: list[Path], quant_files: dict[int, Path]) -> list[ShardSpec]:
    """Put each shard (quantized, or the float one) into the writer's folder; their new specs."""
    shards = []
    for spec, path in zip(manifest.shards, final):
        own_data = f"{spec.file}.data"
        if spec.index not in quant_files and spec.data and spec.data != own_data:
            data = w.save_onnx(onnx.load(str(path)), spec.file)  # it read another shard's data file: it gets its own again
        else:
            w.add_file(path, spec.file)
            source_data = path.parent / f"{path.name}.data" if spec.index in quant_files else (src / spec.data if spec.data else None)
            data = w.add_file(source_data, own_data) if source_data is not None and source_data.exists() else None
        m = onnx.load(str(w.folder / spec.file), load_external_data=False)
        weight_bytes = sum(int(np.prod(t.dims, dtype=np.int64)) * onnx.helper.tensor_dtype_to_np_dtype(t.data_type).itemsize
                           for t in m.graph.initializer)
        shards.append(ShardSpec(index=spec.index, file=spec.file, data=data, weight_bytes=weight_bytes,
                                inputs=_as_written(_inputs(m, spec, manifest), m), outputs=_as_written(spec.outputs, m),
                                layers=spec.layers))
    return shards


# ops of a graph already quantized (ONNX Runtime's and NNCF's int8 and 4-bit forms)
QUANTIZED_OPS = frozenset({
    "DynamicQuantizeLinear", "QuantizeLinear", "DequantizeLinear", "MatMulInteger", "ConvInteger", "QLinearMatMul",
    "QLinearConv", "QGemm", "QAttention", "DynamicQuantizeMatMul", "MatMulIntegerToFloat", "MatMulNBits",
    "GatherBlockQuantized", "QMoE", "DynamicQuantizeLSTM", "QLinearAdd", "QLinearMul",
})


def _unchanged_why(model: onnx.ModelProto, config: QuantizeConfig, ran: bool = True, heads: bool = False) -> str:
    """Why a shard came back as it was (``ran``: the scheme's quantizer ran on it; else it found
    nothing to run on; ``heads``: a classifier's, whose Gemms are kept float)."""
    if isinstance(config, Int8StaticConfig) and not any(n.op_type in config.op_types for n in model.graph.node):
        return (f"left float: int8-static quantizes {'/'.join(config.op_types)} ops, and it has none "
                "(int8-dynamic and int4-weights take an embedding's Gather)")
    if not ran and heads and any(n.op_type == "Gemm" for n in model.graph.node):
        return ("left float: its weights are Gemm heads (a classifier's pooler and output, small and the most "
                "sensitive); the schemes quantize MatMul and Gather")
    if not ran:
        return "nothing to quantize"
    if isinstance(config, WeightOnlyConfig) and config.bits == 8 and config.backend == "ort" \
            and not any(n.op_type == "MatMul" for n in model.graph.node):
        return "left float: ONNX Runtime's weight quantizer takes an embedding's Gather at 4 bits only (--backend nncf: 8)"
    return f"left float: the {_scheme_name(config)} quantizer found nothing it changes in it"


def _made(model: onnx.ModelProto) -> tuple[int, int]:
    """(quantized ops, float32 weight values) of ``model``: a backend that quantized something added
    the one or took from the other (a language model's embedding becomes 8-bit rows behind plain
    Gathers; fp16 halves the float32 weights); one that found nothing gives its graph back as it was."""
    floats = sum(int(np.prod(t.dims, dtype=np.int64)) for t in model.graph.initializer if t.data_type == onnx.TensorProto.FLOAT)
    return sum(n.op_type in QUANTIZED_OPS for n in model.graph.node), floats


def _more(after: tuple[int, int], before: tuple[int, int]) -> bool:
    return after[0] > before[0] or after[1] < before[1]


def _as_written(specs: list[TensorSpec], m: onnx.ModelProto) -> list[TensorSpec]:
    """``specs`` in the dtypes the written graph ``m`` gives them (fp16 keeps a decoder's KV cache in fp16)."""
    types = {v.name: v.type.tensor_type.elem_type for v in [*m.graph.input, *m.graph.output]}
    out = []
    for t in specs:
        dtype = str(onnx.helper.tensor_dtype_to_np_dtype(types[t.name])) if types.get(t.name) else t.dtype
        out.append(t if dtype == t.dtype else dataclasses.replace(t, dtype=dtype))
    return out


def _model_io(specs: list[TensorSpec], shards: list[ShardSpec]) -> list[TensorSpec]:
    """The model's inputs or outputs ``specs`` in the dtypes its shards now take or give them."""
    dtypes = {t.name: t.dtype for s in shards for t in [*s.inputs, *s.outputs]}
    return [dataclasses.replace(t, dtype=dtypes[t.name]) if dtypes.get(t.name, t.dtype) != t.dtype else t for t in specs]


def _record(manifest: Manifest, config: QuantizeConfig, origin: str, quant_files: dict, float_why: dict, notes: dict,
            reads_text: bool = True, images: bool = False) -> dict:
    """The manifest's record of the quantize step for one chain (``reads_text``: calibrated on the
    calibration texts or images, not on generated inputs; ``images``: the chain takes images)."""
    record = {"step": "quantize", **describe(config), "calibration": origin,
              "quantized_shards": sorted(quant_files),
              "float_shards": {str(k): v for k, v in sorted(float_why.items())}}
    if not reads_text:  # a ViT, an ONNX file's MLP: no text to read, whatever was given
        record["calibration"] = "generated inputs (the model reads no text)" if isinstance(config, Int8StaticConfig) else None
        if config.calibration is not None:
            record["calibration_unused"] = f"{origin}: this model reads no text"
            logging.getLogger("slimml").warning("slimml: --calibration %s was not used: the model reads no text; it was "
                                                "calibrated and checked on generated inputs%s", origin,
                                                " (give --calibration a folder of images like its inputs)" if images else "")
    lm = [n["lm_weights"] for n in notes.values() if n.get("lm_weights")]
    if lm:  # the decoder recipe (quantize/grids.py), and whether calibration activations weighed it
        record["recipe"] = lm[0]["recipe"] + (", GPTQ on the calibration text" if any(n["activation_aware"] for n in lm) else "")
        record["scaled_ffn"] = sum(n["scaled_ffn"] for n in lm)  # FFN down projections scaled first (quantize/equalize.py)
        if not any(n["activation_aware"] for n in lm):  # a data-free recipe: no calibration was read
            record["calibration"] = None
            if config.calibration is not None:
                record["calibration_unused"] = f"{origin}: this recipe reads no calibration data"
                logging.getLogger("slimml").warning("slimml: --calibration %s was not used: the %s recipe reads no "
                                                    "calibration data", origin, lm[0]["recipe"].split(" (")[0])
        if any("grid_kept" in n or "grid_8bit" in n for n in lm):  # a GGUF source's 4-bit matrices kept, and those of more bits
            record["gguf_grid"] = {"kept_4bit": sum(n.get("grid_kept", 0) for n in lm), "at_8bit": sum(n.get("grid_8bit", 0) for n in lm)}
            grid = record["gguf_grid"]
            record["recipe"] += f": {grid['kept_4bit']} matrices kept on the file's 4-bit grid" + (
                f", {grid['at_8bit']} of more bits at 8" if grid["at_8bit"] else "")
    experts = [n["experts"] for n in notes.values() if n.get("experts")]
    if experts:  # a mixture of experts' MoE nodes made QMoE (quantize/experts.py)
        record["experts"] = {**experts[0], "moe_nodes": sum(e["moe_nodes"] for e in experts),
                             "grid": " / ".join(sorted({e["grid"] for e in experts}))}
    fused = {str(i): n["fused"] for i, n in notes.items() if n.get("fused")}
    if fused:
        record["fused"] = fused
    elif record.get("fuse") and not fusable(manifest.source):  # asked for, not made: say so
        record["fuse"] = False
        record["fuse_skipped"] = f"model type {manifest.source.get('model_type')!r} is not a BERT-family encoder"
    return record


def _inputs(m: onnx.ModelProto, spec: ShardSpec, manifest: Manifest) -> list[TensorSpec]:
    """The shard's inputs after quantization: fusions may have dropped some and added model inputs."""
    old = {t.name: t for t in spec.inputs}
    model = {t.name: t for t in manifest.inputs}
    inits = {t.name for t in m.graph.initializer}
    out = []
    for vi in m.graph.input:
        if vi.name in inits:
            continue
        if vi.name in old:
            out.append(old[vi.name])
        elif vi.name in model:
            t = model[vi.name]
            out.append(TensorSpec(name=t.name, dtype=t.dtype, shape=t.shape, source="input"))
        else:
            raise ArtifactError(f"quantized shard {spec.index} reads {vi.name!r}, which nothing provides; this is a slimml bug.")
    return out


def _scheme_name(config: QuantizeConfig) -> str:
    return type(config).__name__


__all__ = ["quantize", "quantize_into", "QuantizeReport"]

