"""``pipeline``: an artifact's shards spread over Ray actors, behind the ``Model`` API."""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any

from slimml.errors import ConfigError, StageError
from slimml.runtime.artifact.files import verify_driver_files
from slimml.runtime.artifact.manifest import Manifest, check_same_manifest, read_manifest
from slimml.runtime.engine.budget import plan_stream
from slimml.runtime.engine.config import LoadConfig
from slimml.runtime.engine.engine import Engine
from slimml.runtime.engine.kv_cache import cache_in_place
from slimml.runtime.engine.plan import ExecutionPlan
from slimml.runtime.tasks.base import Task
from slimml.runtime.tasks.registry import build_task
from slimml.scale.balance import compute_sizes, split_stages
from slimml.scale.cluster import connect, nodes_with_cpus, require_ray
from slimml.scale.segment import RayStages, release

LOAD_TIMEOUT_S = 600.0  # the first call waits this long (or timeout_s, if longer) for the stages to load their shards


def check_stageable(folder: Path, manifest: Manifest) -> None:
    """Refuse, before Ray starts, an artifact that pipeline stages cannot split: one of components
    (an encoder-decoder, CLIP), or a language model whose KV cache lives in place beside each layer.

    Raises:
        ConfigError: naming what to do instead.
    """
    if manifest.components:
        raise ConfigError(
            f"pipeline stages split one chain of shards, but {folder} has components {', '.join(manifest.components)}; "
            "run it whole with slimml.runtime.load, or serve it with replicas (slimml serve --replicas N)."
        )
    if cache_in_place(manifest):
        raise ConfigError(
            f"{folder} is a language model whose KV cache lives in place beside each layer (the fused graph), which "
            "pipeline stages do not keep; serve it whole (slimml serve ART, --replicas N for more copies, "
            "--memory-budget to stream it within a budget), or load it with slimml.runtime.load."
        )


