"""A running server under attack, on 127.0.0.1: one Ray Serve for the module, a tiny decoder
(rotary positions, no tokenizer: nothing but ``max_position_embeddings`` bounds its sequences)
behind an API key, with small limits.

Every hostile request gets its 4xx (or is cut off), the replica's memory stays within a stated
bound of where it started, its process never changes (no crash), nothing waits past its client
timeout (no hang), no answer is a 500 or carries a server path, and an honest client's requests,
sent at the same time, all succeed with the outputs of in-process ``generate``.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import re
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from conftest import free_port, serving

from slimml.runtime import load

ray = pytest.importorskip("ray")

KEY = "test-key-" + "k" * 24
AUTH = {"Authorization": f"Bearer {KEY}"}
RSS_BOUND_MB = 200  # the replica's RSS may grow at most this much under the whole attack
LIMITS = dict(max_texts=64, max_body_bytes=256 << 10, max_bodies_bytes=4 << 20, max_batch_tokens=2048,
              max_response_values=100_000, max_new_tokens=64, body_timeout_s=2.0, request_timeout_s=30.0,
              max_ongoing_requests=16, max_queued_requests=64, max_text_chars=1000)


def request(port: int, method: str, path: str, body=None, headers=None, timeout: float = 30) -> tuple[int, dict, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        if body is not None and not isinstance(body, bytes):
            body = json.dumps(body).encode()
        conn.request(method, path, body=body, headers={"Content-Type": "application/json", **(headers or {})})
        r = conn.getresponse()
        raw = r.read()
    finally:
        conn.close()
    try:
        payload = json.loads(raw) if raw else {}
    except ValueError:
        payload = {}
    return r.status, payload, raw


def replica_pid() -> int:
    """The replica's process (Ray names it ``ray::ServeReplica:slimml:slimml``)."""
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/cmdline", "rb") as f:
                    if f.read().startswith(b"ray::ServeReplica:slimml"):
                        return int(entry)
            except OSError:
                pass
    raise AssertionError("no replica process found")


def rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:")) / 1024


@pytest.fixture(scope="module")
def server(ray_env, tiny_llama_past_artifact):
    from slimml.serve import ServeConfig

    config = ServeConfig(str(tiny_llama_past_artifact), api_key=KEY, **LIMITS)
    with serving(config) as port:
        yield port


def _ids(rows: int, tokens: int) -> list[list[int]]:
    return [[(r * 7 + t) % 500 + 1 for t in range(tokens)] for r in range(rows)]


def _run(rows: int, tokens: int, past: bool = True) -> dict:
    """A /v1/run body for the decoder: ``rows`` x ``tokens`` ids, an empty cache (npy: its zero-length axis)."""
    import base64
    import io

    import numpy as np

    def npy(a):
        buf = io.BytesIO()
        np.save(buf, a)
        return {"npy": base64.b64encode(buf.getvalue()).decode()}

    inputs = {"input_ids": {"dtype": "int64", "data": _ids(rows, tokens)},
              "attention_mask": {"dtype": "int64", "data": [[1] * tokens] * rows},
              "position_ids": {"dtype": "int64", "data": [list(range(tokens))] * rows}}
    if past:
        for layer in range(3):
            for kind in ("key", "value"):
                inputs[f"past_key_values.{layer}.{kind}"] = npy(np.zeros((rows, 2, 0, 8), np.float32))
    return {"inputs": inputs, "outputs": ["logits"]}


