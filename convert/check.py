"""The last step of ``convert``: the artifact against what it came from.

Each family is checked as it runs (see :mod:`slimml.convert.families`): a plain or two-tower
model against its unsharded ONNX graph and the torch model, a layer-by-layer export against the
torch model run layer by layer, an encoder-decoder step by step (:mod:`.check_seq2seq`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from slimml.convert.export import Exported
from slimml.convert.reference import reference_for, sentence_transformers_embed
from slimml.convert.sources import Source
from slimml.errors import ArtifactError, ExportError
from slimml.runtime.artifact.manifest import Manifest
from slimml.runtime.engine.backends.base import first_line
from slimml.runtime.engine.session import make_session
from slimml.runtime.loader import load
from slimml.runtime.tasks.inputs.text import TextEncoder
from slimml.runtime.tools.bench import sample_feeds

MIN_COSINE = 0.999  # a float graph slimml writes itself computes what the source does, or is not shipped

SAMPLE_TEXTS = [
    "A man is playing a guitar on the street.",
    "The quick brown fox jumps over the lazy dog.",
    "Quantized models run faster on small machines.",
    "Short.",
]
# the library's embeddings are compared on a text longer than most models read too (800 tokens or
# more, and no two stretches alike), so a truncation read otherwise than the library reads it shows
LIBRARY_TEXTS = [*SAMPLE_TEXTS, "The numbers are " + ", ".join(str(n) for n in range(1000, 1400)) + "."]


def verify(folder: Path, manifest: Manifest, src: Source, exported: Exported) -> dict[str, Any]:
    """Compare the sharded artifact in ``folder`` with the unsharded ONNX graph and the torch model.

    The three run one after the other, each freed before the next loads, so checking needs
    about one copy of the model in memory, not three.
    """
    example = example_feeds(src, manifest)
    feeds = example or _check_feeds(folder, manifest)
    names = [t.name for t in manifest.outputs]
    try:
        full = make_session(exported.onnx_path, "cpu")
    except ArtifactError as e:  # at convert time no artifact is damaged: the exporter wrote a graph ORT refuses
        raise ExportError(f"the exporter wrote a graph ONNX Runtime cannot load ({getattr(e, 'cause', e)}); convert "
                          "with another --exporter (optimum, torch or fused, where it writes the model), or export it "
                          "to ONNX yourself and convert the .onnx file.") from None
    try:
        want = dict(zip(names, full.run(names, feeds)))
    except Exception as e:  # onnxruntime's own exception classes: sample inputs this graph refuses
        raise ExportError(
            f"checking the conversion failed: the exported graph refused slimml's sample inputs "
            f"({first_line(e)}). Convert with --no-verify "
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
    library = (sentence_transformers_embed(src, LIBRARY_TEXTS)
               if exported.pooling is not None and src.kind in ("huggingface", "static")
               and (src.path / "modules.json").is_file() else None)
    model = load(folder, device="cpu")  # the artifact's own integrity check runs here
    if getattr(model, "text", None) is None:  # a source without its tokenizer: its outputs are checked on ids alone
        theirs = library = None
    got = model.run(feeds)
    checks: dict[str, Any] = {"max_abs_diff": max(float(np.abs(got[n] - want[n]).max()) for n in names)}
    common = [n for n in names if n in torch_out]
    for n in common:
        if torch_out[n].dtype.kind == "f":
            refuse_nonfinite(src.name, torch_out[n], f"values in its {n!r} output", nan_only=True)
    if common:
        _refuse_other_shapes(src, exported, got, torch_out, common)
        checks["max_abs_diff_vs_torch"] = max(float(np.abs(got[n] - torch_out[n]).max()) for n in common)
        checks["cosine_vs_torch"] = min(_min_cosine(got[n], torch_out[n]) for n in common)
        checks["rel_diff_vs_torch"] = max(_rel_diff(got[n], torch_out[n]) for n in common)
    if theirs is not None:
        ours = model.encode(SAMPLE_TEXTS, prompt="")  # the torch model pooled the feeds of the texts alone
        checks["embedding_cosine_vs_torch"] = _min_cosine(ours, theirs)  # a Matryoshka cut is not of unit length
    if library is not None:  # the embeddings as the model's own library computes them: a misread pooling shows here
        checks["embedding_library"] = library[1]
    if library is not None and library[0] is not None:
        ours = model.encode(LIBRARY_TEXTS)
        same = ours.shape == library[0].shape
        checks["embedding_cosine_vs_library"] = _min_cosine(ours, library[0]) if same else 0.0
        if checks["embedding_cosine_vs_library"] < MIN_COSINE:
            raise ExportError(
                f"the artifact's embeddings of {src.name} disagree with {library[1]}'s ("
                + (f"cosine {checks['embedding_cosine_vs_library']:.4g}" if same else
                   f"{ours.shape[1]} values each against {library[0].shape[1]}") + "): its pipeline (modules.json, the pooling config, the longest text it reads) is read "
                "otherwise than the library reads it, so slimml does not ship it; convert with --task "
                "feature-extraction (its token states out) and pool them yourself, and report the folder to slimml."
            )
    if common:  # the float graph against the model it was traced from: computing otherwise, it is not shipped
        _refuse_disagreement(src, exported, checks)
    if src.kind == "torch" and example and common:
        checks["other_batch"] = _check_other_batch(model, src, exported, feeds, names)
    model.close()
    return {k: round(v, 8) if isinstance(v, float) else v for k, v in checks.items()}


MAX_REL_DIFF = 0.05  # of an output's largest value: a float32 trace differs by about 1e-6 of it


def _refuse_other_shapes(src: Source, exported: Exported, got: dict[str, np.ndarray], want: dict[str, np.ndarray],
                         names: list[str], batch: str = "") -> None:
    """Refuse an artifact whose outputs come in other shapes than the source model's."""
    for n in names:
        if got[n].shape != want[n].shape:
            raise ExportError(
                f"the exported graph of {src.name} gives its {n!r} output in shape {list(got[n].shape)} where the source "
                f"model gives {list(want[n].shape)}{batch}: slimml does not ship it; {_fix(src, exported, bool(batch))}"
            )


