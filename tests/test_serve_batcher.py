"""The replica's batcher: concurrent requests share one model call, formed when the model is free."""

from __future__ import annotations

import asyncio
import threading
import time

import numpy as np
import pytest

from slimml.serve.batcher import Batcher


def test_requests_that_wait_while_the_model_runs_share_the_next_call():
    calls: list[list[str]] = []
    gate = threading.Event()

    def fn(items: list[str]) -> list[str]:
        calls.append(list(items))
        if len(calls) == 1:
            gate.wait(5)  # the first call holds the model while the others arrive
        return [s.upper() for s in items]

    async def main():
        batcher = Batcher(fn, max_items=6, wait_s=0.0)
        first = asyncio.create_task(batcher(["a"]))
        await asyncio.sleep(0.05)  # the model is busy with ["a"]
        rest = [asyncio.create_task(batcher([f"{i}x", f"{i}y"])) for i in range(4)]
        await asyncio.sleep(0.05)
        gate.set()
        return await first, await asyncio.gather(*rest), batcher

    first, rest, batcher = asyncio.run(main())
    assert first == ["A"] and rest == [[f"{i}X", f"{i}Y"] for i in range(4)]
    # everything that waited went into the next calls, oldest first, at most max_items at a time
    assert calls == [["a"], ["0x", "0y", "1x", "1y", "2x", "2y"], ["3x", "3y"]]
    assert (batcher.calls, batcher.items) == (3, 9)


def test_the_first_request_waits_for_company_at_most_wait_s():
    calls, started = [], []

    async def main():
        batcher = Batcher(lambda items: started.append(time.monotonic()) or calls.append(len(items)) or items,
                          max_items=100, wait_s=0.2)
        t0 = time.monotonic()
        a = asyncio.create_task(batcher([1]))
        await asyncio.sleep(0.05)
        b = asyncio.create_task(batcher([2, 3]))
        assert await a == [1] and await b == [2, 3]
        return t0

    t0 = asyncio.run(main())
    # the batch's call starts once the window closes (timed at the call: its thread's end can lag on a busy machine)
    assert calls == [3] and 0.19 <= started[0] - t0 < 2


def test_an_oversized_request_runs_alone_and_tuples_are_sliced():
    async def main():
        batcher = Batcher(lambda items: (list(items), [len(s) for s in items]), max_items=2, wait_s=0.01)
        big, small = await asyncio.gather(batcher(["aaa", "b", "cc"]), batcher(["dddd"]))
        return big, small, batcher.calls

    big, small, calls = asyncio.run(main())
    assert big == (["aaa", "b", "cc"], [3, 1, 2]) and small == (["dddd"], [4]) and calls == 2


def test_a_failing_call_is_retried_per_request_so_only_the_bad_one_fails():
    calls = []

    def fn(items):
        calls.append(list(items))
        if "bad" in items:
            raise ValueError("bad text")
        return items

    async def main():
        batcher = Batcher(fn, max_items=10, wait_s=0.05)
        results = await asyncio.gather(batcher(["ok", "ok2"]), batcher(["bad"]), batcher(["also"]),
                                       return_exceptions=True)
        return results, await batcher(["fine"])

    (a, b, c), after = asyncio.run(main())
    assert a == ["ok", "ok2"] and isinstance(b, ValueError) and c == ["also"] and after == ["fine"]
    assert calls[0] == ["ok", "ok2", "bad", "also"] and calls[1:4] == [["ok", "ok2"], ["bad"], ["also"]]


def test_a_cancelled_request_is_skipped():
    seen = []
    gate = threading.Event()

    def fn(items):
        seen.extend(items)
        gate.wait(5)
        return items

    async def main():
        batcher = Batcher(fn, max_items=10, wait_s=0.0)
        first = asyncio.create_task(batcher(["first"]))
        await asyncio.sleep(0.05)
        gone = asyncio.create_task(batcher(["gone"]))
        kept = asyncio.create_task(batcher(["kept"]))
        await asyncio.sleep(0.01)
        gone.cancel()
        gate.set()
        assert await first == ["first"] and await kept == ["kept"]
        with pytest.raises(asyncio.CancelledError):
            await gone

    asyncio.run(main())
    assert seen == ["first", "kept"]


