"""Continuous batching in process: aggregate tokens/s and time to first token at 1, 4, 16 clients.

Drives :class:`~slimml.runtime.tasks.generation.continuous.ContinuousBatch` directly (the decode
worker of ``slimml serve`` without HTTP), so the figures are the batch's own: N clients in a closed
loop, each sending its next request when its answer ends (``--requests`` each), random prompts of
``--prompt`` tokens, greedy, ``--new`` tokens each, no end id. The client counts alternate within
each round, so a loaded machine slows them alike; ratios to 1 client are the result.

Also ``--idle``: one decode pass with 3 live rows of a 16-row cache, run as the batch runs it
(only the live rows) against a pass over all 16 rows (idle rows attending one position).

    python benchmarks/bench_llm_batch.py /tmp/decode/art2_b128 --clients 1 4 16 --rounds 2 --quick
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from collections import deque
from pathlib import Path

import numpy as np


def run_clients(model, clients: int, requests: int, prompt: int, new: int, prefill_tokens: int, seed: int) -> dict:
    """``clients`` closed-loop clients, ``requests`` each, through one ContinuousBatch."""
    from slimml.runtime.tasks.generation.config import GenerationConfig
    from slimml.runtime.tasks.generation.continuous import ContinuousBatch

    batch = ContinuousBatch(model, max_batch=clients, prefill_tokens=prefill_tokens)
    config = GenerationConfig(max_new_tokens=new, eos_token_id=())
    rng = np.random.default_rng(seed)
    vocab = model.engine.vocab_size or 32000
    waiting: deque = deque()
    left = {c: requests for c in range(clients)}
    done: list = []
    sent: list = []

    def send(c: int) -> None:
        left[c] -= 1
        seq = batch.prepare(rng.integers(3, vocab, size=prompt).tolist(), config,
                            on_done=lambda s, c=c: (done.append(s), left[c] and send(c)))
        sent.append(seq)
        waiting.append(seq)

    t0 = time.perf_counter()
    for c in range(clients):
        send(c)
    decode_s = 0.0
    while waiting or batch.rows:
        batch.admit(batch.take(waiting))
        t = time.perf_counter()
        batch.step()
        decode_s += time.perf_counter() - t
    wall = time.perf_counter() - t0
    ttft = sorted(s.first_token_s for s in done)
    return {"clients": clients, "requests": len(done), "wall_s": wall, "passes": batch.passes,
            "tokens_per_s": sum(len(s.tokens) for s in done) / wall,
            "decode_tokens_per_s": sum(len(s.tokens) - 1 for s in done) / decode_s,  # the steps' tokens over their time
            "ttft_p50_s": statistics.median(ttft), "ttft_p99_s": ttft[min(len(ttft) - 1, int(0.99 * len(ttft)))],
            "ttft_last_of_first_burst_s": max(s.first_token_s for s in sent[:clients])}


def idle_rows(model, rows: int = 16, live: int = 3, prompt: int = 64, passes: int = 5) -> dict:
    """Seconds of one decode pass: ``live`` rows only, against all ``rows`` (the others idle)."""
    from slimml.runtime.tasks.generation.loop import _mask

    cache = model.kv_cache(rows, prompt + 2 * passes + 2)
    ids = np.random.default_rng(0).integers(3, model.engine.vocab_size or 32000, size=(live, prompt))
    cache.run(ids, _mask(np.full(live, prompt)), rows=(0, live), at=np.full(live, prompt - 1))
    lengths = np.zeros(rows, dtype=np.int64)
    lengths[:live] = prompt
    times = {"live_rows_only_s": [], "all_rows_s": []}
    for _ in range(passes):
        for kind in times:
            n = live if kind == "live_rows_only_s" else rows
            seen = lengths[:n] + 1
            seen[live:] = 1  # an idle row attends one position
            t = time.perf_counter()
            cache.run(np.ones((n, 1), np.int64), _mask(seen), rows=(0, n), at=np.zeros(n, np.int64))
            times[kind].append(time.perf_counter() - t)
            lengths[:live] += 1
    out = {k: statistics.median(v) for k, v in times.items()}
    out["all_over_live"] = out["all_rows_s"] / out["live_rows_only_s"]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("artifact")
    ap.add_argument("--clients", type=int, nargs="+", default=[1, 4, 16])
    ap.add_argument("--requests", type=int, default=2, help="requests per client, one after the other")
    ap.add_argument("--prompt", type=int, default=64)
    ap.add_argument("--new", type=int, default=32)
    ap.add_argument("--prefill-tokens", type=int, default=512)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--quick", action="store_true", help="1 request per client")
    ap.add_argument("--idle", action="store_true", help="also time 3 live rows of 16 against all 16")
    ap.add_argument("--out", type=Path)
    a = ap.parse_args()
    if a.quick:
        a.requests = 1
    from slimml.runtime import load

    model = load(a.artifact, threads=a.threads)
    run_clients(model, 1, 1, 8, 2, a.prefill_tokens, 0)  # warm-up
    rounds = []
    for r in range(a.rounds):
        row = {}
        for n in (a.clients if r % 2 == 0 else a.clients[::-1]):
            row[n] = run_clients(model, n, a.requests, a.prompt, a.new, a.prefill_tokens, r)
            print(f"round {r} clients {n}: {row[n]['tokens_per_s']:.1f} tokens/s ({row[n]['decode_tokens_per_s']:.1f} "
                  f"in decode steps), ttft p50 {row[n]['ttft_p50_s']:.3f} s "
                  f"p99 {row[n]['ttft_p99_s']:.3f} s", flush=True)
        base = row[min(row)]
        for n, x in row.items():
            x["tokens_per_s_over_1"] = x["tokens_per_s"] / base["tokens_per_s"]
            x["decode_tokens_per_s_over_1"] = x["decode_tokens_per_s"] / base["decode_tokens_per_s"]
            x["ttft_p99_over_1"] = x["ttft_p99_s"] / base["ttft_p50_s"]
        rounds.append(row)
    result = {"artifact": a.artifact, "args": vars(a) | {"out": str(a.out)}, "machine": platform.machine(), "rounds": rounds}
    if a.idle:
        result["idle_rows"] = idle_rows(model)
        print("idle rows:", json.dumps(result["idle_rows"]))
    for n in a.clients:
        print(f"clients {n}: tokens/s x{statistics.median(r[n]['tokens_per_s_over_1'] for r in rounds):.2f} of 1 client "
              f"(decode steps x{statistics.median(r[n]['decode_tokens_per_s_over_1'] for r in rounds):.2f}), "
              f"ttft p99 x{statistics.median(r[n]['ttft_p99_over_1'] for r in rounds):.2f} of 1 client's")
    if a.out:
        a.out.write_text(json.dumps(result, indent=2, default=str))


if __name__ == "__main__":
    main()
