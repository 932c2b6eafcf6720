"""What the engine asks of a device: one :class:`Backend` object per device, chosen once at load.

A backend answers every device question, so that no other code compares device names (the
shape of vLLM's ``Platform`` and tinygrad's ``Allocator``): which ONNX Runtime providers and
session options to use, how a session is created and checked, how a step's feeds are bound and
its outputs handed back (:meth:`Backend.run`, :meth:`Backend.to_host`), where a streamed shard's
weights come from (:meth:`Backend.weight_source`), and what memory the device has.
"""

from __future__ import annotations

import logging
import os
import re
import threading
from abc import ABC, abstractmethod
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np
import onnxruntime as ort

from slimml.errors import ArtifactError, ConfigError
from slimml.runtime.engine.cpus import quota_threads

if TYPE_CHECKING:
    from slimml.runtime.artifact.manifest import Manifest
    from slimml.runtime.engine.config import LoadConfig
    from slimml.runtime.engine.contracts import WeightSource

log = logging.getLogger("slimml")

MAX_THREADS = 1024  # intra-op threads a session may ask for: more than any CPU has cores, far less than 10**5


def env_threads() -> int:
    """``SLIMML_THREADS`` (0 where unset or 0: ONNX Runtime's choice), checked.

    Raises:
        ConfigError: it is not a whole number from 0 to MAX_THREADS.
    """
    value = os.environ.get("SLIMML_THREADS", "").strip()
    if not value:
        return 0
    if not (value.isascii() and value.isdigit()) or int(value) > MAX_THREADS:
        raise ConfigError(f"SLIMML_THREADS={value!r} must be a whole number from 1 to {MAX_THREADS} (ONNX Runtime's "
                          f"intra-op threads; this machine has {os.cpu_count()} cores; 0: its choice); fix it or unset it.")
    return int(value)


