"""Dynamic batching for a replica: concurrent requests' items gathered into one model call,
formed when the model is free.

Ray Serve's ``@serve.batch`` forms the next batch as soon as the previous one has *started*:
it takes what arrives within ``batch_wait_timeout_s`` of the first request and then waits for
the model. Under load, the requests that arrive while a batch computes are spread over several
small batches queued behind it. Measured on the default int8 model (2 cores, 32 clients sending
32 texts each, ``max_batch_size`` 256 texts): batches held 1-2 requests in most calls, and the
server gave 0.58x the texts/s of in-process ``encode``, because small batches of unsorted texts
pad to their longest (1.62x the token slots of the sorted corpus). Here a batch is formed at the
moment the model is free, from everything waiting then, up to ``max_items``; the first request
of a batch waits at most ``wait_s`` for others to join it.

A request of more than a call's ``piece`` of items is taken a piece at a time: its items sorted
(by ``key``), a piece of them goes into a batch, and its next piece waits at the back of the
queue. A lone request of 2,048 texts makes the same calls as before; a one-text request sent
while it runs waits for one call, not for all 2,048 texts (it waited 58 s before).
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Callable
from typing import Any

import numpy as np


class _Request:
    """One request's items, its future, and what its calls have given so far."""

    __slots__ = ("items", "future", "arrived", "order", "taken", "rows", "like")

    def __init__(self, items: list[Any], future: asyncio.Future, key: Callable[[Any], Any] | None):
        self.items = items
        self.future = future
        self.arrived = time.monotonic()
        self.order = sorted(range(len(items)), key=lambda i: key(items[i])) if key else list(range(len(items)))
        self.taken = 0  # items of ``order`` given to a batch so far
        self.rows: dict[int, Any] = {}  # item -> its result (a tuple of parts where fn gives a tuple)
        self.like: Any = None  # a call's results, whose types this request's results take

    def next_piece(self, size: int | None) -> list[int]:
        piece = self.order[self.taken:self.taken + size] if size else self.order[self.taken:]
        self.taken += len(piece)
        return piece

    def result(self) -> Any:
        if isinstance(self.like, tuple):
            return tuple(_gather([self.rows[i][k] for i in range(len(self.items))], part) for k, part in enumerate(self.like))
        return _gather([self.rows[i] for i in range(len(self.items))], self.like)