DIGITS = "9" * 5000
HOSTILE = [
    # rows, tokens, rows x tokens, prompts: refused before any model work
    ("run: one sequence of 3,000 ids", "/v1/run", _run(1, 3000, past=False), 400, "this model takes at most 128"),
    ("run: rows x tokens over budget", "/v1/run", _run(40, 100), 413, "--max-batch-tokens"),
    ("run: too many rows", "/v1/run", _run(65, 2), 413, "--max-texts"),
    ("run: a response of 153,600 logits", "/v1/run", _run(30, 10), 413, "--max-response-values"),
    ("generate: 64 prompts of 50 ids", "/v1/generate", {"prompt": _ids(64, 50), "max_new_tokens": 16}, 400,
     "--max-batch-tokens"),
    ("generate: past the positions", "/v1/generate", {"prompt": _ids(1, 120), "max_new_tokens": 16}, 400,
     "128 positions"),
    ("generate: too many prompts", "/v1/generate", {"prompt": _ids(65, 1)}, 413, "--max-texts"),
    ("generate: sampling asked of the greedy route", "/v1/generate", {"prompt": _ids(1, 2), "temperature": 0.7}, 400,
     "POST /v1/completions"),
    ("generate: too many new tokens", "/v1/generate", {"prompt": _ids(1, 2), "max_new_tokens": 65}, 400,
     "--max-new-tokens"),
    ("generate: 2**70 as an id", "/v1/generate", {"prompt": [[1, 2**70]]}, 400, "outside this model's vocabulary"),
    ("generate: a negative id", "/v1/generate", {"prompt": [[-1]]}, 400, "outside this model's vocabulary"),
    ("generate: an id past the vocabulary", "/v1/generate", {"prompt": [[512]]}, 400, "outside this model's vocabulary"),
    ("generate: 5,000 digits", "/v1/generate", f'{{"prompt": [[{DIGITS}]]}}'.encode(), 400, "a number too long"),
    ("generate: 5,000-digit max_new_tokens", "/v1/generate", f'{{"prompt": [[1]], "max_new_tokens": {DIGITS}}}'.encode(),
     400, "a number too long"),
    ("run: 5,000 digits", "/v1/run", f'{{"inputs": {{"input_ids": {{"dtype": "int64", "data": [[{DIGITS}]]}}}}}}'.encode(),
     400, "a number too long"),
    ("run: 2**70 as int64", "/v1/run", {"inputs": {"input_ids": {"dtype": "int64", "data": [[2**70]]}}}, 400,
     "rectangular"),
    ("run: 1e400 as a float", "/v1/run", b'{"inputs": {"past_key_values.0.key": {"dtype": "float32", "data": [1e400]}}}',
     400, None),
    ("generate: a lone surrogate", "/v1/generate", b'{"prompt": ["\\ud800 x"]}', 400, "not valid Unicode"),
    ("generate: text without a tokenizer", "/v1/generate", {"prompt": "hello"}, 400, "has no tokenizer"),
    ("generate: a megabyte of text", "/v1/generate", {"prompt": "x" * 200_000}, 400, "has no tokenizer"),
    ("body over the limit", "/v1/generate", {"prompt": "x" * 300_000}, 413, "--max-body-bytes"),
    ("declared body over the limit", "/v1/generate", None, 413, "--max-body-bytes"),
    ("deep nesting", "/v1/run", b'{"inputs": ' + b"[" * 50_000 + b"]" * 50_000 + b"}", 400, None),
    ("embeddings on a decoder", "/v1/embeddings", {"input": ["a"]}, 400, "not a sentence-embedding"),
    ("completions: past the context", "/v1/completions", {"prompt": _ids(1, 130)[0], "max_tokens": 4}, 400,
     "context is 128, which leaves no room"),
    ("completions: max_tokens past the context", "/v1/completions", {"prompt": _ids(1, 100)[0], "max_tokens": 60}, 400,
     "ask for at most 28 tokens"),
    ("chat: logprobs asked", "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "logprobs": True},
     400, "this model has no tokenizer, so its tokens have no text to show log-probabilities for"),
    ("GET on a POST route", "/v1/chat/completions", None, 405, "is not allowed; send POST /v1/chat/completions"),
    ("no such route", "/v1/nothing", {}, 404, "there is no POST /v1/nothing here"),
    ("no key", "/v1/generate", {"prompt": [[1]]}, 401, "needs an API key"),
    ("wrong key", "/v1/models", None, 401, "this API key is not the server's: send the key it was started with"),
    ("schema hidden", "/openapi.json", None, 404, None),
]
_PATHS = re.compile(rb"/(tmp|home|root|usr|proc|var)/|\b\d{1,3}(\.\d{1,3}){3}\b")


