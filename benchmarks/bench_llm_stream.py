"""Larger than memory: a 4-bit Llama inside a memory cgroup of half its size, slimml streamed
against llama.cpp, with the disk bound measured in the same run (issue 25).

Every system runs in a process of its own, alternated round by round:

- slimml streamed, inside the cap: ``slimml.runtime.load(artifact, memory_budget=B, threads=T)``
  then ``model.generate(ids, max_new_tokens=N)``; B is what a user of a C-byte container would
  give: the cap less the Python + ONNX Runtime floor and some room for activations;
- llama.cpp, inside the same cap: ``llama_cpp.Llama(gguf, n_threads=T)`` as its users run it
  (the weights memory-mapped, the kernel's page cache holding what fits), ``generate(top_k=1)``;
- slimml resident, without a cap: the reference the streamed tokens must equal.

The cap is a cgroup v1 memory group (root only; page cache counts against it), by default half
the artifact's bytes on disk. Every capped run starts cold (the model's files, the GGUF and
slimml's pre-packed cache dropped from the page cache first). Per run: decode tokens/s, bytes
read from storage (``/proc/PID/io`` read_bytes over the timed decode) per token, and the
group's peak usage. The disk bound: the cold sequential read bandwidth of the files the
streamed run reads (``posix_fadvise(DONTNEED)`` first, 8 MiB reads), divided by the bytes the
streamed run must read per token (its streamed shards, from its own counters): the tokens/s a
run limited only by the disk would reach. Reported: slimml / llama.cpp tokens/s, and slimml's
tokens/s / the bound.

Usage (root; the TinyLlama-shaped model of issue 25, docs/llm_decode.md):
    python benchmarks/bench_llm_stream.py --artifact /tmp/decode/art2_b128 \
        --gguf /tmp/decode/tinyllama-q4_0.gguf --rounds 2 --out benchmarks/results/llm_stream.json
    python benchmarks/bench_llm_stream.py ... --quick      # one round, 8 new tokens
    python benchmarks/bench_llm_stream.py ... --rows 1 16 --budget 90MB \
        --out benchmarks/results/llm_stream_rows.json      # slimml alone: 1 prompt against 16 at once
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

CGROUP_ROOT = Path("/sys/fs/cgroup/memory")
VOCAB_LO = 3  # ids below are special in a Llama tokenizer
CHUNK = 8 << 20


# -- measuring inside a worker ----------------------------------------------------------------------

def _io() -> int:
    for line in open("/proc/self/io"):
        if line.startswith("read_bytes:"):
            return int(line.split()[1])
    return 0


def _rss() -> int:
    return int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _prompt(length: int, vocab: int = 32000, seed: int = 0) -> list[int]:
    import numpy as np

    return np.random.default_rng(seed).integers(VOCAB_LO, vocab, size=length).tolist()


def worker_slimml(args) -> dict:
    floor = _rss()  # Python, numpy, onnxruntime and slimml imported, nothing loaded
    from slimml.runtime import load

    options = json.loads(args.load)
    t0 = time.perf_counter()
    model = load(args.artifact, threads=args.threads, **options)
    load_s = time.perf_counter() - t0
    if args.prepare_only:
        return {"load_s": load_s, "plan": model.engine.plan.describe()}
    ids = [_prompt(args.prompt, seed=i) for i in range(args.worker_rows)]  # one prompt per row
    io0, t0 = _io(), time.perf_counter()
    first = model.generate(ids, max_new_tokens=1, eos_token_id=())  # prefill alone: the first token
    prefill_s = time.perf_counter() - t0
    model.engine.plan.reset_stats()
    io1, t1 = _io(), time.perf_counter()
    g = model.generate(ids, max_new_tokens=args.new, eos_token_id=())
    decode_s = time.perf_counter() - t1 - g.prefill_s
    io2 = _io()
    stats = model.engine.stats.to_json()
    made = sum(len(t) - 1 for t in g.tokens)  # every row's tokens after its first (the prompt pass's)
    passes = max(stats.get("passes", 0), 1)
    return {
        "rows": len(ids), "tokens": g.tokens[0], "first": first.tokens[0], "load_s": round(load_s, 3),
        "prefill_s": round(prefill_s, 3), "decode_s": round(decode_s, 3),
        "decode_tok_s": round(made / decode_s, 3),  # all rows together
        # the whole generate (its prompt pass included) over its passes: reads per pass
        "read_bytes": io2 - io1, "read_bytes_per_token": (io2 - io1) // passes,
        "prefill_read_bytes": io1 - io0,
        "streamed_bytes_per_pass": stats.get("bytes_per_pass", 0), "stream": stats,
        "rss_floor": floor, "rss": _rss(), "plan": model.engine.plan.describe(),
    }


def worker_llama(args) -> dict:
    floor = _rss()
    import llama_cpp

    if args.no_repack:  # llama.cpp's --no-repack: the Q4_0 weights stay in the mapped file
        import llama_cpp.llama_cpp as lib

        defaults = lib.llama_model_default_params

        def params():
            p = defaults()
            p.use_extra_bufts = False
            return p

        lib.llama_model_default_params = params
    t0 = time.perf_counter()
    llm = llama_cpp.Llama(str(args.gguf), n_threads=args.threads, n_ctx=args.prompt + args.new + 8, n_batch=args.prompt,
                          verbose=False)  # use_mmap=True, its default
    load_s = time.perf_counter() - t0
    ids = _prompt(args.prompt)

    def run(n: int) -> tuple[list[int], float, float]:
        llm.reset()
        out, t0, first = [], time.perf_counter(), None
        for tok in llm.generate(ids, top_k=1, top_p=1.0, temp=0.0, repeat_penalty=1.0, reset=True):
            if first is None:
                first = time.perf_counter() - t0
            out.append(tok)
            if len(out) == n:
                break
        return out, first, time.perf_counter() - t0

    io0 = _io()
    _, prefill_s, _ = run(1)
    io1 = _io()
    out, first_s, total_s = run(args.new)
    io2 = _io()
    decode_s = total_s - first_s
    return {
        "tokens": out, "load_s": round(load_s, 3), "prefill_s": round(prefill_s, 3), "decode_s": round(decode_s, 3),
        "decode_tok_s": round((len(out) - 1) / decode_s, 3),
        "read_bytes": io2 - io1, "read_bytes_per_token": (io2 - io1) // len(out),  # the prompt pass + one a later token
        "prefill_read_bytes": io1 - io0, "rss_floor": floor, "rss": _rss(),
    }


# -- the driver ---------------------------------------------------------------------------------------

def _drop(paths: list[Path]) -> None:
    """Drop the files' pages from the page cache (clean pages: nothing is lost)."""
    for p in paths:
        try:
            fd = os.open(p, os.O_RDONLY)
        except OSError:
            continue
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def _bandwidth(paths: list[Path]) -> dict:
    """Cold read bandwidth of ``paths``, each dropped from the cache first and read whole: 8 MiB
    reads one after another through the page cache, the same with O_DIRECT, and O_DIRECT with 4
    reads of 4 MiB in flight (how slimml's loader reads); the fastest (the strictest bound).

    The reads land in one 64 MiB buffer touched beforehand, reused round-robin: a fresh buffer
    would measure its page faults (0.4 GB/s against 1.1-1.4 on the same disk), not the disk."""
    import mmap
    from concurrent.futures import ThreadPoolExecutor

    ring = 64 << 20
    buf = mmap.mmap(-1, ring)  # page-aligned, as O_DIRECT needs
    buf.write(b"\1" * ring)
    view = memoryview(buf)
    out = {}
    try:
        with ThreadPoolExecutor(4) as pool:
            for how, flags, chunk, depth in (("buffered", os.O_RDONLY, CHUNK, 1),
                                              ("direct", os.O_RDONLY | os.O_DIRECT, CHUNK, 1),
                                              ("direct_4_in_flight", os.O_RDONLY | os.O_DIRECT, 4 << 20, 4)):
                _drop(paths)
                total, t0 = 0, time.perf_counter()
                for p in paths:
                    fd = os.open(p, flags)
                    try:
                        def read(off: int) -> int:
                            at = off % ring
                            return os.preadv(fd, [view[at:at + chunk]], off)

                        offsets = range(0, p.stat().st_size, chunk)
                        total += sum(pool.map(read, offsets) if depth > 1 else map(read, offsets))
                    finally:
                        os.close(fd)
                out[how] = int(total / (time.perf_counter() - t0))
    finally:
        view.release()
        buf.close()
    return {"bytes": total, "bytes_per_s": max(out.values()), **{f"{k}_bytes_per_s": v for k, v in out.items()}}


