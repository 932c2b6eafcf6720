"""The student against its teacher, for the convert report: parameters, MB, latency ratio, accuracy.

After ``--distill-layers`` / ``--prune``, the teacher is converted too (float, unsharded checks
off) in the work folder, and both artifacts are timed round after round in this one process at
batch 1 x seq 128 (fewer where a model's positions end sooner), so the ratio holds on a noisy
machine. With an STS file, both are also scored (Spearman x100 of the embeddings' cosine).
"""

from __future__ import annotations

import os
import time
from typing import Any

import numpy as np

from slimml.runtime.tools.bench import sample_feeds
from slimml.runtime.loader import Model


def compare(teacher: Model, student: Model, teacher_params: int, student_params: int,
            sts_file: str | os.PathLike | None = None, rounds: int = 20) -> dict[str, Any]:
    """``{"teacher": {...}, "student": {...}, "latency_ratio": s/t}``, each with params, mb, latency_ms[, stsb]."""
    feeds = {}
    seq = min(_longest(teacher), _longest(student))  # the same tokens for both
    for name, model in (("teacher", teacher), ("student", student)):
        feeds[name] = sample_feeds(model.inputs, batch=1, seq=seq, source=model.manifest.source)
        for _ in range(3):
            model.run(feeds[name])
    times: dict[str, list[float]] = {"teacher": [], "student": []}
    for _ in range(rounds):  # interleaved: both see the same machine load
        for name, model in (("teacher", teacher), ("student", student)):
            t0 = time.perf_counter()
            model.run(feeds[name])
            times[name].append((time.perf_counter() - t0) * 1e3)
    out: dict[str, Any] = {}
    for name, model, params in (("teacher", teacher, teacher_params), ("student", student, student_params)):
        out[name] = {"params": int(params), "mb": round(model.manifest.total_bytes / 1e6, 2),
                     "latency_ms": round(float(np.median(times[name])), 3)}
        if sts_file is not None:
            from slimml.runtime.tools.evaluate import evaluate_sts

            out[name]["stsb"] = round(evaluate_sts(model, sts_file).score, 2)
    out["latency_ratio"] = round(out["student"]["latency_ms"] / out["teacher"]["latency_ms"], 3)
    return out


def _longest(model: Model) -> int:
    """128 tokens, or fewer where the model's positions end sooner (a graph with a KV cache is fed one
    cached token beside them, as ``sample_feeds`` sizes it)."""
    past = any("past" in str(d) for t in model.inputs for d in t.shape)
    return min(128, (model.max_sequence_length or 129) - past)


def student_params(steps: list[dict[str, Any]]) -> tuple[int, int]:
    """(teacher, student) parameter counts from the distill/prune step records."""
    by = {s["step"]: s for s in steps}
    last = by.get("prune") or by.get("distill") or {}  # both record the teacher; the last one the final student
    return last.get("teacher_params", 0), last.get("student_params", 0)