def _send(port: int, case) -> tuple[int, dict, bytes]:
    what, path, body, _, _ = case
    headers = dict(AUTH)
    if what == "no key":
        headers = {}
    elif what == "wrong key":
        headers = {"Authorization": "Bearer " + "x" * 32}
    elif what == "declared body over the limit":  # a Content-Length that alone is refused, nothing sent after it
        with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
            s.sendall(b"POST /v1/generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nAuthorization: Bearer "
                      + KEY.encode() + b"\r\nContent-Length: 99999999999\r\n\r\n")
            raw = _read_response(s)
        status = int(raw.split(b" ", 2)[1])
        return status, json.loads(raw.split(b"\r\n\r\n", 1)[1] or b"{}"), raw
    if path == "/openapi.json" or what == "wrong key" or what.startswith("GET"):
        return request(port, "GET", path, headers=headers)
    return request(port, "POST", path, body, headers)


def _read_response(s: socket.socket) -> bytes:
    raw = b""
    while b"\r\n\r\n" not in raw:
        chunk = s.recv(65536)
        if not chunk:
            return raw
        raw += chunk
    head, rest = raw.split(b"\r\n\r\n", 1)
    length = int(re.search(rb"content-length: (\d+)", head, re.I).group(1))
    while len(rest) < length:
        chunk = s.recv(65536)
        if not chunk:
            break
        rest += chunk
    return head + b"\r\n\r\n" + rest


def test_every_hostile_request_gets_its_4xx_while_an_honest_client_is_served(server, tiny_llama_past_artifact):
    port = server
    prompts = [[5, 6, 7, 8], [9, 10]]
    want = load(tiny_llama_past_artifact).generate(prompts, max_new_tokens=6).tokens
    status, _, _ = request(port, "POST", "/v1/generate", {"prompt": prompts, "max_new_tokens": 6}, AUTH)
    assert status == 200
    pid = replica_pid()
    start = rss_mb(pid)
    stop, honest, peak = threading.Event(), [], [start]

    def honest_client():  # the whole time: requests that must all succeed, with the right tokens
        while not stop.is_set():
            status, body, _ = request(port, "POST", "/v1/generate", {"prompt": prompts, "max_new_tokens": 6}, AUTH)
            honest.append(status == 200 and [c["token_ids"] for c in body["choices"]] == want)
            peak.append(rss_mb(pid))

    clients = [threading.Thread(target=honest_client, daemon=True) for _ in range(2)]
    for c in clients:
        c.start()
    rounds = 4
    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(lambda case: (case, _send(port, case)), HOSTILE * rounds))
    peak.append(rss_mb(pid))
    stop.set()
    for c in clients:
        c.join(60)
    failures = []
    for case, (status, payload, raw) in results:
        what, _, _, want_status, needle = case
        message = (payload.get("error") or {}).get("message", "")
        if status != want_status or (needle and needle not in message):
            failures.append((what, status, raw[:300]))
        if set(payload.get("error") or {}) != {"message", "type", "param", "code"}:
            failures.append((what, "not OpenAI's error body", raw[:300]))
        if _PATHS.search(raw) or str(tiny_llama_past_artifact).encode() in raw:
            failures.append((what, "server path or address in the body", raw[:300]))
        if status == 500 or b"Traceback" in raw:
            failures.append((what, "a raw error", raw[:300]))
    assert not failures, "\n".join(f"{w}: {s} {r[:200]!r}" for w, s, r in failures)
    assert honest and all(honest), f"{honest.count(False)} of {len(honest)} honest requests failed"
    assert replica_pid() == pid, "the replica crashed and was replaced"
    grown = max(peak) - start
    print(f"\nhostile requests: {len(results)}; honest requests: {len(honest)}, all correct; replica RSS "
          f"{start:.0f} MB at start, peak +{grown:.1f} MB (bound {RSS_BOUND_MB})")
    assert grown < RSS_BOUND_MB


