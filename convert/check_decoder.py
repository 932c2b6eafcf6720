"""``convert``'s check for a decoder exported with its cache by the fused exporter.

The sample feeds of :func:`slimml.convert.pipeline.verify` hold a random past, which a graph whose
attention reads its positions off the mask refuses (and which says nothing a real decode does):
here the artifact and the source model in torch each read the same prompts from an empty cache.
A model bigger than a third of the memory available is checked without ever being whole in
memory: torch runs it one layer at a time (``layerwise.streamed_reference``) and the artifact is
streamed (``layerwise.check_load_options``); the report says so.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from slimml.convert.check import MIN_COSINE, refuse_nonfinite
from slimml.convert.export import Exported
from slimml.convert.layerwise import check_load_options, streamed_reference
from slimml.convert.llm_check import decoder_feeds, past_shapes
from slimml.convert.reference import reference_for
from slimml.convert.sources import Source
from slimml.convert.weights import weight_bytes
from slimml.errors import ExportError
from slimml.runtime.artifact.manifest import Manifest
from slimml.runtime.engine.budget import bigger_than_memory, fmt_bytes
from slimml.runtime.loader import load

# the float graph computes what torch computes, up to float rounding: a real mismatch is far below these
MIN_TOP1 = 0.95


def verify_decoder(folder: Path, manifest: Manifest, src: Source, exported: Exported,
                   batch: int = 2, length: int = 16) -> dict[str, Any]:
    """Logits of the artifact in ``folder`` against the source model on ``batch`` random prompts.

    Returns:
        ``max_abs_diff_vs_torch``, ``cosine_vs_torch`` (the lowest of any position) and
        ``top1_agreement`` (the share of positions whose most likely next token is the same).
    """
    vocab = int(exported.info.get("vocab_size") or 32)
    ids = np.random.default_rng(0).integers(min(3, vocab - 1), vocab, size=(batch, length)).astype(np.int64)
    feeds = {"input_ids": ids, "attention_mask": np.ones_like(ids)}
    streamed = bigger_than_memory(weight_bytes(src.path))
    ref = streamed_reference(src.path) if streamed else reference_for(src, exported, ["logits"])
    want = ref(dict(feeds))["logits"]
    del ref
    refuse_nonfinite(src.name, want)
    options = check_load_options(manifest)
    model = load(folder, device="cpu", **options)  # the artifact's own integrity check runs here
    try:
        got = model.run(decoder_feeds([t.name for t in model.inputs], ids, past_shapes(model.inputs)))["logits"]
    finally:
        model.close()
    a = got.reshape(-1, got.shape[-1]).astype(np.float64)
    b = want.reshape(-1, want.shape[-1]).astype(np.float64)
    cos = (a * b).sum(1) / np.clip(np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1), 1e-30, None)
    checks = {"max_abs_diff_vs_torch": round(float(np.abs(a - b).max()), 8), "cosine_vs_torch": round(float(cos.min()), 8),
              "top1_agreement": round(float((a.argmax(1) == b.argmax(1)).mean()), 6),
              "reference": "torch, layer by layer (bigger than memory), empty cache" if streamed else "torch, empty cache"}
    if options:
        checks["artifact_run"] = f"streamed (memory_budget {fmt_bytes(options['memory_budget'])}): bigger than memory"
    # never a silently wrong float model (written so that NaN fails too: the artifact's, with the source's finite)
    if not (checks["cosine_vs_torch"] >= MIN_COSINE and checks["top1_agreement"] >= MIN_TOP1):
        raise ExportError(
            f"the fused graph of {src.name} disagrees with the source model in torch (cosine {checks['cosine_vs_torch']:.4g}, "
            f"top-1 agreement {checks['top1_agreement']:.3g}): the fused exporter misreads this architecture; "
            "convert with --exporter optimum."
        )
    return checks
