"""Streamed against fully resident on a decoder larger than K shards (CPU), and a run under a memory cap.

Builds a Llama-architecture causal LM with random weights (default ~1.1B parameters, ~4.4 GB
fp32), exports it with its KV cache (``--task text-generation-with-past``), shards it with slimml,
then runs greedy generation (``model.generate``: the prompt pass, then one pass per new token
with the KV cache) two ways, each in its own subprocess so peak RSS is its own, the rounds
alternating so machine load hits both alike:

- ``resident``: ``slimml.runtime.load(artifact, resident=N)`` (N: all its shards): merged into one session
  (a plain ``load`` would stream a model bigger than the memory free, as in the cap);
- ``streamed``: ``slimml.runtime.load(artifact, resident=K)``: K shards' weights at once.

Reports prefill tokens/s (the prompt pass), decode tokens/s (the passes after it), peak RSS and
whether both produced the same tokens, and how many GB the kernel read from disk during the
rounds (0 when the page cache stayed warm). The page cache is meant to be warm (the machine has
the RAM); on a machine that reclaims idle file cache (a VM running DAMON's proactive reclaim),
``--hold-cache`` keeps the artifact and the packed cache locked in memory during the rounds.

``--memory-cap 2GB`` instead runs inside a Linux memory cgroup (v1, as root) whose limit is below
the model's size: the artifact's pages are dropped from the page cache first, the disk's
sequential read rate is measured in the group, the fully resident model must fail there and the
streamed one must run, matching the resident logits (computed outside the cap) within 1e-4.

Usage:
    python benchmarks/bench_stream.py --batch 4 --seq 32 --generate 16      # decode goal
    python benchmarks/bench_stream.py --batch 4 --seq 256 --generate 1      # prefill goal
    python benchmarks/bench_stream.py --memory-cap 2GB --batch 1 --seq 8    # larger than memory
    python benchmarks/bench_stream.py --layers 4 --hidden 512 --vocab 8000  # a quick small run
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")



def _all_shards(artifact: str) -> int:
    """K = every shard: the model loaded whole, even where the memory free would have it stream."""
    from slimml.runtime.artifact.manifest import read_manifest

    return len(read_manifest(Path(artifact)).shards)

def build(work: Path, args) -> tuple[Path, Path]:
    """Random-weight Llama -> unsharded ONNX (work/onnx/model.onnx) -> artifact (work/artifact)."""
    onnx_path, artifact = work / "onnx" / "model.onnx", work / "artifact"
    if onnx_path.is_file() and (artifact / "manifest.json").is_file():
        return onnx_path, artifact
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from slimml.convert import ConvertConfig, ExportConfig, convert
    from slimml.convert.export import export
    from slimml.convert.sources import resolve

    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    src = work / "src"
    t0 = time.perf_counter()
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.intermediate,
                         num_hidden_layers=args.layers, num_attention_heads=args.heads,
                         num_key_value_heads=args.kv_heads, max_position_embeddings=2048)
    with torch.device("cpu"):
        model = LlamaForCausalLM(config).eval()
    params = sum(p.numel() for p in model.parameters())
    model.save_pretrained(src)
    del model
    print(f"built Llama {params / 1e9:.2f}B params ({params * 4 / 1e9:.2f} GB fp32) in {time.perf_counter() - t0:.0f} s", flush=True)
    t0 = time.perf_counter()
    exported = export(resolve(src), work, ExportConfig(task=args.task))
    shutil.rmtree(src)
    print(f"exported to ONNX in {time.perf_counter() - t0:.0f} s", flush=True)
    t0 = time.perf_counter()
    convert(exported.onnx_path, artifact, ConvertConfig(verify=False, measure_latency=False))
    if args.task != "text-generation":  # an .onnx source converts as "generic": say it is a decoder
        import json as _json

        path = artifact / "manifest.json"
        raw = _json.loads(path.read_text())
        raw["task"] = args.task
        path.write_text(_json.dumps(raw, indent=2) + "\n")
    print(f"sharded in {time.perf_counter() - t0:.0f} s", flush=True)
    return exported.onnx_path, artifact


def peak_rss_mb() -> float:
    """This process's peak RSS. VmHWM, not ru_maxrss: on Linux ru_maxrss survives exec, so a
    child would report the parent's (model-building) peak."""
    from slimml.runtime.tools.bench import peak_rss_mb as peak

    return peak()


