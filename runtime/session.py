"""Creating ONNX Runtime sessions for one device, with clear errors when a provider is missing."""

from __future__ import annotations

import os

import onnxruntime as ort

from slimml.errors import ArtifactError, DeviceError, FeedError

DEVICES = ("cpu", "cuda")


def providers_for(device: str) -> list[str | tuple[str, dict]]:
    """The execution providers for ``device``, in priority order.

    Raises:
        DeviceError: the device is unknown, or CUDA was asked for where onnxruntime has no CUDA
            provider.
    """
    if device not in DEVICES:
        raise DeviceError(f"unknown device {device!r}; use one of {list(DEVICES)}.")
    if device == "cpu":
        return ["CPUExecutionProvider"]
    available = ort.get_available_providers()
    if "CUDAExecutionProvider" not in available:
        raise DeviceError(
            "device='cuda' was asked for, but this onnxruntime has no CUDA provider (available: "
            f"{available}). Install the GPU build (`pip uninstall -y onnxruntime && pip install "
            "onnxruntime-gpu`) on a machine with an NVIDIA driver, or use device='cpu'."
        )
    return [("CUDAExecutionProvider", {}), "CPUExecutionProvider"]


def session_options(threads: int | None = None) -> ort.SessionOptions:
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    threads = threads or int(os.environ.get("SLIMML_THREADS", "0"))
    if threads:
        so.intra_op_num_threads = threads
    # Each shard has its own session and thread pool. With ORT's default spin-waiting, the pools of
    # shards that just ran keep spinning while the next shard computes and steal its cores:
    # measured 1.35x slower at batch 32 on 2 cores; without spinning, 7 shards run as fast as
    # the unsharded graph (benchmarks/bench_shards.py).
    so.add_session_config_entry("session.intra_op.allow_spinning", "0")
    so.log_severity_level = 4  # fatal only: slimml raises its own errors with the fix in them
    return so


def make_session(path: os.PathLike | str, device: str = "cpu", threads: int | None = None) -> ort.InferenceSession:
    providers = providers_for(device)
    try:
        return ort.InferenceSession(os.fspath(path), sess_options=session_options(threads), providers=providers)
    except Exception as e:  # ORT raises its own Fail/InvalidGraph/... classes
        raise ArtifactError(
            f"ONNX Runtime could not load {os.fspath(path)}: {str(e).strip().splitlines()[0]}. "
            "The file is not a valid ONNX model for this onnxruntime; re-convert it."
        ) from None


def run_shard(shard, call, env: dict, drop: list[str]) -> None:
    """Run one shard on the activations in ``env`` and update ``env`` in place.

    ``call(output_names, feeds)`` runs the shard's session (``session.run``, or an IOBinding
    runner on CUDA). Its outputs go into ``env`` and the activations in ``drop`` (those no later
    shard reads) leave it. ONNX Runtime's errors become one-line FeedErrors naming the shard.
    """
    names = [t.name for t in shard.outputs]
    try:
        values = call(names, {t.name: env[t.name] for t in shard.inputs})
    except Exception as e:  # onnxruntime's own exception classes
        msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise FeedError(
            f"shard {shard.index} ({shard.file}) rejected the inputs: {msg}. Check the input values, e.g. "
            "token ids inside the vocabulary and sequences no longer than the model's maximum."
        ) from None
    env.update(zip(names, values))
    for name in drop:
        env.pop(name, None)  # free activations no later shard needs
