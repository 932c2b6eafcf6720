"""``LoadConfig``: how ``load`` runs an artifact (device, threads, streaming, checks), checked once.

Every field carries its help text (``metadata["help"]``), from which the CLI makes its flags;
``metadata["flags"]`` adds short forms. A config checks itself when made: a bad value is one
``ConfigError`` (``DeviceError`` for the device) that names it and the fix, before any file is
read. What depends on the artifact (a budget below its largest shard, a pinned index past its
last shard) is checked by :func:`slimml.runtime.engine.budget.plan_stream` at load.

Example:
    >>> from slimml.runtime import LoadConfig, load
    >>> model = load("artifacts/llama", LoadConfig(memory_budget="4GB", pin=(0, -1)))
    >>> model = load("artifacts/llama", memory_budget="4GB")  # the same, as keywords
"""

from __future__ import annotations

import dataclasses
import difflib
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from slimml.errors import ConfigError
from slimml.runtime.engine.backends import DEFAULT_DEVICE, check_device
from slimml.runtime.engine.backends.base import MAX_THREADS, env_threads
from slimml.runtime.engine.budget import parse_bytes


def _whole(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass(frozen=True)
class LoadConfig:
    """How to load and run an artifact. Defaults: all shards resident on CPU (streamed where the
    model does not fit the free memory, :func:`~slimml.runtime.engine.budget.auto_budget`), every file hashed.

    The fields are :func:`slimml.runtime.load`'s keywords, described there: ``device``,
    ``threads``, ``verify``, ``resident``, ``prefetch``, ``memory_budget``, ``pin``, ``pack``,
    ``cache_dir``, ``shards`` and ``manifest_sha256``. Each is checked when the config is made.

    Raises:
        ConfigError: a value out of range (the message names the field and what it takes).
        DeviceError: an unknown device.

    Example:
        >>> from slimml.runtime import LoadConfig, load
        >>> streamed = LoadConfig(memory_budget="2GB", pin=(0, -1))
        >>> model = load("artifacts/all-MiniLM-L6-v2", streamed, threads=1)   # keywords override the config
    """

    device: str = field(default=DEFAULT_DEVICE, metadata={
        "help": "cpu, cuda, or auto (CUDA where a GPU works, else CPU)."})
    threads: int | None = field(default=None, metadata={
        "help": "ONNX Runtime intra-op threads (default: ORT's choice, or SLIMML_THREADS)."})
    verify: bool = field(default=True, metadata={
        "help": "Check every file's size and sha256 against the manifest before loading (and a streamed file "
                "again if it changes)."})
    resident: int | None = field(default=None, metadata={
        "help": "Shards loaded at once (K); fewer than the shard count streams the model (default: all, where "
                "they fit the free memory; the shard count loads it whole anyway).", "flags": ["-k"]})
    prefetch: int | None = field(default=None, metadata={
        "help": "Shards the loader brings in ahead of the one computing (P).", "flags": ["-p"]})
    memory_budget: int | str | None = field(default=None, metadata={
        "help": "Memory for loaded shards, e.g. 4GB; picks K and P."})
    pin: tuple[int, ...] | None = field(default=None, metadata={
        "help": "A shard to keep loaded (repeat; -1 is the last)."})
    pack: bool | None = field(default=None, metadata={
        "help": "Streamed shards on CPU: ONNX Runtime's pre-packed weights, cached on disk (default where it "
                "can: Linux); --no-pack feeds weights as inputs instead (no cache, slower decoding)."})
    cache_dir: Path | None = field(default=None, metadata={
        "help": "Where pre-packed weights are kept (default SLIMML_CACHE_DIR, XDG_CACHE_HOME/slimml or ~/.cache/slimml); about twice "
                "the streamed shards' size."})
    shards: tuple[int, int] | None = field(default=None, metadata={
        "help": "Load only shards FIRST..LAST (inclusive), as one stage of a pipeline."})
    # a stage or a replica refuses an artifact whose manifest.json differs from the driver's (no CLI flag)
    manifest_sha256: str | None = None

    def __post_init__(self) -> None:
        check_device(self.device)  # DeviceError: "unknown device 'gpu'; use one of [...]"
        if self.threads is not None and (not _whole(self.threads) or not 1 <= self.threads <= MAX_THREADS):
            raise ConfigError(f"threads={self.threads!r} must be a whole number from 1 to {MAX_THREADS} (ONNX Runtime's "
                              f"intra-op threads; this machine has {os.cpu_count()} cores); leave it out for ONNX "
                              "Runtime's choice.")
        if self.threads is None:
            env_threads()  # SLIMML_THREADS, the threads then: refused here, before any session
        if not isinstance(self.verify, bool):
            raise ConfigError(f"verify={self.verify!r} must be True or False.")
        if self.pack is not None and not isinstance(self.pack, bool):
            raise ConfigError(f"pack={self.pack!r} must be None (pack where it can), True or False.")
        if self.resident is not None and (not _whole(self.resident) or self.resident < 1):
            raise ConfigError(f"resident={self.resident!r} must be a whole number >= 1 (shards loaded at once).")
        if self.prefetch is not None and (not _whole(self.prefetch) or self.prefetch < 0):
            raise ConfigError(f"prefetch={self.prefetch!r} must be a whole number >= 0 (shards loaded ahead).")
        if self.memory_budget is not None:
            parse_bytes(self.memory_budget)  # "memory budget 'lots' is not a size; ..."
        if self.pin is not None:
            pins = list(self.pin) if isinstance(self.pin, (list, tuple)) else None
            if pins is None or not all(_whole(p) for p in pins):
                raise ConfigError(f"pin={self.pin!r} must be a list of shard indices, e.g. pin=[0, -1].")
            object.__setattr__(self, "pin", tuple(pins) or None)
        if self.cache_dir is not None:
            if not isinstance(self.cache_dir, (str, os.PathLike)) or not os.fspath(self.cache_dir).strip():
                raise ConfigError(f"cache_dir={self.cache_dir!r} must be a folder path.")
            object.__setattr__(self, "cache_dir", Path(self.cache_dir))
        if self.cache_dir is not None and self.cache_dir.exists() and not self.cache_dir.is_dir():
            raise ConfigError(f"cache_dir={os.fspath(self.cache_dir)!r} is a file, not a folder; give a folder (it is made "
                              "where missing) for slimml's pre-packed weights.")
        if self.shards is not None:
            pair = tuple(self.shards) if isinstance(self.shards, (list, tuple)) else ()
            if len(pair) != 2 or not all(_whole(i) for i in pair) or not 0 <= pair[0] <= pair[1]:
                raise ConfigError(f"shards={self.shards!r} must be (first, last), two shard indices with "
                                  "0 <= first <= last, e.g. shards=(0, 3).")
            object.__setattr__(self, "shards", pair)
        if self.manifest_sha256 is not None and not (isinstance(self.manifest_sha256, str)
                                                     and len(self.manifest_sha256) == 64):
            raise ConfigError(f"manifest_sha256={self.manifest_sha256!r} must be a sha256 in hex (64 characters).")

    @classmethod
    def names(cls) -> list[str]:
        """The fields, in order: what ``load`` takes as keywords."""
        return [f.name for f in dataclasses.fields(cls)]

    @property
    def streams(self) -> bool:
        """Whether the caller asked anything of streaming (``resident``, ``prefetch``,
        ``memory_budget`` or ``pin``); without, a model that fits memory loads whole."""
        return any(v is not None for v in (self.resident, self.prefetch, self.memory_budget, self.pin))

    @classmethod
    def build(cls, config: LoadConfig | None = None, overrides: dict[str, Any] | None = None) -> LoadConfig:
        """``config`` (default: the defaults) with ``overrides`` (field name -> value) applied.

        Raises:
            ConfigError: an override that is not a field, or a value out of range.
        """
        if config is not None and not isinstance(config, cls):
            raise ConfigError(f"config must be a LoadConfig, got {type(config).__name__} {config!r}; pass options by "
                              f"name instead, e.g. load(path, device={config!r})." if isinstance(config, str) else
                              f"config must be a LoadConfig, got {type(config).__name__}; make one with LoadConfig(...).")
        overrides = overrides or {}
        unknown = [k for k in overrides if k not in cls.names()]
        if unknown:
            hint = difflib.get_close_matches(unknown[0], cls.names(), n=1)
            raise ConfigError(
                f"unknown load option{'s' if len(unknown) > 1 else ''} {', '.join(map(repr, unknown))}"
                + (f" (did you mean {hint[0]!r}?)" if hint else "")
                + f"; the options are {', '.join(cls.names())}."
            )
        if config is None:
            return cls(**overrides)
        return dataclasses.replace(config, **overrides) if overrides else config
