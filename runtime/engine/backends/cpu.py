"""The CPU backend: ONNX Runtime's CPU provider, host arrays in and out, weights streamed as
pre-packed files (:mod:`slimml.runtime.engine.packed`, Linux) or fed from mapped data files."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

import onnxruntime as ort

from slimml.errors import ConfigError
from slimml.runtime.engine.backends.base import Backend
from slimml.runtime.engine.budget import UNKNOWN_MEMORY, available_memory, shard_bytes
from slimml.runtime.engine.packed import NO_CACHE, PackedSlots, cache_root, supported
from slimml.runtime.engine.slots import FedSlots

if TYPE_CHECKING:
    from slimml.runtime.artifact.manifest import Manifest
    from slimml.runtime.engine.config import LoadConfig
    from slimml.runtime.engine.contracts import WeightSource

log = logging.getLogger("slimml")

# ONNX Runtime graph fusions left off on CPU, where the fused kernel measured slower than the ops
# it replaces. SkipLayerNormalization (Add + Add + LayerNormalization in one op): 166 µs a call at
# (1, 128, 384) in the int8 all-MiniLM-L6-v2, against 30 µs for LayerNormalization and 30 µs for
# an Add (ORT's profiler, onnxruntime 1.31, 2-core Sapphire Rapids). Whole model, merged graph:
# batch 1 0.88x the time, batch 32 0.93x; the d3-p50 student at batch 1 0.88x. fp32 graphs are
# unchanged (same outputs, same time). CUDA keeps every fusion.
CPU_DISABLED_OPTIMIZERS = ("SkipLayerNormFusion",)

# streamed shards are read in (not paged through the cache) when the memory free is below this
# many times the model's bytes on disk (the packed weights are ~1.1x them, plus what stays resident)
READ_IN_MARGIN = 2


class CpuBackend(Backend):
    """ONNX Runtime on the host's cores."""

    name = "cpu"
    on_host = True
    device_values = False  # outputs are host arrays already

    def providers(self) -> list[str | tuple[str, dict]]:
        return ["CPUExecutionProvider"]

    def disabled_optimizers(self) -> list[str] | None:
        return list(CPU_DISABLED_OPTIMIZERS)

    def direct(self, session: ort.InferenceSession) -> Any:
        # the wrapper's provider fallback only concerns GPU providers
        return getattr(session, "_sess", None)

    def memory_available(self) -> int | None:
        free = available_memory()
        return None if free >= UNKNOWN_MEMORY else free

    def weight_source(self, folder: Path, manifest: Manifest, config: LoadConfig) -> WeightSource:
        why = supported()
        if config.pack and why:
            raise ConfigError(f"pack=True cannot be honoured: {why}. Use pack=None (the default) or pack=False.")
        if config.pack is False or why:
            return FedSlots(folder, manifest, self, config)
        if config.cache_dir is None and cache_root() is None:
            if config.pack:
                raise ConfigError(f"pack=True cannot be honoured: {NO_CACHE}.")
            log.warning("slimml: streaming weights as graph inputs (slower decoding): %s", NO_CACHE)
            return FedSlots(folder, manifest, self, config)
        # the page cache can hold the streamed shards, or the kernel would evict them before their
        # next pass (and, in a memory cgroup, the pages of what stays resident): then read them in
        # ourselves and drop them from the cache
        tight = available_memory() < READ_IN_MARGIN * sum(shard_bytes(manifest))
        return PackedSlots(folder, manifest, self, config, read_in=tight)

    def fallback_source(self, folder: Path, manifest: Manifest, config: LoadConfig) -> WeightSource | None:
        if config.pack:  # asked for packing: its failure is the error
            return None
        return FedSlots(folder, manifest, self, config)

    def _register_arena(self, cfg: ort.OrtArenaCfg) -> None:
        info = ort.OrtMemoryInfo("Cpu", ort.OrtAllocatorType.ORT_ARENA_ALLOCATOR, 0, ort.OrtMemType.DEFAULT)
        ort.create_and_register_allocator(info, cfg)