class Batcher:
    """Runs ``fn(items)`` on a worker thread, one call at a time, over the items of all requests
    waiting when the previous call ends, and gives each request its slice of the results.

    Args:
        fn: a blocking function of a list of items; returns a sequence (a list, an array) as
            long as its input, or a tuple of such sequences.
        max_items: the most items in one batch (at least one request's piece).
        wait_s: how long the oldest waiting request waits for others before its batch runs.
        piece: the most items in one call of ``fn`` (default: a batch in one call). A batch runs
            as calls of this many items, and between calls the items of requests that went away
            (timed out, disconnected) are dropped: a request abandoned mid-batch stops costing
            the model time after the call in progress, instead of holding it for the whole batch.
            A request of more items than this joins each batch with one piece of them, so that
            the requests behind it wait for a call, not for all of it.
        key: order a batch's items by this before it is cut into calls (``len``: texts of like
            length share a call and pad little); results come back in each request's own order.
    """

    def __init__(self, fn: Callable[[list[Any]], Any], max_items: int, wait_s: float, piece: int | None = None,
                 key: Callable[[Any], Any] | None = None):
        self.fn = fn
        self.max_items = max_items
        self.wait_s = wait_s
        self.piece = piece
        self.key = key
        self._waiting: deque[tuple[_Request, list[int]]] = deque()  # a request and the piece of it waiting
        self._count = 0  # items waiting
        self._arrived: asyncio.Event | None = None
        self._worker: asyncio.Task | None = None
        self.calls = 0  # model calls made, and items in them: the batching a caller can check
        self.items = 0

    async def __call__(self, items: list[Any]) -> Any:
        """The results for ``items`` (``fn``'s, sliced), computed in a batch with other requests' items."""
        if self._worker is None or self._worker.done():
            self._arrived = asyncio.Event()
            self._worker = asyncio.get_running_loop().create_task(self._work())
        request = _Request(list(items), asyncio.get_running_loop().create_future(), self.key)
        self._queue(request)
        self._arrived.set()
        return await request.future

    def _queue(self, request: _Request) -> None:
        piece = request.next_piece(self.piece)
        self._waiting.append((request, piece))
        self._count += len(piece)

    def _take(self) -> list[tuple[_Request, list[int]]]:
        """The oldest waiting pieces, up to ``max_items`` items (at least one)."""
        batch, size = [], 0
        while self._waiting:
            request, piece = self._waiting[0]
            if request.future.done():  # its caller went away (a cancelled HTTP request)
                self._waiting.popleft()
                self._count -= len(piece)
                continue
            if batch and size + len(piece) > self.max_items:
                break
            self._waiting.popleft()
            self._count -= len(piece)
            batch.append((request, piece))
            size += len(piece)
        return batch

    async def _work(self) -> None:
        while True:
            while not self._waiting:
                self._arrived.clear()
                await self._arrived.wait()
            # the model is free: let the oldest request wait up to wait_s for company
            deadline = self._waiting[0][0].arrived + self.wait_s
            while self._count < self.max_items and (left := deadline - time.monotonic()) > 0:
                self._arrived.clear()
                try:
                    await asyncio.wait_for(self._arrived.wait(), left)
                except asyncio.TimeoutError:
                    break
            batch = self._take()
            if not batch:
                continue
            try:
                await self._run(batch)
            except Exception as e:
                if len(batch) == 1:
                    self._fail(batch[0][0], e)  # the route maps it to a status
                    continue
                # one request's items failed the call: run each piece on its own, so only the
                # request at fault gets its error and the others their results
                for entry in batch:
                    if entry[0].future.done():
                        continue
                    try:
                        await self._run([entry])
                    except Exception as alone:
                        self._fail(entry[0], alone)
                    else:
                        self._advance(entry[0])
                continue
            for request, _ in batch:
                self._advance(request)

    def _advance(self, request: _Request) -> None:
        """After a piece of ``request`` ran: its next piece to the back of the queue, or its results."""
        if request.future.done():
            return
        if request.taken < len(request.items):
            self._queue(request)
            return
        try:
            result = request.result()
        except Exception as e:  # fn's results not of one shape across its calls: this request's error, not the worker's
            self._fail(request, e)
        else:
            request.future.set_result(result)

    @staticmethod
    def _fail(request: _Request, e: Exception) -> None:
        if not request.future.done():
            request.future.set_exception(e)

    async def _run(self, batch: list[tuple[_Request, list[int]]]) -> None:
        """Each piece's results into its request, from calls of at most ``piece`` items."""
        flat = [(request, i) for request, piece in batch for i in piece]
        order = sorted(range(len(flat)), key=lambda j: self.key(flat[j][0].items[flat[j][1]])) if self.key else list(range(len(flat)))
        size = self.piece or len(flat)
        for start in range(0, len(order), size):
            take = [flat[j] for j in order[start:start + size] if not flat[j][0].future.done()]
            if not take:
                continue
            self.calls += 1
            self.items += len(take)
            like = await asyncio.to_thread(self.fn, [request.items[i] for request, i in take])
            parts = zip(*like) if isinstance(like, tuple) else like
            for (request, i), part in zip(take, parts):
                request.rows[i] = part
                request.like = like


def _gather(values: list[Any], like: Any) -> Any:
    """One request's per-item ``values`` in the form of ``fn``'s results ``like`` (an array's rows stacked)."""
    return np.stack(values) if isinstance(like, np.ndarray) else list(values)
