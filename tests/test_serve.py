"""The HTTP server on a real Ray Serve, on 127.0.0.1, with the real default model.

One server for the module (two replicas), stopped at the end: embeddings equal in-process
``encode``, a bounded load test, every hostile request answered with its 4xx, and a replica
killed mid-test replaced by Serve.
"""

from __future__ import annotations

import base64
import csv
import http.client
import io
import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from conftest import STS_DEV, serving

from slimml.runtime import load

ray = pytest.importorskip("ray")
pytestmark = pytest.mark.slow


class Client:
    """One keep-alive HTTP connection to the server (http.client: what a plain client uses)."""

    def __init__(self, port: int, timeout: float = 60):
        self.conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)

    def request(self, method: str, path: str, body=None, headers=None) -> tuple[int, dict]:
        if body is not None and not isinstance(body, bytes):
            body = json.dumps(body).encode()
        try:
            self.conn.request(method, path, body=body, headers={"Content-Type": "application/json", **(headers or {})})
            r = self.conn.getresponse()
            raw = r.read()
        except (http.client.HTTPException, OSError):
            self.conn.close()  # a dropped connection: reconnect on the next request
            raise
        return r.status, json.loads(raw) if raw else {}

    def close(self):
        self.conn.close()


@pytest.fixture(scope="module")
def server(ray_env, default_artifact):
    from slimml.serve import ServeConfig

    config = ServeConfig(str(default_artifact), replicas=2, max_texts=64, max_body_bytes=64 << 10, max_batch_size=32)
    with serving(config) as port:
        yield port
    assert not ray.is_initialized()


@pytest.fixture(scope="module")
def local(default_artifact):
    return load(default_artifact)


def sts_sentences(n: int) -> list[str]:
    with open(STS_DEV, newline="", encoding="utf-8") as f:
        rows = list(csv.DictReader(f))
    return [r["sentence1"] for r in rows[:n]]


def test_embeddings_equal_in_process_encode(server, local):
    client = Client(server)
    texts = sts_sentences(40)
    status, body = client.request("POST", "/v1/embeddings", {"input": texts, "model": local.manifest.name})
    assert status == 200, body
    assert body["object"] == "list" and body["model"] == local.manifest.name
    assert [d["index"] for d in body["data"]] == list(range(len(texts)))
    got = np.array([d["embedding"] for d in body["data"]], dtype=np.float32)
    want = local.encode(texts)
    cos = (got * want).sum(1) / np.linalg.norm(got, axis=1) / np.linalg.norm(want, axis=1)
    assert cos.min() >= 0.9999
    assert body["usage"]["prompt_tokens"] == body["usage"]["total_tokens"] == sum(local.count_tokens(texts))
    status, one = client.request("POST", "/v1/embeddings/", {"input": texts[0], "encoding_format": "base64"})  # a 307 before
    vec = np.frombuffer(base64.b64decode(one["data"][0]["embedding"]), dtype="<f4")
    assert status == 200 and float(vec @ want[0]) >= 0.9999
    status, cut = client.request("POST", "/v1/embeddings", {"input": texts[:2], "dimensions": 64})  # OpenAI's field
    short = np.array([d["embedding"] for d in cut["data"]], dtype=np.float32)
    wanted = want[:2, :64] / np.linalg.norm(want[:2, :64], axis=1, keepdims=True)  # the first values, unit length again
    assert status == 200 and short.shape == (2, 64) and np.abs(short - wanted).max() < 1e-5


def test_models_health_and_run(server, local):
    client = Client(server)
    status, models = client.request("GET", "/v1/models")
    assert status == 200 and models["data"][0]["id"] == local.manifest.name
    assert isinstance(models["data"][0]["created"], int)  # OpenAI's field (the client reads it)
    status, health = client.request("GET", "/health")
    assert status == 200 and health["status"] == "ok"
    assert client.request("HEAD", "/health") == (200, {})  # uptime probes send HEAD (405 before)
    feeds = local.tokenize(["a man is playing a guitar", "a dog"])
    body = {"inputs": {k: {"dtype": str(v.dtype), "data": v.tolist()} for k, v in feeds.items()}}
    status, out = client.request("POST", "/v1/run", body)
    assert status == 200, out
    got = np.array(out["outputs"]["last_hidden_state"]["data"], dtype=np.float32)
    np.testing.assert_allclose(got, local.run(feeds)["last_hidden_state"], atol=1e-5)

    def npy(a):
        buf = io.BytesIO()
        np.save(buf, a)
        return base64.b64encode(buf.getvalue()).decode()

    status, out = client.request("POST", "/v1/run", {"inputs": {k: {"npy": npy(v)} for k, v in feeds.items()},
                                                     "encoding": "npy", "outputs": ["last_hidden_state"]})
    assert status == 200, out
    arr = np.load(io.BytesIO(base64.b64decode(out["outputs"]["last_hidden_state"]["npy"])))
    np.testing.assert_allclose(arr, local.run(feeds)["last_hidden_state"], atol=1e-5)


