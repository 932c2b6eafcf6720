"""``load``: an artifact folder in, its task out, over one engine per chain of shards."""

from __future__ import annotations

import dataclasses
import logging
import os
from pathlib import Path
from typing import Any

from slimml.errors import ConfigError, SlimmlError
from slimml.runtime.artifact.files import check_unchanged, verify_files
from slimml.runtime.artifact.manifest import check_same_manifest, read_manifest
from slimml.runtime.engine.backends import backend_for
from slimml.runtime.engine.budget import auto_budget, fmt_bytes, plan_stream, resident_need, split_budget
from slimml.runtime.engine.config import LoadConfig
from slimml.runtime.engine.engine import Engine
from slimml.runtime.tasks.base import Task
from slimml.runtime.tasks.registry import build_task

log = logging.getLogger("slimml")

Model = Task  # the name a loaded artifact had before tasks were classes of their own


def load(path: str | os.PathLike, config: LoadConfig | None = None, **overrides: Any) -> Task:
    """Load an artifact folder written by ``slimml convert``.

    Args:
        path: the artifact folder (it holds ``manifest.json``).
        config: how to load and run it (:class:`~slimml.runtime.engine.config.LoadConfig`;
            default: all shards resident on CPU where they fit its free memory, every file hashed first).
        **overrides: any of LoadConfig's fields by name, applied over ``config``:

            - ``device``: ``"cpu"``, ``"cuda"``, or ``"auto"`` (CUDA where onnxruntime-gpu finds a
              working GPU, else CPU; ``model.device`` says which).
            - ``threads``: ONNX Runtime intra-op threads (default: ORT's choice, or ``SLIMML_THREADS``).
            - ``verify``: check every file's size and sha256 against the manifest first (default). A
              file that does not match is refused, never run; a streamed shard whose file changes
              after that is hashed again when it streams in.
            - ``resident``: K, the most shards loaded at once (pinned ones included). Fewer than the
              shard count streams the model: a background thread loads shards ahead and the run
              releases each one after use. Default: all shards (fully resident) where the model
              fits the host's free memory with a tenth to spare; one over 32 MB that needs more
              (MemAvailable, or what a memory cgroup leaves) streams within 60% of it, with one
              warning line, rather than be killed by the kernel as it loads (CPU; on CUDA it is
              loaded whole unless told otherwise).
            - ``prefetch``: P, shards loaded ahead of the one computing (default: K - pinned - 1).
            - ``memory_budget``: bytes of loaded shards allowed, e.g. ``"4GB"``; alone it picks K and
              P (``model.plan.describe()`` says what it chose). Refused, before anything loads,
              when smaller than the largest shard.
            - ``pin``: shard indices kept loaded for the model's lifetime, e.g. ``[0, -1]`` for the
              embeddings and the head; only the others stream.
            - ``pack``: how streamed shards get their weights on CPU. None (default): ONNX Runtime's
              pre-packed weights, written once to ``cache_dir`` and paged in per pass (Linux), else
              weights fed as inputs. False: always fed (no cache; slower decoding).
            - ``cache_dir``: where pre-packed weights are kept (default ``SLIMML_CACHE_DIR``,
              ``$XDG_CACHE_HOME/slimml`` or ``~/.cache/slimml``; none without a home folder: weights
              fed); about twice the streamed shards' size on disk.
            - ``shards``: ``(first, last)``, load only those shards (inclusive), as one stage of a
              pipeline (:mod:`slimml.scale`): the model's inputs are then what they read from
              outside (model inputs and earlier activations) and its outputs what they hand on.
              Only their files are hashed; ``resident``, ``memory_budget`` and ``pin`` apply
              within the stage.
            - ``manifest_sha256``: refuse the artifact unless its ``manifest.json`` has this sha256:
              pin an artifact that came from elsewhere (no hash vouches for the manifest itself), as
              a pipeline stage or a server replica checks it holds what the driver read.

    Returns:
        The artifact's task (:mod:`slimml.runtime.tasks.registry` picks its class once, from the
        manifest): ``run(feeds)`` always, and what the task is for: ``encode(texts)`` for a
        sentence-embedding artifact, ``classify``, ``embed_images``, ``generate``, ...;
        ``task.supports(name)`` says which. A method the task lacks raises ``TaskError``.

    Raises:
        ConfigError: an unknown option (the message lists the valid ones) or a value out of range.
        ArtifactError / IntegrityError: a missing, malformed or tampered artifact.
        DeviceError: the device is unknown or not available.

    Example:
        >>> from slimml.runtime import LoadConfig, load
        >>> model = load("artifacts/all-MiniLM-L6-v2", device="cpu")
        >>> emb = model.encode(["Hello world"])
        >>> streamed = load("artifacts/llama", LoadConfig(memory_budget="2GB", pin=(0, -1)))
    """
    config = LoadConfig.build(config, overrides)
    if not isinstance(path, (str, os.PathLike)):
        raise ConfigError(f"load() takes the artifact's folder (a str or a path), got {type(path).__name__}; e.g. "
                          "load(\"artifacts/all-MiniLM-L6-v2\").")
    if not os.fspath(path):  # Path("") is the current folder: almost never what an empty setting meant
        raise ConfigError("load() got an empty path; give the artifact's folder, e.g. load(\"artifacts/all-MiniLM-L6-v2\") "
                          "(\".\" for the current folder).")
    folder = Path(path)
    manifest = read_manifest(folder)
    check_same_manifest(folder, manifest, config.manifest_sha256)
    if config.shards is not None:
        if manifest.components:
            raise SlimmlError(
                f"shards=(first, last) picks a stage of one chain of shards, but {folder} has components "
                f"{', '.join(manifest.components)}; load it whole, or serve it with replicas instead of stages."
            )
        manifest = manifest.stage(*config.shards)
    backend = backend_for(config.device)
    backend.providers()  # fail on a missing provider before hashing gigabytes
    parts = manifest.components or {None: manifest}
    chosen = None  # the streaming slimml chose itself, in words
    if backend.on_host and not config.streams:  # a model that does not fit memory streams rather than be killed
        free = backend.memory_available()
        budget = auto_budget(parts, free)
        if budget is not None:
            chosen = (f"{folder.resolve().name} takes about {fmt_bytes(resident_need(parts))} loaded whole, and "
                      f"{fmt_bytes(free)} of memory is free (a model loads whole within 90% of it), so it streams within "
                      f"{fmt_bytes(budget)} (memory_budget=; resident={max(len(m.shards) for m in parts.values())} loads it "
                      "whole anyway)")
            log.warning("slimml: %s", chosen)
            config = dataclasses.replace(config, memory_budget=budget)
    try:
        return _load(folder, manifest, parts, config)
    except ConfigError as e:
        if chosen is None:
            raise
        raise ConfigError(f"{chosen}; but {e}") from None


def _load(folder: Path, manifest: Any, parts: dict, config: LoadConfig) -> Task:
    """The engines of ``parts`` (each component's chain, or the one chain) as ``config`` plans them,
    and the artifact's task over them."""
    # a bad budget fails before loading; resident, prefetch and pin apply to each component's chain,
    # one memory budget is shared out among them (their loaded shards together stay within it)
    budgets = split_budget(parts, config.memory_budget)
    plans = {name: plan_stream(m, config.resident, config.prefetch, budgets[name], config.pin)
             for name, m in parts.items()}
    seen = verify_files(folder, manifest) if config.verify else {}
    # the last step: what the artifact is for (its task, chosen once), over one engine per chain of shards
    engines: dict[str | None, Engine] = {}
    try:
        for name, m in parts.items():
            engines[name] = Engine(folder, m, config, plans[name])
        check_unchanged(folder, seen)  # the files the sessions opened are the ones hashed
        return build_task(folder, manifest, engines)
    except BaseException:  # a later component or the task's tokenizer failed: stop what started
        for engine in engines.values():
            engine.close()
        raise
