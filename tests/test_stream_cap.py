"""Streaming under a memory cap: a budget pins what fits beside two slots, and shards the page
cache cannot hold are read in (not paged) where ONNX Runtime mapped their packed weights."""

from __future__ import annotations

import os
import sys

import numpy as np
import pytest

from slimml.runtime import load
from slimml.runtime.artifact.manifest import read_manifest
from slimml.runtime.engine import packed
from slimml.runtime.engine.backends import cpu
from slimml.runtime.engine.budget import STREAM_SLOTS, plan_stream
from conftest import mlp_artifact_in


@pytest.fixture(scope="module")
def mlp_artifact(tmp_path_factory):
    """A 6-block ONNX MLP split per layer."""
    return mlp_artifact_in(tmp_path_factory.mktemp("stream_cap_mlp"), layers=6, hidden=32)


def _feeds(seed=0):
    rng = np.random.default_rng(seed)
    return {"x": rng.standard_normal((3, 32)).astype(np.float32), "scale": rng.random((3, 1)).astype(np.float32)}


def test_budget_pins_what_fits_beside_two_slots(mlp_artifact):
    plan = plan_stream(read_manifest(mlp_artifact))
    sizes, n = plan.sizes, len(plan.sizes)
    two = sum(sorted(sizes, reverse=True)[:STREAM_SLOTS])
    budget = two + sizes[0] + sizes[-1] + sizes[1] // 2  # the first and last shards fit, not a third
    got = plan_stream(read_manifest(mlp_artifact), memory_budget=budget)
    assert got.pinned == [0, n - 1] and got.resident == 2 + STREAM_SLOTS and got.prefetch == 1
    assert got.streamed == list(range(1, n - 1)) and got.peak_bytes <= budget
    assert "pinned 2 shard(s), the most that fit" in got.describe()
    # room for the two slots only: nothing pinned, the slots stream every shard
    assert plan_stream(read_manifest(mlp_artifact), memory_budget=two).pinned == []
    model, full = load(mlp_artifact, memory_budget=budget), load(mlp_artifact)
    for seed in range(2):
        np.testing.assert_allclose(model.run(_feeds(seed))["y"], full.run(_feeds(seed))["y"], rtol=0, atol=1e-6)
    assert model.stats.bytes_loaded > 0


def test_read_in_slots_equal_resident_and_free_their_memory(mlp_artifact, monkeypatch):
    monkeypatch.setattr(cpu, "READ_IN_MARGIN", 10**9)  # as if the machine had no room for the page cache
    model = load(mlp_artifact, resident=2)
    source = next(s.source for s in model.plan.segments if s.kind == "streamed")
    assert source.read_in and "read from the cache in large reads" in model.plan.describe()
    full = load(mlp_artifact)
    for seed in range(3):  # several passes: every slot is read in again after its release
        np.testing.assert_allclose(model.run(_feeds(seed))["y"], full.run(_feeds(seed))["y"], rtol=0, atol=1e-6)
    # ONNX Runtime's mappings of the packed files were replaced: nothing of them is file-backed now
    for index, ranges in source.ranges.items():
        assert not set(packed._mappings(source.entries[index].data)) & set(ranges)
    assert model.stats.bytes_loaded >= 3 * sum(n for r in source.ranges.values() for _, n, _ in r)
    # slots were filled in populated buffers and their pages moved where the sessions read them
    # (mremap), on a kernel that can; one buffer per slot in use, at most the plan's two
    buffers = source._buffers
    release = tuple(int(x) for x in os.uname().release.split("-")[0].split(".")[:2])
    assert buffers.moves == (sys.platform.startswith("linux") and release >= (5, 7))  # MREMAP_DONTUNMAP
    assert 1 <= len(buffers.made) <= 2


def test_trim_heap_runs():
    packed.trim_heap()  # glibc's malloc_trim where there is one, else nothing
