"""The Ray Serve application: one deployment whose replicas hold the model, behind FastAPI routes.

Importable for Ray's own tools::

    serve run slimml.serve.app:build artifact=artifacts/all-MiniLM-L6-v2 max_batch_size=32
    serve deploy serve.yaml   # import_path: slimml.serve.app:build (README, "Deployment")

Endpoints: ``POST /v1/embeddings`` (OpenAI's shape), ``POST /v1/run`` (named arrays),
``POST /v1/generate`` (decoders), ``GET /health`` and ``GET /v1/models``. Concurrent embeddings
requests are batched together, counting texts, in batches formed when the model is free
(:mod:`slimml.serve.batcher`; Ray's ``@serve.batch`` forms them earlier, and smaller); model
calls run on a worker thread so the replica keeps answering while it computes.
"""

# no `from __future__ import annotations`: FastAPI reads the route annotations at run time

import asyncio
from functools import partial
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from ray import serve

from slimml.errors import FeedError, IntegrityError, RequestError, SlimmlError
from slimml.serve import protocol
from slimml.serve.batcher import Batcher
from slimml.serve.config import ServeConfig
from slimml.serve.llm import RETRY_AFTER_S, LLMService

api = FastAPI(title="slimml", docs_url=None, redoc_url=None)


@api.exception_handler(RequestError)
async def _request_error(request: Request, e: RequestError):
    headers = {"Retry-After": str(RETRY_AFTER_S)} if e.status == 429 else None
    return JSONResponse(protocol.error_body(str(e), e.status), status_code=e.status, headers=headers)


@api.exception_handler(FeedError)
async def _feed_error(request: Request, e: FeedError):
    return JSONResponse(protocol.error_body(str(e), 400), status_code=400)


@api.exception_handler(SlimmlError)
async def _slimml_error(request: Request, e: SlimmlError):
    status = 503 if isinstance(e, IntegrityError) else 500  # a changed artifact: not ready, not the client's fault
    return JSONResponse(protocol.error_body(str(e), status), status_code=status)


