"""A small bounded load on a served language model (benchmarks/load_llm_serve.py's client, a tiny
Llama with its KV cache): mixed streamed and whole completions, clients that drop mid-stream, the
batch and queue full (429s retried after Retry-After): no errors, /health answers throughout,
and once idle nothing runs, waits or holds a cache, and the server takes its caps' worth of requests
again (every place in the batch and queue given back)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from conftest import serving

pytest.importorskip("ray")
pytest.importorskip("openai")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import load_llm_serve as load  # noqa: E402


def test_mixed_load_with_drops_and_full_queue_leaves_nothing_running(ray_env, tiny_llama_past_artifact):
    from slimml.serve import ServeConfig

    config = ServeConfig(str(tiny_llama_past_artifact), name="tiny", max_running=4, max_waiting=2, max_new_tokens=32)
    with serving(config) as port:
        with load.HealthWatch(port, every=0.1) as watch:
            stats = load.run_load(port, "tiny", requests=80, concurrency=12, max_tokens=12, drop_every=2,
                                  token_prompts=True, seconds=120)
        idle = load.settle(port, idle_s=0.5)
        probe = load.capacity_probe(port, "tiny", 4 + 2, token_prompts=True)  # an idle server takes its caps' worth
    assert stats["errors"] == 0, stats["error_samples"]
    assert stats["ok"] + stats["dropped"] == 80 and stats["dropped"] > 0
    assert stats["retried_429"] > 0  # 12 clients against 4 running + 2 waiting: the caps were met
    assert watch.failures == 0 and watch.latencies
    gen = idle["generation"]
    assert (gen["running"], gen["waiting"], gen["cache_bytes"]) == (0, 0, 0)
    assert probe == {"sent": 6, "ok": 6, "busy": 0, "other": 0}  # every dropped answer gave its place back