class Cgroup:
    """A cgroup v1 memory group capped at ``limit`` bytes; removed on exit."""

    def __init__(self, limit: int):
        self.path = CGROUP_ROOT / f"slimml_bench_stream_{os.getpid()}"
        self.limit = limit

    def __enter__(self) -> Cgroup:
        self.path.mkdir()
        (self.path / "memory.limit_in_bytes").write_text(str(self.limit))
        return self

    def reset(self) -> None:
        for name in ("memory.max_usage_in_bytes", "memory.failcnt"):
            try:
                (self.path / name).write_text("0")
            except OSError:
                pass

    def peak(self) -> dict:
        read = lambda n: int((self.path / n).read_text())  # noqa: E731
        return {"peak_bytes": read("memory.max_usage_in_bytes"), "failcnt": read("memory.failcnt")}

    def enter(self) -> None:  # in the child, before exec
        (self.path / "cgroup.procs").write_text(str(os.getpid()))

    def __exit__(self, *exc) -> None:
        for _ in range(50):
            try:
                self.path.rmdir()
                return
            except OSError:
                time.sleep(0.1)


def _spawn(args, system: str, group: Cgroup | None, load: dict | None = None, prepare: bool = False,
           no_repack: bool = False, rows: int = 1) -> dict:
    cmd = [sys.executable, __file__, "--worker", system, "--artifact", str(args.artifact), "--gguf", str(args.gguf),
           "--threads", str(args.threads), "--prompt", str(args.prompt), "--new", str(args.new),
           "--worker-rows", str(rows),
           "--load", json.dumps(load or {})] + (["--prepare-only"] if prepare else []) + (
               ["--no-repack"] if no_repack else [])
    if group is not None:
        group.reset()
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, preexec_fn=group.enter if group else None,
                           timeout=args.timeout)
    except subprocess.TimeoutExpired:  # thrashing in the cap: a result (at most new / timeout tokens/s), not a crash
        out = {"error": f"did not finish in --timeout {args.timeout} s", "timed_out": True,
               "decode_tok_s_at_most": round(args.new / args.timeout, 4)}
        if group is not None:
            out["cgroup"] = group.peak()
        return out
    if p.returncode != 0:
        tail = (p.stderr or "").strip().splitlines()[-3:]
        out = {"error": f"exit {p.returncode}" + (" (killed: out of memory in the cap?)" if p.returncode < 0 else ""),
               "stderr": tail}
    else:
        out = json.loads(p.stdout.strip().splitlines()[-1])
    if group is not None:
        out["cgroup"] = group.peak()
    return out