def _refuse_disagreement(src: Source, exported: Exported, checks: dict[str, Any], batch: str = "") -> None:
    """Refuse a float graph whose outputs disagree with the model it was exported from (the torch
    module, or the Hugging Face model in torch): a cosine under ``MIN_COSINE`` or a difference over
    ``MAX_REL_DIFF`` of the output's largest value. A quantized artifact is checked later, by the
    quantize step's own guard, against this float one."""
    cosine, rel = checks.get("cosine_vs_torch", 1.0), checks.get("rel_diff_vs_torch", 0.0)
    if cosine >= MIN_COSINE and rel <= MAX_REL_DIFF:
        return
    if exported.info.get("exporter") == "torch" and not batch:  # float32, traced by slimml
        raise ExportError(
            f"the torch exporter's graph of {src.name} disagrees with the source model in torch (cosine "
            f"{cosine:.4g}, difference {rel:.3g} of its largest value): slimml does not ship it; export this model to ONNX "
            "yourself and convert the .onnx file."
        )
    raise ExportError(
        f"the exported graph of {src.name} disagrees with the source model in torch{batch} (cosine {cosine:.4g}, "
        f"difference {rel:.3g} of its largest value): slimml does not ship it; {_fix(src, exported, bool(batch))}"
    )


def _fix(src: Source, exported: Exported, batch: bool) -> str:
    """What to do about a graph that does not compute what its source does."""
    if batch:
        return ("the module's Python code depends on the batch size (a loop over the batch, a shape read as a number): "
                "write it without Python loops over the batch, or convert with a fixed batch (ExportConfig(dynamic_batch=False)).")
    if src.kind == "torch":
        return ("the trace of its forward does not compute what the module does (a Python branch or loop on tensor values, "
                "an input used by position): make forward traceable, or export it to ONNX yourself and convert the .onnx file.")
    if exported.info.get("exporter") == "optimum" and src.kind == "huggingface":  # Gemma 2 under transformers 4.57
        return ("convert with --exporter torch (slimml's own trace of the model in torch), or export this model to ONNX "
                "yourself and convert the .onnx file.")
    return "export this model to ONNX yourself and convert the .onnx file."


def _check_other_batch(model: Any, src: Source, exported: Exported, feeds: dict[str, np.ndarray],
                       names: list[str]) -> str:
    """A torch module's graph run at one more row than its example inputs (their rows repeated, on
    each input whose first axis is dynamic) against the module: a trace of Python code that depends
    on the batch size is right at the example's batch only. Returns what was compared."""
    from slimml.convert.reference import reference_for

    dynamic = [t.name for t in model.inputs if t.shape and not isinstance(t.shape[0], int) and feeds[t.name].ndim >= 1
               and feeds[t.name].shape[0] >= 1]
    if not dynamic:
        return "not run: no input with a dynamic batch axis"
    batch = feeds[dynamic[0]].shape[0] + 1
    more = {k: np.concatenate([v, v[:1]]) if k in dynamic else v for k, v in feeds.items()}
    try:
        want = reference_for(src, exported, names)(more)
    except Exception as e:  # noqa: BLE001 -- the module itself does not take another batch: nothing to compare
        return f"not run: the module does not take a batch of {batch} ({type(e).__name__})"
    got = model.run(more)
    common = [n for n in names if n in want]
    note = f" at a batch of {batch} (the example's rows repeated)"
    _refuse_other_shapes(src, exported, got, want, common, note)
    _refuse_disagreement(src, exported, {"cosine_vs_torch": min(_min_cosine(got[n], want[n]) for n in common),
                                         "rel_diff_vs_torch": max(_rel_diff(got[n], want[n]) for n in common)}, note)
    return f"batch {batch}: agrees"


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