def child(args) -> None:
    """One variant in this process: load, generate (once to warm up, then timed), save the tokens."""
    import numpy as np

    from slimml.runtime import load

    t0 = time.perf_counter()
    streamed = args.child == "streamed"
    model = load(args.artifact, resident=args.resident if streamed else _all_shards(args.artifact),
                 pin=(args.pin or None) if streamed else None, pack=args.pack, cache_dir=args.cache_dir)
    load_s = time.perf_counter() - t0
    prompts = np.random.default_rng(0).integers(0, args.vocab, size=(args.batch, args.seq)).tolist()
    model.generate(prompts[:1], max_new_tokens=2)  # warm-up: reads the model in once
    model.plan.reset_stats()
    gen = model.generate(prompts, max_new_tokens=args.generate)
    np.save(args.save, np.array(gen.tokens))
    report = {"variant": args.child, "load_s": round(load_s, 2), "seconds": round(gen.seconds, 2),
              "prefill_tokens_per_s": round(gen.prefill_tokens_per_s, 2),
              "decode_tokens_per_s": round(gen.decode_tokens_per_s, 3),
              "peak_rss_mb": round(peak_rss_mb(), 1), "plan": model.plan.describe()}
    if streamed:
        report["stream"] = model.stats.to_json()
    print("RESULT " + json.dumps(report), flush=True)


def first_pass_feeds(manifest, batch: int, seq: int, vocab: int) -> dict:
    """The prompt pass's feeds: ``seq`` tokens per row, an empty (zero-length) past."""
    import numpy as np

    rng = np.random.default_rng(0)
    feeds = {"input_ids": rng.integers(0, vocab, size=(batch, seq)).astype(np.int64),
             "attention_mask": np.ones((batch, seq), dtype=np.int64),
             "position_ids": np.broadcast_to(np.arange(seq, dtype=np.int64), (batch, seq)).copy()}
    for t in manifest.inputs:
        if t.name.startswith("past_key_values."):
            feeds[t.name] = np.zeros((batch, t.shape[1], 0, t.shape[3]), dtype=np.float32)
    return {k: v for k, v in feeds.items() if k in {t.name for t in manifest.inputs}}


def child_pass(args) -> None:
    """Capped run: ``--runs`` prompt passes (resident, or streamed with K) on a cold page cache."""
    import numpy as np

    from slimml.runtime import load

    if args.child == "disk":
        print("RESULT " + json.dumps({"disk_gbps": disk_read_gbps(Path(args.artifact))}), flush=True)
        return
    t0 = time.perf_counter()
    model = (load(args.artifact, resident=args.resident, pack=args.pack, cache_dir=args.cache_dir)
             if args.child == "cap-streamed" else load(args.artifact, resident=_all_shards(args.artifact)))
    feeds = first_pass_feeds(model.manifest, args.batch, args.seq, args.vocab)
    times = []
    for _ in range(args.runs):
        t = time.perf_counter()
        out = model.run(feeds)
        times.append(time.perf_counter() - t)
    np.save(args.save, out["logits"])
    print("RESULT " + json.dumps({"variant": args.child, "load_s": round(time.perf_counter() - t0 - sum(times), 2),
                                  "pass_s": [round(x, 4) for x in times], "peak_rss_mb": round(peak_rss_mb(), 1),
                                  "stream": model.stats.to_json(), "plan": model.plan.describe()}), flush=True)


def data_files(artifact: Path) -> list[Path]:
    from slimml.runtime.artifact.manifest import read_manifest

    return [artifact / s.data for s in read_manifest(artifact).shards if s.data]


