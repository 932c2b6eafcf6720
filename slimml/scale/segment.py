"""Pipeline stages as a kind of plan segment: shards run by Ray actors, activations as ObjectRefs.

A :class:`RayStages` segment sits in an :class:`~slimml.runtime.engine.plan.ExecutionPlan` like a resident
or streamed one, so the model that holds it has the whole ``Model`` API (``run``, ``encode``,
``generate``). Its ``run`` cuts the batch into microbatches and submits every microbatch to every
stage at once: stage ``k`` takes microbatch ``m`` while stage ``k+1`` takes ``m-1``, so the stages
overlap. A stage's output reaches the next stage as an ObjectRef (through the shared-memory
object store on one node, copied once between nodes); only model outputs come back to the caller.
"""

from __future__ import annotations

import time
from itertools import pairwise
from typing import Any

import numpy as np

from slimml.errors import SlimmlError, StageError

PROBE_S = 3.0  # how long calls to a stage that died must keep failing at once before it counts as dead for good


class RayStages:
    """Stage actors that own consecutive shard groups, in order: a plan segment
    (:class:`slimml.runtime.engine.contracts.Segment`) whose files its stages own and check.

    Args:
        actors: one Ray actor handle per stage (:class:`slimml.scale.stage.Stage`).
        groups: each stage's ``(first, last)`` shards.
        nodes: each stage's node id and address, for messages and ``describe``.
        takes: model inputs the stages read (sent once per microbatch, shared by all stages).
        microbatch: microbatches per call (cut along the batch axis) when the batch allows.
        splittable: whether every model input and output has a batch axis first.
        timeout_s: how long a call waits for its outputs before it gives up.
        max_restarts: how often Ray restarts a stage that died (for the error message).
    """

    kind = "ray stages"

    def __init__(self, actors: list, groups: list[tuple[int, int]], nodes: list[str], takes: list[str],
                 microbatch: int, splittable: bool, timeout_s: float, max_restarts: int,
                 placement_group: Any = None, owns_ray: bool = False):
        self.actors = actors
        self.groups = groups
        self.nodes = nodes
        self.takes = takes
        self.microbatch = microbatch
        self.splittable = splittable
        self.timeout_s = timeout_s
        self.max_restarts = max_restarts
        self.shards = [i for first, last in groups for i in range(first, last + 1)]
        self._pg = placement_group
        self._owns_ray = owns_ray

    @property
    def sessions(self) -> int:
        return len(self.actors)

    def run(self, env: dict[str, Any], streamer: Any = None) -> None:
        """Run every microbatch through every stage; the model outputs land in ``env``."""
        import ray

        parts = self._split(env)
        pending = []
        for part in parts:  # submit everything first: the stages overlap on different microbatches
            inputs = ray.put({name: part[name] for name in self.takes if name in part})
            upstream, outs = None, []
            for actor in self.actors:
                upstream, out = actor.run.options(num_returns=2).remote(inputs, upstream)
                outs.append(out)
            pending.append(outs)
        deadline = time.monotonic() + self.timeout_s
        try:
            got = [self._collect(outs, deadline) for outs in pending]
        except BaseException:  # a stage timed out or failed: its work still queued would hold the next call
            for ref in (r for outs in pending for r in outs):
                try:
                    ray.cancel(ref, force=False)
                except Exception:  # noqa: BLE001 -- done already, or its stage gone: nothing to cancel
                    pass
            raise
        for name in got[0]:
            env[name] = got[0][name] if len(got) == 1 else np.concatenate([g[name] for g in got], axis=0)

    def _split(self, env: dict[str, Any]) -> list[dict[str, Any]]:
        batch = len(next(iter(env.values()))) if env else 0
        m = min(self.microbatch, batch) if self.splittable else 1
        if m <= 1:
            return [env]
        cuts = np.linspace(0, batch, m + 1).astype(int)
        return [{k: v[a:b] for k, v in env.items()} for a, b in pairwise(cuts)]

    def _collect(self, outs: list, deadline: float) -> dict[str, np.ndarray]:
        merged: dict[str, np.ndarray] = {}
        for k, ref in enumerate(outs):  # in stage order: a dead stage is named before those waiting on it
            merged.update(self._get(k, ref, deadline))
        return merged

    def _get(self, k: int, ref, deadline: float):
        """Stage ``k``'s result, or its failure as one slimml error that names the stage."""
        import ray
        from ray import exceptions as rx

        try:
            return ray.get(ref, timeout=max(deadline - time.monotonic(), 0.0))
        except rx.GetTimeoutError:
            raise StageError(
                f"{self._name(k)} did not answer within {self.timeout_s:g}s; check the node with `ray status`, "
                "or raise timeout_s for very large batches."
            ) from None
        except rx.RayTaskError as e:
            if isinstance(e.cause, SlimmlError):
                raise e.cause from None  # a bad feed or a changed file: the stage's own clear message
            raise StageError(f"{self._name(k)} failed ({type(e.cause).__name__}: {e.cause}); the stage's log in Ray's "
                             "session folder has the traceback: retry the call, or report it if it fails again.") from None
        except rx.TaskCancelledError:  # the call was cancelled (its request's client went away): nothing to report
            raise StageError(f"{self._name(k)}'s call was cancelled (its request was abandoned); retry it.") from None
        except (rx.RayActorError, rx.ObjectLostError) as e:
            if self._gone_for_good(k):
                raise StageError(
                    f"{self._name(k)} died ({type(e).__name__}) and will not come back: Ray restarts a stage "
                    f"at most {self.max_restarts} time(s) (max_restarts), or it was killed for good. Check the "
                    "node with `ray status`, then close this pipeline and create it again."
                ) from None
            raise StageError(
                f"{self._name(k)} died ({type(e).__name__}); this call's outputs are lost. Ray restarts a "
                f"stage up to {self.max_restarts} time(s), loading and verifying its shards again; calls "
                "are not retried for you: retry once the stage is back (inference has no side effects)."
            ) from None

    def _gone_for_good(self, k: int) -> bool:
        """Whether stage ``k``'s actor is dead for good (its restarts spent, or killed without one):
        calls to it keep failing at once for :data:`PROBE_S`, where one to a restarting actor waits
        for it (right after a death, before Ray knows of the restart, a call may fail at once too)."""
        import ray
        from ray import exceptions as rx

        end = time.monotonic() + PROBE_S
        while (left := end - time.monotonic()) > 0:
            try:
                ray.get(self.actors[k].stats.remote(False), timeout=max(left, 0.1))
                return False  # back already
            except rx.RayActorError:
                time.sleep(0.2)
            except Exception:  # noqa: BLE001 -- waiting on its restart (a timeout), or anything else: it may come back
                return False
        return True

    def _name(self, k: int) -> str:
        first, last = self.groups[k]
        return f"pipeline stage {k} (shards {first}-{last}, node {self.nodes[k]})"

    def describe(self) -> str:
        lines = [f"{_span(self.groups[0][0], self.groups[-1][1])}: {len(self.actors)} Ray stage(s), "
                 f"{self.microbatch} microbatch(es) in flight"]
        lines += [f"    stage {k}: shards {a}-{b} on node {self.nodes[k]}" for k, (a, b) in enumerate(self.groups)]
        return "\n".join(lines)

    def stage_stats(self, reset: bool = False) -> list[dict[str, float]]:
        """Per stage: seconds spent computing (``busy_s``) and microbatches run (``calls``)."""
        deadline = time.monotonic() + self.timeout_s
        return [self._get(k, a.stats.remote(reset), deadline) for k, a in enumerate(self.actors)]

    def stage_info(self, timeout_s: float | None = None) -> list[dict[str, Any]]:
        """Per stage: node id, pid, threads and the stage's own execution plan (``timeout_s``: how
        long to wait, default the call timeout; the first call waits for the stages to load)."""
        deadline = time.monotonic() + (self.timeout_s if timeout_s is None else timeout_s)
        return [self._get(k, a.info.remote(), deadline) for k, a in enumerate(self.actors)]

    def check_files(self, deep: bool = False) -> None:
        """Each stage checks its own files (``deep``: re-hashes them); a changed one raises IntegrityError."""
        deadline = time.monotonic() + self.timeout_s
        for k, ref in enumerate([a.check_files.remote(deep) for a in self.actors]):
            self._get(k, ref, deadline)

    def close(self) -> None:
        """Stop the stage actors (and Ray, if the pipeline started it)."""
        release(self.actors, self._pg, self._owns_ray)
        self.actors, self._pg = [], None


def release(actors: list, placement_group: Any, owns_ray: bool) -> None:
    """Stop the stage actors, free their placement group, and stop Ray if slimml started it and this
    was its last user."""
    import ray

    from slimml.scale.cluster import release_ray

    if not ray.is_initialized():
        return
    for a in actors:
        ray.kill(a, no_restart=True)
    if placement_group is not None:
        from ray.util.placement_group import remove_placement_group

        remove_placement_group(placement_group)
    if owns_ray and release_ray():  # the last pipeline on the Ray this process started
        ray.shutdown()


def _span(first: int, last: int) -> str:
    return f"shard {first}" if first == last else f"shards {first}-{last}"