def example_feeds(src: Source, manifest: Manifest) -> dict[str, np.ndarray] | None:
    """A torch module's own example inputs, as the graph's inputs (its inputs' values may be bounded:
    an embedding's ids); None where they do not line up with them one to one."""
    example = getattr(src, "example_inputs", None) if src.kind == "torch" else None
    if example is None:
        return None
    if isinstance(example, dict):  # by name: the graph's inputs come in forward's order, not the dict's
        if sorted(example) != sorted(t.name for t in manifest.inputs):
            return None
        values = [example[t.name] for t in manifest.inputs]
    else:
        values = [example] if hasattr(example, "detach") else list(example)
    if len(values) != len(manifest.inputs) or not all(hasattr(v, "detach") for v in values):
        return None
    return {t.name: v.detach().cpu().numpy().astype(t.dtype) for t, v in zip(manifest.inputs, values)}


def _check_feeds(folder: Path, manifest: Manifest) -> dict[str, np.ndarray]:
    feeds: dict[str, np.ndarray] = {}
    if any(t.name.startswith("past_key_values") for t in manifest.inputs):
        # a decoder with its cache: the texts' token ids alone leave the cache (and a mask as long as
        # cache + ids) unfed; sample inputs size all of them together
        return sample_feeds(manifest.inputs, batch=2, seq=16, source=manifest.source)
    if manifest.tokenizer is not None:
        text = TextEncoder(folder / manifest.tokenizer.file, manifest.tokenizer, [t.name for t in manifest.inputs])
        feeds = text(SAMPLE_TEXTS)
        vocab = (manifest.source or {}).get("vocab_size")
        ids = feeds.get("input_ids")
        if isinstance(vocab, int) and ids is not None and ids.size and int(ids.max()) >= vocab:
            raise ExportError(f"the tokenizer gives token id {int(ids.max())}, and the model's embedding has {vocab} rows: "
                              "the tokenizer is not this model's (or its vocabulary grew without resizing the "
                              "embeddings); convert the folder with the model's own tokenizer files.")
        if not manifest.components:
            return feeds
    rest = [t for t in manifest.inputs if t.name not in feeds]  # a vision tower's pixels beside the texts
    return feeds | sample_feeds(rest, batch=2, seq=16, source=manifest.source) if rest else feeds


def refuse_nonfinite(name: str, values: np.ndarray, output: str = "logits", nan_only: bool = False) -> None:
    """Refuse a source model whose ``output`` on the check's inputs holds NaN (or inf, unless
    ``nan_only``: a model's own outputs may hold inf on purpose): its weights are damaged, or
    overflow in float32. Every comparison with NaN passes unseen, and argmax of NaN rows agrees
    everywhere, so without this a model of NaN weights shipped with "top1 agreement 1".

    Raises:
        ExportError: naming the model and the fix.
    """
    bad = np.isnan(values) if nan_only else ~np.isfinite(values)
    if bad.any():
        raise ExportError(
            f"the source model {name} itself gives non-finite {output} (NaN or inf: {int(bad.sum())} of {bad.size}) on "
            "slimml's check inputs, so its weights are damaged or overflow in float32; slimml does not ship it. Check "
            "the source file (its own library gives the same), or convert a good copy."
        )


def _min_cosine(a: np.ndarray, b: np.ndarray) -> float:
    """The smallest cosine between ``a``'s and ``b``'s rows (a 0-dim output, a loss or a score, is one row)."""
    a = a.reshape(a.shape[0] if a.ndim else 1, -1).astype(np.float64)
    b = b.reshape(b.shape[0] if b.ndim else 1, -1).astype(np.float64)
    if a.size == 0:  # an empty output: nothing disagrees
        return 1.0
    cos = (a * b).sum(1) / np.clip(np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1), 1e-30, None)
    same = np.linalg.norm(a - b, axis=1) <= 1e-6 * max(float(np.linalg.norm(b, axis=1).max()), 1.0)
    return float(np.where(same, 1.0, cos).min())  # rows of zeros in both (a masked row) agree


def _rel_diff(a: np.ndarray, b: np.ndarray) -> float:
    """The largest difference between ``a`` and ``b`` as a fraction of ``b``'s largest magnitude."""
    if a.size == 0:
        return 0.0
    a, b = a.astype(np.float64), b.astype(np.float64)
    return float(np.abs(a - b).max() / max(float(np.abs(b).max()), 1e-6))