@serve.deployment(name="slimml")
@serve.ingress(api)
class SlimmlServer:
    """A replica: loads the model (or a pipeline of stages) once and answers the routes."""

    def __init__(self, config: dict[str, Any]):
        self.config = ServeConfig(**config)
        if self.config.stages:
            from slimml.scale import pipeline

            self.model = pipeline(self.config.artifact, stages=self.config.stages, microbatch=self.config.microbatch,
                                  memory_budget=self.config.memory_budget)
        else:
            import ray

            from slimml.runtime import load

            cpus = ray.get_runtime_context().get_assigned_resources().get("CPU")
            self.model = load(self.config.artifact, threads=max(1, int(cpus)) if cpus else None,
                              memory_budget=self.config.memory_budget)
        self.name = self.config.name or self.model.manifest.name
        self._llm = None
        if self.model.manifest.task.startswith("text-generation") and not self.config.stages:
            self._llm = LLMService(self.model, self.name, self.config.max_new_tokens, self.config.max_running,
                                   self.config.max_waiting)
        self._embed_batch = Batcher(partial(self.model.encode_with_counts, batch_size=self.config.batch_size),
                                    self.config.max_batch_size, self.config.batch_wait_ms / 1000)

    async def _body(self, request: Request) -> dict[str, Any]:
        limit = self.config.max_body_bytes
        declared = request.headers.get("content-length")
        if declared and declared.isdigit() and int(declared) > limit:
            raise RequestError(f"the request body is {declared} bytes, more than this server takes ({limit}); "
                               "send smaller requests.", 413)
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise RequestError(f"the request body is over {limit} bytes, more than this server takes; send "
                                   "smaller requests.", 413)
            chunks.append(chunk)
        return protocol.parse_json(b"".join(chunks))

    def _needs(self, what: str) -> None:
        m = self.model.manifest
        if what == "embeddings" and m.pooling is None and not m.zero_shot:  # CLIP: its text tower's embeddings
            raise RequestError(f"this artifact is a {m.task!r} model, not a sentence-embedding one, so it has no "
                               "/v1/embeddings; use POST /v1/run for its raw outputs.")
        if what == "generate" and not (m.task.startswith("text-generation") or getattr(m, "seq2seq", None)):
            raise RequestError(f"this artifact is a {m.task!r} model, not a decoder, so it has no /v1/generate; "
                               "use POST /v1/run.")

    @api.post("/v1/embeddings")
    async def embeddings(self, request: Request):
        data = await self._body(request)
        self._needs("embeddings")
        protocol.check_model(data, self.name)
        texts = protocol.embedding_texts(data, self.config.max_texts)
        emb, counts = await self._embed_batch(texts)  # with the texts of concurrent requests
        body = protocol.embeddings_response(emb, self.name, sum(counts), data.get("encoding_format", "float"))
        return Response(protocol.dumps(body), media_type="application/json")

    @api.post("/v1/run")
    async def run(self, request: Request):
        data = await self._body(request)
        protocol.check_model(data, self.name)
        feeds, wanted, encoding = protocol.run_inputs(data)
        out = await asyncio.to_thread(self.model.run, feeds)
        if wanted is not None:
            missing = [w for w in wanted if w not in out]
            if missing:
                raise RequestError(f"unknown output(s) {missing}; this model's outputs are {sorted(out)}.")
            out = {w: out[w] for w in wanted}
        return Response(protocol.dumps(protocol.run_response(out, encoding)), media_type="application/json")

    @api.post("/v1/generate")
    async def generate(self, request: Request):
        data = await self._body(request)
        self._needs("generate")
        protocol.check_model(data, self.name)
        prompts, n = protocol.generate_request(data, self.config.max_new_tokens, self.config.max_texts)
        gen = await asyncio.to_thread(self.model.generate, prompts, n)
        return protocol.generate_response(gen, self.name, n)

    @api.post("/v1/chat/completions")
    async def chat_completions(self, request: Request):
        return await self._complete(request, chat=True)

    @api.post("/v1/completions")
    async def completions(self, request: Request):
        return await self._complete(request, chat=False)

    async def _complete(self, request: Request, chat: bool):
        data = await self._body(request)
        if self._llm is None:
            raise RequestError(f"this artifact is a {self.model.manifest.task!r} model, not a language model served "
                               "here, so it has no /v1/chat/completions or /v1/completions; use POST /v1/embeddings "
                               "or POST /v1/run.", 404)
        protocol.check_model(data, self.name)
        answer = await self._llm.answer(data, chat)
        if isinstance(answer, dict):
            return Response(protocol.dumps(answer), media_type="application/json")
        return StreamingResponse(answer, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})

    @api.get("/health")
    async def health(self):
        await asyncio.to_thread(self.model.check_files)  # IntegrityError -> 503
        body = {"status": "ok", "model": self.name}
        if self._llm is not None:  # answers being generated, waiting, and the batch's KV cache in bytes
            body["generation"] = self._llm.worker.load
        return body

    @api.get("/v1/models")
    async def models(self):
        m = self.model.manifest
        return {"object": "list", "data": [{"id": self.name, "object": "model", "owned_by": "slimml", "task": m.task,
                                            "shards": len(m.shards), "stages": self.config.stages}]}

    def check_health(self):
        """Serve's own probe: a replica whose files changed is replaced (it reloads and re-verifies)."""
        self.model.check_files()


def app(config: ServeConfig, cpus_per_replica: float | None = None, memory_bytes: int | None = None):
    """The Serve application for ``config`` (bind it with ``serve.run``)."""
    cpus = config.cpus_per_replica or cpus_per_replica or 1  # fractional when replicas outnumber CPUs
    actor = {"num_cpus": 0 if config.stages else cpus}
    if memory_bytes:  # a streamed model: Ray places a replica only on a node with room for its budget
        actor["memory"] = memory_bytes
    return SlimmlServer.options(
        num_replicas=config.replicas, max_ongoing_requests=config.max_ongoing_requests,
        ray_actor_options=actor,
    ).bind(config.to_args())


def build(args: dict[str, Any]):
    """Application builder for ``serve run slimml.serve.app:build artifact=PATH [key=value ...]``
    and for a config YAML's ``import_path``; keys are :class:`ServeConfig`'s fields."""
    return app(ServeConfig.from_args(args))
