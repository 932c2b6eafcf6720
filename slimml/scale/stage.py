"""One pipeline stage: a contiguous group of shards, run by the slimml runtime inside a Ray actor.

The class is plain Python; :mod:`slimml.scale.segment` makes it an actor. A stage loads its
shards with ``load(artifact, shards=(first, last))``: it hashes its own files (and only them),
merges them into one session, or streams them when given a memory budget.
"""

from __future__ import annotations

import os
import time
from typing import Any

import numpy as np

from slimml.errors import SlimmlError


class Stage:
    """Runs shards ``first..last`` on each microbatch and hands on what later stages read.

    Args:
        artifact: the artifact folder, at the same path on every node.
        index: the stage's number (for messages).
        first, last: its shards, inclusive.
        hands_on: activations later stages read that exist once this stage has run (its own
            outputs, or earlier ones it passes through).
        returns: model outputs its shards produce.
        load_options: keyword arguments for :func:`slimml.runtime.load` (``memory_budget``, ...).
    """

    def __init__(self, artifact: str, index: int, first: int, last: int, hands_on: list[str], returns: list[str],
                 load_options: dict[str, Any]):
        from slimml.runtime import load

        self.index, self.first, self.last = index, first, last
        self.hands_on, self.returns = hands_on, returns
        self.threads = load_options.pop("threads", None) or _assigned_cpus()
        self.busy_s = 0.0
        self.calls = 0
        self.failed: SlimmlError | None = None
        try:
            self.model = load(artifact, shards=(first, last), threads=self.threads, **load_options)
        except SlimmlError as e:  # kept, not raised: Ray would hand the caller only a string of it
            self.failed = e
            return
        self.model.allow_nonfinite = True  # activations may hold -inf (attention masks); the driver checked the inputs
        self.takes = [t.name for t in self.model.inputs]

    def info(self) -> dict[str, Any]:
        """Where the stage runs and what it loaded; raises the stage's load error, if any."""
        import ray

        if self.failed is not None:
            raise self.failed

        return {"stage": self.index, "shards": [self.first, self.last], "node": ray.get_runtime_context().get_node_id(),
                "pid": os.getpid(), "threads": self.threads, "plan": self.model.plan.describe()}

    def run(self, inputs: dict[str, np.ndarray], upstream: dict[str, np.ndarray] | None
            ) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
        """One microbatch: model ``inputs`` and the previous stage's hand-on -> (hand-on, outputs)."""
        if self.failed is not None:
            raise self.failed  # a restarted stage whose files no longer verify
        t0 = time.perf_counter()
        got = {**inputs, **(upstream or {})}
        out = self.model.run({name: got[name] for name in self.takes})
        handed = {name: out[name] if name in out else got[name] for name in self.hands_on}
        returned = {name: out[name] for name in self.returns}
        self.busy_s += time.perf_counter() - t0
        self.calls += 1
        return handed, returned

    def stats(self, reset: bool = False) -> dict[str, float]:
        """Seconds spent computing and microbatches run since start (or the last reset)."""
        got = {"stage": self.index, "busy_s": self.busy_s, "calls": self.calls}
        if reset:
            self.busy_s, self.calls = 0.0, 0
        return got

    def check_files(self, deep: bool = False) -> None:
        """Raise IntegrityError if the stage's files changed (``deep``: re-hash them)."""
        if self.failed is not None:
            raise self.failed
        self.model.verify() if deep else self.model.check_files()


def _assigned_cpus() -> int | None:
    """The CPUs Ray gave this actor: ONNX Runtime ignores OMP_NUM_THREADS, so they become its threads."""
    import ray

    if not ray.is_initialized():  # not inside Ray: ORT's default
        return None
    cpus = ray.get_runtime_context().get_assigned_resources().get("CPU")
    return max(1, int(cpus)) if cpus else None