def _packed_files(args, load: dict) -> list[Path]:
    """The pre-packed cache files the streamed model maps (the bytes it streams come from them)."""
    code = ("import json,sys; from slimml.runtime import load; "
            f"m = load({str(args.artifact)!r}, threads={args.threads}, **json.loads(sys.argv[1])); "
            "segs = [s for s in m.engine.plan.segments if s.kind == 'streamed']; "
            "print(json.dumps(sorted({str(e.data) for s in segs for e in getattr(s.source, 'entries', {}).values()} | "
            "{str(s.source.folder / s.source.manifest.shards[i].data) for s in segs if not hasattr(s.source, 'entries') "
            "for i in s.shards if s.source.manifest.shards[i].data})))")
    p = subprocess.run([sys.executable, "-c", code, json.dumps(load)], capture_output=True, text=True, check=True)
    return [Path(x) for x in json.loads(p.stdout.strip().splitlines()[-1])]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--artifact", type=Path, default=Path("/tmp/decode/art2_b128"))
    ap.add_argument("--gguf", type=Path, default=Path("/tmp/decode/tinyllama-q4_0.gguf"))
    ap.add_argument("--cap", default=None, help="the cgroup's limit (bytes or 300MB; default: half the artifact)")
    ap.add_argument("--budget", default=None,
                    help="slimml's memory_budget (default: the cap less the measured floor and 60 MB of room)")
    ap.add_argument("--load", default=None, help="slimml's load options as JSON, instead of --budget")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prompt", type=int, default=32)
    ap.add_argument("--new", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--quick", action="store_true", help="one round, 8 new tokens")
    ap.add_argument("--timeout", type=int, default=600)
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "llm_stream.json")
    ap.add_argument("--worker", choices=["slimml", "llama"], help=argparse.SUPPRESS)
    ap.add_argument("--prepare-only", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--no-repack", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--worker-rows", type=int, default=1, help=argparse.SUPPRESS)
    ap.add_argument("--rows", type=int, nargs="+", default=None,
                    help="instead of the comparison: slimml streamed in the cap generating for this many prompts "
                         "at once (e.g. 1 16), each pass serving every row; aggregate tokens/s per row count")
    args = ap.parse_args()
    if args.worker:
        args.load = args.load or "{}"
        out = worker_slimml(args) if args.worker == "slimml" else worker_llama(args)
        print(json.dumps(out))
        return
    if args.quick:
        args.rounds, args.new = 1, 8
    if os.geteuid() != 0 or not CGROUP_ROOT.is_dir():
        sys.exit("bench_llm_stream needs root and cgroup v1's memory controller at /sys/fs/cgroup/memory.")

    from slimml.runtime.engine.budget import parse_bytes

    artifact_files = sorted(p for p in args.artifact.iterdir() if p.is_file())
    artifact_bytes = sum(p.stat().st_size for p in artifact_files)
    cap = parse_bytes(args.cap) if args.cap else artifact_bytes // 2
    floor = _floor(args)
    budget = parse_bytes(args.budget) if args.budget else cap - floor - 60 * 10**6
    load = json.loads(args.load) if args.load else {"memory_budget": budget}
    print(f"artifact {artifact_bytes / 1e6:.0f} MB, cap {cap / 1e6:.0f} MB, floor {floor / 1e6:.0f} MB, slimml "
          f"load {load}", file=sys.stderr)
    # the packed cache is built once, uncapped (a first load writes it): not part of what is timed
    prep = _spawn(args, "slimml", None, load, prepare=True)
    print("prepared:", prep.get("plan", prep), file=sys.stderr)
    streamed_files = _packed_files(args, load)
    cold = [*artifact_files, args.gguf, *streamed_files]
    if args.rows:
        return _rows_run(args, cap, floor, load, artifact_bytes, cold)
    rounds = []
    with Cgroup(cap) as group:
        for r in range(args.rounds):
            row = {}
            for system in ("slimml_stream", "llama_cpp", "llama_cpp_no_repack", "slimml_resident"):
                _drop(cold)
                if system == "slimml_stream":
                    row[system] = _spawn(args, "slimml", group, load)
                    # the disk bound, measured right after: the files slimml streams, and the GGUF
                    row["bandwidth_streamed_files"] = _bandwidth(streamed_files)
                    row["bandwidth_gguf"] = _bandwidth([args.gguf])
                elif system.startswith("llama_cpp"):
                    row[system] = _spawn(args, "llama", group, no_repack=system.endswith("no_repack"))
                else:
                    row[system] = _spawn(args, "slimml", None, {})
                res = row[system]
                print(f"round {r} {system}: {res.get('decode_tok_s', res.get('error'))} tok/s, "
                      f"{res.get('read_bytes_per_token', 0) / 1e6:.0f} MB read/token", file=sys.stderr)
            rounds.append(row)
    report = _report(args, cap, floor, load, artifact_bytes, rounds)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    print(json.dumps(report["summary"], indent=1))