HOSTILE = [
    ("malformed JSON", "/v1/embeddings", b'{"input": ["a"', 400, "not valid JSON"),
    ("not an object", "/v1/embeddings", b'["a", "b"]', 400, "must be a JSON object"),
    ("empty body", "/v1/embeddings", b"", 400, "body is empty"),
    ("invalid UTF-8", "/v1/embeddings", b'{"input": ["caf\xe9"]}', 400, "not valid UTF-8"),
    ("lone surrogate", "/v1/embeddings", b'{"input": ["\\ud800 x"]}', 400, "not valid Unicode"),
    ("no input", "/v1/embeddings", {"encoding_format": "float"}, 400, 'needs "input"'),
    ("wrong type", "/v1/embeddings", {"input": 42}, 400, "must be a text or a list of texts, got a JSON number"),
    ("token ids", "/v1/embeddings", {"input": [[101, 102]]}, 400, "token ids, not a text"),
    ("empty list", "/v1/embeddings", {"input": []}, 400, "empty list"),
    ("empty text", "/v1/embeddings", {"input": ["ok", ""]}, 400, "empty text"),
    ("too many texts", "/v1/embeddings", {"input": ["a"] * 65}, 413, "more than this server takes"),
    ("body too long", "/v1/embeddings", {"input": ["x" * 70000]}, 413, "more than this server takes"),
    ("bad encoding format", "/v1/embeddings", {"input": ["a"], "encoding_format": "int4"}, 400, "encoding_format"),
    ("other model", "/v1/embeddings", {"input": ["a"], "model": "gpt-9"}, 404, "is not served here"),
    ("unknown prompt", "/v1/embeddings", {"input": ["a"], "prompt_name": "query"}, 400, "not one of this model's prompts"),
    ("prompt not a name", "/v1/embeddings", {"input": ["a"], "prompt_name": 3}, 400, '"prompt_name" must be'),
    ("dimensions not a number", "/v1/embeddings", {"input": ["a"], "dimensions": "64"}, 400, '"dimensions" must be'),
    ("dimensions too many", "/v1/embeddings", {"input": ["a"], "dimensions": 100000}, 400, "more than this model's"),
    ("task without generate", "/v1/generate", {"prompt": "hi"}, 400, "not a decoder"),
    ("run without inputs", "/v1/run", {"x": 1}, 400, 'needs "inputs"'),
    ("run unknown dtype", "/v1/run", {"inputs": {"input_ids": {"dtype": "complex", "data": [[1]]}}}, 400, "dtype"),
    ("run ragged", "/v1/run", {"inputs": {"input_ids": {"dtype": "int64", "data": [[1, 2], [3]]}}}, 400, "rectangular"),
    ("run bad npy", "/v1/run", {"inputs": {"input_ids": {"npy": "bm90IG5weQ=="}}}, 400, "not a .npy"),
    ("run wrong names", "/v1/run", {"inputs": {"pixels": {"dtype": "float32", "data": [[1.0]]}}}, 400, "pixels"),
]


@pytest.mark.parametrize("what,path,body,status,needle", HOSTILE, ids=[h[0] for h in HOSTILE])
def test_hostile_requests_get_their_4xx_and_the_server_stays_up(server, what, path, body, status, needle):
    client = Client(server)
    got, payload = client.request("POST", path, body)
    assert got == status, payload
    assert needle in payload["error"]["message"] and payload["error"]["code"] == status
    assert client.request("GET", "/health")[0] == 200


def test_unknown_route_is_404(server):
    assert Client(server).request("GET", "/v2/nothing")[0] == 404


def test_load_1000_requests_at_concurrency_32(server):
    texts = sts_sentences(200)
    local_clients = threading.local()
    statuses: list[int] = []

    def one(i: int) -> int:
        if not hasattr(local_clients, "c"):
            local_clients.c = Client(server, timeout=60)
        return local_clients.c.request("POST", "/v1/embeddings", {"input": [texts[i % len(texts)]]})[0]

    t0 = time.monotonic()
    with ThreadPoolExecutor(32) as pool:
        statuses = list(pool.map(one, range(1000)))
    assert statuses.count(200) == 1000, {s: statuses.count(s) for s in set(statuses)}
    assert time.monotonic() - t0 < 300


def test_a_killed_replica_is_replaced(server):
    from ray import serve

    replicas = [n for n in ray.util.list_named_actors(all_namespaces=True) if "SERVE_REPLICA" in n["name"]]
    assert len(replicas) == 2
    victim = replicas[0]
    ray.kill(ray.get_actor(victim["name"], namespace=victim["namespace"]), no_restart=True)
    client = Client(server)
    deadline = time.monotonic() + 120
    while True:  # Serve notices the dead replica, starts a new one; requests meanwhile go to the other
        names = {n["name"] for n in ray.util.list_named_actors(all_namespaces=True) if "SERVE_REPLICA" in n["name"]}
        status = serve.status().applications["slimml"].deployments["slimml"].status
        if victim["name"] not in names and len(names) == 2 and status == "HEALTHY":
            break
        assert time.monotonic() < deadline, "Serve did not replace the killed replica"
        time.sleep(0.5)
    oks = 0
    for i in range(20):
        try:
            oks += client.request("POST", "/v1/embeddings", {"input": [f"after the kill {i}"]})[0] == 200
        except (http.client.HTTPException, OSError):
            client = Client(server)
    assert oks == 20


def test_chat_to_an_embedding_model_names_the_endpoints_it_has(server):
    status, body = Client(server).request("POST", "/v1/chat/completions",
                                          {"messages": [{"role": "user", "content": "hi"}]})
    assert status == 400 and "/v1/embeddings" in body["error"]["message"]
