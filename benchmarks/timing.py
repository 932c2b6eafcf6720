"""Timing several systems fairly in one process: interleaved in blocks, never call by call.

ONNX Runtime's default intra-op pool spins after each run, and each session has its own pool.
Called one call after another, a system's run meets the previous system's spinning threads and
caches full of another model's weights. Measured on the 2-core project machine, batch 1 x 128
tokens, three plain ``InferenceSession`` objects (slimml's merged int8 graph, Optimum's int8
model, the fused int8 graph), each alone: 7.1 ms for the first two. The same three alternating
call by call: 16.5, 10.0-12.3 and 15.4 ms, the ratios swinging with call order. Alternated in
blocks of 30 calls (3 warm-up calls dropped per block): 7.4, 7.3 and 6.7 ms, as alone.

So each round gives every system a block: ``warmup`` untimed calls, then ``block`` timed ones;
the order of systems reverses every other round, so drift on a shared machine hits them alike.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable


def interleaved(fns: dict[str, Callable[[], object]], runs: int, block: int | None = None, warmup: int = 3,
                clock: Callable[[], float] = time.perf_counter) -> dict[str, float]:
    """Median ms per call of each callable, over ``runs`` timed calls each.

    Args:
        fns: the systems, by name; each a callable of no arguments.
        runs: timed calls per system, in all.
        block: timed calls per system per round (default: ``runs // 10``, at least 1).
        warmup: untimed calls before each block.
        clock: ``time.perf_counter`` (wall) or ``time.process_time`` (CPU of this process).
    """
    block = max(1, block or runs // 10)
    times: dict[str, list[float]] = {k: [] for k in fns}
    keys = list(fns)
    r = 0
    while min(len(v) for v in times.values()) < runs:
        for k in keys if r % 2 == 0 else keys[::-1]:
            for _ in range(warmup):
                fns[k]()
            for _ in range(min(block, runs - len(times[k]))):
                t0 = clock()
                fns[k]()
                times[k].append(clock() - t0)
        r += 1
    return {k: statistics.median(v) * 1e3 for k, v in times.items()}