def _rows_run(args, cap: int, floor: int, load: dict, artifact_bytes: int, cold: list[Path]) -> None:
    """slimml streamed in the cap at each of ``--rows`` prompts at once, cold each time, rounds
    alternating the order: what one pass read from disk serves, as the server's batch shares it."""
    rounds = []
    with Cgroup(cap) as group:
        for r in range(args.rounds):
            row = {}
            for n in args.rows if r % 2 == 0 else args.rows[::-1]:
                _drop(cold)
                res = row[f"rows_{n}"] = _spawn(args, "slimml", group, load, rows=n)
                res.pop("tokens", None)
                print(f"round {r} slimml streamed, {n} rows: {res.get('decode_tok_s', res.get('error'))} tok/s, "
                      f"{res.get('read_bytes_per_token', 0) / 1e6:.0f} MB read a pass", file=sys.stderr)
            rounds.append(row)
    one = f"rows_{min(args.rows)}"
    summary = [{f"{k}_tok_s": v.get("decode_tok_s", 0.0) for k, v in row.items()}
               | {f"{k}_over_{one}": round(v.get("decode_tok_s", 0.0) / row[one]["decode_tok_s"], 2)
                  for k, v in row.items() if k != one and row[one].get("decode_tok_s")} for row in rounds]
    report = {"benchmark": "llm_stream_rows", "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
              "machine": {"cores": os.cpu_count(), "load_avg": os.getloadavg()}, "artifact": str(args.artifact),
              "artifact_bytes": artifact_bytes, "cap_bytes": cap, "python_ort_floor_bytes": floor, "slimml_load": load,
              "threads": args.threads, "prompt": args.prompt, "new_tokens": args.new, "rounds": rounds, "summary": summary}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    print(json.dumps(summary, indent=1))


