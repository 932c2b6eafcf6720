"""What small hostile requests cost a replica: RSS growth of ``slimml serve`` on a 2-layer,
32,000-token Llama decoder (rotary positions, no tokenizer), request by request.

    python benchmarks/bench_hostile_serve.py [--json out.json]

Each request is sent once, in order, on a fresh server; the replica's RSS (``/proc``) is read
before and at its peak while the request runs (sampled every 10 ms). Run it with another
checkout's interpreter to compare versions (the artifact is built once, under /tmp).
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import secrets
import socket
import tempfile
import threading
import time
from pathlib import Path

ART = Path(tempfile.gettempdir()) / "slimml-bench-llama32k"


def build() -> Path:
    if (ART / "manifest.json").is_file():
        return ART
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from slimml.convert import ConvertConfig, ExportConfig, convert

    torch.manual_seed(0)
    src = Path(tempfile.mkdtemp(prefix="llama32k-src-"))
    LlamaForCausalLM(LlamaConfig(vocab_size=32000, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048)
                     ).eval().save_pretrained(src)
    convert(src, ART, ConvertConfig(export=ExportConfig(task="text-generation"), verify=False, measure_latency=False))
    return ART


def rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:")) / 1024


def replica() -> int:
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/cmdline", "rb") as f:
                    if f.read().startswith(b"ray::ServeReplica:slimml"):
                        return int(entry)
            except OSError:
                pass
    raise SystemExit("no replica")


def post(port: int, path: str, body: dict) -> tuple[int, str]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    conn.request("POST", path, body=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    r = conn.getresponse()
    raw = r.read()
    conn.close()
    try:
        return r.status, (json.loads(raw).get("error") or {}).get("message", "")[:120]
    except ValueError:
        return r.status, raw[:120].decode(errors="replace")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--json")
    args = parser.parse_args()
    os.environ.setdefault("RAY_TMPDIR", tempfile.mkdtemp(prefix="slimml-ray-", dir="/tmp"))
    os.environ.setdefault("RAY_AUTH_TOKEN", secrets.token_hex(32))
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    art = build()
    from slimml.serve import ServeConfig, serve

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    urls, stop = [], threading.Event()
    thread = threading.Thread(target=serve, args=(ServeConfig(str(art)),),
                              kwargs={"port": port, "ready": urls.append, "stop": stop}, daemon=True)
    thread.start()
    while not urls:
        assert thread.is_alive(), "the server did not start"
        time.sleep(0.2)
    pid = replica()
    ids = lambda rows, n: [[(r * 31 + t) % 31999 + 1 for t in range(n)] for r in range(rows)]  # noqa: E731
    run = lambda n: {"inputs": {"input_ids": {"dtype": "int64", "data": ids(1, n)},  # noqa: E731
                                "attention_mask": {"dtype": "int64", "data": [[1] * n]},
                                "position_ids": {"dtype": "int64", "data": [list(range(n))]}}}
    cases = [("honest: generate 2 prompts x 8 ids, 8 new", "/v1/generate", {"prompt": ids(2, 8), "max_new_tokens": 8}),
             ("run: one sequence of 100 ids", "/v1/run", run(100)),
             ("run: one sequence of 500 ids", "/v1/run", run(500)),
             ("run: one sequence of 1,000 ids", "/v1/run", run(1000)),
             ("run: one sequence of 3,000 ids (74 kB)", "/v1/run", run(3000)),
             ("generate: 16 prompts x 50 ids, 16 new", "/v1/generate", {"prompt": ids(16, 50), "max_new_tokens": 16}),
             ("generate: 64 prompts x 50 ids, 16 new (10 kB)", "/v1/generate", {"prompt": ids(64, 50), "max_new_tokens": 16}),
             ("generate: 256 prompts x 50 ids, 16 new", "/v1/generate", {"prompt": ids(256, 50), "max_new_tokens": 16})]
    rows = []
    try:
        for what, path, body in cases:
            before, peak, done = rss_mb(pid), [0.0], threading.Event()

            def sample():
                while not done.is_set():
                    peak[0] = max(peak[0], rss_mb(pid))
                    time.sleep(0.01)

            sampler = threading.Thread(target=sample, daemon=True)
            sampler.start()
            t0 = time.perf_counter()
            status, message = post(port, path, body)
            seconds = time.perf_counter() - t0
            done.set()
            sampler.join()
            rows.append({"request": what, "status": status, "rss_before_mb": round(before, 1),
                         "rss_peak_growth_mb": round(max(peak[0], rss_mb(pid)) - before, 1),
                         "seconds": round(seconds, 3), "message": message})
            print(f"{what:48s} {status}  RSS +{rows[-1]['rss_peak_growth_mb']:7.1f} MB  {seconds:6.2f} s  {message}")
    finally:
        stop.set()
        thread.join(120)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
