"""Latency, throughput and memory of a loaded artifact, and the sample inputs used to measure it."""

from __future__ import annotations

import resource
import sys
import time
from dataclasses import dataclass

import numpy as np

from slimml.runtime.manifest import TensorSpec

_SEQ_AXES = ("seq", "sequence", "length", "token", "time", "past")


def sample_feeds(
    specs: list[TensorSpec], batch: int = 1, seq: int = 128, seed: int = 0, vocab_size: int | None = None
) -> dict[str, np.ndarray]:
    """Plausible inputs for ``specs``: dynamic axes set to ``batch``/``seq``, ids, masks, noise.

    Token ids are drawn from [1000, 2000), inside any real vocabulary, or from [1, vocab_size / 2)
    for a vocabulary smaller than that; masks are ones; token type and position ids follow their
    usual meaning; float inputs are standard normal.
    """
    lo, hi = (1, max(2, vocab_size // 2)) if vocab_size and vocab_size <= 2000 else (1000, 2000)
    rng = np.random.default_rng(seed)
    feeds = {}
    for spec in specs:
        shape = []
        for dim, want in enumerate(spec.shape):
            if isinstance(want, int) and want > 0:
                shape.append(want)
            elif isinstance(want, str) and any(k in want.lower() for k in _SEQ_AXES):
                shape.append(seq)
            elif dim == 0:
                shape.append(batch)
            else:
                shape.append(seq)
        dtype = np.dtype(spec.dtype)
        lname = spec.name.lower()
        if dtype.kind in "iu":
            if "mask" in lname:
                value = np.ones(shape, dtype=dtype)
            elif "type" in lname:
                value = np.zeros(shape, dtype=dtype)
            elif "position" in lname and len(shape) >= 1:
                value = np.broadcast_to(np.arange(shape[-1], dtype=dtype), shape).copy()
            else:
                value = rng.integers(lo, hi, size=shape).astype(dtype)
        elif dtype.kind == "b":
            value = np.ones(shape, dtype=dtype)
        else:
            value = rng.standard_normal(shape).astype(dtype)
        feeds[spec.name] = value
    return feeds


@dataclass
class BenchResult:
    p50_ms: float
    p90_ms: float
    throughput_per_s: float
    peak_rss_mb: float
    model_mb: float
    batch: int
    seq: int
    device: str
    runs: int

    def to_json(self) -> dict:
        return {
            "latency_ms": {"p50": round(self.p50_ms, 3), "p90": round(self.p90_ms, 3)},
            "throughput_per_s": round(self.throughput_per_s, 2),
            "peak_rss_mb": round(self.peak_rss_mb, 1),
            "model_mb": round(self.model_mb, 2),
            "batch": self.batch,
            "seq": self.seq,
            "device": self.device,
            "runs": self.runs,
        }


def peak_rss_mb() -> float:
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss / (1 << 20) if sys.platform == "darwin" else rss / 1024  # bytes on macOS, KiB elsewhere


def time_runs(fn, runs: int, warmup: int) -> np.ndarray:
    """Wall times of ``runs`` calls of ``fn`` in ms, after ``warmup`` untimed calls."""
    for _ in range(warmup):
        fn()
    times = np.empty(runs)
    for i in range(runs):
        t0 = time.perf_counter()
        fn()
        times[i] = (time.perf_counter() - t0) * 1e3
    return times


def bench(model, batch: int = 1, seq: int = 128, runs: int = 50, warmup: int = 5) -> BenchResult:
    """Time ``model.run`` on sample inputs of ``batch`` x ``seq``; report p50/p90 and throughput (items/s)."""
    feeds = sample_feeds(model.manifest.inputs, batch=batch, seq=seq, vocab_size=model.manifest.source.get("vocab_size"))
    times = time_runs(lambda: model.run(feeds), runs, warmup)
    p50 = float(np.percentile(times, 50))
    return BenchResult(
        p50_ms=p50,
        p90_ms=float(np.percentile(times, 90)),
        throughput_per_s=batch * 1e3 / p50,
        peak_rss_mb=peak_rss_mb(),
        model_mb=model.manifest.total_bytes / 1e6,
        batch=batch,
        seq=seq,
        device=model.device,
        runs=runs,
    )
