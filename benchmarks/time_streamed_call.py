"""Time to a streamed tool call's name and to its last argument piece, through ``slimml serve``
and the ``openai`` client (5 questions, ``tool_choice`` "required", greedy; the second of two
rounds is reported).

    python benchmarks/time_streamed_call.py ARTIFACT
"""
import json, pathlib, sys, time, statistics
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "tests"))  # its serving() helper
import openai
from conftest import serving
from slimml.serve import ServeConfig
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "The weather now in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 40}}, "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "description": "The time now in a time zone",
    "parameters": {"type": "object", "properties": {"tz": {"type": "string", "maxLength": 40}}, "required": ["tz"]}}}
QS = ["What's the weather like in Paris today?", "Is it raining in Tokyo?", "What time is it in New York?",
      "How warm is it in Cairo?", "What is the time in Sydney right now?"]
art = sys.argv[1]
rows = []
with serving(ServeConfig(art, name="m", max_running=4, max_new_tokens=80)) as port:
    c = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0, timeout=120)
    for rnd in range(2):
        for q in QS:
            t0 = time.perf_counter(); first = last = name = None; pieces = 0; args = ""
            for ch in c.chat.completions.create(model="m", messages=[{"role": "user", "content": q}], tools=[WEATHER, TIME],
                                                 tool_choice="required", max_tokens=80, temperature=0, stream=True):
                if ch.choices and ch.choices[0].delta.tool_calls:
                    now = time.perf_counter() - t0
                    for d in ch.choices[0].delta.tool_calls:
                        pieces += 1; args += d.function.arguments or ""
                        if d.function.name: name, first = d.function.name, now
                    last = now
            end = time.perf_counter() - t0
            if rnd:
                rows.append({"q": q, "name": name, "args": json.loads(args), "name_s": round(first, 3),
                             "last_piece_s": round(last, 3), "answer_s": round(end, 3), "pieces": pieces})
for r in rows: print(r)
print("median name_s / last_piece_s / answer_s:", statistics.median(r["name_s"] for r in rows),
      statistics.median(r["last_piece_s"] for r in rows), statistics.median(r["answer_s"] for r in rows))
