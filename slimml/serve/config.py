"""What a server runs and the limits it keeps: one dataclass, checked when made."""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import Any

from slimml.errors import ConfigError


@dataclass
class ServeConfig:
    """Options of ``slimml serve`` and of the importable application (``slimml.serve.app:build``).

    Attributes:
        artifact: the artifact folder (the same path on every node of a cluster).
        name: the model name clients send and ``/v1/models`` lists (default: the manifest's).
        replicas: Serve replicas, each with its own copy of the model.
        cpus_per_replica: CPUs Ray gives each replica, which become its ONNX Runtime threads
            (ORT ignores OMP_NUM_THREADS). Default: the cluster's CPUs / replicas.
        stages: 0 runs the model inside each replica; S >= 1 runs it as S pipeline stages
            (:func:`slimml.scale.pipeline`) behind the replica.
        microbatch: microbatches in flight through the stages.
        max_batch_size: the most texts gathered from concurrent embeddings requests into one
            ``encode`` call, made when the model is free from the requests waiting then
            (:mod:`slimml.serve.batcher`); ``encode`` sorts them by length and runs them
            ``batch_size`` at a time, a batch per core.
        batch_wait_ms: how long the first request of a batch waits for others to join it.
        batch_size: texts per model call inside ``encode`` (16: on a 2-core Sapphire Rapids, 32
            clients x 32 STSb sentences, 16 served 1,265-1,276 texts/s against 1,131-1,182 for
            32; in process, 128-token texts ran 146-154 texts/s at 16 against 139-150 at 32).
        max_body_bytes: larger request bodies get 413 (8 MiB: about 40,000 short sentences).
        max_texts: texts per embeddings request, at most; more gets 413.
        max_new_tokens: the most tokens one generate, chat or completions request may ask for.
        max_running: language models: answers generated together, one model pass a token for all
            of them (continuous batching: a request joins at the next step, leaves when done).
        max_waiting: language models: requests queued for a place in the batch; more get 429.
        max_ongoing_requests: requests a replica holds at once (batching needs at least
            max_batch_size); more wait in Serve's queue.
        memory_budget: passed to ``load`` (streams the model within that many bytes).
        access_log: have Serve log every request (off: a log line per request costs CPU that
            a small machine needs for the model).
    """

    artifact: str
    name: str | None = None
    replicas: int = 1
    cpus_per_replica: float | None = None
    stages: int = 0
    microbatch: int = 4
    max_batch_size: int = 1024
    batch_wait_ms: float = 5.0
    batch_size: int = 16
    max_body_bytes: int = 8 << 20
    max_texts: int = 2048
    max_new_tokens: int = 512
    max_running: int = 16
    max_waiting: int = 64
    max_ongoing_requests: int = 128
    memory_budget: str | None = None
    access_log: bool = False

    def __post_init__(self):
        whole = {"replicas": 1, "stages": 0, "microbatch": 1, "max_batch_size": 1, "batch_size": 1, "max_body_bytes": 1024,
                 "max_texts": 1, "max_new_tokens": 1, "max_ongoing_requests": 1, "max_running": 1, "max_waiting": 0}
        for name, low in whole.items():
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < low:
                raise ConfigError(f"{name} must be a whole number >= {low}, got {v!r}.")
        if not isinstance(self.batch_wait_ms, (int, float)) or isinstance(self.batch_wait_ms, bool) or not 0 <= self.batch_wait_ms <= 10_000:
            raise ConfigError(f"batch_wait_ms must be between 0 and 10000, got {self.batch_wait_ms!r}.")
        if self.cpus_per_replica is not None and not (isinstance(self.cpus_per_replica, (int, float)) and self.cpus_per_replica > 0):
            raise ConfigError(f"cpus_per_replica must be a number > 0, got {self.cpus_per_replica!r}.")
        if self.stages and self.replicas > 1:
            raise ConfigError(
                f"stages={self.stages} with replicas={self.replicas}: each replica would hold a pipeline of its own. "
                "Use one replica in front of the stages (--replicas 1), or replicas without stages."
            )
        if self.max_ongoing_requests < self.max_batch_size:
            self.max_ongoing_requests = self.max_batch_size  # else batches could never fill
        # a language model's queue is its own: Serve must let in every request it may run or queue
        self.max_ongoing_requests = max(self.max_ongoing_requests, self.max_running + self.max_waiting + 8)

    @classmethod
    def from_args(cls, args: dict[str, Any]) -> ServeConfig:
        """From ``serve run ... key=value`` arguments (strings) or a config YAML's ``args`` (typed)."""
        known = {f.name: f for f in fields(cls)}
        unknown = sorted(set(args) - set(known))
        if unknown:
            raise ConfigError(f"unknown serve option(s) {unknown}; known: {sorted(known)}.")
        if "artifact" not in args:
            raise ConfigError("give the artifact to serve, e.g. `serve run slimml.serve.app:build artifact=PATH`.")
        typed: dict[str, Any] = {}
        for key, value in args.items():
            kind = str(known[key].type)
            try:
                if isinstance(value, str) and kind == "bool":
                    if value.lower() not in ("true", "false", "1", "0", "yes", "no"):
                        raise ConfigError(f"{key} must be true or false, got {value!r}.")
                    value = value.lower() in ("true", "1", "yes")
                elif isinstance(value, str) and "int" in kind:
                    value = int(value)
                elif isinstance(value, str) and "float" in kind:
                    value = float(value)
            except ValueError:
                raise ConfigError(f"{key} must be a number, got {value!r}.") from None
            typed[key] = value
        return cls(**typed)

    def to_args(self) -> dict[str, Any]:
        return {k: v for k, v in asdict(self).items() if v is not None}
