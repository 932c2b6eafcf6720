"""`slimml serve` as a user runs it: a real process, stopped by SIGTERM, leaving nothing behind."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request

import pytest
from conftest import free_port

from slimml.runtime import load

pytest.importorskip("ray")


def post(url: str, body: dict) -> tuple[int, dict]:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def started(args: tuple[str, ...]) -> tuple[str, subprocess.Popen]:
    """``slimml serve ARGS --port P`` in its own session, waited on until /health answers; returns the base URL
    and the process. A free port can be taken between ``free_port()`` and Serve's bind (Ray's own processes
    take ports too, and so do other tests' clusters): then it starts again on another."""
    for attempt in range(3):
        port = free_port()
        proc = subprocess.Popen([sys.executable, "-m", "slimml", "serve", *args, "--port", str(port)],
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 180
        try:
            while proc.poll() is None:
                try:
                    with urllib.request.urlopen(f"{url}/health", timeout=5) as r:
                        assert json.loads(r.read())["status"] == "ok"
                    return url, proc
                except OSError:
                    assert time.monotonic() < deadline, "the server did not come up"
                    time.sleep(0.5)
        except BaseException:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            raise
        said = proc.stdout.read()
        assert re.search(r"(cannot|could not) listen on", said) and attempt < 2, said
        reaped(proc)
    raise AssertionError("unreachable")


def reaped(proc: subprocess.Popen) -> None:
    """Waits until no process of ``proc``'s group (Ray's raylet, GCS, workers) outlives it; fails if one does
    (Ray's workers leave on their own once the raylet is gone: seconds, more on a busy machine)."""
    deadline = time.monotonic() + 90
    while True:
        try:
            os.killpg(proc.pid, 0)
        except ProcessLookupError:
            return
        if time.monotonic() > deadline:
            os.killpg(proc.pid, signal.SIGKILL)
            pytest.fail("Ray processes of the server outlived it")
        time.sleep(0.5)


@contextlib.contextmanager
def served(*args: str):
    """``slimml serve ARGS`` started (see ``started``); yields the base URL and the process; SIGTERM at the end,
    then checks that it exited cleanly and that no process of its group (Ray's) outlived it."""
    url, proc = started(args)
    try:
        yield url, proc
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=120) == 0
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    reaped(proc)


def test_serve_bad_input_is_one_line_before_ray_starts(tmp_path, ray_env, tiny_bert_artifact):
    import shutil

    def serve(*args: str) -> str:
        r = subprocess.run([sys.executable, "-m", "slimml", "serve", *args, "--port", str(free_port())],
                           capture_output=True, text=True, timeout=120, check=False)
        assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
        return " ".join(r.stderr.split())

    sessions = set((ray_env / "ray").glob("session_2*"))
    assert "is not an artifact folder" in serve(str(tmp_path / "nope"))
    bad = tmp_path / "bad"
    shutil.copytree(tiny_bert_artifact, bad)
    data = bad / load(bad, verify=False).manifest.shards[0].data
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    data.write_bytes(bytes(raw))
    assert "does not match its sha256" in serve(str(bad))
    assert "Use one replica in front of the stages" in serve(str(tiny_bert_artifact), "--stages", "2", "--replicas", "2")
    assert serve(str(tiny_bert_artifact), "--stages", "2", "--max-running", "4").endswith(  # was accepted, did nothing
        "error: --max-running sets how chat and completions run, which a server over --stages does not serve (POST "
        "/v1/generate only); drop it, or serve without --stages.")
    assert "direct ingress serves one replica" in serve(str(tiny_bert_artifact), "--direct-ingress", "--replicas", "2")
    assert "the largest shard; a shard must fit whole" in serve(str(tiny_bert_artifact), "--memory-budget", "1KB")  # was
    # refused in the replica, after Ray and Serve had started (18 s)
    template = tmp_path / "chat.jinja"
    template.write_text("{% for m in messages %}{{ m.content }}{% endfor %}", encoding="utf-8")
    assert "--chat-template is for language models" in serve(str(tiny_bert_artifact), "--chat-template", str(template))
    assert "is not a file; give the path of a Jinja chat template" in serve(str(tiny_bert_artifact), "--chat-template",
                                                                            str(tmp_path / "none.jinja"))
    assert set((ray_env / "ray").glob("session_2*")) == sessions  # Ray never started