def evict(*folders: Path) -> None:
    """Drop the files' pages from the page cache (clean pages: no privilege needed)."""
    for folder in folders:
        for path in [p for p in folder.rglob("*") if p.is_file()] if folder.is_dir() else []:
            with open(path, "rb") as f:
                os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)


def disk_reads_gb() -> float:
    """GB the kernel has read from disk since boot (/proc/vmstat pgpgin; 0 elsewhere)."""
    try:
        with open("/proc/vmstat") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("pgpgin ")) / 1e6  # KiB
    except (OSError, StopIteration):
        return 0.0


class HeldInPageCache:
    """Every file under ``folders`` mapped and locked (mlock) in this process, so the page cache
    stays warm for the children however the machine reclaims idle memory (a VM's proactive
    reclaim, DAMON, pages out file cache idle for some seconds). Needs CAP_IPC_LOCK (root) or a
    large enough RLIMIT_MEMLOCK, and the RAM."""

    def __init__(self, *folders: Path):
        import ctypes

        self.libc = ctypes.CDLL(None, use_errno=True)
        self.libc.mmap.restype = ctypes.c_void_p
        self.libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
        self.libc.mlock.argtypes = self.libc.munlock.argtypes = self.libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        self.held: list[tuple[int, int, int]] = []
        self.bytes = 0
        try:
            for folder in folders:
                for path in sorted(p for p in folder.rglob("*") if p.is_file() and p.stat().st_size):
                    fd = os.open(path, os.O_RDONLY)
                    size = os.fstat(fd).st_size
                    # read afresh, in order: pages brought back one fault at a time (after the
                    # machine reclaimed them) sit in small folios, which cost more to map in and
                    # read on every pass than the large ones a sequential read makes (docs/streaming.md)
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                    while os.read(fd, 16 << 20):
                        pass
                    addr = self.libc.mmap(None, size, 1, 1, fd, 0)  # PROT_READ, MAP_SHARED
                    if addr in (None, ctypes.c_void_p(-1).value):
                        os.close(fd)
                        raise SystemExit(f"--hold-cache: could not map {path}: {os.strerror(ctypes.get_errno())}")
                    self.held.append((addr, size, fd))
                    if self.libc.mlock(ctypes.c_void_p(addr), size) != 0:
                        raise SystemExit(f"--hold-cache: could not lock {path} in memory ({os.strerror(ctypes.get_errno())}); "
                                         "run as root or raise the memlock limit (ulimit -l)")
                    self.bytes += size
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        import ctypes

        for addr, size, fd in self.held:
            self.libc.munlock(ctypes.c_void_p(addr), size)
            self.libc.munmap(ctypes.c_void_p(addr), size)
            os.close(fd)
        self.held = []


def disk_read_gbps(artifact: Path) -> float:
    """Sequential read rate of the artifact's weight files from a cold cache, in GB/s."""
    evict(artifact)
    total, t0 = 0, time.perf_counter()
    buf = bytearray(16 << 20)
    for path in data_files(artifact):
        with open(path, "rb", buffering=0) as f:
            while n := f.readinto(buf):
                total += n
    gbps = total / (time.perf_counter() - t0) / 1e9
    evict(artifact)
    return round(gbps, 3)


class MemoryCap:
    """A cgroup v1 memory group with a hard limit, for the children started inside it."""

    def __init__(self, limit: int):
        self.path = Path("/sys/fs/cgroup/memory") / f"slimml-bench-{os.getpid()}"
        self.path.mkdir()
        (self.path / "memory.limit_in_bytes").write_text(str(limit))

    def join(self) -> None:  # runs in the child, before exec
        (self.path / "cgroup.procs").write_text(str(os.getpid()))

    def max_usage(self) -> int:
        return int((self.path / "memory.max_usage_in_bytes").read_text())

    def reset_max(self) -> None:
        (self.path / "memory.max_usage_in_bytes").write_text("0")

    def close(self) -> None:
        self.path.rmdir()