def test_a_slow_sender_is_cut_off_and_a_client_that_leaves_costs_nothing(server):
    port = server
    pid = replica_pid()
    t0 = time.monotonic()
    with socket.create_connection(("127.0.0.1", port), timeout=30) as s:  # a body that never finishes
        s.sendall(b"POST /v1/generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nAuthorization: Bearer "
                  + KEY.encode() + b"\r\nContent-Length: 1000\r\n\r\n{\"prompt\": ")
        raw = _read_response(s)
    waited = time.monotonic() - t0
    status = int(raw.split(b" ", 2)[1]) if raw else None
    assert status == 408 and b"--body-timeout-s" in raw, raw[:300]
    assert waited < LIMITS["body_timeout_s"] + 10
    for _ in range(8):  # clients that ask for a long generation and hang up at once
        with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
            body = json.dumps({"prompt": _ids(16, 60), "max_new_tokens": 64}).encode()
            s.sendall(b"POST /v1/generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nAuthorization: "
                      b"Bearer " + KEY.encode() + b"\r\nContent-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
    status, body, _ = request(port, "POST", "/v1/generate", {"prompt": [[1, 2]], "max_new_tokens": 2}, AUTH)
    assert status == 200 and replica_pid() == pid


def test_the_api_key_guards_every_endpoint_but_health(server):
    port = server
    assert request(port, "GET", "/health")[0] == 200  # load balancers and probes need no key
    assert request(port, "GET", "/v1/models")[0] == 401
    status, body, _ = request(port, "GET", "/v1/models", headers={"Authorization": "Bearer " + KEY[:-1]})
    assert status == 401 and body["error"]["message"] == (
        "this API key is not the server's: send the key it was started with (--api-key or SLIMML_API_KEY) in the header "
        "`Authorization: Bearer KEY`.")
    status, body, _ = request(port, "GET", "/v1/models", headers={"Authorization": "Basic " + KEY})  # no bearer key
    assert status == 401 and body["error"]["message"] == (
        "this server needs an API key: send the header `Authorization: Bearer KEY`.")
    assert request(port, "GET", "/v1/models", headers=AUTH)[0] == 200
    assert request(port, "GET", "/v1/models", headers={"X-API-Key": KEY})[0] == 200
    assert request(port, "POST", "/v1/generate", {"prompt": [[1]], "max_new_tokens": 1}, AUTH)[0] == 200
    assert request(port, "GET", "/openapi.json", headers=AUTH)[0] == 404  # off unless asked


def test_embeddings_asked_of_a_language_model_get_a_400_naming_the_routes_it_has(server):
    """The task's refusal (TaskError) as the server words it, and the server still generates."""
    status, body, _ = request(server, "POST", "/v1/embeddings", {"input": ["hi"]}, AUTH)
    assert status == 400 and body["error"]["message"] == (
        "this artifact is a language model ('text-generation'), not a sentence-embedding one, so it has no "
        "/v1/embeddings; use POST /v1/chat/completions or POST /v1/completions, or serve an embedding artifact "
        "for embeddings.")
    status, body, _ = request(server, "POST", "/v1/generate", {"prompt": [[5, 6, 7]], "max_new_tokens": 2}, AUTH)
    assert status == 200 and len(body["choices"][0]["token_ids"]) == 2


@contextlib.contextmanager
def guarded(api, **guard):
    """``api`` (behind the replica's middleware) on uvicorn in a thread, no Ray, with the middleware's
    limits set to ``guard``; yields its port, stops it and restores the limits after."""
    import uvicorn

    import slimml.serve.guard as middleware

    sock = socket.socket()  # bound here and handed to uvicorn: no moment in which another process takes the port
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(api, host="127.0.0.1", port=port, log_level="error"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    old = dict(middleware.state)
    middleware.state.update(guard)
    thread.start()
    try:
        deadline = time.monotonic() + 20
        while not server.started:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        yield port
    finally:
        middleware.state.update(old)
        server.should_exit = True
        thread.join(10)
        sock.close()


def test_a_request_past_its_timeout_gets_408_and_its_work_is_cancelled_and_bodies_share_a_pool():
    """The replica's middleware on its own (uvicorn, no Ray): the route is cancelled at the deadline,
    and body bytes past the replica's pool are refused with 503."""
    import asyncio

    from fastapi import FastAPI
    from fastapi.responses import JSONResponse

    from slimml.errors import RequestError
    from slimml.serve import guard, refusals

    api = FastAPI()
    api.add_middleware(guard.Guard)
    api.exception_handler(RequestError)(refusals.request_error)
    cancelled = threading.Event()

    async def echo(request):  # a plain Starlette route: it reads the body
        return JSONResponse({"bytes": len(await request.body())})

    api.add_route("/echo", echo, methods=["POST"])

    @api.get("/slow")
    async def slow():
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            cancelled.set()
            raise
        return {}

    with guarded(api, timeout_s=0.5, key_sha256=None, bodies_bytes=1000) as port:
        t0 = time.monotonic()
        status, body, _ = request(port, "GET", "/slow")
        assert status == 408 and body["error"]["message"] == (
            "the request took longer than this server allows (0.5 s), its own work or the requests ahead of it; "
            "send smaller requests, retry when the server is less busy, or raise the limit (slimml serve "
            "--request-timeout-s).")
        assert time.monotonic() - t0 < 5 and cancelled.wait(5)
        assert request(port, "POST", "/echo", b"x" * 900)[:2] == (200, {"bytes": 900})
        status, body, _ = request(port, "POST", "/echo", b"x" * 2000)
        assert status == 503 and "--max-bodies-bytes" in body["error"]["message"]
        assert request(port, "POST", "/echo", b"x" * 900)[0] == 200
        until = time.monotonic() + 5
        while guard.state["held"] and time.monotonic() < until:  # released once the route has returned
            time.sleep(0.01)
        assert guard.state["held"] == 0


def test_a_stream_past_its_timeout_ends_with_an_error_event_and_done():
    """A server-sent stream cut at the request's deadline ends as streams end: OpenAI's error
    event (408, naming the flag), then ``data: [DONE]``, and a complete chunked body, so that a
    client can tell a cut answer from a whole one."""
    import asyncio

    from fastapi import FastAPI
    from fastapi.responses import StreamingResponse

    from slimml.serve import guard

    api = FastAPI()
    api.add_middleware(guard.Guard)
    cancelled = threading.Event()

    @api.get("/stream")
    async def stream():
        async def events():
            yield b'data: {"piece": 1}\n\n'
            try:
                await asyncio.sleep(30)
            except asyncio.CancelledError:
                cancelled.set()
                raise
            yield b"data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    with guarded(api, timeout_s=0.5, key_sha256=None) as port:
        status, _, raw = request(port, "GET", "/stream")
        events = raw.split(b"\n\n")
        assert status == 200 and events[0] == b'data: {"piece": 1}' and events[-2:] == [b"data: [DONE]", b""], raw
        error = json.loads(events[1].removeprefix(b"data: "))["error"]
        assert error["code"] == 408 and "--request-timeout-s" in error["message"]
        assert cancelled.wait(5)


def test_a_port_in_use_or_a_host_not_of_this_machine_is_refused_before_ray_starts(tiny_llama_past_artifact):
    from slimml.errors import ConfigError
    from slimml.serve import ServeConfig, serve

    config = ServeConfig(str(tiny_llama_past_artifact))
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(ConfigError, match=rf"cannot listen on 127.0.0.1:{port} \(Address already in use\); choose another --port"):
            serve(config, port=port)
    with pytest.raises(ConfigError, match="cannot listen on 'no such host'.*give --host an address of this machine"):
        serve(config, host="no such host", port=free_port())
