"""What a server runs and the limits it keeps: one dataclass, checked when made."""

from __future__ import annotations

import difflib
import hashlib
import os
from dataclasses import asdict, dataclass, field, fields
from typing import Any

from slimml.errors import ConfigError
from slimml.runtime.engine.config import LoadConfig


def _load_option(name: str) -> Any:
    """A field of ServeConfig that each replica passes to ``load``: its default and help are
    LoadConfig's, declared there once."""
    option = next(f for f in fields(LoadConfig) if f.name == name)
    return field(default=option.default, metadata=option.metadata)


@dataclass
class ServeConfig:
    """Options of ``slimml serve`` and of the importable application (``slimml.serve.app:build``).

    Each field with ``metadata["help"]`` is a flag of ``slimml serve`` (:mod:`slimml.cli.options`).

    Attributes:
        artifact: the artifact folder (the same path on every node of a cluster).
        name: the model name clients send and ``/v1/models`` lists (default: the manifest's).
        replicas: Serve replicas, each with its own copy of the model.
        cpus_per_replica: CPUs Ray gives each replica, which become its ONNX Runtime threads
            (ORT ignores OMP_NUM_THREADS). Default: the cluster's CPUs / replicas, at most what
            lets every replica sit on one node.
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
        max_bodies_bytes: request body bytes one replica holds at once, over all its requests
            (parsed JSON costs about 9x its bytes); a request whose body would pass it gets 503.
            With max_body_bytes it bounds what bodies can cost a replica, whatever
            max_ongoing_requests is (64 MiB: about 600 MB parsed).
        max_texts: rows of one request (texts, prompts, a run's batch), at most; more gets 413.
        max_text_chars: characters of one text kept before tokenizing (the tokenizer would
            truncate the rest anyway; this bounds its time: an 8 MiB text took 6.4 s whole), and of
            a language model's prompt (refused past it, 413). None: 16,384, and for a language
            model's prompt 16 a position of its context (``Limits.prompt_chars``).
        max_batch_tokens: rows x tokens of one /v1/run or /v1/generate request (prompt plus new
            tokens), at most, and of one chat or completions answer; more gets 413 (400 for
            generate, chat and completions). None: 8,192, fewer for vocabularies past 8,192 tokens
            (a pass's logits within 256 MiB); for a graph that computes logits only where they are
            read (the fused exporter's), 8,192 or the model's context if longer, so one prompt may
            fill the context (:class:`slimml.runtime.tasks.limits.Limits`). Each row must also fit
            the model's positions (400).
        max_window_tokens: tokens of all the windows one model call of /v1/entities (with
            ``stride``) or /v1/answer reads its texts in (``Limits.max_window_tokens``; a request
            goes to the model a piece of 8 batches at a time); more gets 400.
        max_response_values: values in one /v1/run or /v1/embeddings response, at most, counted
            from the output shapes before the model runs (4,194,304: 16 MiB as float32; a 32,000-token
            decoder's logits for 131 tokens; 1,024 texts of a 4,096-wide embedding, 137 of a sparse
            embedder's 30,522); more gets 413.
        max_new_tokens: the most tokens one generate, chat or completions request may ask for.
        max_running: language models: answers generated together, one model pass a token for all
            of them (continuous batching: a request joins at the next step, leaves when done).
        max_waiting: language models: requests queued for a place in the batch; more get 429
            with Retry-After. Past max_ongoing_requests, Serve's own queue holds them first.
        prefill_tokens: language models: prompt tokens prefilled between two decode steps (a
            longer prompt is read this many a step, beside the running answers).
        prefix_cache: language models (fused graphs): KV cache kept for prompts that begin with
            text the replica read before (a system prompt, the conversation so far: chat clients
            send it again every turn), so only the rest is prefilled; "0" keeps none. Requests
            that share a prefix are faster, which another client can time: turn it off where
            clients must not learn what others asked.
        reasoning: language models with ``<think>`` or ``[THINK]`` blocks: "split" (thoughts as
            ``reasoning_content``) or "keep" (left in the content).
        chat_template: language models: a Jinja chat template file rendered instead of the
            artifact's own (a GGUF's template that knows no tools, a fixed template); the same
            path on every node.
        max_ongoing_requests: requests a replica works on at once (each holds its body and its
            share of a batch); more wait in Serve's queue.
        max_queued_requests: requests waiting for a replica, at most; more get 503 at once.
        body_timeout_s: the most time a client may take to send its body (a slow sender holds
            a request slot); later gets 408.
        request_timeout_s: the most time one request may take, end to end; later gets 408
            and its work is cancelled (a generate stops after its current pass).
        api_key: when set, every endpoint but ``/health`` needs ``Authorization: Bearer KEY``
            (401 without). ``slimml serve --api-key`` or ``SLIMML_API_KEY``. Only its sha256
            reaches the replicas.
        openapi: serve ``/openapi.json`` (the API's schema); off by default.
        memory_budget: passed to ``load`` (streams the model within that many bytes).
        pack, cache_dir: passed to ``load``: how a streamed model's weights reach its sessions on
            CPU, and where their pre-packed copies are kept (:class:`~slimml.runtime.LoadConfig`).
        access_log: have Serve log every request (off: a log line per request costs CPU that
            a small machine needs for the model).
    """

    artifact: str
    name: str | None = field(default=None, metadata={
        "help": "The model name clients send and /v1/models lists (default: the manifest's)."})
    replicas: int = field(default=1, metadata={"help": "Serve replicas, each with its own copy of the model."})
    cpus_per_replica: float | None = field(default=None, metadata={
        "help": "CPUs Ray gives each replica, its ONNX Runtime threads (default: the cluster's CPUs / replicas, as many as fit each replica on one node)."})
    stages: int = field(default=0, metadata={
        "help": "Run the model as S pipeline stages on Ray actors (0: inside each replica)."})
    microbatch: int = field(default=4, metadata={"help": "With --stages: microbatches in flight through the stages."})
    max_batch_size: int = field(default=1024, metadata={
        "help": "Most texts gathered from concurrent requests into one encode call (run 16 at a time, sorted by "
                "length, a batch per core)."})
    batch_wait_ms: float = field(default=5.0, metadata={"help": "How long a batch waits for more requests to join it."})
    batch_size: int = field(default=16, metadata={"help": "Texts per model call inside one encode call."})
    max_body_bytes: int = field(default=8 << 20, metadata={"help": "Larger request bodies get 413."})
    max_bodies_bytes: int = field(default=64 << 20, metadata={
        "help": "Request body bytes one replica holds at once, over all its requests (parsed JSON costs about "
                "9x); more gets 503."})
    max_texts: int = field(default=2048, metadata={
        "help": "Rows of one request (texts, prompts, a run's batch) at most; more gets 413."})
    max_text_chars: int | None = field(default=None, metadata={
        "help": "Characters of one text kept before tokenizing (bounds the tokenizer's time); a language model's "
                "prompt over it gets 413. Default: 16384, and for a language model's prompt 16 a position of its "
                "context (131072 for 8192 positions)."})
    max_batch_tokens: int | None = field(default=None, metadata={
        "help": "Rows x tokens of one /v1/run or /v1/generate request (prompt plus new tokens), and of one chat or "
                "completions answer, at most; more gets 413 (400 for generate, chat, completions). Default: 8192, fewer "
                "for vocabularies past 8,192 tokens (a pass's logits within 256 MiB); a fused decoder (logits only "
                "where read): 8192 or its context if longer."})
    max_window_tokens: int = field(default=65_536, metadata={
        "help": "Tokens of all the windows one call of /v1/entities (with stride) or /v1/answer reads long texts "
                "in (a request goes to the model 128 texts a call at batch size 16); more gets 400."})
    max_response_values: int = field(default=1 << 22, metadata={
        "help": "Values in one /v1/run or /v1/embeddings response at most, counted before the model runs where "
                "the shapes tell; more gets 413."})
    max_new_tokens: int = field(default=512, metadata={
        "help": "The most new tokens one generate, chat or completions request may ask for."})
    max_running: int = field(default=16, metadata={
        "help": "Language models: answers generated together, one model pass a token for all (continuous "
                "batching)."})
    max_waiting: int = field(default=64, metadata={
        "help": "Language models: requests queued for a place in the batch; more get 429 with Retry-After."})
    prefill_tokens: int = field(default=512, metadata={
        "help": "Language models: prompt tokens prefilled between two decode steps; a longer prompt is read this "
                "many a step beside the running streams. Lower keeps running streams smooth, higher admits a burst "
                "sooner."})
    prompt_lookup: int = field(default=0, metadata={
        "help": "Language models: while one answer runs alone, positions a pass may also compute by guessing that "
                "it repeats its prompt (prompt lookup: the same tokens, fewer passes when answers quote the prompt); "
                "0: off."})
    prefix_cache: str = field(default="256MB", metadata={
        "help": "Language models: KV cache kept for prompts that begin with text read before (a system prompt, "
                "the conversation so far), so only the rest is prefilled; 0: none."})
    chat_template: str | None = field(default=None, metadata={
        "help": "Language models: a Jinja chat template file used instead of the artifact's own (e.g. one that "
                "knows tools); the same path on every node."})
    reasoning: str = field(default="split", metadata={
        "help": "Language models whose template writes <think> blocks (Qwen3, DeepSeek-R1, SmolLM3) or [THINK] ones "
                "(Magistral): \"split\" answers the thoughts as message.reasoning_content and the answer as content "
                "(llama.cpp's and vLLM's field); \"keep\" leaves them in the content. gpt-oss's harmony thoughts "
                "always come apart."})
    max_ongoing_requests: int = field(default=128, metadata={
        "help": "Requests a replica works on at once; more wait in Serve's queue."})
    max_queued_requests: int = field(default=512, metadata={
        "help": "Requests waiting for a replica at most; more get 503 at once."})
    body_timeout_s: float = field(default=30.0, metadata={
        "help": "Seconds a client may take to send its body; later gets 408."})
    request_timeout_s: float = field(default=300.0, metadata={
        "help": "Seconds one request may take end to end; later gets 408 and its work is cancelled."})
    memory_budget: str | None = _load_option("memory_budget")
    pack: bool | None = _load_option("pack")
    cache_dir: str | None = _load_option("cache_dir")
    access_log: bool = field(default=False, metadata={
        "help": "Have Serve log every request (a line per request costs CPU).", "flags": ("--access-log",)})
    api_key: str | None = field(default=None, metadata={
        "help": "Every endpoint but /health needs `Authorization: Bearer KEY` (401 without). Prefer the "
                "SLIMML_API_KEY variable: a flag shows in the process list.",
        "flags": ("--api-key",), "envvar": "SLIMML_API_KEY"})
    openapi: bool = field(default=False, metadata={
        "help": "Serve the API's schema at /openapi.json (off by default).", "flags": ("--openapi",)})
    api_key_sha256: str | None = None  # what replicas get instead of the key (set by to_args)
    manifest_sha256: str | None = None  # the driver's manifest.json: replicas and stages refuse another

    def __post_init__(self):
        whole = {"replicas": 1, "stages": 0, "microbatch": 1, "max_batch_size": 1, "batch_size": 1, "max_body_bytes": 1024, "max_bodies_bytes": 1024,
                 "max_texts": 1, "max_response_values": 1, "max_new_tokens": 1, "max_window_tokens": 1,
                 "max_ongoing_requests": 1, "max_queued_requests": 1, "max_running": 1, "max_waiting": 0, "prefill_tokens": 1,
                 "prompt_lookup": 0}
        for name, low in whole.items():
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < low:
                raise ConfigError(f"{name} must be a whole number >= {low}, got {v!r}.")
        if self.name is not None and (not isinstance(self.name, str) or not self.name.strip()):
            raise ConfigError(f"name must be a non-empty model name (what clients send as \"model\"), got {self.name!r}; "
                              "leave it out for the artifact's own.")
        if not isinstance(self.batch_wait_ms, (int, float)) or isinstance(self.batch_wait_ms, bool) or not 0 <= self.batch_wait_ms <= 10_000:
            raise ConfigError(f"batch_wait_ms must be between 0 and 10000, got {self.batch_wait_ms!r}.")
        if self.cpus_per_replica is not None and not (isinstance(self.cpus_per_replica, (int, float)) and self.cpus_per_replica > 0):
            raise ConfigError(f"cpus_per_replica must be a number > 0, got {self.cpus_per_replica!r}.")
        if self.stages and self.replicas > 1:
            raise ConfigError(
                f"stages={self.stages} with replicas={self.replicas}: each replica would hold a pipeline of its own. "
                "Use one replica in front of the stages (--replicas 1), or replicas without stages."
            )
        if self.stages:  # a staged server answers POST /v1/generate only: chat and completions' settings would do nothing
            chat = [f"--{n.replace('_', '-')}" for n in ("max_running", "prefix_cache", "prompt_lookup", "chat_template")
                    if getattr(self, n) != _DEFAULTS[n]]
            if chat:
                raise ConfigError(f"{', '.join(chat)} {'sets' if len(chat) == 1 else 'set'} how chat and completions run, "
                                  "which a server over --stages does not serve (POST /v1/generate only); drop "
                                  f"{'it' if len(chat) == 1 else 'them'}, or serve without --stages.")
        if self.reasoning not in ("split", "keep"):
            raise ConfigError(f'reasoning must be "split" or "keep", got {self.reasoning!r}.')
        for name in ("max_batch_tokens", "max_text_chars"):
            v = getattr(self, name)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
                raise ConfigError(f"{name} must be a whole number >= 1, got {v!r}.")
        for name in ("body_timeout_s", "request_timeout_s"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 < v <= 86_400:
                raise ConfigError(f"{name} must be a number of seconds from 0 to 86400, got {v!r}.")
        self.prefix_bytes  # "prefix cache (prefix_cache=, --prefix-cache) 'lots' is not a size; ..., or 0 to turn it off."
        if self.pack is not None or self.cache_dir is not None:  # LoadConfig's checks and words, before Ray starts
            LoadConfig(pack=self.pack, cache_dir=self.cache_dir)
        if self.memory_budget is not None:  # "memory budget 'lots' is not a size; ..." before Ray starts
            from slimml.runtime.engine.budget import parse_bytes

            parse_bytes(self.memory_budget)
        if self.chat_template is not None:
            from slimml.runtime.tasks.generation.chat import ChatTemplate

            if not isinstance(self.chat_template, str) or not os.path.isfile(self.chat_template):
                raise ConfigError(f"chat_template {self.chat_template!r} is not a file; give the path of a Jinja chat "
                                  "template (e.g. chat_template.jinja).")
            with open(self.chat_template, encoding="utf-8", errors="replace") as f:
                ChatTemplate(f.read(), where=self.chat_template)  # a template that does not parse is refused here
        if self.api_key is not None and (not isinstance(self.api_key, str) or len(self.api_key) < 16
                                         or not self.api_key.isprintable() or " " in self.api_key):
            raise ConfigError("api_key must be at least 16 printable characters without spaces (e.g. from "
                              "`python -c 'import secrets; print(secrets.token_urlsafe(32))'`).")

    @property
    def prefix_bytes(self) -> int:
        """``prefix_cache`` in bytes (0: off)."""
        from slimml.runtime.engine.budget import parse_bytes_or_off

        return parse_bytes_or_off(self.prefix_cache, "prefix cache (prefix_cache=, --prefix-cache)")

    @classmethod
    def from_args(cls, args: dict[str, Any]) -> ServeConfig:
        """From ``serve run ... key=value`` arguments (strings) or a config YAML's ``args`` (typed)."""
        known = {f.name: f for f in fields(cls)}
        unknown = sorted(set(args) - set(known))
        if unknown:
            hint = difflib.get_close_matches(unknown[0], known, n=1)
            raise ConfigError(f"unknown serve option{'s' if len(unknown) > 1 else ''} {', '.join(map(repr, unknown))}"
                              + (f" (did you mean {hint[0]!r}?)" if hint else "")
                              + f"; the options are {', '.join(sorted(known))}.")
        if "api_key" not in args and os.environ.get("SLIMML_API_KEY"):
            args = {**args, "api_key": os.environ["SLIMML_API_KEY"]}
        if "artifact" not in args:
            raise ConfigError("give the artifact to serve, e.g. `serve run slimml.serve.app:build artifact=PATH`.")
        typed: dict[str, Any] = {}
        for key, value in args.items():
            kind = str(known[key].type)
            try:
                if isinstance(value, str) and kind in ("bool", "bool | None"):
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
        """Arguments for the replicas: the API key travels as its sha256 only (Ray keeps these
        arguments where its dashboard and state API show them)."""
        args = {k: v for k, v in asdict(self).items() if v is not None and k != "api_key"}
        if self.api_key is not None:
            args["api_key_sha256"] = hashlib.sha256(self.api_key.encode()).hexdigest()
        return args


_DEFAULTS = {f.name: f.default for f in fields(ServeConfig)}  # what a flag left out is (a staged server refuses others)
