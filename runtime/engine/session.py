"""Creating ONNX Runtime sessions for one device, with clear errors when a provider is missing."""

from __future__ import annotations

import logging
import os
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort

from slimml.errors import ArtifactError, DeviceError, FeedError

DEVICES = ("cpu", "cuda")
log = logging.getLogger("slimml")

# ONNX Runtime graph fusions left off on CPU, where the fused kernel measured slower than the ops
# it replaces. SkipLayerNormalization (Add + Add + LayerNormalization in one op): 166 µs a call at
# (1, 128, 384) in the int8 all-MiniLM-L6-v2, against 30 µs for LayerNormalization and 30 µs for
# an Add (ORT's profiler, onnxruntime 1.31, 2-core Sapphire Rapids). Whole model, merged graph:
# batch 1 0.88x the time, batch 32 0.93x; the d3-p50 student at batch 1 0.88x. fp32 graphs are
# unchanged (same outputs, same time). CUDA keeps every fusion.
CPU_DISABLED_OPTIMIZERS = ("SkipLayerNormFusion",)


def disabled_optimizers(device: str) -> list[str] | None:
    """The graph optimizers ONNX Runtime should skip for ``device`` (see CPU_DISABLED_OPTIMIZERS)."""
    return list(CPU_DISABLED_OPTIMIZERS) if device == "cpu" else None


def providers_for(device: str) -> list[str | tuple[str, dict]]:
    """The execution providers for ``device``, in priority order.

    Raises:
        DeviceError: the device is unknown, or CUDA was asked for where onnxruntime has no CUDA
            provider.
    """
    if device not in DEVICES:
        raise DeviceError(f"unknown device {device!r}; use one of {list(DEVICES) + ['auto']}.")
    if device == "cpu":
        return ["CPUExecutionProvider"]
    available = ort.get_available_providers()
    if "CUDAExecutionProvider" not in available:
        raise DeviceError(
            "device='cuda' was asked for, but this onnxruntime has no CUDA provider (available: "
            f"{available}). Install the GPU build (`pip uninstall -y onnxruntime && pip install "
            "onnxruntime-gpu`) on a machine with an NVIDIA driver, or use device='cpu'."
        )
    _preload_cuda_libraries()
    return [("CUDAExecutionProvider", {}), "CPUExecutionProvider"]


_auto: str | None = None


def resolve_device(device: str) -> str:
    """``device`` checked, with ``"auto"`` made concrete: CUDA where onnxruntime has its CUDA
    provider and it starts (a GPU, its driver and libraries), else CPU. Decided once per process.

    Raises:
        DeviceError: an unknown device, or CUDA asked for where it cannot run.
    """
    global _auto
    if device != "auto":
        providers_for(device)
        return device
    if _auto is None:
        _auto = "cpu"
        if "CUDAExecutionProvider" in ort.get_available_providers():
            from onnx import TensorProto, helper

            x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1])
            graph = helper.make_graph([helper.make_node("Relu", ["x"], ["y"])], "probe", [x],
                                      [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1])])
            model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
            model.ir_version = 8
            try:
                make_session(model.SerializeToString(), "cuda")  # without a working GPU: DeviceError
                _auto = "cuda"
            except (DeviceError, ArtifactError):
                log.info("slimml: device='auto' runs on CPU: onnxruntime's CUDA provider did not start here")
    return _auto


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
        except Exception:  # libraries found elsewhere (LD_LIBRARY_PATH) still load; make_session checks
            pass