def pipeline(
    artifact: str | os.PathLike,
    stages: int = 2,
    address: str | None = None,
    microbatch: int = 4,
    *,
    balance: str = "bytes",
    cpus_per_stage: float | None = None,
    timeout_s: float = 300.0,
    max_restarts: int = 1,
    verify: bool = True,
    **load_options: Any,
) -> Task:
    """Load ``artifact`` as ``stages`` Ray actors that each own a contiguous group of shards.

    Each stage verifies its shards' hashes and runs them with the slimml runtime (merged into
    one session, or streamed within the stage when ``memory_budget``/``resident`` ask for it).
    Activations travel between stages as ObjectRefs and several microbatches are in flight, so
    the stages overlap. When the cluster has at least ``stages`` nodes with CPUs, the stages are
    placed on distinct nodes (a ``STRICT_SPREAD`` placement group); on one machine they share it.

    The artifact must be at the same path on every node (a shared or copied folder): each stage
    reads its own shards there, and this process reads the manifest and tokenizer.

    Args:
        artifact: the artifact folder.
        stages: S, the number of stages.
        address: the Ray cluster to join (``"auto"`` for one started with ``ray start``); None
            joins the Ray already initialised in this process, or starts a local one.
        microbatch: M, microbatches a call is cut into along the batch axis (when the batch has
            at least M rows and every input and output is batch-first).
        balance: ``"bytes"`` (groups of equal weight bytes), ``"memory"`` (bytes in proportion
            to each stage's node memory) or ``"compute"`` (equal matrix-product weights: the
            best throughput when an embedding table holds much of the bytes but little work).
        cpus_per_stage: CPUs Ray reserves for each stage, which become its ONNX Runtime threads
            (default: a node's CPUs when stages get nodes of their own, else the CPUs / S).
        timeout_s: how long a call waits for its outputs before raising StageError (its work still
            queued on the stages is cancelled); loading waits up to ``LOAD_TIMEOUT_S`` (600 s) or this.
        max_restarts: how often Ray restarts a stage process that died. A call in flight when
            a stage dies raises StageError naming the stage; it is not retried for you.
        verify: stages hash their files at load (default).
        **load_options: passed to each stage's :func:`slimml.runtime.load` (``memory_budget``,
            ``resident``, ``pack``, ``cache_dir``, ``threads``).

    Returns:
        The artifact's task (:class:`~slimml.runtime.Task`, chosen as ``load`` chooses it) over an
        engine whose plan is one ``RayStages`` segment; ``close()`` stops the actors (and Ray, if
        slimml started it and no other pipeline of this process still uses it).

    Raises:
        ConfigError: Ray is not installed (the ``serve`` extra), an option out of range, more
            stages than shards, or an artifact stages cannot split (components, or a language
            model whose KV cache lives beside each layer: load it whole instead).
        ArtifactError / IntegrityError: a missing, malformed or tampered artifact (a stage's own
            load error is raised as the stage raised it).
        StageError: Ray could not reserve the stages' CPUs within 60 s, or a stage's process died
            as it started.

    Example:
        >>> from slimml.scale import pipeline
        >>> model = pipeline("artifacts/all-MiniLM-L6-v2", stages=2)
        >>> model.encode(["A man is playing a guitar."]).shape
        (1, 384)
    """
    folder = Path(artifact).resolve()
    manifest = read_manifest(folder)
    check_same_manifest(folder, manifest, load_options.pop("manifest_sha256", None))
    load_options["manifest_sha256"] = manifest.sha256  # every stage must hold the manifest read here
    check_stageable(folder, manifest)
    if balance not in ("bytes", "memory", "compute"):
        raise ConfigError(f"balance must be 'bytes', 'memory' or 'compute', got {balance!r}.")
    if not isinstance(microbatch, int) or isinstance(microbatch, bool) or microbatch < 1:
        raise ConfigError(f"microbatch must be a whole number >= 1, got {microbatch!r}.")
    split_stages([s.weight_bytes for s in manifest.shards], stages)  # a bad S fails before Ray starts
    if cpus_per_stage is not None and (isinstance(cpus_per_stage, bool) or not isinstance(cpus_per_stage, (int, float))
                                       or not 0 < cpus_per_stage < float("inf")):
        # before any placement group: Ray's raylet died removing one of negative CPUs
        raise ConfigError(f"cpus_per_stage must be a number > 0 (CPUs each stage reserves; fractions share a core), "
                          f"got {cpus_per_stage!r}.")
    if not isinstance(timeout_s, (int, float)) or isinstance(timeout_s, bool) or not 0 < timeout_s < float("inf"):
        raise ConfigError(f"timeout_s must be a number of seconds > 0, got {timeout_s!r}.")
    if verify:  # this process reads the tokenizer; the stages hash their own shards
        verify_driver_files(folder, manifest)

    require_ray()
    import ray
    from ray.util.placement_group import placement_group, placement_group_table
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    from slimml.scale.stage import Stage

    owns_ray = connect(address)
    pg = None
    actors: list = []
    try:
        nodes = nodes_with_cpus()
        spread = stages > 1 and len(nodes) >= stages
        if cpus_per_stage is None:  # a node's CPUs each, or the CPUs / S (a share of a core where S is more)
            cpus_per_stage = max(int(min(n["cpus"] for n in nodes)), 1) if spread else _shared_cpus(nodes, stages)
        pg = placement_group([{"CPU": cpus_per_stage}] * stages, strategy="STRICT_SPREAD" if spread else "PACK")
        if not pg.wait(timeout_seconds=60):
            raise StageError(
                f"Ray could not reserve {stages} x {cpus_per_stage:g} CPU(s) for the stages within 60 s "
                f"(nodes: {[(n['id'][:8], n['cpus']) for n in nodes]}); lower --stages or cpus_per_stage, "
                "or add nodes."
            )
        bundle_nodes = placement_group_table(pg)["bundles_to_node_id"]
        by_id = {n["id"]: n for n in nodes}
        placed = [by_id.get(bundle_nodes[k], {"id": bundle_nodes[k], "address": "?", "memory": 1}) for k in range(stages)]
        caps = [max(p["memory"], 1) for p in placed] if balance == "memory" else None
        sizes = compute_sizes(folder, manifest) if balance == "compute" else [s.weight_bytes for s in manifest.shards]
        groups = split_stages(sizes, stages, caps)
        hands_on, returns = _traffic(manifest, groups)
        actor_class = ray.remote(Stage)
        for k, (first, last) in enumerate(groups):
            actors.append(actor_class.options(
                num_cpus=cpus_per_stage, max_restarts=max_restarts, max_task_retries=0,
                # Stage.run keeps nothing between calls; in order, a call cancelled before it reached the actor (a
                # client that went away: Serve cancels the calls its request made) left a gap that held every later
                # call (and /health's) for Ray's 30 s wait, then failed them all
                allow_out_of_order_execution=True,
                scheduling_strategy=PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=k),
            ).remote(str(folder), k, first, last, hands_on[k], returns[k], {"verify": verify, **load_options}))
        names = [f"{p['id'][:8]} ({p['address']})" for p in placed]
        segment = RayStages(actors, groups, names, [t.name for t in manifest.inputs], microbatch,
                            _batch_first(manifest), timeout_s, max_restarts, pg, owns_ray)
        segment.stage_info(max(timeout_s, LOAD_TIMEOUT_S))  # waits for every stage to load; its errors surface here
        memory = plan_stream(manifest)
        engine = Engine(folder, manifest, LoadConfig(verify=verify), memory, plan=ExecutionPlan(memory, "cpu", [segment], None))
        return build_task(folder, manifest, {None: engine})  # the same task load() would give
    except BaseException as e:
        release(actors, pg, owns_ray)
        if isinstance(e, ray.exceptions.RayActorError):
            raise StageError(f"a pipeline stage failed to start ({str(e).splitlines()[0] if str(e) else type(e).__name__}); "
                             "check the node with `ray status` and the stage's log in Ray's session folder, then start "
                             "again (fewer stages, or more memory a node).") from None
        raise


