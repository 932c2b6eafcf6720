"""Soak: several threads share one loaded model for a bounded time; outputs and memory stay put."""

from __future__ import annotations

import os
import threading
import time

import numpy as np

from slimml.runtime import load
from slimml.runtime.tools.bench import sample_feeds

THREADS = 4
SECONDS = float(os.environ.get("SLIMML_SOAK_SECONDS", "4"))


def rss_mb() -> float:
    """Current (not peak) resident set size, from /proc; 0 where there is none."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
    except OSError:
        return 0.0


def test_threads_share_one_model(tiny_bert_artifact):
    model = load(tiny_bert_artifact)
    # a mix of shapes per thread, so concurrent runs really differ; the answers come from one thread first
    cases = [sample_feeds(model.inputs, batch=b, seq=s, seed=i) for i, (b, s) in enumerate([(1, 8), (2, 16), (4, 32), (3, 7)])]
    texts = [["a small sentence", "another, longer sentence about nothing much"], ["x"]]
    want = [model.run(f) for f in cases]
    want_text = [model.encode(t) for t in texts]
    for _ in range(20):  # warm up ORT's arenas before taking the memory reference
        for f in cases:
            model.run(f)
    rss0 = rss_mb()
    stop = time.monotonic() + SECONDS
    calls = [0] * THREADS
    failures: list[str] = []

    def worker(k: int) -> None:
        i = k
        try:
            while time.monotonic() < stop:
                j = i % len(cases)
                got = model.run(cases[j])
                for name, value in want[j].items():
                    if not np.array_equal(got[name], value):
                        failures.append(f"thread {k}: output {name} of case {j} differs")
                if i % 7 == 0:
                    t = i % len(texts)
                    if not np.array_equal(model.encode(texts[t]), want_text[t]):
                        failures.append(f"thread {k}: encode of text batch {t} differs")
                calls[k] += 1
                i += 1
        except Exception as e:  # reported below; a thread's exception would otherwise vanish
            failures.append(f"thread {k}: {type(e).__name__}: {e}")

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(THREADS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=SECONDS + 60)
    assert not any(t.is_alive() for t in threads), "a thread hung"
    grown = rss_mb() - rss0
    assert not failures, failures[:5]
    assert min(calls) > 0
    assert grown < 50, f"resident memory grew by {grown:.1f} MB over {sum(calls)} calls"
    print(f"soak: {THREADS} threads x {SECONDS:.0f} s, {sum(calls)} calls, outputs identical, RSS {grown:+.1f} MB")