class Backend(ABC):
    """One device, as ONNX Runtime drives it. Made by
    :func:`slimml.runtime.engine.backends.backend_for`; ``name`` is the device's public name
    (``model.device``)."""

    name: ClassVar[str]
    on_host: ClassVar[bool]  # computes on the host's cores (encode's lanes split them)
    device_values: ClassVar[bool]  # outputs can stay on the device between calls (run_trusted's keep_on_device)

    # -- sessions --------------------------------------------------------------------------------

    @abstractmethod
    def providers(self) -> list[str | tuple[str, dict]]:
        """ONNX Runtime's execution providers for this device, in priority order.

        Raises:
            DeviceError: this onnxruntime cannot run on the device.
        """

    def disabled_optimizers(self) -> list[str] | None:
        """Graph optimizers ONNX Runtime should skip on this device (None: keep all)."""
        return None

    def session_options(self, threads: int | None = None, spinning: bool = True,
                        weights_folder: os.PathLike | str | None = None,
                        shared_arena: bool = False) -> ort.SessionOptions:
        """ORT's defaults, plus what slimml's plan needs.

        Args:
            threads: intra-op threads (default: ORT's choice, or ``SLIMML_THREADS``).
            spinning: let idle pool threads spin-wait for the next op (ORT's default). A plan with
                one session keeps it: it is what makes small batches fast. Several sessions that
                run one after another turn it off, or the pools of the sessions that just ran keep
                spinning and steal the cores of the one computing (benchmarks/bench_threads.py).
            weights_folder: where the external data of a graph given as bytes lives (a merged
                graph reads each weight from its own shard's data file there).
            shared_arena: allocate activations from one arena per device shared by every session
                that asks for it, instead of an arena per session. Sessions that run one after
                another need the memory of the largest, not the sum: 24 streamed layer sessions of
                a 4.4 GB Llama held 4.6 GB of CPU arenas after a batch 4 x 256 prefill with their
                own; on an H100, 48 streamed layer sessions of a 3.2 GB chain peaked at 9.4 GB of
                GPU memory with theirs, 7.9 GB with one shared (benchmarks/bench_cuda.py).
        """
        so = ort.SessionOptions()
        so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        threads = threads or env_threads() or quota_threads()  # a container's CPU quota, not the host's cores
        if threads:
            so.intra_op_num_threads = threads
        if not spinning:
            so.add_session_config_entry("session.intra_op.allow_spinning", "0")
        if weights_folder is not None:
            so.add_session_config_entry("session.model_external_initializers_file_folder_path", os.fspath(weights_folder))
        if shared_arena and self._shared_arena():
            so.add_session_config_entry("session.use_env_allocators", "1")
        so.log_severity_level = 4  # fatal only: slimml raises its own errors with the fix in them
        return so

    def session(self, model: os.PathLike | str | bytes, options: ort.SessionOptions | None = None,
                threads: int | None = None, what: str | None = None) -> ort.InferenceSession:
        """An InferenceSession on this device over an ONNX file, or a serialized graph (``bytes``).

        Raises:
            ArtifactError: ONNX Runtime refused the graph; the message names ``what`` (default: the path).
            DeviceError: the device's provider did not start.
        """
        providers = self.providers()
        source = model if isinstance(model, bytes) else os.fspath(model)
        try:
            session = ort.InferenceSession(source, sess_options=options or self.session_options(threads),
                                           providers=providers, disabled_optimizers=self.disabled_optimizers())
        except Exception as e:  # ORT raises its own Fail/InvalidGraph/... classes
            name = what or (Path(source).name if isinstance(source, str) else "the graph")
            err = ArtifactError(f"ONNX Runtime could not load {name}: {first_line(e)}. The file is not a valid ONNX model "
                                "for this onnxruntime; re-convert it.")
            err.cause = first_line(e)  # ONNX Runtime's own words, for a caller that says it otherwise (convert)
            raise err from None
        self.check_session(session)
        return session

    def check_session(self, session: ort.InferenceSession) -> None:
        """Raise DeviceError when ``session`` does not run on this device (a silent fallback)."""

    # -- running ---------------------------------------------------------------------------------

    def direct(self, session: ort.InferenceSession) -> Any:
        """The session's C++ binding where a call on checked host feeds may skip the Python
        wrapper (its second check of the names, 5-6 us of a 1.7 ms batch-1 call), else None."""
        return None

    def run(self, session: ort.InferenceSession, outputs: list[str], feeds: dict[str, Any],
            on_device: bool) -> list[Any]:
        """One session call. ``on_device``: outputs may stay on the device, for a later step or
        call to bind where they sit (:meth:`to_host` brings them back)."""
        return session.run(outputs, feeds)

    def to_host(self, value: Any) -> np.ndarray:
        """A value :meth:`run` returned, as a host array."""
        return value

    # -- memory and weights ----------------------------------------------------------------------

    @abstractmethod
    def memory_available(self) -> int | None:
        """Bytes free on the device now (None where it cannot be told)."""

    @abstractmethod
    def weight_source(self, folder: Path, manifest: Manifest, config: LoadConfig) -> WeightSource:
        """Where streamed shards' weights come from on this device (``config.pack``,
        ``config.verify``, ``config.cache_dir`` apply).

        Raises:
            ConfigError: ``pack=True`` where packing cannot run.
        """

    def fallback_source(self, folder: Path, manifest: Manifest, config: LoadConfig) -> WeightSource | None:
        """The source to retry with when :meth:`weight_source`'s could not be built (packing
        failed), or None."""
        return None

    # -- the shared activation arena -------------------------------------------------------------

    _arena_lock: ClassVar[threading.Lock] = threading.Lock()
    _arena: ClassVar[bool | None]

    def _shared_arena(self) -> bool:
        """Register one activation arena for this device in ONNX Runtime's environment, once per
        process. False where this onnxruntime cannot (the sessions then keep their own)."""
        cls = type(self)
        with Backend._arena_lock:
            if getattr(cls, "_arena", None) is None:
                cfg = ort.OrtArenaCfg({"arena_extend_strategy": 1})  # grow by what is asked, not powers of two
                try:
                    self._register_arena(cfg)
                    cls._arena = True
                except Exception as e:  # an older or differently built onnxruntime
                    log.warning("slimml: each session keeps its own %s arena: one shared arena could not be registered "
                                "(%s)", self.name, first_line(e))
                    cls._arena = False
            return cls._arena

    @abstractmethod
    def _register_arena(self, cfg: ort.OrtArenaCfg) -> None:
        """Register ``cfg`` as this device's shared arena (raises where onnxruntime cannot)."""

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name!r}>"


def first_line(e: BaseException) -> str:
    """An exception's first line, without the build paths ONNX Runtime's messages carry
    (``/onnxruntime_src/onnxruntime/core/...h:583 void onnxruntime::...(...)``)."""
    text = str(e).strip()
    line = text.splitlines()[0] if text else type(e).__name__
    return _BUILD_PLACE.sub("", line)


# where in its sources ONNX Runtime raised (its build path, line, and the C++ function's signature)
_BUILD_PLACE = re.compile(r"/\S*onnxruntime_src/\S+:\d+ (?:[\w:<>,*& ]+\([^()]*\)(?: const)? )?")