def _floor(args) -> int:
    code = "import numpy, onnxruntime, slimml.runtime, os; print(int(open('/proc/self/statm').read().split()[1]) * os.sysconf('SC_PAGE_SIZE'))"
    return int(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout)


def _report(args, cap: int, floor: int, load: dict, artifact_bytes: int, rounds: list[dict]) -> dict:
    summary = []
    for r, row in enumerate(rounds):
        s, ref = row["slimml_stream"], row["slimml_resident"]
        bw = max(row["bandwidth_streamed_files"]["bytes_per_s"], row["bandwidth_gguf"]["bytes_per_s"])
        out = {"round": r, "cold_read_bytes_per_s": bw}
        for name in ("slimml_stream", "llama_cpp", "llama_cpp_no_repack", "slimml_resident"):
            res = row[name]
            out[f"{name}_tok_s"] = res.get("decode_tok_s", 0.0)  # 0: it did not run (killed in the cap)
            if "error" in res:
                out[f"{name}_error"] = res["error"]
            else:
                out[f"{name}_read_bytes_per_token"] = res["read_bytes_per_token"]
            if "cgroup" in res:
                out[f"{name}_cgroup_peak_bytes"] = res["cgroup"]["peak_bytes"]
        if "error" in s:
            summary.append(out)
            continue
        must = s["streamed_bytes_per_pass"]  # what the plan streams per token
        bound = bw / must if must else None
        best_llama = max(out["llama_cpp_tok_s"], out["llama_cpp_no_repack_tok_s"])
        out.update({
            "ratio_vs_best_llama_cpp": round(s["decode_tok_s"] / best_llama, 2) if best_llama else None,
            "tokens_equal_resident": s["tokens"] == ref.get("tokens"),
            "slimml_streamed_bytes_per_token": must,
            "disk_bound_tok_s": round(bound, 2) if bound else None,
            "fraction_of_disk_bound": round(s["decode_tok_s"] / bound, 2) if bound else None,
        })
        summary.append(out)
    return {
        "benchmark": "llm_stream", "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "machine": {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(),
                    "load_avg": os.getloadavg()},
        "artifact": str(args.artifact), "artifact_bytes": artifact_bytes, "gguf": str(args.gguf),
        "gguf_bytes": args.gguf.stat().st_size, "cap_bytes": cap, "python_ort_floor_bytes": floor,
        "left_for_weights_bytes": cap - floor, "slimml_load": load, "threads": args.threads,
        "prompt": args.prompt, "new_tokens": args.new, "rounds": rounds, "summary": summary,
    }


if __name__ == "__main__":
    main()