def test_a_batch_runs_in_pieces_of_like_items_and_comes_back_in_each_request_s_order():
    calls = []

    def fn(items):
        calls.append(list(items))
        return np.array([[len(s), ord(s[0])] for s in items], np.float32), [len(s) for s in items]

    async def main():
        batcher = Batcher(fn, max_items=100, wait_s=0.05, piece=3, key=len)
        return await asyncio.gather(batcher(["ccc", "a", "dddd"]), batcher(["bb", "eeeee"]))

    (emb1, n1), (emb2, n2) = asyncio.run(main())
    assert calls == [["a", "bb", "ccc"], ["dddd", "eeeee"]]  # by length, three at a time
    np.testing.assert_array_equal(emb1, [[3, 99], [1, 97], [4, 100]])
    np.testing.assert_array_equal(emb2, [[2, 98], [5, 101]])
    assert n1 == [3, 1, 4] and n2 == [2, 5] and emb1.dtype == np.float32


def test_a_request_that_goes_away_mid_batch_stops_after_the_call_in_progress():
    """A timed-out or disconnected request's remaining items are dropped between calls: the model
    is free for the next request after one call, not after the whole batch."""
    calls, started, gate, fn = _held_model(lambda items: items)

    async def main():
        batcher = Batcher(fn, max_items=1000, wait_s=0.0, piece=4)
        big = asyncio.create_task(batcher([f"t{i}" for i in range(40)]))
        await asyncio.to_thread(started.wait, 5)
        big.cancel()  # the route's deadline, or the client gone
        gate.set()
        with pytest.raises(asyncio.CancelledError):
            await big
        return await batcher(["next"])

    assert asyncio.run(main()) == ["next"]
    assert calls == [["t0", "t1", "t2", "t3"], ["next"]]


def test_a_request_behind_a_big_one_waits_for_a_call_not_for_all_of_it():
    """A one-text request sent while a 2,048-text one ran waited 58 s for all of it: a request of
    more than a piece joins each batch with one piece, the others get in between. Alone, the big
    request makes the calls a whole sort would (its items by length, a piece at a time)."""
    calls, started, gate, fn = _held_model(lambda items: [len(s) for s in items])

    texts = ["x" * n for n in (9, 3, 7, 1, 5, 2, 8, 4, 6, 10)]

    async def main():
        batcher = Batcher(fn, max_items=100, wait_s=0.0, piece=3, key=len)
        big = asyncio.create_task(batcher(texts))
        await asyncio.to_thread(started.wait, 5)
        small = asyncio.create_task(batcher(["hello"]))
        await asyncio.sleep(0.05)
        gate.set()
        return await big, await small

    big, small = asyncio.run(main())
    assert big == [len(t) for t in texts] and small == [5]
    assert [[len(s) for s in c] for c in calls] == [[1, 2, 3], [4, 5, 5], [6], [7, 8, 9], [10]]  # "hello" in the 2nd
    calls.clear()
    gate.set()
    assert asyncio.run(Batcher(fn, max_items=100, wait_s=0.0, piece=3, key=len)(texts)) == [len(t) for t in texts]
    assert [[len(s) for s in c] for c in calls] == [[1, 2, 3], [4, 5, 6], [7, 8, 9], [10]]


def _held_model(answer):
    """``(calls, started, gate, fn)``: ``fn`` records each call's items, sets ``started`` and holds
    the model until ``gate`` is set, then answers ``answer(items)``."""
    calls, started, gate = [], threading.Event(), threading.Event()

    def fn(items):
        calls.append(list(items))
        started.set()
        gate.wait(5)
        return answer(items)

    return calls, started, gate, fn


def test_results_that_cannot_be_put_together_fail_their_request_not_the_batcher():
    """Arrays of another width from a later call left the request pending and killed the worker (a review)."""
    widths = iter([2, 3, 2, 2])

    def fn(items):
        return np.zeros((len(items), next(widths)), np.float32)

    async def main():
        batcher = Batcher(fn, max_items=100, wait_s=0.0, piece=2)
        with pytest.raises(ValueError):
            await asyncio.wait_for(batcher(["a", "b", "c", "d"]), 5)
        return await asyncio.wait_for(batcher(["e"]), 5)

    assert asyncio.run(main()).shape == (1, 2)
