"""The engine: one chain of shards, loaded into an execution plan, feeds in and outputs out.

It knows no task. Users call :meth:`Engine.run`, which checks every feed against the manifest
(names, dtypes, shapes, token-id range, NaN) and refuses files changed since load. Tasks that
built their own feeds, such as a decode loop handing the cache the engine itself produced back
to it, call :meth:`Engine.run_trusted`, which skips the feed checks but not the file watch, and
can leave outputs it will feed back on the device (``keep_on_device``: a KV cache stays in GPU
memory on CUDA between tokens).
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Collection, Mapping
from pathlib import Path
from typing import Any

import numpy as np

from slimml.errors import SlimmlError
from slimml.runtime.artifact.files import verify_driver_files, verify_files
from slimml.runtime.artifact.integrity import check_shard_file, id_limits, max_sequence_length
from slimml.runtime.artifact.manifest import Manifest, check_manifest_unchanged
from slimml.runtime.artifact.watch import FileWatch
from slimml.runtime.engine.backends import backend_for
from slimml.runtime.engine.backends.base import env_threads
from slimml.runtime.engine.budget import StreamPlan, plan_stream
from slimml.runtime.engine.config import LoadConfig
from slimml.runtime.engine.feeds import FeedChecker
from slimml.runtime.engine.plan import ExecutionPlan, build_plan


class Engine:
    """A loaded chain of shards: ``run(feeds)`` walks its execution plan.

    ``run`` is safe to call from several threads at once: each call keeps its own activations
    and ONNX Runtime sessions accept concurrent ``run`` calls.

    Args:
        folder, manifest: the artifact (its files already hashed, where ``config.verify``).
        config: how to run it (:class:`~slimml.runtime.engine.config.LoadConfig`; default: its defaults).
        memory: the memory plan (:func:`~slimml.runtime.engine.budget.plan_stream`; default: all resident).
        plan: a plan built elsewhere (pipeline stages), run instead of building one.
    """

    def __init__(self, folder: Path, manifest: Manifest, config: LoadConfig | None = None,
                 memory: StreamPlan | None = None, plan: ExecutionPlan | None = None):
        self.folder = folder
        self.manifest = manifest
        self.config = config = config or LoadConfig()
        self.backend = plan.backend if plan is not None else backend_for(config.device)
        self.device: str = self.backend.name  # the device's public name, as load(device=...) takes it
        self.threads = config.threads or env_threads() or None  # load(threads=), else SLIMML_THREADS (None: ORT's choice)
        self._lanes: dict[int, ExecutionPlan] = {}  # single-threaded copies of the plan (encode's lanes)
        self._lanes_lock = threading.Lock()
        # files changed after load are refused, not run; a plan built elsewhere (pipeline stages)
        # watches the files its segments own
        memory = memory or plan_stream(manifest)
        self._watch = FileWatch(folder, manifest, follow_paths=memory.streaming) if plan is None else None
        self._check_watch = self._watch.check if self._watch is not None else _nothing
        facts = [check_shard_file(folder, s) for s in manifest.shards]  # external data stays inside
        self.max_sequence_length: int | None = max_sequence_length(facts, manifest)
        limits = id_limits(facts)  # ids outside the table they index raise FeedError
        self.vocab_size: int | None = limits.get("input_ids")
        self.allow_nonfinite = False  # NaN/inf in float inputs raise FeedError unless set
        self._check = FeedChecker(manifest.inputs, self.max_sequence_length, limits)
        self.plan: ExecutionPlan = plan or build_plan(folder, manifest, memory, config,
                                                      self.backend)
        self._outputs = [t.name for t in manifest.outputs]

    @property
    def inputs(self):
        return self.manifest.inputs

    @property
    def outputs(self):
        return self.manifest.outputs

    @property
    def owns_files(self) -> bool:
        """True when this engine loaded (and watches) its files itself; False for a plan of
        pipeline stages, whose stages watch their own."""
        return self._watch is not None

    def run(self, feeds: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Run the whole chain on ``feeds`` (input name -> array); return its outputs by name.

        Raises:
            FeedError: names, dtypes or shapes that do not fit the manifest's inputs, or values
                ONNX Runtime rejects (say, a sequence longer than the model allows).
        """
        self._check_watch()
        env = self._check(feeds, self.allow_nonfinite)
        return self.plan.run(env, self._outputs)

    def run_trusted(self, feeds: dict[str, Any], outputs: list[str] | None = None,
                    keep_on_device: Collection[str] = ()) -> dict[str, Any]:
        """``run`` for feeds a task built itself (right names, dtypes and shapes; a cache this
        engine produced): no feed checks, the file watch still applies. ``feeds`` may be
        updated in place.

        Args:
            feeds: input name -> host array, or a device value an earlier call kept.
            outputs: the outputs wanted (default: all the model's).
            keep_on_device: outputs the caller will feed back (a KV cache): on a device backend
                (CUDA) they come back as device values (OrtValues), which the next call binds
                where they sit, with no copy through the host; elsewhere as host arrays.

        Example:
            >>> out = engine.run_trusted(feeds, keep_on_device=present_names)  # decode loop
            >>> feeds.update({past: out[present] for past, present in zip(past_names, present_names)})
        """
        self._check_watch()
        return self.plan.run(feeds, outputs or self._outputs, keep_on_device)

    def to_host(self, value: Any) -> np.ndarray:
        """A value ``run_trusted(keep_on_device=...)`` returned, as a host array."""
        return self.backend.to_host(value)

    def kv_cache(self, batch: int, capacity: int):
        """A decoder's cache for one generation, in buffers bound in place (``engine.kv_cache``).

        Args:
            batch: rows of the generation.
            capacity: positions the cache holds (prompt + new tokens); a pass beyond it is refused.

        Returns:
            A :class:`~slimml.runtime.engine.kv_cache.KVCache` whose ``step(input_ids,
            attention_mask)`` runs one pass and returns the logits; ``None`` when the artifact's
            attention cannot share past and present (not converted with ``--exporter fused``):
            feed ``past_key_values.*`` through :meth:`run_trusted` then.

        Raises:
            FeedError: ``capacity`` past the model's positions.
        """
        from slimml.runtime.engine.kv_cache import KVCache, shares_buffers

        return KVCache(self, batch, capacity) if shares_buffers(self) else None

    def verify(self) -> None:
        """Re-hash every file of the artifact against the manifest, as ``load`` did.

        Use it in a health check of a long-running service: a shard corrupted or replaced on disk
        after load raises, and ``run`` refuses to go on until the artifact is loaded again.

        Raises:
            IntegrityError: naming the file that no longer matches.
        """
        if self._watch is not None:
            self._watch.check()
            check_manifest_unchanged(self.folder, self.manifest)
            verify_files(self.folder, self.manifest)
        else:  # a plan of pipeline stages: the stages re-hash their shards; this process, the rest it reads
            check_manifest_unchanged(self.folder, self.manifest)
            verify_driver_files(self.folder, self.manifest)
        self.plan.check_files(deep=True)

    def check_files(self) -> None:
        """The cheap check ``run`` does before every call: has any weight file changed since load
        (:mod:`slimml.runtime.artifact.watch`)? For a readiness probe; :meth:`verify` re-hashes.

        Raises:
            IntegrityError: naming a file replaced, truncated or removed since load.
        """
        self._check_watch()
        self.plan.check_files(deep=False)

    @property
    def replaced(self) -> bool:
        """Whether the files at the artifact's paths are no longer the ones loaded (renamed over, or
        the folder swapped for another): a new load from that path would read another artifact."""
        watch = self._watch
        return watch is not None and not watch.at_paths()

    @property
    def stats(self):
        """Streaming counters (:class:`slimml.runtime.engine.stream.StreamStats`): passes, bytes
        loaded, time waiting on loads and computing. All zero for a fully resident model."""
        return self.plan.stats

    def lane(self, threads: int):
        """``run`` on a copy of the plan with ``threads`` intra-op threads, made once (from files
        hashed again first: graphs are read from disk to make it)."""
        self._check_watch()  # a closed engine makes no new sessions
        with self._lanes_lock:
            plan = self._lanes.get(threads)
            if plan is None:
                watch = self._watch
                before = watch.snapshot() if watch is not None else None
                if watch is not None and not watch.at_paths():
                    return self.run  # its folder was swapped for another since load: no new sessions from that one
                verify_files(self.folder, self.manifest)
                config = dataclasses.replace(self.config, threads=threads)
                plan = build_plan(self.folder, self.manifest, self.plan.memory, config, self.backend)
                if watch is not None and watch.snapshot() != before:  # swapped while hashed or read: not what was hashed
                    plan.close()
                    return self.run
                self._lanes[threads] = plan

        def run(feeds: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
            self._check_watch()
            return plan.run(self._check(feeds, self.allow_nonfinite), self._outputs)

        return run

    def close(self) -> None:
        """Stop the shard loader thread (if streaming) and drop every session; a later call is
        refused in one line."""
        self._check_watch = _closed  # every way in (run, run_trusted, a lane, a KV-cache pass) asks first
        self.plan.close()
        if self._watch is not None:
            self._watch.close()
        with self._lanes_lock:
            for plan in self._lanes.values():
                plan.close()
            self._lanes.clear()


def _nothing() -> None:
    pass


def _closed() -> None:
    raise SlimmlError("the model was closed; load it again to run it.")
