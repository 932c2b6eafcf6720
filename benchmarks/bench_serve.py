"""HTTP embeddings on Ray Serve against in-process ``encode``, on the same cores.

    python benchmarks/bench_serve.py ARTIFACT [--rounds 3] [--concurrency 32] [--texts-per-request 1 8 32] [--repeat 1] [--json OUT]

The STSb dev sentences (3,000, variable lengths; ``--repeat N`` sends them N times a round, so
that the start and end of a round, when fewer than ``--concurrency`` requests are in flight,
weigh less). Each round runs, one after another in this process:
  * ``in-process``: ``load(artifact).encode(texts, batch_size=32)``, ORT's default threads (the
    ratios are to this); ``in-process b16``: the same at ``batch_size=16``, the server's own
    batch size inside its ``encode`` calls;
  * ``http kN``: ``slimml serve``'s application (one replica holding every CPU, its ORT threads =
    those CPUs, the default batching: up to 1,024 texts of concurrent requests in one ``encode``,
    formed when the model is free, 5 ms wait) answering ``POST /v1/embeddings``
    with N texts per request, sent by ``--concurrency`` client threads over keep-alive
    connections (http.client), the corpus in order.
``--direct-ingress`` turns on Ray Serve's direct ingress for the server: the replica answers HTTP
itself, without Serve's proxy in between.
The server and the client share the machine's cores with each other, as they would on one
host; the client's share of the CPU used during the HTTP rounds is reported (this process's CPU
time against the machine's, from /proc/stat). The median round gives texts/s; latency
percentiles are per request, over all rounds.
"""

from __future__ import annotations

import argparse
import csv
import http.client
import json
import os
import secrets
import shutil
import statistics
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from slimml.scale.cluster import free_port  # where starting Ray does not take it first

STSB = Path(__file__).resolve().parents[2] / "shared" / "data" / "stsb" / "sts-dev.csv"


def corpus() -> list[str]:
    with open(STSB, newline="", encoding="utf-8") as f:
        rows = list(csv.DictReader(f))
    return [r["sentence1"] for r in rows] + [r["sentence2"] for r in rows]


def http_round(port: int, texts: list[str], per_request: int, concurrency: int) -> tuple[float, list[float], tuple[float, float]]:
    """Texts/s, per-request latencies (s) and (the client's share of the CPU used, cores busy)
    for the corpus sent ``per_request`` texts at a time."""
    chunks = [texts[i:i + per_request] for i in range(0, len(texts), per_request)]
    local = threading.local()

    def send(chunk: list[str]) -> float:
        if not hasattr(local, "conn"):
            local.conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
        body = json.dumps({"input": chunk}).encode()
        t0 = time.perf_counter()
        local.conn.request("POST", "/v1/embeddings", body=body, headers={"Content-Type": "application/json"})
        r = local.conn.getresponse()
        payload = r.read()
        if r.status != 200:
            raise RuntimeError(f"HTTP {r.status}: {payload[:200]!r}")
        return time.perf_counter() - t0

    t0, c0, m0 = time.perf_counter(), time.process_time(), machine_cpu()
    with ThreadPoolExecutor(concurrency) as pool:
        lat = list(pool.map(send, chunks))
    wall, client, busy = time.perf_counter() - t0, time.process_time() - c0, machine_cpu() - m0
    return len(texts) / wall, lat, (client / busy if busy else 0.0, busy / wall)


def machine_cpu() -> float:
    """CPU seconds all processes have used (Linux /proc/stat; 0 elsewhere)."""
    try:
        with open("/proc/stat") as f:
            v = [int(x) for x in f.readline().split()[1:]]
    except OSError:
        return 0.0
    return (sum(v) - v[3] - v[4]) / os.sysconf("SC_CLK_TCK")  # all but idle and iowait


def pct(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(int(q * len(s)), len(s) - 1)]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("artifact", type=Path)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--texts-per-request", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--repeat", type=int, default=1, help="send the corpus this many times a round")
    p.add_argument("--direct-ingress", action="store_true",
                   help="serve as `slimml serve --direct-ingress` does: the replica answers HTTP itself, without "
                        "Serve's proxy in between")
    p.add_argument("--json", type=Path)
    args = p.parse_args()

    ray_tmp = tempfile.mkdtemp(prefix="slimml-ray-", dir="/tmp")  # Ray's files here, removed at the end
    os.environ.update({"RAY_TMPDIR": ray_tmp, "RAY_AUTH_TOKEN": secrets.token_hex(32), "RAY_USAGE_STATS_ENABLED": "0"})
    port = free_port()
    from slimml.runtime import load
    from slimml.serve import ServeConfig, serve

    texts = corpus() * max(1, args.repeat)
    model = load(args.artifact)
    urls, stop = [], threading.Event()
    server = threading.Thread(target=serve, args=(ServeConfig(str(args.artifact), replicas=1),),
                              kwargs={"port": port, "ready": urls.append, "stop": stop,
                                      "direct_ingress": args.direct_ingress}, daemon=True)
    server.start()
    while not urls:
        if not server.is_alive():
            raise SystemExit("the server did not start")
        time.sleep(0.2)
    try:
        http_round(port, texts[:256], 8, args.concurrency)  # warm both
        model.encode(texts[:256])
        rates: dict[str, list[float]] = {"in-process": [], "in-process b16": []}
        lats: dict[str, list[float]] = {}
        cpu: list[tuple[float, float]] = []  # per HTTP round: the client's share of the CPU used, cores busy
        for r in range(args.rounds):
            t0 = time.perf_counter()
            model.encode(texts, batch_size=32)
            rates["in-process"].append(len(texts) / (time.perf_counter() - t0))
            t0 = time.perf_counter()
            model.encode(texts, batch_size=16)
            rates["in-process b16"].append(len(texts) / (time.perf_counter() - t0))
            for k in args.texts_per_request:
                rate, lat, use = http_round(port, texts, k, args.concurrency)
                cpu.append(use)
                rates.setdefault(f"http k{k}", []).append(rate)
                lats.setdefault(f"http k{k}", []).extend(lat)
            print(f"round {r}: " + ", ".join(f"{name} {v[-1]:.0f}/s" for name, v in rates.items()), flush=True)
    finally:
        stop.set()
        server.join(120)
        shutil.rmtree(ray_tmp, ignore_errors=True)
    base = statistics.median(rates["in-process"])
    res = {"artifact": str(args.artifact), "cpu_count": os.cpu_count(), "texts": len(texts),
           "direct_ingress": args.direct_ingress,
           "concurrency": args.concurrency, "in-process texts/s": round(base, 1),
           "in-process b16 texts/s": round(statistics.median(rates["in-process b16"]), 1)}
    for name in lats:
        res[name] = {"texts/s": round(statistics.median(rates[name]), 1),
                     "vs in-process": round(statistics.median(rates[name]) / base, 3),
                     "vs in-process b16": round(statistics.median(rates[name]) / statistics.median(rates["in-process b16"]), 3),
                     "p50 ms": round(pct(lats[name], 0.50) * 1000, 1), "p99 ms": round(pct(lats[name], 0.99) * 1000, 1)}
    if cpu:  # what the client costs the server: its share of the CPU used during the HTTP rounds
        res["client share of cpu used"] = round(statistics.median(c for c, _ in cpu), 3)
        res["cores busy during http"] = round(statistics.median(b for _, b in cpu), 2)
    print(json.dumps(res, indent=2))
    if args.json:
        args.json.write_text(json.dumps(res, indent=2) + "\n")


if __name__ == "__main__":
    main()
