"""Latency, throughput and memory of a loaded artifact, and the sample inputs used to measure it."""

from __future__ import annotations

import os
import resource
import sys
import time
from dataclasses import dataclass, replace

import numpy as np

from slimml.runtime.artifact.manifest import TensorSpec
from slimml.runtime.tasks.limits import a_or_an

_SEQ_AXES = ("seq", "sequence", "length", "token", "time", "past")


def sample_feeds(
    specs: list[TensorSpec], batch: int = 1, seq: int = 128, seed: int = 0, vocab_size: int | None = None,
    source: dict | None = None, past: int = 1,
) -> dict[str, np.ndarray]:
    """Plausible inputs for ``specs``: dynamic axes set to ``batch``/``seq``, ids, masks, noise.

    Token ids are drawn from [1000, 2000), inside any real vocabulary, or from [1, vocab_size / 2)
    for a vocabulary smaller than that; masks are ones; token type and position ids follow their
    usual meaning (``logits_index``: the last position, as a decoder's prefill pass reads it: the
    logits of every position cost 1.3-1.8x the pass on SmolLM2); float inputs are standard normal. ``source``: the manifest's facts about the
    source model (``vocab_size``, and for images ``num_channels`` and ``image_size``, which size
    a 4-D float input's dynamic axes as ``(batch, channels, size, size)``). ``past``: the positions a
    decoder's KV cache holds before the pass (1 exercises the cache path; 0 is a prompt's prefill).
    """
    facts = source or {}
    vocab_size = vocab_size or facts.get("vocab_size")
    image = _image_axes(facts)
    lo, hi = (1, max(2, vocab_size // 2)) if vocab_size and vocab_size <= 2000 else (1000, 2000)
    rng = np.random.default_rng(seed)
    feeds = {}
    for spec in specs:
        shape = []
        for dim, want in enumerate(spec.shape):
            if isinstance(want, int) and want > 0:
                shape.append(want)
            elif isinstance(want, str):  # a named axis, or a sum of them ("past_sequence_length + sequence_length")
                shape.append(sum(_axis_size(part, dim, batch, seq, past) for part in want.split("+")))
            else:
                shape.append(batch if dim == 0 else seq)
        dtype = np.dtype(spec.dtype)
        if image and dtype.kind == "f" and len(spec.shape) == 4:  # (batch, channels, height, width)
            shape = [shape[0]] + [w if isinstance(w, int) and w > 0 else image[d] for d, w in enumerate(spec.shape[1:])]
        lname = spec.name.lower()
        if dtype.kind in "iu":
            if "mask" in lname:
                value = np.ones(shape, dtype=dtype)
            elif "type" in lname:
                value = np.zeros(shape, dtype=dtype)
            elif lname == "logits_index" and len(shape) >= 1:  # the last position, as a generating pass reads it
                value = np.full([*shape[:-1], 1], seq - 1, dtype=dtype)
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


def _image_axes(facts: dict) -> tuple[int, int, int] | None:
    """(channels, height, width) from a source's ``num_channels`` and ``image_size``, if known."""
    channels, size = facts.get("num_channels"), facts.get("image_size")
    if not isinstance(channels, int) or size is None:
        return None
    h, w = (size, size) if isinstance(size, int) else (tuple(size) + (0, 0))[:2]
    return (channels, int(h), int(w)) if h and w else None


def seq_matters(specs, source: dict | None = None) -> bool:
    """Whether :func:`sample_feeds`' ``seq`` sizes any of ``specs``: a dynamic axis past the batch
    axis that is not a cache's or a known image's (an image or speech model's inputs take none, and
    "x seq 128" said of them meant nothing)."""
    image = _image_axes(source or {})
    for spec in specs:
        if image and np.dtype(spec.dtype).kind == "f" and len(spec.shape) == 4:
            continue
        for dim, want in enumerate(spec.shape):
            if dim == 0 or (isinstance(want, int) and want > 0):
                continue
            parts = want.split("+") if isinstance(want, str) else [""]
            if any(_axis_size(part, dim, 0, 1, 0) == 1 for part in parts):
                return True
    return False


def shape_words(specs, batch: int, seq: int, source: dict | None = None) -> str:
    """``"batch 1 x seq 128"``, or ``"batch 1"`` for inputs :func:`seq_matters` says take no ``seq``."""
    return f"batch {batch} x seq {seq}" if seq_matters(specs, source) else f"batch {batch}"


def _axis_size(name: str, dim: int, batch: int, seq: int, past: int) -> int:
    name = name.strip().lower()
    if "past" in name:
        return past
    if any(k in name for k in _SEQ_AXES):
        return seq
    return batch if dim == 0 or "batch" in name else seq


def _past(seq: int) -> int:
    """The cache a timed pass of a decoder runs over: none before a pass of several tokens, a prompt's
    prefill (ONNX Runtime's GroupQueryAttention takes several rows of several tokens only with no cache
    before them); one position before a single token, a decode step."""
    return 0 if seq > 1 else 1


@dataclass
class BenchResult:
    p50_ms: float
    p90_ms: float
    throughput_per_s: float
    peak_rss_mb: float | None  # this process's peak (None where two models shared it: bench_against)
    model_mb: float
    batch: int
    seq: int
    device: str
    runs: int
    run_peak_rss_mb: float | None = None  # highest RSS sampled during the timed runs
    stream: dict | None = None  # streaming counters per timed run (plan, bytes moved, wait vs compute)

    def to_json(self) -> dict:
        extra = {}
        if self.run_peak_rss_mb is not None:
            extra["run_peak_rss_mb"] = round(self.run_peak_rss_mb, 1)
        if self.stream is not None:
            extra["stream"] = self.stream
        return extra | {
            "latency_ms": {"p50": round(self.p50_ms, 3), "p90": round(self.p90_ms, 3)},
            "throughput_per_s": round(self.throughput_per_s, 2),
            "peak_rss_mb": round(self.peak_rss_mb, 1) if self.peak_rss_mb is not None else None,
            "model_mb": round(self.model_mb, 2),
            "batch": self.batch,
            "seq": self.seq,
            "device": self.device,
            "runs": self.runs,
        }


def peak_rss_mb() -> float:
    """This process's peak resident memory in MB (VmHWM on Linux: unlike ru_maxrss it does not
    carry over a parent's peak across fork and exec)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
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
    """Time ``model.run`` on sample inputs of ``batch`` x ``seq``; report p50/p90 and throughput (items/s).

    A streamed model also reports, per timed run, the bytes it loaded and the seconds its compute
    waited on the loader versus computed, and the plan (K, P, pinned shards) it ran under.
    """
    feeds = sample_feeds(model.manifest.inputs, batch=batch, seq=seq, source=model.manifest.source, past=_past(seq))
    for _ in range(warmup):
        model.run(feeds)
    model.plan.reset_stats()
    with RssMonitor() as rss:
        times = time_runs(lambda: model.run(feeds), runs, 0)
    return _result(model, times, batch, seq, rss.peak_mb)


def latency_settings(model) -> dict:
    """What besides batch, sequence and device decides ``model``'s latency, as a baseline records it:
    the streaming plan (``resident``, or K, P and the pinned shards), how streamed weights reach
    their sessions (``weights``: pre-packed from the cache, fed from the data files, or copied to the
    device; 20x apart for a 4-bit model) and the threads (``SLIMML_THREADS``; 0: ONNX Runtime's
    choice, the machine's cores)."""
    from slimml.runtime.engine.backends.base import env_threads

    memory = model.plan.memory
    plan = (f"K={memory.resident} P={memory.prefetch}" + (f" pinned {memory.pinned}" if memory.pinned else "")
            if memory.streaming else "resident")
    weights = sorted({seg.source.kind for seg in model.plan.segments if seg.kind == "streamed"})
    return {"plan": plan, "weights": "; ".join(weights) or "resident", "threads": env_threads()}


def model_identity(model) -> dict:
    """What a bench baseline records of the model it timed (its task and input names), so that a
    gate refuses another model's timing: a baseline of a language model passed an embedder's."""
    return {"task": model.manifest.task, "inputs": [t.name for t in model.manifest.inputs]}


def check_comparable(model, reference, where: str) -> None:
    """Refuse to time ``model`` against ``reference`` (loaded from ``where``) where their latencies
    would not compare: other inputs (another model), or another streaming plan under the same load
    options (one resident, the other streamed).

    Raises:
        ConfigError: naming what differs and what to do.
    """
    from slimml.errors import ConfigError

    from slimml.runtime.artifact.manifest import tensor_list

    if [t.name for t in model.manifest.inputs] != [t.name for t in reference.manifest.inputs]:
        raise ConfigError(f"the reference {where} takes other inputs ({tensor_list(reference.manifest.inputs, False)}) "
                          f"than this artifact ({tensor_list(model.manifest.inputs, False)}), so their latencies do not "
                          "compare; give a reference of the same model (its float or earlier build).")
    if reference.manifest.task != model.manifest.task:  # an embedder and a classifier read the same token ids
        raise ConfigError(f"the reference {where} is {a_or_an(reference.manifest.task)} model and this artifact "
                          f"{a_or_an(model.manifest.task)} one, so their latencies do not compare; give a reference of the same "
                          "model (its float or earlier build).")
    ours, theirs = latency_settings(model)["plan"], latency_settings(reference)["plan"]
    if ours != theirs:
        raise ConfigError(f"under these load options this artifact runs {ours} and the reference {where} {theirs}, so "
                          "their latencies do not compare; give --resident/--prefetch under which both run alike, or "
                          "leave the streaming options out (both resident).")


def bench_against(model, reference, batch: int = 1, seq: int = 128, runs: int = 50,
                  warmup: int = 5) -> tuple[BenchResult, BenchResult]:
    """``model`` and ``reference`` timed in turn in this process, run by run, the order swapped every
    pair (AB BA AB ...), so that what else a shared machine runs falls on both alike: a burst of load
    longer than two runs slows both. (A baseline saved earlier met other load; blocks of ten runs
    each still let a burst fall on one of the two: 2 gates of 10 failed at +50% with one artifact
    against its own copy.) Each is given its own sample inputs; ``runs`` of each are timed.

    Returns:
        ``(model's result, reference's result)``; their peak RSS is None: the process held both, so
        its peak is neither's (bench each alone, or in its own process, for its memory).
    """
    pair = (model, reference)
    feeds = [sample_feeds(m.manifest.inputs, batch=batch, seq=seq, source=m.manifest.source, past=_past(seq)) for m in pair]
    for m, f in zip(pair, feeds):
        for _ in range(warmup):
            m.run(f)
        m.plan.reset_stats()
    times = np.empty((2, runs))
    for r in range(runs):
        for i in ((0, 1) if r % 2 == 0 else (1, 0)):
            t0 = time.perf_counter()
            pair[i].run(feeds[i])
            times[i, r] = (time.perf_counter() - t0) * 1e3
    return tuple(replace(_result(m, times[i], batch, seq, None), peak_rss_mb=None) for i, m in enumerate(pair))


def _result(model, times: np.ndarray, batch: int, seq: int, run_peak_mb: float | None) -> BenchResult:
    """The figures of ``times`` (ms per run of ``model``), with its streaming counters since its
    last ``reset_stats``."""
    p50 = float(np.percentile(times, 50))
    stream_info = None
    if model.plan.streaming:
        st = model.plan.stats
        stream_info = {
            "plan": model.plan.describe(),
            "resident": model.plan.resident,
            "prefetch": model.plan.prefetch,
            "pinned": model.plan.pinned,
            "bytes_per_run": st.bytes_loaded // max(st.passes, 1),
            "wait_s_per_run": round(st.wait_s / max(st.passes, 1), 4),
            "compute_s_per_run": round(st.compute_s / max(st.passes, 1), 4),
            "load_s_per_run": round(st.load_s / max(st.passes, 1), 4),
            "peak_streamed_shards": st.peak_streamed,
        }
    return BenchResult(
        p50_ms=p50,
        p90_ms=float(np.percentile(times, 90)),
        throughput_per_s=batch * 1e3 / p50,
        peak_rss_mb=peak_rss_mb(),
        model_mb=model.manifest.total_bytes / 1e6,
        batch=batch,
        seq=seq,
        device=model.device,
        runs=len(times),
        run_peak_rss_mb=run_peak_mb,
        stream=stream_info,
    )


class RssMonitor:
    """Samples this process's RSS every few ms in a thread; ``peak_mb`` is the highest seen.

    Unlike the process-wide high-water mark, it isolates one measurement (say one K, P setting of
    a sweep) from what ran before it in the same process.
    """

    def __init__(self, interval_s: float = 0.005):
        self.interval_s = interval_s
        self.peak_mb: float | None = None
        self._stop = None

    def __enter__(self) -> RssMonitor:
        import threading

        self._stop = threading.Event()
        self.peak_mb = current_rss_mb()
        self._thread = threading.Thread(target=self._loop, daemon=True, name="slimml-rss-monitor")
        self._thread.start()
        return self

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            now = current_rss_mb()
            if now is not None and (self.peak_mb is None or now > self.peak_mb):
                self.peak_mb = now

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


def current_rss_mb() -> float | None:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * _PAGE / 2**20
    except (OSError, ValueError, IndexError):
        return None


_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