def session_options(threads: int | None = None, spinning: bool = True,
                    weights_folder: os.PathLike | str | None = None, shared_arena: bool = False,
                    device: str = "cpu") -> ort.SessionOptions:
    """ORT's defaults, plus what slimml's plan needs.

    Args:
        threads: intra-op threads (default: ORT's choice, or ``SLIMML_THREADS``).
        spinning: let idle pool threads spin-wait for the next op (ORT's default). A plan with one
            session keeps it: it is what makes small batches fast. Several sessions that run one
            after another turn it off, or the pools of the sessions that just ran keep spinning
            and steal the cores of the one computing (measured: benchmarks/bench_threads.py).
        weights_folder: where the external data of a graph given as bytes lives (a merged graph
            reads each weight from its own shard's data file there).
        shared_arena: allocate activations from one arena per device (CPU, or the GPU for
            ``device="cuda"``) shared by every session that asks for it, instead of an arena per
            session. Sessions that run one after another need the memory of the largest, not the
            sum: 24 streamed layer sessions of a 4.4 GB Llama held 4.6 GB of CPU arenas after a
            batch 4 x 256 prefill with their own; on an H100, 48 streamed layer sessions of a
            3.2 GB chain peaked at 9.4 GB of GPU memory with theirs, 7.9 GB with one shared
            (benchmarks/bench_cuda.py; layers of one type now share a session, 1.1 GB).
    """
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    threads = threads or int(os.environ.get("SLIMML_THREADS", "0"))
    if threads:
        so.intra_op_num_threads = threads
    if not spinning:
        so.add_session_config_entry("session.intra_op.allow_spinning", "0")
    if weights_folder is not None:
        so.add_session_config_entry("session.model_external_initializers_file_folder_path", os.fspath(weights_folder))
    if shared_arena and _register_shared_arena(device):
        so.add_session_config_entry("session.use_env_allocators", "1")
    so.log_severity_level = 4  # fatal only: slimml raises its own errors with the fix in them
    return so


_arena_lock = threading.Lock()
_arenas: dict[str, bool] = {}


def _register_shared_arena(device: str) -> bool:
    """Register one arena for ``device`` in ONNX Runtime's environment, once per process.
    False where this onnxruntime cannot (the sessions then keep their own arenas)."""
    with _arena_lock:
        if device not in _arenas:
            cfg = ort.OrtArenaCfg({"arena_extend_strategy": 1})  # grow by what is asked, not powers of two
            try:
                if device == "cuda":
                    info = ort.OrtMemoryInfo("Cuda", ort.OrtAllocatorType.ORT_ARENA_ALLOCATOR, 0, ort.OrtMemType.DEFAULT)
                    ort.create_and_register_allocator_v2("CUDAExecutionProvider", info, {}, cfg)
                else:
                    info = ort.OrtMemoryInfo("Cpu", ort.OrtAllocatorType.ORT_ARENA_ALLOCATOR, 0, ort.OrtMemType.DEFAULT)
                    ort.create_and_register_allocator(info, cfg)
                _arenas[device] = True
            except Exception as e:  # an older or differently built onnxruntime
                log.warning("slimml: each session keeps its own %s arena: one shared arena could not be registered (%s)",
                            device, str(e).splitlines()[0] if str(e) else type(e).__name__)
                _arenas[device] = False
        return _arenas[device]


def make_session(model: os.PathLike | str | bytes, device: str = "cpu", threads: int | None = None,
                 options: ort.SessionOptions | None = None, what: str | None = None) -> ort.InferenceSession:
    """An InferenceSession over an ONNX file, or over a serialized graph (``bytes``).

    Raises:
        ArtifactError: ONNX Runtime refused the graph; the message names ``what`` (default: the path).
    """
    providers = providers_for(device)
    source = model if isinstance(model, bytes) else os.fspath(model)
    try:
        session = ort.InferenceSession(source, sess_options=options or session_options(threads), providers=providers,
                                       disabled_optimizers=disabled_optimizers(device))
    except Exception as e:  # ORT raises its own Fail/InvalidGraph/... classes
        name = what or (Path(source).name if isinstance(source, str) else "the graph")
        raise ArtifactError(
            f"ONNX Runtime could not load {name}: {_first_line(e)}. The file is not a valid ONNX model for this "
            "onnxruntime; re-convert it."
        ) from None
    if device == "cuda" and session.get_providers()[0] != "CUDAExecutionProvider":
        # ORT falls back to CPU when the CUDA provider's libraries do not load: say so, never run slowly unasked
        raise DeviceError(
            "device='cuda' was asked for, but ONNX Runtime could not start its CUDA provider (its CUDA or cuDNN "
            "libraries did not load). Install the CUDA and cuDNN versions this onnxruntime-gpu was built for (`pip "
            "install onnxruntime-gpu[cuda,cudnn]`), or use device='cpu'."
        )
    return session