def spawn(args, variant: str, work: Path, cap: MemoryCap | None = None) -> tuple[int, dict | None, str]:
    cmd = [sys.executable, __file__, "--child", variant, "--artifact", str(args.artifact_path),
           "--save", str(work / f"out_{variant}.npy"), "--batch", str(args.batch), "--seq", str(args.seq),
           "--vocab", str(args.vocab), "--runs", str(args.runs), "--resident", str(args.resident),
           "--generate", str(args.generate), "--cache-dir", str(args.cache_dir)]
    if args.pack is not None:
        cmd += ["--pack", str(args.pack).lower()]
    if args.pin:
        cmd += ["--pin", *map(str, args.pin)]
    proc = subprocess.run(cmd, capture_output=True, text=True, preexec_fn=cap.join if cap else None)
    line = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
    return proc.returncode, (json.loads(line[-1][7:]) if line else None), (proc.stderr or proc.stdout)[-1500:]


def memory_cap_run(args, work: Path, model_bytes: int) -> dict:
    import numpy as np

    from slimml.runtime.engine.budget import parse_bytes

    limit = parse_bytes(args.memory_cap)
    rc, ref, err = spawn(args, "cap-resident", work)  # the reference logits, outside the cap
    if rc or ref is None:
        sys.exit(f"the resident reference run failed (rc {rc}): {err}")
    np.save(work / "ref.npy", np.load(work / "out_cap-resident.npy"))
    rc, warm, err = spawn(args, "cap-streamed", work)  # outside the cap: builds the packed cache if needed
    if rc or warm is None:
        sys.exit(f"the streamed run failed (rc {rc}): {err}")
    cap = MemoryCap(limit)
    try:
        rc_disk, disk, err_disk = spawn(args, "disk", work, cap)
        evict(args.artifact_path, args.cache_dir)
        rc_res, res, err_res = spawn(args, "cap-resident", work, cap)
        evict(args.artifact_path, args.cache_dir)
        cap.reset_max()
        rc_st, st, err_st = spawn(args, "cap-streamed", work, cap)
        group_peak = cap.max_usage()
    finally:
        cap.close()
    if rc_st or st is None:
        sys.exit(f"the streamed run failed under the cap (rc {rc_st}): {err_st}")
    diff = float(np.abs(np.load(work / "out_cap-streamed.npy") - np.load(work / "ref.npy")).max())
    gbps = disk["disk_gbps"] if disk else None
    weight_bytes = st["stream"]["bytes_per_pass"]  # what one pass brings in
    bound_s = weight_bytes / (gbps * 1e9) if gbps else None
    pass_s = float(np.median(st["pass_s"]))
    return {
        "model_gb": round(model_bytes / 1e9, 3), "memory_cap_gb": round(limit / 1e9, 3),
        "model_over_cap": round(model_bytes / limit, 2), "pass": f"batch {args.batch} x {args.seq} tokens, empty past",
        "resident_in_cap": "failed" if rc_res or res is None else "ran", "resident_rc": rc_res,
        "resident_error": None if res else err_res.strip().splitlines()[-1:] or [f"killed (rc {rc_res})"],
        "streamed_in_cap": st, "group_peak_mb": round(group_peak / 2**20, 1), "max_abs_diff_vs_resident": diff,
        "disk_read_gbps": gbps, "disk_bound_pass_s": round(bound_s, 2) if bound_s else None,
        "streamed_pass_s": round(pass_s, 4), "fraction_of_disk_bound": round(bound_s / pass_s, 3) if bound_s and pass_s else None,
        "goals": {"resident fails in the cap": bool(rc_res or res is None), "outputs within 1e-4": diff <= 1e-4,
                  "model >= 2x cap": model_bytes >= 2 * limit,
                  ">= 50% of the disk bound": bool(bound_s and bound_s / pass_s >= 0.5)},
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--work", default=None, help="build folder (default /tmp/slimml-bench-stream-past)")
    p.add_argument("--layers", type=int, default=22)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--intermediate", type=int, default=5632)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=32, help="prompt tokens per row")
    p.add_argument("--generate", type=int, default=16, help="new tokens per prompt")
    p.add_argument("--resident", type=int, default=2)
    p.add_argument("--pin", type=int, nargs="*", default=None)
    p.add_argument("--runs", type=int, default=2, help="timed passes per subprocess (--memory-cap)")
    p.add_argument("--rounds", type=int, default=2, help="alternating resident/streamed subprocess rounds")
    p.add_argument("--hold-cache", action="store_true",
                   help="keep the artifact and the packed cache locked in the page cache during the rounds (needs root or "
                        "a memlock limit, and the RAM), so 'page cache warm' holds on machines that reclaim idle file cache")
    p.add_argument("--memory-cap", default=None, help="run inside a memory cgroup of this size, e.g. 2GB")
    p.add_argument("--cache-dir", type=Path, default=None, help="pre-packed weights (default: WORK/cache)")
    p.add_argument("--pack", type=lambda v: {"true": True, "false": False}[v.lower()], default=None,
                   help="true/false: force packed or fed streamed weights (default: slimml's choice)")
    p.add_argument("--out", default=None, help="write the JSON report here")
    p.add_argument("--build-only", action="store_true")
    p.add_argument("--task", default="text-generation-with-past", help=argparse.SUPPRESS)
    p.add_argument("--child", choices=["resident", "streamed", "cap-resident", "cap-streamed", "disk"], help=argparse.SUPPRESS)
    p.add_argument("--artifact", help=argparse.SUPPRESS)
    p.add_argument("--save", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child in ("resident", "streamed"):
        return child(args)
    if args.child:
        return child_pass(args)
    work = Path(args.work or "/tmp/slimml-bench-stream-past")
    args.cache_dir = args.cache_dir or work / "cache"
    _, args.artifact_path = build(work, args)
    if args.build_only:
        return
    from slimml.runtime.artifact.manifest import read_manifest

    model_bytes = read_manifest(args.artifact_path).total_bytes
    if args.memory_cap:
        report = memory_cap_run(args, work, model_bytes)
    else:
        import numpy as np

        results: dict[str, list[dict]] = {"resident": [], "streamed": []}
        held = HeldInPageCache(args.artifact_path, args.cache_dir) if args.hold_cache else None
        read0 = disk_reads_gb()
        try:
            for r in range(args.rounds):
                for variant in (("resident", "streamed") if r % 2 == 0 else ("streamed", "resident")):
                    rc, res, err = spawn(args, variant, work)
                    if rc or res is None:
                        sys.exit(f"{variant} failed (rc {rc}):\n{err}")
                    results[variant].append(res)
                    print(f"round {r + 1} {variant}: {json.dumps(res)}", flush=True)
        finally:
            read = disk_reads_gb() - read0
            held_gb = held.bytes / 1e9 if held else 0.0
            if held:
                held.close()
        same = bool((np.load(work / "out_resident.npy") == np.load(work / "out_streamed.npy")).all())
        med = {v: {k: float(np.median([x[k] for x in rs])) for k in ("prefill_tokens_per_s", "decode_tokens_per_s")}
               for v, rs in results.items()}
        ratio = {k: round(med["streamed"][k] / med["resident"][k], 3) if med["resident"][k] else None
                 for k in ("prefill_tokens_per_s", "decode_tokens_per_s")}
        report = {"model_gb": round(model_bytes / 1e9, 3), "shards": len(read_manifest(args.artifact_path).shards),
                  "generate": f"{args.batch} prompts x {args.seq} tokens, {args.generate} new tokens each (KV cache)",
                  "resident_k": args.resident, "same_tokens": same, "median": med, "streamed_vs_resident": ratio,
                  "peak_rss_mb": {v: max(x["peak_rss_mb"] for x in rs) for v, rs in results.items()},
                  "disk_read_gb_during_rounds": round(read, 2), "held_in_page_cache_gb": round(held_gb, 2),
                  "plan": results["streamed"][-1]["plan"], "stream_stats_last": results["streamed"][-1].get("stream")}
    print(json.dumps(report, indent=2))
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
