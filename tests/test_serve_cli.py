"""`slimml serve` as a user runs it: a real process, stopped by SIGTERM, leaving nothing behind."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request

import pytest

from conftest import free_port

pytest.importorskip("ray")


def slimml(*args: str, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "slimml", *args], capture_output=True, text=True, timeout=120, **kw)


def test_serve_a_missing_artifact_is_one_line(tmp_path, ray_env):
    r = slimml("serve", str(tmp_path / "nope"))
    assert r.returncode == 1
    assert "is not an artifact folder" in r.stderr and "Traceback" not in r.stderr
    assert len(r.stderr.strip().splitlines()) <= 2  # one message, wrapped at most once by the terminal width


def test_serve_runs_until_sigterm_and_stops_its_ray(tmp_path, ray_env, tiny_bert_artifact):
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "slimml", "serve", str(tiny_bert_artifact), "--port", str(port)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        deadline = time.monotonic() + 180
        while True:
            assert proc.poll() is None, proc.stdout.read()
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as r:
                    assert json.loads(r.read())["status"] == "ok"
                break
            except OSError:
                assert time.monotonic() < deadline, "the server did not come up"
                time.sleep(0.5)
        req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/embeddings", data=b'{"input": ["hello"]}',
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=30) as r:
            assert len(json.loads(r.read())["data"][0]["embedding"]) == 32
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=120) == 0
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    deadline = time.monotonic() + 30
    while True:  # Ray's own processes (raylet, GCS, workers) are gone with it
        try:
            os.killpg(proc.pid, 0)
        except ProcessLookupError:
            break
        if time.monotonic() > deadline:
            os.killpg(proc.pid, signal.SIGKILL)
            pytest.fail("Ray processes of the server outlived it")
        time.sleep(0.5)
