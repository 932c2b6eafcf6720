"""Prefix caching: the keys and values of text the model has read, kept for prompts that start with it.

Chat clients send the whole conversation again every turn, and many requests open with the same
system prompt. A decoder computes position ``i``'s keys and values from tokens ``[0, i]`` alone, so
the cache of any earlier sequence is exact at every position where its tokens equal a new
prompt's: those positions are copied into the new sequence's cache row and only the rest of the
prompt is prefilled (llama.cpp's slot reuse, vLLM's automatic prefix caching).

:class:`PrefixStore` keeps the cache in blocks of ``BLOCK`` tokens, in a tree whose edges are the
blocks' exact token ids (no hashes: two prompts share a block only if their tokens are equal from
the first position on), within a byte budget. The least recently used blocks are dropped first, a
block never before the blocks after it (each use touches a block's whole path, the deepest first),
so every stored block is reachable from the root. A shared system prompt is stored once, however
many conversations continue it.

On a fused graph (past and present sharing one buffer) the rows of a continuous batch store their
prompt once it is prefilled and their whole text when they leave
(:class:`~slimml.runtime.tasks.generation.rows.SlotRows`); so does ``generate`` for one prompt
(:class:`~slimml.runtime.tasks.generation.loop.CacheLoop`, the model's own store: a chat in a
loop prefills only each turn's new text). The positions reused are the same
numbers a prefill would compute in float32; a quantized graph's kernels may round a position
computed within a longer pass differently, as prompt lookup's note says.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import numpy as np

from slimml.runtime.engine.kv_cache import prefill_alone

BLOCK = 16  # tokens a stored block holds; a prompt reuses whole blocks (vLLM's default block size)
MIN_REUSE = BLOCK  # positions worth copying instead of prefilling


@dataclass(eq=False)
class Block:
    """``BLOCK`` positions of cache: ``kv`` (layers' past names in order, kv_heads, BLOCK, head_dim)."""

    key: tuple[int, bytes]  # (the parent block's id, these positions' token ids)
    id: int
    kv: np.ndarray


class PrefixStore:
    """Blocks of KV cache found by the token ids that made them, within ``budget`` bytes.

    Args:
        budget: bytes the stored blocks may hold; 0 stores nothing.

    Attributes:
        nbytes: bytes held now.
        prompt_tokens / reused_tokens: tokens of the prompts prefilled, and of those, the tokens
            whose cache was copied instead.
    """

    def __init__(self, budget: int):
        self.budget = int(budget)
        self.blocks: OrderedDict[tuple[int, bytes], Block] = OrderedDict()  # least recently used first
        self.nbytes = 0
        self.prompt_tokens = 0
        self.reused_tokens = 0
        self._next_id = 1  # 0 is the root
        self._lock = threading.Lock()  # generate() may run on several threads over one model's store

    def match(self, ids: list[int] | np.ndarray) -> list[Block]:
        """The stored blocks that begin ``ids``, in order (at least one position is left to
        prefill, whose logits the prompt needs); empty under ``MIN_REUSE`` positions."""
        ids = np.asarray(ids, dtype=np.int64)
        with self._lock:
            path = self._walk(ids, (len(ids) - 1) // BLOCK)
            if len(path) * BLOCK < MIN_REUSE:
                return []
            self._touch(path)
        return path

    def load(self, path: list[Block], buffers: dict[str, np.ndarray], row: int) -> int:
        """Copy ``path``'s positions into ``row`` of the cache ``buffers`` (past name ->
        (rows, kv_heads, capacity, head_dim)); the positions copied."""
        for k, block in enumerate(path):
            for i, buf in enumerate(buffers.values()):
                buf[row, :, k * BLOCK : (k + 1) * BLOCK] = block.kv[i]
        self.reused_tokens += len(path) * BLOCK
        return len(path) * BLOCK

    def prefill(self, cache: Any, row: int, ids: list[int], path: list[Block]) -> tuple[np.ndarray, int]:
        """``ids`` prefilled on ``row`` of ``cache`` (a :class:`~slimml.runtime.engine.kv_cache.KVCache`,
        the row empty): ``path``'s positions copied in, passes over the rest (one row: after a cache,
        a pass over several positions runs at batch 1; a long rest in chunks, ``prefill_alone``). The
        last position's logits, (1, vocab), and the positions copied."""
        n = self.load(path, cache.buffers, row) if path else 0
        return prefill_alone(cache, row, ids, n), n

    def read(self, ids: list[int], buffers: dict[str, np.ndarray], row: int) -> None:
        """A prompt ``ids`` is prefilled in ``row`` of ``buffers``: count it, and store it."""
        self.prompt_tokens += len(ids)
        self.keep(ids, buffers, row, len(ids))

    def keep(self, ids: list[int] | np.ndarray, buffers: dict[str, np.ndarray], row: int, positions: int) -> None:
        """Store the whole blocks of ``row``'s first ``positions`` positions of ``buffers``, made
        from ``ids`` (at least ``positions`` token ids), that are not stored yet."""
        ids = np.asarray(ids[:positions], dtype=np.int64)
        blocks = len(ids) // BLOCK
        if blocks == 0 or self.budget <= 0:
            return
        with self._lock:
            self._keep(ids, blocks, buffers, row)

    def _keep(self, ids: np.ndarray, blocks: int, buffers: dict[str, np.ndarray], row: int) -> None:
        path = self._walk(ids, blocks)
        size = _block_bytes(buffers)
        room = max(0, self.budget // size - len(path))  # blocks that fit beside the path, however old the rest
        for k in range(len(path), min(blocks, len(path) + room)):
            parent = path[-1].id if path else 0
            kv = np.stack([buf[row, :, k * BLOCK : (k + 1) * BLOCK] for buf in buffers.values()])
            block = Block((parent, ids[k * BLOCK : (k + 1) * BLOCK].tobytes()), self._next_id, kv)
            self._next_id += 1
            self.blocks[block.key] = block
            self.nbytes += kv.nbytes
            path.append(block)
        self._touch(path)
        while self.nbytes > self.budget and self.blocks:
            _, old = self.blocks.popitem(last=False)
            self.nbytes -= old.kv.nbytes

    def clear(self) -> None:
        with self._lock:
            self.blocks.clear()
            self.nbytes = 0

    @property
    def stats(self) -> dict[str, int]:
        return {"bytes": self.nbytes, "blocks": len(self.blocks), "prompt_tokens": self.prompt_tokens,
                "reused_tokens": self.reused_tokens}

    def _walk(self, ids: np.ndarray, blocks: int) -> list[Block]:
        path: list[Block] = []
        parent = 0
        for k in range(blocks):
            block = self.blocks.get((parent, ids[k * BLOCK : (k + 1) * BLOCK].tobytes()))
            if block is None:
                break
            path.append(block)
            parent = block.id
        return path

    def _touch(self, path: list[Block]) -> None:
        """Mark ``path`` used, the deepest block first: a block is always newer than those after it."""
        for block in reversed(path):
            self.blocks.move_to_end(block.key)


def common(a: list[int], b: list[int]) -> int:
    """How many tokens ``a`` and ``b`` share from their first on."""
    n = min(len(a), len(b))
    same = np.asarray(a[:n]) == np.asarray(b[:n])
    return n if same.all() else int(np.argmin(same))


def _block_bytes(buffers: dict[str, np.ndarray]) -> int:
    return sum(buf.shape[1] * BLOCK * buf.shape[3] * buf.itemsize for buf in buffers.values())