def _shared_cpus(nodes: list[dict], stages: int) -> float:
    """The most CPUs each of ``stages`` stages can reserve when they share the nodes: whole CPUs where
    there are enough, else a share of a core, such that the nodes hold every stage's bundle (a bundle
    never spans nodes: 3 stages on two 1-CPU nodes get half a CPU each, not two thirds)."""
    cpus = [float(n["cpus"]) for n in nodes]
    whole = int(sum(cpus) // stages)
    if whole >= 1 and sum(int(c // whole) for c in cpus) >= stages:
        return whole
    fits = [c / k for c in cpus for k in range(1, stages + 1)
            if sum(int(x / (c / k) + 1e-9) for x in cpus) >= stages]
    return math.floor(max(fits) * 1e4) / 1e4 if fits else 1  # Ray counts 1e-4 CPUs; 1: its error names the shortfall


def _traffic(manifest, groups: list[tuple[int, int]]) -> tuple[list[list[str]], list[list[str]]]:
    """Per stage: the activations it must hand on (read after it, made at or before it) and the
    model outputs its shards make."""
    model_outputs = {t.name for t in manifest.outputs}
    hands_on, returns = [], []
    for first, last in groups:
        later = {t.name for s in manifest.shards[last + 1:] for t in s.inputs
                 if isinstance(t.source, int) and t.source <= last}
        made = [t.name for s in manifest.shards[first:last + 1] for t in s.outputs]
        hands_on.append(sorted(later))
        returns.append([n for n in made if n in model_outputs])
    return hands_on, returns


def _batch_first(manifest) -> bool:
    """Whether every model input and output has a dynamic first axis (so microbatches can be cut)."""
    return all(t.shape and not isinstance(t.shape[0], int) for t in [*manifest.inputs, *manifest.outputs])
