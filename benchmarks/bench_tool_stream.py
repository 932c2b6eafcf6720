"""What reading a streamed answer for its tool calls costs a piece, as the answer grows.

A server hands each answer's text to its tool-call reader (``ToolText.feed``) piece by piece, on
its event loop: a reader that read the whole answer again each piece would cost a long answer
seconds and stall every other stream. This feeds answers of 4,000 to 64,000 characters, 4 characters
a piece (about a token), in each format, and reports microseconds a piece (the median of 3 runs).
gpt-oss's harmony replies go through the whole reply reader (``ReplyReader``: thoughts, content and
calls, as the server reads them), with and without tools.

    python benchmarks/bench_tool_stream.py [--out benchmarks/results/tool_stream.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from slimml.runtime.tasks.generation.reply import ReplyFormat
from slimml.runtime.tasks.generation.tools import Generic, Hermes, Llama3, MistralArgs, MistralJSON, Tools, ToolText

HARMONY = "<|channel|>analysis<|message|> ... <|call|>"  # what makes a template harmony's, with its calls
TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}


def answers(n: int) -> dict:
    body = ('lorem ipsum {dolor} sit "amet" \\ ' * (n // 20 + 1))[:n]
    args = json.dumps({"text": body, "list": [1, 2, {"a": "b"}]})
    calls = "\n".join(f'<tool_call>\n{{"name": "f", "arguments": {json.dumps({"t": body[: n // 4]})}}}\n</tool_call>'
                      for _ in range(4))
    return {
        "hermes, text": (Hermes, body),
        "hermes, one call": (Hermes, 'Ok.\n<tool_call>\n{"name": "f", "arguments": ' + args + "}\n</tool_call>"),
        "hermes, four calls": (Hermes, "Sure.\n" + calls),
        "llama3, one call": (Llama3, '{"name": "f", "parameters": ' + args + "}"),
        "generic, response": (Generic, json.dumps({"response": body})),
        "generic, response with escapes": (Generic, json.dumps({"response": "é😀\n" * (n // 3)})),
        "generic, one call": (Generic, '{"tool_calls": [{"name": "f", "arguments": ' + args + "}]}"),
        "mistral, four calls": (MistralJSON, "Sure. [TOOL_CALLS][" + ", ".join(
            f'{{"name": "f", "arguments": {json.dumps({"t": body[: n // 4]})}, "id": "a1B2c3D4e"}}' for _ in range(4)) + "]"),
        "mistral [ARGS], four calls": (MistralArgs, "".join(f'[TOOL_CALLS]f[ARGS]{json.dumps({"t": body[: n // 4]})}'
                                                              for _ in range(4))),
        "harmony, thoughts then a call": ("harmony tools", f"<|channel|>analysis<|message|>{body}<|end|><|start|>assistant"
                                          f"<|channel|>commentary to=functions.f <|constrain|>json<|message|>{args}"),
        "harmony, thoughts then an answer": ("harmony", f"<|channel|>analysis<|message|>{body}<|end|><|start|>assistant"
                                             f"<|channel|>final<|message|>{body}"),
    }


def per_piece_us(format, text: str, step: int = 4) -> float:
    if isinstance(format, str):  # the whole reply's reader, as the server reads a harmony reply
        reader = ReplyFormat.of(HARMONY, Tools.of([TOOL]) if format.endswith("tools") else None).reader("")
    else:
        reader = ToolText(format())
    t0 = time.perf_counter()
    for i in range(0, len(text), step):
        reader.feed(text[i : i + step])
    reader.finish()
    return (time.perf_counter() - t0) / (len(text) / step) * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=None, help="write the figures as JSON here")
    ap.add_argument("--sizes", type=int, nargs="+", default=[4_000, 16_000, 64_000], help="answer lengths in characters")
    args = ap.parse_args()
    rows = []
    for n in args.sizes:
        for name, (format, text) in answers(n).items():
            us = statistics.median(per_piece_us(format, text) for _ in range(3))
            rows.append({"chars": n, "answer": name, "us_per_piece": round(us, 1)})
            print(f"{n:6d} chars  {name:32s} {us:7.1f} us a piece", flush=True)
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            json.dump({"step_chars": 4, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
