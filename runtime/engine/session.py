"""Sessions and steps: the compatibility front of :mod:`slimml.runtime.engine.backends`, and
:class:`Step`, one session call of a plan.

``make_session(path, device)`` and ``session_options(...)`` keep working for the converter and the
quantizer; every device question they raise is answered by the device's backend object.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import onnxruntime as ort

from slimml.errors import FeedError, OutOfMemoryError
from slimml.runtime.engine.backends import DEFAULT_DEVICE, DEVICES, Backend, backend_for, resolve_device
from slimml.runtime.engine.backends.base import first_line as _first_line

__all__ = ["DEVICES", "Step", "disabled_optimizers", "make_session", "providers_for", "resolve_device",
           "session_options"]


def providers_for(device: str | Backend) -> list[str | tuple[str, dict]]:
    """The execution providers for ``device``, in priority order.

    Raises:
        DeviceError: the device is unknown, or its provider is missing from this onnxruntime.
    """
    return backend_for(device).providers()


def disabled_optimizers(device: str | Backend) -> list[str] | None:
    """The graph optimizers ONNX Runtime should skip on ``device`` (see the backends)."""
    return backend_for(device).disabled_optimizers()


def session_options(threads: int | None = None, spinning: bool = True,
                    weights_folder: os.PathLike | str | None = None, shared_arena: bool = False,
                    device: str | Backend = DEFAULT_DEVICE) -> ort.SessionOptions:
    """ORT's defaults plus what slimml's plan needs (:meth:`Backend.session_options`)."""
    return backend_for(device).session_options(threads, spinning, weights_folder, shared_arena)


def make_session(model: os.PathLike | str | bytes, device: str | Backend = DEFAULT_DEVICE, threads: int | None = None,
                 options: ort.SessionOptions | None = None, what: str | None = None) -> ort.InferenceSession:
    """An InferenceSession on ``device`` over an ONNX file, or a serialized graph (``bytes``).

    Raises:
        ArtifactError: ONNX Runtime refused the graph; the message names ``what`` (default: the path).
        DeviceError: the device is unknown or its provider did not start.
    """
    return backend_for(device).session(model, options, threads, what)


# A call whose inputs hold this many values (ids, masks: tokens; a float input's values where there are
# no ids) gives the CPU arena's unused chunks back when it ends. ONNX Runtime keeps what a call's
# activations took for the next one: after one encode of 256 texts of 400 tokens the default model
# held 2.4 GB until close (a refused, larger call: 5.7 GB); the calls of ordinary batches (32 x 128
# tokens: 12k values) stay below this and keep reusing it.
SHRINK_VALUES = 1 << 16
SHRINK_ARENA = ort.RunOptions()  # free the CPU arena's unused chunks when the run ends
SHRINK_ARENA.add_run_config_entry("memory.enable_memory_arena_shrinkage", "cpu:0")


def run_options(feeds: dict) -> ort.RunOptions | None:
    """The run options of a call on ``feeds``: the arena's shrinking after a call of large inputs."""
    ids = floats = 0
    for v in feeds.values():
        kind = getattr(getattr(v, "dtype", None), "kind", "")
        if kind and kind in "iub":
            ids += getattr(v, "size", 0)
        else:
            floats += getattr(v, "size", 0)
    return SHRINK_ARENA if (ids or floats) >= SHRINK_VALUES else None


@dataclass
class Step:
    """One session call of a plan: a shard, or several merged. ``drop``: activations no later
    step reads, freed once it has run."""

    label: str  # "shard 3 (shard_003.onnx)" or "shards 0-6 (merged)", for error messages
    inputs: list[str]
    outputs: list[str]
    drop: list[str]
    session: ort.InferenceSession
    backend: Backend
    names: dict[str, str] | None = None  # this step's names -> the session's, where a session serves several
    on_device: bool = True  # outputs may stay on the device for the next step (a device backend)

    def __post_init__(self):
        # ``call`` gets feeds already checked against the manifest, so where the backend allows
        # (CPU) it skips the Python wrapper's second check of the names (5-6 us of a 1.7 ms
        # batch-1 call, measured) and calls the session's C++ binding
        self._inner = self.backend.direct(self.session)

    def call(self, feeds: dict) -> dict:
        """The outputs by name for ``feeds`` that are exactly this step's inputs, on the host."""
        try:
            inner = self._inner
            values = (inner.run(self.outputs, feeds, run_options(feeds)) if inner is not None
                      else self.backend.run(self.session, self.outputs, feeds, False))
            return dict(zip(self.outputs, values))
        except Exception as e:  # onnxruntime's own exception classes
            raise self._error(e) from None

    def _error(self, e: BaseException) -> FeedError:
        if isinstance(e, MemoryError) or "Failed to allocate memory" in str(e) or "bad_alloc" in str(e):
            return OutOfMemoryError(f"{self.label} ran out of memory for this batch (ONNX Runtime could not allocate a buffer); "
                             "send fewer rows or shorter sequences a call (encode's batch_size), or stream the model with "
                             "a memory budget.")
        if "batch_size must be 1 when sequence_length > 1 and past context" in str(e):  # GroupQueryAttention's rule
            return FeedError(f"{self.label} takes several new tokens over a KV cache one row at a time (ONNX Runtime's "
                             "fused attention): run such rows one per call, or one new token per row (generate() and "
                             "perplexity() do so for you).")
        return FeedError(f"{self.label} rejected the inputs: {_first_line(e)}. {self._hint()}")

    def _hint(self) -> str:
        """What to check, by what this step takes: images, token ids, or arrays in general."""
        if any("pixel" in name for name in self.inputs):
            return ("Check the images' size and channels: the model takes the size its preprocessor makes "
                    "(`slimml info ARTIFACT` shows the inputs).")
        if any(name.endswith("input_ids") for name in self.inputs):
            return "Check the input values, e.g. token ids inside the vocabulary and sequences no longer than the model's maximum."
        return "Check the inputs' values and shapes against the model's (`slimml info ARTIFACT` shows them)."

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
            values = self.backend.run(self.session, outputs, feeds, self.on_device)
        except Exception as e:  # onnxruntime's own exception classes
            raise self._error(e) from None
        env.update(zip(self.outputs, values))
        for name in self.drop:
            env.pop(name, None)
