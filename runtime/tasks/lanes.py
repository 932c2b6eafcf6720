"""Lanes: the batches of one ``encode`` call run side by side, one batch per core.

A model that fits runs one graph whose ops ONNX Runtime splits over every core: what makes one
batch fast. A long list of texts is many batches, and there splitting each op costs more than it
gives: the cores meet at a barrier after every op, and a core taken for a moment by another
process (an HTTP proxy, the caller's own threads) idles the rest. So ``encode`` gives each core
a lane instead: a thread that runs whole batches through a single-threaded copy of the resident
plan (all lanes share that one session; ONNX Runtime sessions take concurrent calls). Measured
on this project's 2-core machine, the 3,000 STSb dev sentences with the int8 default model,
batch 32, three alternating runs: 1,672-1,784 sentences/s in two lanes against 1,410-1,514 with
every batch on the plan's two threads (1.17x); embeddings equal (max abs diff 0.0). Behind a Ray
Serve proxy on the same cores: docs/deploy.md.

The copy costs a second session, so lanes are used only where it is cheap: on CPU, for a fully
resident model whose weights take at most a quarter of the memory available (and, loaded with a
``memory_budget``, whose two copies fit in it), with two batches or more to run.

A short list is cut finer so that every lane has work: each lane gets two batches or more, of
at least :data:`LANE_MIN_BATCH` texts (:func:`lane_batch_size`; never more than the caller's
``batch_size``). Measured with the int8 default model, ``encode`` against one batch on both
threads: 32 texts of 128 tokens 0.89x the time in four batches of 8 (0.93-0.96x in two of 16);
32 STSb sentences 0.61-0.81x (two sets, four batches of 8); 16 sentences 0.81x, 64 0.79-0.82x.
Below 8 texts a batch loses: 8 sentences in two lanes of 4 took 1.05x one batch of 8.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

from slimml.errors import ConfigError
from slimml.runtime.engine.budget import available_memory
from slimml.runtime.engine.cpus import cpu_count

T = TypeVar("T")
R = TypeVar("R")


LANE_MIN_BATCH = 8  # texts: smaller batches in lanes lost to one batch on every thread (module doc)


def lane_batch_size(texts: int, batch_size: int, lanes: int) -> int:
    """Texts per batch for ``texts`` texts over ``lanes`` lanes: ``batch_size``, or fewer where
    that gives each lane at least two batches, down to :data:`LANE_MIN_BATCH`."""
    if lanes <= 1:
        return batch_size
    return min(batch_size, max(LANE_MIN_BATCH, -(-texts // (2 * lanes))))


def possible_batches(texts: int, batch_size: int) -> int:
    """The most batches ``texts`` texts can be cut into for lanes (see :func:`lane_batch_size`)."""
    return -(-texts // min(batch_size, LANE_MIN_BATCH))


def lane_count(workers: int | None, batches: int, *, unfit: str | None, threads: int | None,
               model_bytes: int, memory_budget: int | None = None) -> tuple[int, int]:
    """``(lanes, threads per lane)`` for an ``encode`` call of ``batches`` batches.

    ``workers`` None picks: one lane per core of the model's threads (``load(threads=)``, else
    every core), where lanes are cheap (see the module) and the copy fits the memory budget the
    model was loaded with, if any; else one lane, the plan itself. ``unfit`` says why this model
    cannot have lanes ("streams", "runs on cuda"), or is None.

    Raises:
        ConfigError: ``workers`` is not a whole number >= 1, or more than one was asked of a
            model that cannot have lanes.
    """
    if workers is not None:
        if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
            raise ConfigError(f"workers must be a whole number >= 1, got {workers!r}.")
        if workers > 1 and unfit:
            raise ConfigError(
                f"workers={workers} runs batches side by side on CPU cores, each through a copy of a model that is "
                f"fully resident in this process; this one {unfit}. Use workers=1, or leave it unset."
            )
    cores = threads or cpu_count()
    if workers is None:
        cheap = (unfit is None and cores > 1 and batches > 1  # meminfo is read only where lanes could run
                 and (memory_budget is None or 2 * model_bytes <= memory_budget)
                 and model_bytes * 4 <= available_memory())
        workers = min(cores, batches) if cheap else 1
    return workers, max(1, cores // workers)


def in_lanes(fn: Callable[[T], R], items: Iterable[T], lanes: int) -> Iterator[R]:
    """``fn`` over ``items``, ``lanes`` at a time, results in order. The first error is raised
    as soon as its turn comes, and the items not started yet are dropped."""
    if lanes <= 1:
        yield from map(fn, items)
        return
    pool = ThreadPoolExecutor(lanes, thread_name_prefix="slimml-lane")
    try:
        futures = [pool.submit(fn, item) for item in items]
        for future in futures:
            yield future.result()
    finally:
        pool.shutdown(wait=True, cancel_futures=True)