@dataclass
class Step:
    """One session call of a plan: a shard, or several merged. ``drop``: activations no later
    step reads, freed once it has run."""

    label: str  # "shard 3 (shard_003.onnx)" or "shards 0-6 (merged)", for error messages
    inputs: list[str]
    outputs: list[str]
    drop: list[str]
    session: ort.InferenceSession
    device: str = "cpu"
    names: dict[str, str] | None = None  # this step's names -> the session's, where a session serves several
    on_device: bool = True  # CUDA: outputs stay on the GPU for the next step (False for a plan's only step)

    def __post_init__(self):
        # ``call`` gets feeds already checked against the manifest, so on CPU it skips the Python
        # wrapper's second check of the names (5-6 us of a 1.7 ms batch-1 call, measured) and calls
        # the session's C++ binding; the wrapper's provider fallback only concerns GPU providers
        self._inner = getattr(self.session, "_sess", None) if self.device == "cpu" else None

    def call(self, feeds: dict) -> dict:
        """The outputs by name for ``feeds`` that are exactly this step's inputs, on the host."""
        try:
            inner = self._inner
            values = inner.run(self.outputs, feeds, None) if inner is not None else self.session.run(self.outputs, feeds)
            return dict(zip(self.outputs, values))
        except Exception as e:  # onnxruntime's own exception classes
            raise self._error(e) from None

    def _error(self, e: BaseException) -> FeedError:
        return FeedError(
            f"{self.label} rejected the inputs: {_first_line(e)}. Check the input values, e.g. token ids inside "
            "the vocabulary and sequences no longer than the model's maximum."
        )

    def run(self, env: dict, extra: dict | None = None) -> None:
        """Run on the activations in ``env`` and update it in place; ``extra`` adds feeds that are
        not activations (a streamed shard's weights). ONNX Runtime's errors become one-line
        FeedErrors naming the step."""
        feeds = {name: env[name] for name in self.inputs}
        if extra:
            feeds.update(extra)
        outputs = self.outputs
        if self.names:
            feeds = {self.names.get(k, k): v for k, v in feeds.items()}
            outputs = [self.names.get(o, o) for o in outputs]
        try:
            if self.device == "cuda" and self.on_device:
                values = _run_bound(self.session, outputs, feeds)
            else:
                values = self.session.run(outputs, feeds)
        except Exception as e:  # onnxruntime's own exception classes
            raise self._error(e) from None
        env.update(zip(self.outputs, values))
        for name in self.drop:
            env.pop(name, None)


def _run_bound(session, names: list[str], feeds: dict[str, Any]) -> list[Any]:
    """Run on CUDA with IOBinding: inputs may be host arrays or device OrtValues from an earlier
    step; outputs stay on the device as OrtValues until the plan hands them back."""
    binding = session.io_binding()
    for name, value in feeds.items():
        if isinstance(value, np.ndarray):
            binding.bind_cpu_input(name, value)
        elif isinstance(value, tuple):  # a streamed weight in a CUDA slot (cuda_slots.DeviceWeight)
            address, dtype, shape = value
            binding.bind_input(name, "cuda", 0, dtype.type, list(shape), address)
        else:
            binding.bind_ortvalue_input(name, value)
    for name in names:
        binding.bind_output(name, "cuda")
    session.run_with_iobinding(binding)
    return binding.get_outputs()


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__
