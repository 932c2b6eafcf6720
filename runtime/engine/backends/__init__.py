"""Backends: one object per device, picked once from the device's name (the only place that
reads it). ``backend_for("cpu")``, ``backend_for("cuda")``, ``backend_for("auto")``.

Adding a device adds a module with a :class:`~slimml.runtime.engine.backends.base.Backend`
subclass and a line in :data:`BACKENDS`, not an ``if`` elsewhere.
"""

from __future__ import annotations

import logging

from slimml.errors import ArtifactError, DeviceError
from slimml.runtime.engine.backends.base import Backend
from slimml.runtime.engine.backends.cpu import CpuBackend
from slimml.runtime.engine.backends.cuda import CudaBackend

log = logging.getLogger("slimml")

BACKENDS: dict[str, type[Backend]] = {"cpu": CpuBackend, "cuda": CudaBackend}
AUTO = "auto"  # CUDA where it starts, else CPU
DEFAULT_DEVICE = CpuBackend.name
DEVICES = (*BACKENDS, AUTO)

_made: dict[str, Backend] = {}
_auto: str | None = None


def check_device(device: str) -> None:
    """Raise DeviceError unless ``device`` names a known device (or ``"auto"``)."""
    if device not in DEVICES:
        raise DeviceError(f"unknown device {device!r}; use one of {list(DEVICES)}.")


def backend_for(device: str | Backend) -> Backend:
    """The backend for ``device`` (``"auto"`` made concrete), one per device and process. Whether
    this onnxruntime can run on it is asked of ``backend.providers()`` (as every session does).

    Raises:
        DeviceError: an unknown device.
    """
    if isinstance(device, Backend):
        return device
    check_device(device)
    name = resolve_device(device) if device == AUTO else device
    backend = _made.get(name)
    if backend is None:
        backend = _made[name] = BACKENDS[name]()
    return backend


def resolve_device(device: str) -> str:
    """``device`` checked, with ``"auto"`` made concrete: CUDA where onnxruntime has its CUDA
    provider and it starts (a GPU, its driver and libraries), else CPU. Decided once per process.

    Raises:
        DeviceError: an unknown device, or CUDA asked for where it cannot run.
    """
    global _auto
    check_device(device)
    if device != AUTO:
        BACKENDS[device]().providers()  # a missing provider fails here, before anything is hashed
        return device
    if _auto is None:
        _auto = _probe()
    return _auto


def _probe() -> str:
    """The first backend, in order of preference, on which a one-node graph runs."""
    from onnx import TensorProto, helper

    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1])
    graph = helper.make_graph([helper.make_node("Relu", ["x"], ["y"])], "probe", [x],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    for cls in (CudaBackend,):
        try:
            cls().session(model.SerializeToString())  # no provider or no working GPU: DeviceError
            return cls.name
        except (DeviceError, ArtifactError):
            log.info("slimml: device='auto' runs on CPU: onnxruntime's %s provider did not start here", cls.name)
    return CpuBackend.name


__all__ = ["BACKENDS", "DEFAULT_DEVICE", "DEVICES", "Backend", "CpuBackend", "CudaBackend", "backend_for", "check_device",
           "resolve_device"]
