"""Which shards each pipeline stage owns: contiguous groups, balanced by weight bytes or memory."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from slimml.errors import ConfigError

# ops whose weight bytes stand for their work: each weight element is a multiply-add per row
_COMPUTE_OPS = {"MatMul", "Gemm", "Conv", "ConvTranspose", "MatMulInteger", "MatMulIntegerToFloat", "MatMulNBits",
                "QLinearMatMul", "QLinearConv", "ConvInteger", "DynamicQuantizeMatMul", "FusedMatMul", "Attention",
                "QAttention", "MultiHeadAttention", "GroupQueryAttention", "LSTM", "GRU", "RNN", "Einsum"}


def compute_sizes(folder: Path, manifest) -> list[int]:
    """Per shard, the elements of weights that matrix products and convolutions read: a stand-in
    for its work per row. Embedding tables (read by Gather, one row per token) count for nothing,
    so a shard of embeddings alone weighs little even when it holds most of the bytes."""
    import onnx

    from slimml.runtime.artifact.files import safe_path

    sizes = []
    for s in manifest.shards:
        graph = onnx.load(str(safe_path(folder, s.file)), load_external_data=False).graph
        dims = {t.name: t.dims for t in graph.initializer}
        used = {i for n in graph.node if n.op_type in _COMPUTE_OPS for i in n.input if i in dims}
        total = 0
        for name in used:
            count = 1
            for d in dims[name]:
                count *= d
            total += count
        sizes.append(total)
    return sizes


def split_stages(sizes: Sequence[int], stages: int, capacities: Sequence[float] | None = None) -> list[tuple[int, int]]:
    """Cut shards into ``stages`` contiguous, non-empty groups, as evenly as their sizes allow.

    The cut minimises the largest ``group bytes / capacity``: with no capacities every stage
    counts the same (balanced by weight bytes); with each stage's node memory as its capacity, a
    node with twice the memory gets about twice the bytes.

    Args:
        sizes: each shard's weight bytes, in order.
        stages: how many groups.
        capacities: one positive number per stage (say, its node's memory), or None.

    Returns:
        ``(first, last)`` shard indices per stage, inclusive.

    Raises:
        ConfigError: ``stages`` below 1 or more than the shards, or capacities that are not one
            positive number a stage.

    Example:
        >>> split_stages([10, 10, 10, 10], 2)
        [(0, 1), (2, 3)]
    """
    n = len(sizes)
    if not isinstance(stages, int) or isinstance(stages, bool) or stages < 1:
        raise ConfigError(f"stages must be a whole number >= 1, got {stages!r}.")
    if stages > n:
        raise ConfigError(
            f"cannot split {n} shard(s) into {stages} stages: each stage needs at least one shard. Use "
            f"--stages {n} or fewer, or convert with smaller shards (--shard-layers)."
        )
    caps = [1.0] * stages if capacities is None else [float(c) for c in capacities]
    if len(caps) != stages or any(c <= 0 for c in caps):
        raise ConfigError(f"give one positive capacity per stage ({stages}), got {list(capacities or [])}.")
    prefix = [0]
    for s in sizes:
        prefix.append(prefix[-1] + max(int(s), 1))  # a weightless shard still costs a hop
    inf = float("inf")
    # best[k][j]: the smallest worst load putting shards 0..j-1 on stages 0..k-1
    best = [[inf] * (n + 1) for _ in range(stages + 1)]
    cut = [[0] * (n + 1) for _ in range(stages + 1)]
    best[0][0] = 0.0
    for k in range(1, stages + 1):
        for j in range(k, n - (stages - k) + 1):
            for i in range(k - 1, j):
                load = max(best[k - 1][i], (prefix[j] - prefix[i]) / caps[k - 1])
                if load < best[k][j]:
                    best[k][j], cut[k][j] = load, i
    groups, j = [], n
    for k in range(stages, 0, -1):
        i = cut[k][j]
        groups.append((i, j - 1))
        j = i
    return groups[::-1]
