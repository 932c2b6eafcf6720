"""The CUDA backend: ONNX Runtime's CUDA provider, with IOBinding so that activations, streamed
weights and (for tasks that ask) a KV cache stay in device memory between steps and calls.

Runs only where onnxruntime-gpu finds a working GPU; the CPU-side logic (which value binds how,
what comes back to the host) is the same everywhere.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import onnxruntime as ort

from slimml.errors import ConfigError, DeviceError
from slimml.runtime.engine.backends.base import Backend
from slimml.runtime.engine.cuda_slots import CudaSlots, DeviceWeight

if TYPE_CHECKING:
    from slimml.runtime.artifact.manifest import Manifest
    from slimml.runtime.engine.config import LoadConfig
    from slimml.runtime.engine.contracts import WeightSource

log = logging.getLogger("slimml")
ORT_DEVICE = "cuda"  # ONNX Runtime's own name for the device (OrtValue, IOBinding)
PROVIDER = "CUDAExecutionProvider"


class CudaBackend(Backend):
    """ONNX Runtime on one NVIDIA GPU, the first (``device_id`` 0: the one ORT's provider uses by default)."""

    name = "cuda"
    on_host = False
    device_values = True  # OrtValues in device memory, bound by the next step or call where they sit

    def __init__(self, device_id: int = 0):
        self.device_id = device_id

    def providers(self) -> list[str | tuple[str, dict]]:
        available = ort.get_available_providers()
        if PROVIDER not in available:
            raise DeviceError(
                "device='cuda' was asked for, but this onnxruntime has no CUDA provider (available: "
                f"{available}). Install the GPU build (`pip uninstall -y onnxruntime && pip install "
                "onnxruntime-gpu`) on a machine with an NVIDIA driver, or use device='cpu'."
            )
        _preload_cuda_libraries()
        return [(PROVIDER, {}), "CPUExecutionProvider"]

    def check_session(self, session: ort.InferenceSession) -> None:
        if session.get_providers()[0] != PROVIDER:
            # ORT falls back to CPU when the CUDA provider's libraries do not load: say so, never run slowly unasked
            raise DeviceError(
                "device='cuda' was asked for, but ONNX Runtime could not start its CUDA provider (its CUDA or cuDNN "
                "libraries did not load). Install the CUDA and cuDNN versions this onnxruntime-gpu was built for "
                "(`pip install onnxruntime-gpu[cuda,cudnn]`), or use device='cpu'."
            )

    def run(self, session: ort.InferenceSession, outputs: list[str], feeds: dict[str, Any],
            on_device: bool) -> list[Any]:
        if not on_device and not any(isinstance(v, (ort.OrtValue, DeviceWeight)) for v in feeds.values()):
            return session.run(outputs, feeds)
        binding = session.io_binding()
        for name, value in feeds.items():
            self.bind(binding, name, value)
        for name in outputs:
            binding.bind_output(name, ORT_DEVICE, self.device_id)
        session.run_with_iobinding(binding)
        values = binding.get_outputs()
        return values if on_device else [self.to_host(v) for v in values]

    def bind(self, binding: ort.IOBinding, name: str, value: Any) -> None:
        """Bind one feed where it sits: a host array is copied up, a device value (an OrtValue an
        earlier step or call left on the GPU) or a streamed weight (:class:`DeviceWeight`) is bound
        in place."""
        if isinstance(value, np.ndarray):
            binding.bind_cpu_input(name, value)
        elif isinstance(value, DeviceWeight):
            binding.bind_input(name, ORT_DEVICE, self.device_id, value.dtype.type, list(value.shape), value.address)
        else:
            binding.bind_ortvalue_input(name, value)

    def to_host(self, value: Any) -> np.ndarray:
        return value.numpy() if isinstance(value, ort.OrtValue) else value

    def to_device(self, array: np.ndarray) -> ort.OrtValue:
        """``array`` copied into device memory (one transfer), as an OrtValue."""
        return ort.OrtValue.ortvalue_from_numpy(array, ORT_DEVICE, self.device_id)

    def memory_available(self) -> int | None:
        try:
            from cuda.bindings import runtime as rt
        except ImportError:
            return None
        err, free, _total = rt.cudaMemGetInfo()
        return int(free) if err == rt.cudaError_t.cudaSuccess else None

    def weight_source(self, folder: Path, manifest: Manifest, config: LoadConfig) -> WeightSource:
        if config.pack:
            raise ConfigError("pack=True cannot be honoured: it runs on CPU only. Use pack=None (the default) or "
                              "pack=False.")
        return CudaSlots(folder, manifest, self, config)

    def _register_arena(self, cfg: ort.OrtArenaCfg) -> None:
        info = ort.OrtMemoryInfo("Cuda", ort.OrtAllocatorType.ORT_ARENA_ALLOCATOR, self.device_id, ort.OrtMemType.DEFAULT)
        ort.create_and_register_allocator_v2(PROVIDER, info, {}, cfg)


_preloaded = False


def _preload_cuda_libraries() -> None:
    """Load the CUDA and cuDNN libraries that pip installed beside onnxruntime-gpu
    (``onnxruntime-gpu[cuda,cudnn]``), once: without them on the loader's path, or torch imported
    first, ONNX Runtime's CUDA provider does not load."""
    global _preloaded
    if not _preloaded and hasattr(ort, "preload_dlls"):
        _preloaded = True
        try:
            ort.preload_dlls()
        except Exception:  # libraries found elsewhere (LD_LIBRARY_PATH) still load; session() checks
            pass
