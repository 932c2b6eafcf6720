"""A bounded load test of ``slimml serve`` for a language model: many clients, mixed requests, drops.

    python benchmarks/load_llm_serve.py --artifact ART [--requests 500] [--concurrency 32]
        [--max-tokens 16] [--max-running 16] [--max-waiting 64] [--drop-every 7] [--warmup 64]
        [--passes 1] [--max-seconds 540] [--token-prompts] [--slimml-python PY] [--quick]
        [--out benchmarks/results/llm_serve_load.json]

It starts ``slimml serve ART`` on 127.0.0.1 (its own process group, stopped at the end), warms it
with ``--warmup`` requests of the same mix, lets it idle, and reads the replica's resident memory
from ``/health``. Then ``--concurrency`` threads of the ``openai`` client send ``--requests``
requests in turn (``--passes`` times): chat and completions, streamed and not; every
``--drop-every``-th streamed one is closed after its second chunk (a client that goes away). A
429 is answered as a client would: wait its ``Retry-After`` and send again (counted; one without
the header is an error). Meanwhile a thread asks ``/health`` every 0.2 s (its worst latency and
any failure recorded). Last, ``max_running + max_waiting`` one-token requests at once: an idle
server takes them all, unless places in the batch or queue were not given back.

Passes when: no errors (a request that failed, an answer without a finish reason or usage, a
stream that ended without one); ``/health`` answered every time; once idle, nothing running or
waiting and the batch's cache empty; the capacity probe met no 429; the replica's memory within
10% of its level before the load (and, over several passes, within 5% of the first pass's: a
leak grows every pass, an allocator's high-water mark does not). ``--token-prompts`` sends token
ids to /v1/completions only (a model without a tokenizer).
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from slimml.scale.cluster import free_port  # where starting Ray does not take it first

os.environ.setdefault("HF_HUB_OFFLINE", "1")

PROMPTS = ["Tell me about the history of Paris.", "Write a short poem about the sea.", "Why is the sky blue?",
           "Explain how a bicycle works.", "What should I cook tonight?", "Give me three tips for learning a language."]
KINDS = ("chat-stream", "chat", "completion-stream", "completion")


def health(port: int, timeout: float = 10) -> tuple[float, dict | None]:
    """``(seconds, body)`` of one ``GET /health``; body None when it failed."""
    t0 = time.perf_counter()
    try:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
        conn.request("GET", "/health")
        r = conn.getresponse()
        body = json.loads(r.read()) if r.status == 200 else None
        conn.close()
    except (OSError, ValueError):
        body = None
    return time.perf_counter() - t0, body


class HealthWatch:
    """Asks ``/health`` every ``every`` seconds on a thread until stopped."""

    def __init__(self, port: int, every: float = 0.2):
        self.port, self.every = port, every
        self.latencies: list[float] = []
        self.failures = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> HealthWatch:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(30)

    def _run(self) -> None:
        while not self._stop.wait(self.every):
            seconds, body = health(self.port)
            self.latencies.append(seconds)
            self.failures += body is None


def one(client, model: str, i: int, max_tokens: int, drop_every: int, token_prompts: bool, stats: dict,
        lock: threading.Lock, deadline: float) -> None:
    """Request ``i`` (its kind and whether it drops follow from ``i``), retried after each 429."""
    import openai

    kind = KINDS[2 + i % 2] if token_prompts else KINDS[i % len(KINDS)]
    stream, chat = kind.endswith("stream"), kind.startswith("chat")
    drop = stream and drop_every > 0 and (i // len(KINDS)) % drop_every == 0
    prompt = PROMPTS[i % len(PROMPTS)]
    args = {"model": model, "max_tokens": max_tokens, "temperature": 0.8, "seed": i}
    if stream:
        args.update(stream=True, stream_options={"include_usage": True})

    def note(key: str, detail: str | None = None) -> None:
        with lock:
            stats[key] = stats.get(key, 0) + 1
            if detail is not None and len(stats["error_samples"]) < 10:
                stats["error_samples"].append(f"{kind} #{i}: {detail}")

    while time.monotonic() < deadline:
        try:
            if chat:
                made = client.chat.completions.create(messages=[{"role": "user", "content": prompt}], **args)
            else:
                made = client.completions.create(prompt=[[1 + (i + k) % 50 for k in range(8)]] if token_prompts
                                                 else prompt, **args)
            if not stream:
                if made.choices[0].finish_reason not in ("stop", "length") or made.usage is None:
                    return note("errors", f"finish {made.choices[0].finish_reason!r}, usage {made.usage!r}")
                return note("ok")
            finish, usage, chunks = None, None, 0
            for chunk in made:
                chunks += 1
                if chunk.choices and chunk.choices[0].finish_reason:
                    finish = chunk.choices[0].finish_reason
                if getattr(chunk, "usage", None):
                    usage = chunk.usage
                if drop and chunks == 2:
                    made.close()
                    return note("dropped")
            if finish not in ("stop", "length") or usage is None:
                return note("errors", f"a stream ended with finish {finish!r}, usage {usage!r}")
            return note("ok")
        except openai.RateLimitError as e:
            wait = e.response.headers.get("retry-after")
            if wait is None:
                return note("errors", "429 without Retry-After")
            note("retried_429")
            time.sleep(float(wait))
        except Exception as e:  # noqa: BLE001 - every failure is counted, the load goes on
            return note("errors", f"{type(e).__name__}: {str(e)[:160]}")
    note("errors", "not answered before --max-seconds")


def run_load(port: int, model: str, requests: int, concurrency: int, max_tokens: int, drop_every: int,
             token_prompts: bool, seconds: float) -> dict:
    """``requests`` requests from ``concurrency`` threads; the counts and the wall time."""
    import openai

    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0, timeout=seconds)
    stats: dict = {"ok": 0, "dropped": 0, "errors": 0, "retried_429": 0, "error_samples": []}
    lock = threading.Lock()
    deadline = time.monotonic() + seconds
    t0 = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        list(pool.map(lambda i: one(client, model, i, max_tokens, drop_every, token_prompts, stats, lock, deadline),
                      range(requests)))
    stats["wall_s"] = round(time.perf_counter() - t0, 2)
    return stats


def settle(port: int, timeout: float = 60, idle_s: float = 3) -> dict:
    """Wait until nothing runs or waits, then ``idle_s`` more; the last ``/health`` body."""
    deadline = time.monotonic() + timeout
    body: dict = {}
    while time.monotonic() < deadline:
        _, got = health(port)
        body = got or body
        gen = (got or {}).get("generation", {})
        if got and gen.get("running") == 0 and gen.get("waiting") == 0:
            break
        time.sleep(0.5)
    time.sleep(idle_s)
    _, got = health(port)
    return got or body


def working_set(load: dict) -> int | None:
    """The replica's resident bytes but for its prefix store (the KV cache it keeps for prompts
    that begin with text read before, within --prefix-cache: memory kept on purpose, not leaked)."""
    if not load.get("rss_bytes"):
        return None
    return load["rss_bytes"] - ((load.get("prefix") or {}).get("bytes") or 0)


def check(report: dict) -> list[str]:
    """What failed, in words (empty: the load test passed)."""
    bad = []
    load, idle, before = report["load"], report["after"]["generation"], report["before"]["generation"]
    if load["errors"]:
        bad.append(f"{load['errors']} errors")
    if report["health"]["failures"]:
        bad.append(f"/health failed {report['health']['failures']} times")
    if idle["running"] or idle["waiting"] or idle["cache_bytes"]:
        bad.append(f"not idle after the load: {idle}")
    rss0, rss1 = working_set(before), working_set(idle)
    if rss0 and rss1 and rss1 > 1.10 * rss0:
        bad.append(f"memory {rss1 / rss0:.2f}x its level before the load (the prefix store's bytes aside)")
    if report["capacity_probe"]["busy"]:
        bad.append(f"{report['capacity_probe']['busy']} of {report['capacity_probe']['sent']} requests sent at once "
                   "to an idle server within its caps got 429: places in the batch or queue were not given back")
    rss = [working_set(p) for p in report["passes"] if p["rss_bytes"]]
    if len(rss) > 1 and rss[-1] > 1.05 * rss[0]:
        bad.append(f"memory grew {rss[-1] / rss[0]:.2f}x from the first pass to the last")
    return bad


def capacity_probe(port: int, model: str, n: int, token_prompts: bool) -> dict:
    """``n`` one-token requests at once (``max_running + max_waiting``: what an idle server takes
    without a 429); a 429 means places were not given back after the load (a leak of the count)."""
    import openai

    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0, timeout=300)

    def ask(i: int) -> str:
        try:
            client.completions.create(model=model, prompt=[[1 + i % 50, 2]] if token_prompts else PROMPTS[i % len(PROMPTS)],
                                      max_tokens=1)
            return "ok"
        except openai.RateLimitError:
            return "busy"
        except Exception as e:  # noqa: BLE001 - reported
            return type(e).__name__

    with ThreadPoolExecutor(n) as pool:
        got = list(pool.map(ask, range(n)))
    return {"sent": n, "ok": got.count("ok"), "busy": got.count("busy"), "other": len(got) - got.count("ok") - got.count("busy")}


def model_name(port: int) -> str:
    """The served model's name, from ``/v1/models``."""
    import urllib.request

    with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=10) as r:
        return json.loads(r.read())["data"][0]["id"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--artifact", type=Path, required=True, help="a causal-LM artifact with its KV cache")
    ap.add_argument("--requests", type=int, default=500)
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--max-running", type=int, default=16, help="the server's --max-running")
    ap.add_argument("--max-waiting", type=int, default=64,
                    help="the server's --max-waiting (its default; 8 with 32 clients: 429s are met and retried)")
    ap.add_argument("--drop-every", type=int, default=7, help="every Nth streamed request is dropped mid-stream")
    ap.add_argument("--max-seconds", type=float, default=540, help="the load's own limit (unanswered ones are errors)")
    ap.add_argument("--warmup", type=int, default=64, help="requests of the same mix before memory is read")
    ap.add_argument("--slimml-python", default=sys.executable,
                    help="the interpreter that runs `slimml serve` (another checkout's venv; default: this one)")
    ap.add_argument("--passes", type=int, default=1,
                    help="run the load this many times, the replica's memory read after each (a leak grows with "
                         "every pass, an allocator's high-water mark does not)")
    ap.add_argument("--token-prompts", action="store_true", help="token-id completions only (no tokenizer)")
    ap.add_argument("--quick", action="store_true", help="100 requests, 16 concurrent, 8 tokens")
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "llm_serve_load.json")
    args = ap.parse_args()
    if args.quick:
        args.requests, args.concurrency, args.max_tokens, args.warmup = 100, 16, 8, 32
    port = free_port()
    cmd = [args.slimml_python, "-m", "slimml", "serve", str(args.artifact.resolve()), "--port", str(port), "--max-running",
           str(args.max_running), "--max-waiting", str(args.max_waiting)]
    log = Path(os.environ.get("TMPDIR", "/tmp")) / "load_llm_serve.log"
    proc = subprocess.Popen(cmd, cwd=log.parent, stdout=subprocess.DEVNULL, stderr=log.open("wb"),  # its own slimml
                            start_new_session=True)
    try:
        deadline = time.monotonic() + 300
        while health(port, 5)[1] is None:
            if proc.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"the server did not start; its log: {log}")
            time.sleep(1)
        model = model_name(port)
        first = settle(port, idle_s=0)
        warm = run_load(port, model, args.warmup, args.concurrency, args.max_tokens, args.drop_every,
                        args.token_prompts, 300)
        before = settle(port)
        passes = []
        with HealthWatch(port) as watch:
            for _ in range(args.passes):
                load = run_load(port, model, args.requests, args.concurrency, args.max_tokens, args.drop_every,
                                args.token_prompts, args.max_seconds)
                after = settle(port)
                passes.append({**{k: load[k] for k in ("ok", "dropped", "errors", "retried_429", "wall_s")},
                               "rss_bytes": after["generation"].get("rss_bytes"), "prefix": after["generation"].get("prefix")})
        probe = capacity_probe(port, model, args.max_running + args.max_waiting, args.token_prompts)
        load = {k: sum(p[k] for p in passes) for k in ("ok", "dropped", "errors", "retried_429", "wall_s")} | {
            "error_samples": load["error_samples"]}
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
    lat = sorted(watch.latencies)
    report = {"command": " ".join(cmd).replace(f" --port {port}", ""), "args": {k: str(v) for k, v in vars(args).items()},
              "load": load, "warm_up": {k: warm[k] for k in ("ok", "errors", "retried_429")},
              "health": {"polls": len(lat), "failures": watch.failures, "max_s": round(lat[-1], 4) if lat else None,
                         "p50_s": round(lat[len(lat) // 2], 4) if lat else None},
              "started": first, "before": before, "after": after, "passes": passes, "capacity_probe": probe}
    rss0, rss1 = working_set(before["generation"]), working_set(after["generation"])
    report["rss_after_over_before"] = round(rss1 / rss0, 3) if rss0 and rss1 else None
    report["problems"] = check(report)
    report["passed"] = not report["problems"]
    print(json.dumps({k: report[k] for k in ("load", "health", "rss_after_over_before", "problems", "passed")}, indent=1))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    sys.exit(0 if report["passed"] else 1)


if __name__ == "__main__":
    main()