def test_a_replica_that_cannot_load_says_why_in_one_line(ray_env, tiny_bert_artifact, tmp_path):
    """A replica's own refusal reached the user as Serve's "Failed to update the deployments
    ['slimml']", its cause only in the replica's log. Here a shard whose bytes match the manifest
    but are no ONNX graph (the driver hashes files; the replica is the first to parse them)."""
    import shutil

    from slimml.runtime.artifact.files import file_entry
    from slimml.runtime.artifact.manifest import read_manifest

    art = tmp_path / "art"
    shutil.copytree(tiny_bert_artifact, art)
    manifest = read_manifest(art)
    shard = manifest.shards[-1].file
    (art / shard).write_bytes(b"not an onnx graph" * 10)
    manifest.files = [file_entry(art, art / f.path) if f.path == shard else f for f in manifest.files]
    manifest.write(art)
    r = subprocess.run([sys.executable, "-m", "slimml", "serve", str(art), "--port", str(free_port())],
                       capture_output=True, text=True, timeout=300, check=False)
    said = " ".join(r.stderr.split())
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
    assert f"Ray Serve could not start the application ({shard} is not a readable ONNX file" in said, said


def test_serve_runs_until_sigterm_and_stops_its_ray(ray_env, tiny_bert_artifact, tmp_path):
    import shutil

    art = tmp_path / "art"
    shutil.copytree(tiny_bert_artifact, art)
    with served(str(art)) as (url, _):
        status, body = post(f"{url}/v1/embeddings", {"input": ["hello"]})
        assert status == 200 and len(body["data"][0]["embedding"]) == 32
        data = art / load(art).manifest.shards[-1].data  # tampered with while served
        raw = bytearray(data.read_bytes())
        raw[len(raw) // 2] ^= 0xFF
        data.write_bytes(bytes(raw))
        try:
            urllib.request.urlopen(f"{url}/health", timeout=30)
            pytest.fail("/health answered 200 for a changed artifact")
        except urllib.error.HTTPError as e:
            assert e.code == 503 and "after the model was loaded" in json.loads(e.read())["error"]["message"]
            assert e.headers["x-should-retry"] == "false" and "Retry-After" not in e.headers  # no retry helps
        status, body = post(f"{url}/v1/embeddings", {"input": ["hello"]})
        assert status == 503  # refused, never run
        # and it stays so: the replica is not replaced by one that cannot load the files (Serve restarted it
        # again and again, every route timing out with a plain-text 408 meanwhile)
        from slimml.serve.app import HEALTH_CHECK_S

        time.sleep(4 * HEALTH_CHECK_S)
        for _ in range(3):
            status, body = post(f"{url}/v1/embeddings", {"input": ["hello"]})
            assert status == 503 and "after the model was loaded" in body["error"]["message"], (status, body)
        # another artifact put in its place (a new convert): the replica stays, answering 503 with the reason
        # (it was replaced, and its replacements refused the new manifest over and over, every request hanging)
        shutil.rmtree(art)
        shutil.copytree(tiny_bert_artifact, art)
        manifest = json.loads((art / "manifest.json").read_text())
        manifest["name"] = "another model"
        (art / "manifest.json").write_text(json.dumps(manifest))
        time.sleep(4 * HEALTH_CHECK_S)
        for _ in range(3):
            status, body = post(f"{url}/v1/embeddings", {"input": ["hello"]})
            assert status == 503 and "after the model was loaded" in body["error"]["message"], (status, body)


def test_another_artifact_renamed_into_place_is_said_by_health_while_the_loaded_one_serves(ray_env, tiny_bert_artifact,
                                                                                           tmp_path):
    """A new artifact renamed into the served path (the old folder moved aside, intact): the replica kept
    serving what it loaded with /health 200 and nothing said, while a replica that stopped could not start
    again (the new manifest is not the pinned one) and Serve retried it for good."""
    import shutil

    from slimml.serve.app import HEALTH_CHECK_S

    art = tmp_path / "art"
    shutil.copytree(tiny_bert_artifact, art)
    with served(str(art)) as (url, _):
        status, before = post(f"{url}/v1/embeddings", {"input": ["hello"]})
        assert status == 200
        with urllib.request.urlopen(f"{url}/health", timeout=30) as r:
            assert "artifact" not in json.loads(r.read())
        art.rename(tmp_path / "old")
        shutil.copytree(tiny_bert_artifact, art)
        time.sleep(2 * HEALTH_CHECK_S)
        with urllib.request.urlopen(f"{url}/health", timeout=30) as r:
            body = json.loads(r.read())
        assert r.status == 200 and "moved or replaced since the server started" in body["artifact"] and "restart" in body["artifact"]
        status, after = post(f"{url}/v1/embeddings", {"input": ["hello"]})
        assert status == 200 and after["data"] == before["data"]  # what it loaded, from the files it holds


def test_sigterm_to_the_whole_process_group_stops_in_seconds(ray_env, tiny_bert_artifact):
    """A service manager's stop signals every process of the server (systemd's KillMode=control-group), Ray's
    own among them: Serve's shutdown then waited 30 s on its controller, gone (38-40 s to stop, 5 s for Ctrl-C)."""
    url, proc = started((str(tiny_bert_artifact),))
    try:
        t0 = time.monotonic()
        os.killpg(proc.pid, signal.SIGTERM)
        assert proc.wait(timeout=120) == 0
        took = time.monotonic() - t0
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    reaped(proc)
    assert took < 20, f"stopped in {took:.1f} s"
    said = proc.stdout.read()
    assert "Started Serve" in said and "will not be applied" not in said, said  # Serve's line after our own start


def test_serve_direct_ingress_answers_on_the_port_itself(ray_env, tiny_bert_artifact):
    """--direct-ingress: the replica answers HTTP on --port, without Serve's proxy in between;
    the same embeddings, the same errors, a killed replica brought back on the port, and SIGTERM
    still stops everything."""
    import numpy as np

    texts = ["a dog runs", "the weather is cold today", "hi"]
    want = load(tiny_bert_artifact).encode(texts)
    with served(str(tiny_bert_artifact), "--direct-ingress") as (url, server):
        status, body = post(f"{url}/v1/embeddings", {"input": texts})
        assert status == 200, body
        got = np.array([d["embedding"] for d in body["data"]], dtype=np.float32)
        cos = (got * want).sum(1) / np.linalg.norm(got, axis=1) / np.linalg.norm(want, axis=1)
        assert cos.min() >= 0.9999
        status, body = post(f"{url}/v1/embeddings", {"input": []})
        assert status == 400 and "error" in body
        # the replica's process dies: Serve starts another, which listens on the same port again
        replicas = [pid for pid in _session(server.pid) if b"ServeReplica" in _cmdline(pid)]
        assert len(replicas) == 1, replicas
        os.kill(replicas[0], signal.SIGKILL)
        deadline = time.monotonic() + 240
        while True:
            try:
                if post(f"{url}/v1/embeddings", {"input": texts})[0] == 200:
                    break
            except OSError:  # refused until the new replica listens
                pass
            assert time.monotonic() < deadline, "the killed replica was not brought back on the port"
            time.sleep(1)


def _session(sid: int) -> list[int]:
    """Processes of a session (Linux /proc): the server's, and Ray's processes it started."""
    pids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                if os.getsid(int(entry)) == sid:
                    pids.append(int(entry))
            except OSError:
                pass
    return pids


def _cmdline(pid: int) -> bytes:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read()
    except OSError:
        return b""


def test_serve_stages_put_a_pipeline_behind_generate(ray_env, tiny_llama_past_artifact):
    prompts = [[5, 6, 7, 8], [9, 10]]
    alone = load(tiny_llama_past_artifact).generate(prompts, max_new_tokens=5)
    want = alone.tokens
    with served(str(tiny_llama_past_artifact), "--stages", "2") as (url, _):
        status, body = post(f"{url}/v1/generate", {"prompt": prompts, "max_new_tokens": 5})
        assert status == 200, body
        assert [c["token_ids"] for c in body["choices"]] == want
        assert [c["finish_reason"] for c in body["choices"]] == alone.finish_reasons  # it guessed from the length
        assert body["usage"]["completion_tokens"] == sum(map(len, want))
        status, body = post(f"{url}/v1/embeddings", {"input": ["hi"]})
        assert status == 400 and "not a sentence-embedding one" in body["error"]["message"]
        status, body = post(f"{url}/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]})
        assert status == 400 and body["error"]["message"].startswith(  # was "not a language model served here"
            "this language model is served over pipeline stages (--stages), which answer POST /v1/generate only")
        status, body = post(f"{url}/v1/generate", {"prompt": prompts, "temperature": 0.7})  # not sent to chat, which refuses it
        assert status == 400 and "serve it without --stages for sampling" in body["error"]["message"], body


# every flag `slimml serve` had before its flags came from ServeConfig's fields
OLD_FLAGS = ("--host", "--port", "--replicas", "--stages", "--max-batch-size", "--batch-wait-ms", "--address",
             "--memory-budget", "--max-running", "--max-waiting", "--direct-ingress", "--api-key", "--max-texts",
             "--max-text-chars", "--max-batch-tokens", "--max-response-values", "--max-new-tokens", "--max-body-bytes",
             "--max-bodies-bytes", "--max-ongoing-requests", "--max-queued-requests", "--body-timeout-s",
             "--request-timeout-s", "--openapi")


def test_serve_flags_come_from_serve_config(tiny_bert_artifact, ray_env):
    """Each ServeConfig field with help is a flag (the old names kept); values reach the config, which
    refuses a bad one in one line before Ray starts; SLIMML_API_KEY still gives the key."""
    import dataclasses

    from slimml.serve import ServeConfig

    env = dict(os.environ, COLUMNS="200", TERM="dumb", NO_COLOR="1")
    env.pop("SLIMML_API_KEY", None)
    shown = subprocess.run([sys.executable, "-m", "slimml", "serve", "--help"], capture_output=True, text=True,
                           env=env, timeout=120).stdout
    names = {f"--{f.name.replace('_', '-')}" for f in dataclasses.fields(ServeConfig) if "help" in f.metadata}
    for flag in (*OLD_FLAGS, *names):
        assert flag in shown, flag
    assert "SLIMML_API_KEY" in shown

    def refused(*args: str, **more: str) -> str:
        r = subprocess.run([sys.executable, "-m", "slimml", "serve", str(tiny_bert_artifact), *args, "--port",
                            str(free_port())], capture_output=True, text=True, env={**env, **more}, timeout=120)
        assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
        return " ".join(r.stderr.split())

    sessions = set((ray_env / "ray").glob("session_2*"))
    assert "max_running must be a whole number >= 1, got 0" in refused("--max-running", "0")
    assert "batch_wait_ms must be between 0 and 10000, got 20000.0" in refused("--batch-wait-ms", "20000")
    assert "api_key must be at least 16 printable characters" in refused(SLIMML_API_KEY="short")
    assert "api_key must be at least 16 printable characters" in refused("--api-key", "short")
    assert set((ray_env / "ray").glob("session_2*")) == sessions  # Ray never started


def test_a_staged_replica_asks_ray_for_no_model_memory(tiny_llama_past_artifact):
    """Over --stages the stage actors hold the model; the replica in front holds no model, KV cache or
    prefix store, so it reserves nothing of --memory-budget (it asked for all of it: 6.1 GiB for
    SmolLM2 at 150MB, which a cluster of small nodes could refuse)."""
    from slimml.serve import ServeConfig
    from slimml.serve.run import _replica_memory

    nodes = [{"memory": 64 << 30, "address": "127.0.0.1"}]
    budget = dict(artifact=str(tiny_llama_past_artifact), memory_budget="50MB")
    assert _replica_memory(ServeConfig(**budget), nodes) > 50e6
    assert _replica_memory(ServeConfig(**budget, stages=2), nodes) is None
