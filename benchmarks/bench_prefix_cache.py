"""Conversations over a shared document: slimml's server with and without its prefix cache, and
llama-cpp-python's server, on the same model.

    python benchmarks/bench_prefix_cache.py --artifact ART --gguf FILE.gguf [--clients 1 4] [--turns 4]
        [--max-tokens 32] [--document-chars 1600] [--rounds 2] [--template zephyr]
        [--out benchmarks/results/prefix_cache.json]

The workload is what a chat application over a document sends: every conversation's system prompt
holds the same document (``--document-chars`` characters of gensim's news text, another part for
each N), each of
``--clients`` clients holds a conversation of ``--turns`` turns (streamed, temperature 0,
``--max-tokens`` each), and every turn sends the whole conversation again: the system prompt, the
earlier questions and answers, the new question. Each system runs as its users run it, in its
own process on 127.0.0.1, the systems taking turns (``--rounds``, the order reversed every other
round):

- ``slimml``: ``slimml serve ART --max-running N`` (its default ``--prefix-cache 256MB``);
- ``slimml-no-prefix``: the same with ``--prefix-cache 0`` (every prompt prefilled whole);
- ``llama.cpp``: ``python -m llama_cpp.server --model FILE.gguf --n_threads T --n_ctx 2048
  --interrupt_requests False`` (the GGUF's own chat template; its ``Llama`` reuses the longest
  prefix its one context shares with the previous prompt).

Reported per system and N: time to first token p50/p99 of first turns and of later turns, the
aggregate output tokens/s, and for slimml the prefix store's figures from ``/health`` (prompt
tokens looked up, reused). Both slimml runs must give the same answers (greedy; counted).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import sys
import threading
import time
import urllib.request
from pathlib import Path

from bench_llm_serve import free_port, model_name, start, stop, wait_ready  # this folder's server helpers

os.environ.setdefault("HF_HUB_OFFLINE", "1")

QUESTIONS = ["What is the first article about?", "Who is mentioned in it?", "Where did it happen?",
             "Summarise it in one sentence.", "What happened next?", "Why does it matter?",
             "Which numbers does it give?", "What is the second article about?"]


def document(chars: int, part: int = 0) -> str:
    """Part ``part`` of gensim's news text, ``chars`` characters (each N gets a document of its own,
    so that its first turns find nothing stored by an earlier run)."""
    spec = importlib.util.find_spec("gensim")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("gensim is not installed: pip install gensim (its wheel ships the news text)")
    text = (Path(spec.submodule_search_locations[0]) / "test" / "test_data" / "lee_background.cor").read_text()
    return text[part * chars : (part + 1) * chars]


def command(kind: str, args, port: int) -> list[str]:
    if kind.startswith("slimml"):
        return [args.slimml_python, "-m", "slimml", "serve", str(args.artifact), "--port", str(port),
                "--max-running", str(max(args.clients)), "--max-waiting", "64"] + (
            ["--prefix-cache", "0"] if kind == "slimml-no-prefix" else [])
    return [sys.executable, "-m", "llama_cpp.server", "--model", str(args.gguf), "--n_threads", str(args.threads),
            "--n_ctx", "2048", "--interrupt_requests", "False", "--host", "127.0.0.1", "--port", str(port)] + (
        ["--chat_format", args.template] if args.template else [])


def turn(client, model: str, messages: list[dict], max_tokens: int) -> dict:
    t0 = time.perf_counter()
    first, text, tokens = None, [], None
    stream = client.chat.completions.create(model=model, messages=messages, max_tokens=max_tokens, temperature=0,
                                            stream=True, stream_options={"include_usage": True})
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            first = first or time.perf_counter() - t0
            text.append(chunk.choices[0].delta.content)
        if getattr(chunk, "usage", None):
            tokens = chunk.usage.completion_tokens
    return {"ttft": first, "text": "".join(text), "tokens": tokens if tokens is not None else len(text)}


def conversations(port: int, clients: int, turns: int, max_tokens: int, doc: str) -> dict:
    import openai

    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0, timeout=600)
    model = model_name(port)
    system = "You answer questions about these news articles.\n\n" + doc
    out: dict[int, list[dict]] = {}
    errors: list[str] = []

    def worker(c: int) -> None:
        messages = [{"role": "system", "content": system}]
        done = []
        try:
            for t in range(turns):
                messages.append({"role": "user", "content": QUESTIONS[(c + t) % len(QUESTIONS)]})
                r = turn(client, model, messages, max_tokens)
                messages.append({"role": "assistant", "content": r["text"]})
                done.append(r)
        except Exception as e:  # noqa: BLE001 - counted and reported
            errors.append(f"{type(e).__name__}: {str(e)[:200]}")
        out[c] = done

    t0 = time.perf_counter()
    threads = [threading.Thread(target=worker, args=(c,)) for c in range(clients)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    wall = time.perf_counter() - t0
    tokens = sum(r["tokens"] for rs in out.values() for r in rs)
    return {"clients": clients, "wall_s": round(wall, 3), "tokens_per_s": round(tokens / wall, 2), "errors": errors,
            "turns": {c: out[c] for c in sorted(out)}, "health": health(port)}


def health(port: int) -> dict | None:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=10) as r:
            return json.loads(r.read()).get("generation")
    except (OSError, ValueError):
        return None


def summary(runs: list[dict]) -> dict:
    import numpy as np

    first = [r["ttft"] for run in runs for rs in run["turns"].values() for r in rs[:1] if r["ttft"]]
    later = [r["ttft"] for run in runs for rs in run["turns"].values() for r in rs[1:] if r["ttft"]]
    pct = lambda xs, q: round(float(np.percentile(xs, q)), 4) if xs else None  # noqa: E731
    prefix = [(run["health"] or {}).get("prefix") for run in runs]
    return {"clients": runs[0]["clients"], "ttft_first_turn_p50_s": pct(first, 50), "ttft_first_turn_p99_s": pct(first, 99),
            "ttft_later_turns_p50_s": pct(later, 50), "ttft_later_turns_p99_s": pct(later, 99),
            "tokens_per_s": round(statistics.median(run["tokens_per_s"] for run in runs), 2),
            "tokens_per_s_rounds": [run["tokens_per_s"] for run in runs], "errors": sum(len(run["errors"]) for run in runs),
            "prefix_store": prefix}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--artifact", type=Path, required=True, help="slimml with-past artifact with a tokenizer and chat template")
    ap.add_argument("--gguf", type=Path, default=None, help="the same model as GGUF, for llama-cpp-python's server")
    ap.add_argument("--clients", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--document-chars", type=int, default=1600, help="characters of news text in the system prompt")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--template", default=None,
                    help="llama.cpp's --chat_format (default: the GGUF's own template; the artifact's must write the same)")
    ap.add_argument("--threads", type=int, default=2, help="llama.cpp's --n_threads (slimml takes Ray's CPUs)")
    ap.add_argument("--systems", nargs="+", default=None, help="a subset of: slimml slimml-no-prefix llama.cpp")
    ap.add_argument("--slimml-python", default=sys.executable)
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "prefix_cache.json")
    args = ap.parse_args()
    systems = args.systems or ["slimml", "slimml-no-prefix"] + (["llama.cpp"] if args.gguf else [])
    runs: dict[str, dict[int, list[dict]]] = {k: {n: [] for n in args.clients} for k in systems}
    logs = Path(os.environ.get("TMPDIR", "/tmp")) / "bench_prefix_cache"
    logs.mkdir(parents=True, exist_ok=True)
    for rnd in range(args.rounds):
        for kind in systems if rnd % 2 == 0 else systems[::-1]:
            port = free_port()
            log = logs / f"{kind}.log"
            proc = start(command(kind, args, port), args.threads, log)
            try:
                wait_ready(port, proc, log)
                for i, n in enumerate(args.clients):
                    run = conversations(port, n, args.turns, args.max_tokens, document(args.document_chars, i))
                    runs[kind][n].append(run)
                    s = summary([run])
                    print(f"round {rnd} {kind:17s} N={n:2d} ttft first {s['ttft_first_turn_p50_s']} s later "
                          f"{s['ttft_later_turns_p50_s']} s, {s['tokens_per_s']} tok/s, errors {s['errors']}", flush=True)
            finally:
                stop(proc)
    report = {"commands": {k: " ".join(command(k, args, 0)).replace(" --port 0", "") for k in systems},
              "args": {k: str(v) for k, v in vars(args).items()},
              "systems": {k: [summary(runs[k][n]) for n in args.clients] for k in systems}}
    if "slimml" in systems and "slimml-no-prefix" in systems:  # greedy: the same answers with and without the store
        pairs = [(a["text"], b["text"]) for n in args.clients for ra, rb in zip(runs["slimml"][n], runs["slimml-no-prefix"][n])
                 for c in ra["turns"] for a, b in zip(ra["turns"][c], rb["turns"].get(c, []))]
        report["same_answers"] = f"{sum(a == b for a, b in pairs)} of {len(pairs)}"
    ratios = {}
    for n in args.clients:
        later = {k: {r["clients"]: r for r in report["systems"][k]}[n]["ttft_later_turns_p50_s"] for k in systems}
        for k in systems:
            if k != "slimml" and later.get(k) and later.get("slimml"):
                ratios[f"later-turn ttft p50, {k} over slimml, N={n}"] = round(later[k] / later["slimml"], 2)
    report["ratios"] = ratios
    print(json.dumps({"systems": report["systems"], "ratios": ratios, "same_answers": report.get("same_answers")}, indent=1))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1, default=str) + "\n")


if __name__ == "__main__":
    main()
