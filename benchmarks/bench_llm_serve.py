"""Concurrent streaming chat clients against slimml's OpenAI server and llama-cpp-python's.

    python benchmarks/bench_llm_serve.py --artifact ART [--streamed ART_OR_SAME --budget 400MB]
                                         [--gguf FILE.gguf] [--clients 1 4 16] [--requests 3]
                                         [--max-tokens 64] [--threads 2] [--out benchmarks/results/llm_serve.json]

Each system runs as its users run it, in its own process, one at a time, on 127.0.0.1:

- ``slimml``: ``slimml serve ART --max-running 16`` (Ray Serve, continuous batching);
- ``slimml-streamed``: the same with ``--memory-budget`` (weights streamed, each pass shared);
- ``llama.cpp``: ``python -m llama_cpp.server --model FILE.gguf --n_threads T`` (llama-cpp-python's
  own OpenAI server).

For each N in ``--clients``, N threads of the ``openai`` client each send ``--requests`` streaming
chat requests back to back (``max_tokens`` each, temperature 0). Reported per N: aggregate output
tokens/s (all clients' tokens over the wall time), time to first token p50/p99 and inter-token
latency p50/p99. Tokens are counted from ``usage`` when the server sends it
(``stream_options.include_usage``), else one per content chunk.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

PROMPTS = ["Tell me about the history of Paris.", "Write a short poem about the sea.",
           "Explain how a bicycle works.", "What should I cook tonight?", "Describe a walk in a forest.",
           "Why is the sky blue?", "Give me three tips for learning a language.", "Summarise the plot of Hamlet."]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(kind: str, args, port: int) -> subprocess.Popen:
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads))
    if kind.startswith("slimml"):
        cmd = [sys.executable, "-m", "slimml", "serve", str(args.artifact if kind == "slimml" else args.streamed),
               "--port", str(port), "--max-running", str(max(args.clients)), "--max-waiting", "64"]
        if kind == "slimml-streamed":
            cmd += ["--memory-budget", args.budget]
    else:
        cmd = [sys.executable, "-m", "llama_cpp.server", "--model", str(args.gguf), "--n_threads", str(args.threads),
               "--n_ctx", "2048", "--port", str(port), "--host", "127.0.0.1"]
    return subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True)


def wait_ready(port: int, proc: subprocess.Popen, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"the server exited: {proc.stderr.read().decode()[-2000:]}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=5) as r:
                if r.status == 200:
                    return
        except OSError:
            time.sleep(1)
    raise SystemExit("the server did not start in time")


def stop(proc: subprocess.Popen) -> None:
    import signal

    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(60)
    except (ProcessLookupError, subprocess.TimeoutExpired):
        os.killpg(proc.pid, signal.SIGKILL)


def one_request(client, model: str, prompt: str, max_tokens: int, usage_ok: bool) -> dict:
    t0 = time.perf_counter()
    times, tokens = [], None
    extra = {"stream_options": {"include_usage": True}} if usage_ok else {}
    for chunk in client.chat.completions.create(model=model, messages=[{"role": "user", "content": prompt}],
                                                max_tokens=max_tokens, temperature=0, stream=True, **extra):
        if chunk.choices and chunk.choices[0].delta.content:
            times.append(time.perf_counter())
        if getattr(chunk, "usage", None):
            tokens = chunk.usage.completion_tokens
    gaps = [b - a for a, b in zip(times, times[1:])]
    return {"ttft": times[0] - t0 if times else None, "gaps": gaps, "tokens": tokens or len(times)}


def load_test(port: int, model: str, clients: int, requests: int, max_tokens: int, usage_ok: bool) -> dict:
    import numpy as np
    import openai

    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0, timeout=600)
    one_request(client, model, PROMPTS[0], 4, usage_ok)  # warm-up
    results: list[dict] = []
    lock = threading.Lock()

    def worker(c: int) -> None:
        for r in range(requests):
            out = one_request(client, model, PROMPTS[(c + r) % len(PROMPTS)], max_tokens, usage_ok)
            with lock:
                results.append(out)

    t0 = time.perf_counter()
    threads = [threading.Thread(target=worker, args=(c,)) for c in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    ttft = [r["ttft"] for r in results if r["ttft"] is not None]
    gaps = [g for r in results for g in r["gaps"]]
    tokens = sum(r["tokens"] for r in results)
    pct = lambda xs, q: float(np.percentile(xs, q)) if xs else None  # noqa: E731
    return {"clients": clients, "requests": len(results), "tokens": tokens, "wall_s": wall,
            "tokens_per_s": tokens / wall, "ttft_p50_s": pct(ttft, 50), "ttft_p99_s": pct(ttft, 99),
            "itl_p50_s": pct(gaps, 50), "itl_p99_s": pct(gaps, 99)}


def model_name(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=10) as r:
        return json.loads(r.read())["data"][0]["id"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--artifact", type=Path, required=True, help="slimml with-past artifact (resident)")
    ap.add_argument("--streamed", type=Path, default=None, help="artifact to serve streamed (default: --artifact)")
    ap.add_argument("--budget", default=None, help="--memory-budget for the streamed run, e.g. 400MB")
    ap.add_argument("--gguf", type=Path, default=None, help="the same model and bits as GGUF, for llama-cpp-python")
    ap.add_argument("--clients", type=int, nargs="+", default=[1, 4, 16])
    ap.add_argument("--requests", type=int, default=3, help="requests per client")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "llm_serve.json")
    args = ap.parse_args()
    args.streamed = args.streamed or args.artifact
    systems = ["slimml"] + (["slimml-streamed"] if args.budget else []) + (["llama.cpp"] if args.gguf else [])
    report: dict = {"args": {k: str(v) for k, v in vars(args).items()}, "systems": {}}
    for kind in systems:
        port = free_port()
        proc = start(kind, args, port)
        try:
            wait_ready(port, proc)
            name = model_name(port)
            rows = []
            for n in args.clients:
                row = load_test(port, name, n, args.requests, args.max_tokens, usage_ok=kind.startswith("slimml"))
                rows.append(row)
                print(f"{kind:16s} clients {n:3d}: {row['tokens_per_s']:7.1f} tok/s, TTFT p50 {row['ttft_p50_s']:.3f} s "
                      f"p99 {row['ttft_p99_s']:.3f} s, ITL p50 {row['itl_p50_s'] or 0:.4f} s p99 {row['itl_p99_s'] or 0:.4f} s",
                      flush=True)
            report["systems"][kind] = rows
        finally:
            stop(proc)
    for kind, rows in report["systems"].items():
        by = {r["clients"]: r for r in rows}
        lo, hi = min(by), max(by)
        report.setdefault("ratios", {})[kind] = {
            f"tokens_per_s_{hi}_over_{lo}": by[hi]["tokens_per_s"] / by[lo]["tokens_per_s"],
            f"ttft_p99_{hi}_over_{lo}": by[hi]["ttft_p99_s"] / by[lo]["ttft_p99_s"]}
    if "llama.cpp" in report["systems"]:
        hi = max(args.clients)
        ref = {r["clients"]: r for r in report["systems"]["llama.cpp"]}[hi]["tokens_per_s"]
        for kind in ("slimml", "slimml-streamed"):
            if kind in report["systems"]:
                mine = {r["clients"]: r for r in report["systems"][kind]}[hi]["tokens_per_s"]
                report["ratios"][kind][f"vs_llama_cpp_at_{hi}"] = mine / ref
    print(json.dumps(report["ratios"], indent=1))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
