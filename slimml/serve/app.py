"""The Ray Serve application: one deployment whose replicas hold the model, behind FastAPI routes.

Importable for Ray's own tools::

    serve run slimml.serve.app:build artifact=artifacts/all-MiniLM-L6-v2 max_batch_size=32
    serve deploy serve.yaml   # import_path: slimml.serve.app:build (README, "Deployment")

Endpoints: OpenAI's ``/v1/chat/completions``, ``/v1/completions``, ``/v1/responses`` and
``/v1/embeddings``, slimml's own for the other tasks (``/v1/rerank``, ``/v1/classify``, ...,
``/v1/generate``, ``/v1/run``), ``GET /health`` and ``GET /v1/models``. Every request passes the
replica's middleware (:mod:`slimml.serve.guard`: the API key, the deadline ``request_timeout_s``, the
pool of body bytes) and is checked against its budgets (rows, characters, tokens) before any model
work; refusals are OpenAI's error body (:mod:`slimml.serve.refusals`), with no server paths or node
addresses (the replica logs them). Concurrent embeddings requests are batched together, counting
texts, in batches formed when the model is free (:mod:`slimml.serve.batcher`; Ray's ``@serve.batch``
forms them earlier, and smaller); model calls run on a worker thread so the replica keeps answering
while it computes.
"""

# no `from __future__ import annotations`: FastAPI reads the route annotations at run time

import asyncio
import logging
import re
import threading
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
from fastapi import FastAPI, Request
from fastapi.responses import Response, StreamingResponse
from ray import serve

from slimml.errors import ConfigError, FeedError, IntegrityError, OutOfMemoryError, RequestError
import slimml.serve.images as images
import slimml.serve.protocol as protocol
import slimml.serve.refusals as refusals
import slimml.serve.transcription as transcription
from slimml.runtime.artifact.manifest import MANIFEST_NAME, read_manifest
from slimml.runtime.tasks.inputs.audio import wav_from_bytes
from slimml.serve.batcher import Batcher
from slimml.serve.config import ServeConfig
from slimml.serve.guard import Guard
from slimml.serve.llm import LLMService
from slimml.runtime.tasks.limits import a_or_an

log = logging.getLogger("ray.serve")
api = FastAPI(title="slimml", docs_url=None, redoc_url=None)
api.add_middleware(Guard)
refusals.install(api)


@serve.deployment(name="slimml")
@serve.ingress(api)
class SlimmlServer:
    """A replica: loads the model (or a pipeline of stages) once and answers the routes."""

    def __init__(self, config: dict[str, Any]):
        self.config = ServeConfig(**config)
        self._damage_told = False  # check_health has logged that the artifact's files changed
        self._replaced_told = False  # ... or that another artifact took its path
        # Serve pickles this class by value, globals and all: the middleware reads its module's own
        # state, so it is reached through the module, not through this function's globals
        import slimml.serve.app as module
        import slimml.serve.guard as guard

        module._reuse_address()  # before Serve binds the direct-ingress port (after this constructor)
        guard.state.update(key_sha256=self.config.api_key_sha256, openapi=self.config.openapi,
                             timeout_s=self.config.request_timeout_s, bodies_bytes=self.config.max_bodies_bytes)
        expect = self.config.manifest_sha256  # the driver's manifest: this node's copy must be the same
        if self.config.stages:
            from slimml.scale import pipeline

            self.model = pipeline(self.config.artifact, stages=self.config.stages, microbatch=self.config.microbatch,
                                  memory_budget=self.config.memory_budget, pack=self.config.pack,
                                  cache_dir=self.config.cache_dir, manifest_sha256=expect)
        else:
            import ray

            from slimml.runtime import load

            cpus = ray.get_runtime_context().get_assigned_resources().get("CPU")
            self.model = load(self.config.artifact, threads=max(1, int(cpus)) if cpus else None,
                              memory_budget=self.config.memory_budget, pack=self.config.pack,
                              cache_dir=self.config.cache_dir, manifest_sha256=expect)
        limits = getattr(self.model, "limits", None)
        if limits is not None:
            if self.config.max_text_chars is not None:
                limits.max_text_chars = limits.max_prompt_chars = self.config.max_text_chars
            limits.max_batch_tokens = self.config.max_batch_tokens
            limits.max_window_tokens = self.config.max_window_tokens
        self.text_chars = limits.max_text_chars if limits is not None else self.config.max_text_chars or 16_384
        # the vocabulary bounds a pass's logits, where the model has an output of vocabulary width (a
        # decoder's, a masked LM's); a classifier's outputs are its labels: its budget is the plain one
        vocab = getattr(self.model, "vocab_size", None)
        if not any(shape and shape[-1] in (vocab, "vocab_size") for shape in
                   (getattr(o, "shape", None) for o in getattr(self.model, "outputs", []))):
            vocab = None
        self.batch_tokens = (limits.batch_tokens(vocab) if limits is not None
                             else self.config.max_batch_tokens or 8_192)
        self.name = self.config.name or self.model.manifest.name
        self._llm = None  # a language model's chat and completions: one continuous batch per replica
        if self.config.chat_template is not None:
            if not hasattr(self.model, "use_chat_template"):
                raise ConfigError(f"chat_template is for language models, and {self.name} is {a_or_an(self.model.kind)} "
                                  "artifact; leave --chat-template out.")
            self.model.use_chat_template(self.config.chat_template)
        if self.model.kind == "text-generation" and not self.config.stages:
            self._llm = LLMService(self.model, self.name, self.config.max_new_tokens, self.config.max_running,
                                   self.config.max_waiting, limits.prompt_chars(self.model.engine.max_sequence_length),
                                   prefill_tokens=self.config.prefill_tokens, prompt_lookup=self.config.prompt_lookup,
                                   prefix_bytes=self.config.prefix_bytes, reasoning=self.config.reasoning)
        # each request's prompt is put before its texts here: a batch holds the texts of requests that differ
        # a request's texts go to the model in calls of 8 batches (``_pieces``): one that times out or goes
        # away stops costing the model time after the call in progress (a 2,048-text request held it minutes)
        self._piece = 8 * self.config.batch_size
        self._width_seen: int | None = None  # the embeddings' width, once seen, where the manifest does not say it
        self._embed_batch = Batcher(partial(self.model.encode_with_counts, batch_size=self.config.batch_size, prompt=""),
                                    self.config.max_batch_size, self.config.batch_wait_ms / 1000,
                                    piece=self._piece, key=len)  # texts of like length in one call

    async def _body(self, request: Request) -> dict[str, Any]:
        return protocol.parse_json(await self._raw_body(request))

    async def _raw_body(self, request: Request) -> bytes:
        limit = self.config.max_body_bytes
        declared = request.headers.get("content-length")
        if declared and declared.isdigit() and int(declared) > limit:
            raise RequestError(f"the request body is {declared[:20]} bytes, more than this server takes ({limit}); "
                               "send smaller requests, or raise the limit (slimml serve --max-body-bytes).", 413)
        chunks, size = [], 0

        async def read() -> None:
            nonlocal size
            async for chunk in request.stream():
                size += len(chunk)
                if size > limit:
                    raise RequestError(f"the request body is over {limit} bytes, more than this server takes; send "
                                       "smaller requests, or raise the limit (slimml serve --max-body-bytes).", 413)
                chunks.append(chunk)

        try:  # a client that sends slowly holds a request slot: it gets a deadline
            await asyncio.wait_for(read(), self.config.body_timeout_s)
        except asyncio.TimeoutError:
            raise RequestError(f"the request body did not arrive within {self.config.body_timeout_s:g} s; send it at "
                               "once (slimml serve --body-timeout-s sets the limit).", 408) from None
        return b"".join(chunks)

    def _pieces(self, items: list[Any]) -> list[tuple[int, list[Any]]]:
        """``items`` in pieces of 8 model batches, each with where it starts. A route runs one piece a call:
        at its deadline, or when its client goes away, the route is cancelled at the call's await and
        the model is free after the piece in progress (one call of the whole request held it to the end)."""
        size = self._piece
        return [(start, items[start:start + size]) for start in range(0, len(items), size)]

    def _needs(self, method: str) -> None:
        """Refuse a route whose task method this artifact lacks (a 400 naming the route that works)."""
        if not self.model.supports(method):
            raise refusals.task_refusal(self.model.unsupported(method), self.model)

    @api.post("/v1/embeddings")
    async def embeddings(self, request: Request):
        data = await self._body(request)
        if self.model.supports("embed_images"):
            sent = data.get("input")
            if images.is_image(sent) or isinstance(sent, list) and any(images.is_image(i) for i in sent):
                return await self._image_embeddings(data)
            if not self.model.supports("encode_with_counts"):
                raise RequestError(f"this artifact ({self.model.kind!r}) embeds images, not texts; send each input as an "
                                   'image data URL ("data:image/png;base64,...").', param="input")
        if self._llm is not None and not self.model.supports("encode_with_counts"):
            raise RequestError(f"this artifact is a language model ({self.model.kind!r}), not a sentence-embedding one, so "
                               "it has no /v1/embeddings; use POST /v1/chat/completions or POST /v1/completions, or "
                               "serve an embedding artifact for embeddings.", 400)
        self._needs("encode_with_counts")
        protocol.check_model(data, self.name)
        texts = protocol.embedding_texts(data, self.config.max_texts, self.text_chars)
        try:
            prompt = self.model.text_prompt(protocol.prompt_name(data))  # the model's default, or the one named
        except FeedError as e:
            raise RequestError(str(e), param="prompt_name") from None
        width = self._embedding_size() or self._width_seen
        size = protocol.dimensions(data, width)
        self._response_fits(len(texts) * (size or width or 0))  # a sparse model's: 30,522 a text
        emb, counts = await self._embed_batch([prompt + t for t in texts] if prompt else texts)  # with concurrent requests' texts
        pooling = self.model.manifest.pooling
        emb = protocol.shortened(emb, size, normalized=pooling is None or bool(pooling.get("normalize", True)))
        self._response_fits(emb.size)  # where the size was not known before
        if emb.ndim == 2 and size is None:  # a width the manifest does not give: the next request is checked first
            self._width_seen = emb.shape[1]
        body = protocol.embeddings_response(emb, self.name, sum(counts), protocol.encoding_format(data))
        return Response(protocol.dumps(body), media_type="application/json")

    async def _image_embeddings(self, data: dict[str, Any]) -> Response:
        """``/v1/embeddings`` of images (data URLs) for a model that embeds them (CLIP's vision tower,
        ViTModel): unit-length vectors, as ``model.embed_images`` gives them; ``usage`` counts no tokens."""
        protocol.check_model(data, self.name)
        sent = data["input"] if isinstance(data["input"], list) else [data["input"]]
        text = next((i for i, item in enumerate(sent) if not images.is_image(item)), None)
        if text is not None:
            raise RequestError(f'"input"[{text}] is not an image data URL, and the others are images; send texts and '
                               "images in requests of their own.", param=f"input[{text}]")
        fmt = protocol.encoding_format(data)
        if data.get("prompt_name") is not None:
            raise RequestError('"prompt_name" puts a text before each text; images have none: leave it out.',
                               param="prompt_name")
        size = protocol.dimensions(data)
        opened = await asyncio.to_thread(images.open_images, sent, "input", self.config.max_texts)
        self._response_fits(len(opened.opened) * (size or 0))
        emb = []
        with images.decoding(opened):
            for _, piece in self._pieces(await asyncio.to_thread(opened.decode)):
                emb.append(await asyncio.to_thread(self.model.embed_images, piece, self.config.batch_size))
        found = protocol.shortened(np.concatenate(emb), size, normalized=True)
        self._response_fits(found.size)
        return Response(protocol.dumps(protocol.embeddings_response(found, self.name, 0, fmt)), media_type="application/json")

    def _response_fits(self, values: int) -> None:
        if values > self.config.max_response_values:
            raise RequestError(f"the embeddings of this request hold {values:,} values, more than the "
                               f"{self.config.max_response_values:,} this server answers at once; send fewer texts a "
                               "request (or ask for fewer \"dimensions\"), or raise the limit (slimml serve "
                               "--max-response-values).", 413, param="input")

    def _embedding_size(self) -> int | None:
        """The size of the model's embeddings, where its manifest says it (the pooled output's last
        axis, or its pooling's last projection)."""
        pooler = getattr(self.model, "pooler", None)
        shape = next((t.shape for t in self.model.manifest.outputs if pooler is not None and t.name == pooler.output), None)
        return pooler.size(shape[-1] if shape and isinstance(shape[-1], int) else None) if pooler is not None else None

    @api.post("/v1/rerank")
    async def rerank(self, request: Request):
        """Documents ranked by a cross-encoder's relevance to a query (the shape of Jina's, Cohere's
        and vLLM's ``/v1/rerank``)."""
        data = await self._body(request)
        self._needs("rerank_with_counts")
        protocol.check_model(data, self.name)
        query, documents, top_n, returned = protocol.rerank_request(data, self.config.max_texts, self.text_chars)
        ranked, tokens = [], []
        for start, piece in self._pieces(documents):  # every document scored, a piece at a time; then ranked as one list
            got, counts = await asyncio.to_thread(self.model.rerank_with_counts, query, piece, None, self.config.batch_size)
            ranked += [{"index": r["index"] + start, "score": r["score"]} for r in got]
            tokens += counts
        ranked = sorted(ranked, key=lambda r: (-r["score"], r["index"]))[: top_n or len(ranked)]
        return protocol.rerank_response(ranked, returned, self.name, sum(tokens))

    @api.post("/v1/entities")
    async def entities(self, request: Request):
        """Each text's named entities (token classifiers), as ``model.entities`` gives them."""
        data = await self._body(request)
        self._needs("entities")
        protocol.check_model(data, self.name)
        texts, options = protocol.entities_request(data, self.config.max_texts, self.text_chars)
        found = []
        for _, piece in self._pieces(texts):
            found += await asyncio.to_thread(self.model.entities, piece, batch_size=self.config.batch_size, **options)
        return protocol.spans_response(found, "entities", self.name)

    @api.post("/v1/classify")
    async def classify(self, request: Request):
        """Each input's classes with their scores, best first, as ``model.classify`` gives them: texts
        (text classifiers), images as data URLs (image classifiers; CLIP against ``labels``)."""
        data = await self._body(request)
        self._needs("classify")
        if refusals.serving_routes("classify", self.model) is None:
            raise refusals.task_refusal(self.model.unsupported("classify"), self.model)
        protocol.check_model(data, self.name)
        options: dict[str, Any] = {"batch_size": self.config.batch_size}
        if self.model.kind == "text-classification":
            items, options["top_k"] = protocol.classify_request(data, self.config.max_texts, self.text_chars)
        else:  # images, decoded here (never a path or an address: a text would have been read as a file)
            raw, options["top_k"], labels = images.image_classify_request(
                data, self.config.max_texts, self.model.kind == "zero-shot-image-classification", self.text_chars)
            if labels is not None:
                options["labels"] = labels
            opened = await asyncio.to_thread(images.open_images, raw, "input", self.config.max_texts)
            with images.decoding(opened):
                found = await self._classify(await asyncio.to_thread(opened.decode), options)
            return protocol.spans_response(found, "labels", self.name)
        return protocol.spans_response(await self._classify(items, options), "labels", self.name)

    async def _classify(self, items: list, options: dict[str, Any]) -> list:
        found = []
        for _, piece in self._pieces(items):
            found += await asyncio.to_thread(self.model.classify, piece, **options)
        return found

    @api.post("/v1/answer")
    async def answer(self, request: Request):
        """The answers to each question in its context (extractive question answering), as
        ``model.answer`` gives them, a list per question."""
        data = await self._body(request)
        self._needs("answer")
        protocol.check_model(data, self.name)
        question, context, options = protocol.answer_request(data, self.config.max_texts)
        if isinstance(question, str) and isinstance(context, str):
            got = [await asyncio.to_thread(self.model.answer, question, context, batch_size=self.config.batch_size, **options)]
        else:  # pairs (a question for each context, or one of either for all), a piece at a time, as entities go
            n = len(question) if isinstance(question, list) else len(context)
            questions = question if isinstance(question, list) else [question] * n
            contexts = context if isinstance(context, list) else [context] * n
            got = []
            for start, piece in self._pieces(list(zip(questions, contexts))):
                got += await asyncio.to_thread(self.model.answer, [q for q, _ in piece], [c for _, c in piece],
                                               batch_size=self.config.batch_size, **options)
        return protocol.spans_response([g if isinstance(g, list) else [g] for g in got], "answers", self.name)

    @api.post("/v1/run")
    async def run(self, request: Request):
        data = await self._body(request)
        protocol.check_model(data, self.name)
        feeds, wanted, encoding = protocol.run_inputs(data)
        protocol.check_run_budget(feeds, getattr(self.model, "inputs", []), getattr(self.model, "max_sequence_length", None),
                                  self.config.max_texts, self.batch_tokens, getattr(self.model, "outputs", []), wanted,
                                  self.config.max_response_values)
        try:
            out = await asyncio.to_thread(self.model.run, feeds)
        except FeedError as e:  # the engine's checks name the input at fault: its param
            named = re.search(r"input '([^']+)'", str(e))
            if isinstance(e, OutOfMemoryError) or named is None:
                raise
            raise RequestError(str(e), param=f"inputs.{named.group(1)}"[:80]) from None
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
        if getattr(self.model, "speech", False):  # its prompts are audio: a text here would be read as a path
            raise RequestError("this artifact is a speech model: it transcribes audio, which POST /v1/generate does not "
                               "take; send the audio file to POST /v1/audio/transcriptions.", 400)
        protocol.check_model(data, self.name)
        # prompts are not cut here: generate refuses one past its characters (a decoder's prompt loses
        # its end to a cut) or, for an encoder-decoder, its encoder reads what its length allows
        seq2seq = self.model.kind == "text2text-generation"
        prompts, n, options = protocol.generate_request(data, self.config.max_new_tokens, self.config.max_texts, None,
                                                        getattr(self.model, "vocab_size", None),
                                                        protocol.SEQ2SEQ_OPTIONS if seq2seq else (), bool(self.config.stages))
        if not seq2seq:  # greedy, as this route promises, whatever the model's generation config samples
            options["temperature"] = 0
        cancel = threading.Event()  # both generating tasks take it (a decoder's was lost to a check of its signature)
        try:
            gen = await asyncio.to_thread(self.model.generate, prompts, n, cancel=cancel, **options)
        except asyncio.CancelledError:  # the client went away, or the request timed out: stop decoding
            cancel.set()
            raise
        return protocol.generate_response(gen, self.name)

    @api.post("/v1/audio/transcriptions")
    async def transcriptions(self, request: Request):
        """A recording's transcript (speech artifacts: Whisper), in the shape of OpenAI's
        ``/v1/audio/transcriptions`` (a multipart form with the WAV ``file``)."""
        if not getattr(self.model, "speech", False):
            raise refusals.task_refusal(self.model.unsupported("transcribe"), self.model)
        raw = await self._raw_body(request)
        form = await asyncio.to_thread(transcription.form_fields, raw, request.headers.get("content-type"))
        req = transcription.transcription_request(form, self.name)
        if "language" in req.options:
            try:
                self.model.language_id(req.options["language"])
            except FeedError as e:
                raise RequestError(str(e), param="language") from None
        rate = self.model.sampling_rate
        cancel = threading.Event()
        try:  # read off the event loop (which answers /health meanwhile)
            wave = await asyncio.to_thread(wav_from_bytes, req.audio, req.filename, rate)
            gen = await asyncio.to_thread(self.model.generate, [wave], None, cancel=cancel, **req.options)
        except FeedError as e:  # the recording's own faults (its format, its length) name the file field
            raise RequestError(str(e), param="file") from None
        except asyncio.CancelledError:  # the client went away, or the request timed out: stop transcribing
            cancel.set()
            raise
        body, media = transcription.transcription_response(gen.texts[0] if gen.texts else "", wave.size / rate,
                                                           req.response_format)
        return Response(protocol.dumps(body) if isinstance(body, dict) else body, media_type=media)

    @api.post("/v1/chat/completions")
    async def chat_completions(self, request: Request):
        return await self._complete(request, "chat")

    @api.post("/v1/completions")
    async def completions(self, request: Request):
        return await self._complete(request, "completions")

    @api.post("/v1/responses")
    async def responses(self, request: Request):
        return await self._complete(request, "responses")

    async def _complete(self, request: Request, api: str):
        data = await self._body(request)
        if self._llm is None:
            if self.model.kind == "text-generation":  # a language model over pipeline stages: one request a pass
                raise RequestError("this language model is served over pipeline stages (--stages), which answer POST "
                                   "/v1/generate only (greedy, no continuous batching); use POST /v1/generate, or serve "
                                   "the model without --stages for chat, completions and responses.", 400)
            works = "POST /v1/embeddings" if self.model.supports("encode_with_counts") else (
                "POST /v1/generate" if self.model.supports("generate") else None)
            use = f"use {works}, or POST /v1/run for its raw outputs" if works else "use POST /v1/run for its raw outputs"
            raise RequestError(f"this artifact is {a_or_an(repr(self.model.kind))} model, not a language model, so it "
                               f"has no /v1/chat/completions, /v1/completions or /v1/responses; {use}.", 400)
        protocol.check_model(data, self.name)
        await asyncio.to_thread(self.model.check_files)  # a changed artifact: 503 with the reason, before a stream's 200
        answer = await self._llm.answer(data, api)
        if isinstance(answer, dict):
            return Response(protocol.dumps(answer), media_type="application/json")
        return StreamingResponse(answer, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})

    @api.api_route("/health", methods=["GET", "HEAD"])  # uptime probes send HEAD
    async def health(self):
        await asyncio.to_thread(self.model.check_files)  # IntegrityError -> 503
        body = {"status": "ok", "model": self.name}
        if await asyncio.to_thread(self._replaced):  # still serving, but not what its path now holds
            body["artifact"] = ("moved or replaced since the server started: it serves the one it loaded; restart it to serve "
                                "what is at its path now")
        if self._llm is not None:  # answers being generated, waiting, and the batch's KV cache in bytes
            body["generation"] = self._llm.worker.load
        return body

    @api.get("/v1/models")
    async def models(self):
        return {"object": "list", "data": [self._model_card()]}

    @api.get("/v1/models/{model:path}")
    async def model_card(self, model: str):
        """OpenAI's model retrieval (``client.models.retrieve(name)``): the served model, else 404."""
        protocol.check_model({"model": model}, self.name)
        return self._model_card()

    def _model_card(self) -> dict[str, Any]:
        m = self.model.manifest
        made = (Path(self.config.artifact) / MANIFEST_NAME).stat().st_mtime  # OpenAI's created: when the artifact was written
        return {"id": self.name, "object": "model", "created": int(made), "owned_by": "slimml", "task": m.task,
                "shards": len(m.shards), "stages": self.config.stages}

    def check_health(self):
        """Serve's own probe. A replica whose artifact's files changed on disk (damaged, tampered
        with, or replaced by a new convert) stays up answering 503 with the reason: a new replica
        could not load them (it refuses an artifact other than the one the server started on), so
        Serve would restart it again and again, every route hanging meanwhile. It says so once in
        the server's log: restart the server to serve a new artifact. A pipeline stage that died for
        good fails the probe, so that Serve replaces the replica and its stages."""
        try:
            self.model.check_files()
        except IntegrityError as e:
            if not self._damage_told:
                log.error("slimml: %s; every request gets 503 until the server is restarted (on the new artifact, if "
                          "one replaced it).", e)
                self._damage_told = True
            return
        if not self._replaced_told and self._replaced():
            log.error("slimml: the artifact at %s was moved or replaced since this server started: the replicas serve the "
                      "one they loaded (its files intact), but a replica that stops cannot start again there (the server "
                      "pinned its manifest); restart the server to serve what is at that path now.", self.config.artifact)
            self._replaced_told = True

    def _replaced(self) -> bool:
        """Whether the files at the artifact's path are no longer the ones this replica loaded (a new
        artifact renamed into place: what ``slimml convert`` does to its output folder)."""
        return bool(getattr(self.model, "replaced", False))


def _reuse_address() -> None:
    """Direct ingress: the replica's listening socket gets SO_REUSEADDR, as uvicorn's and Serve's proxy's have.
    Serve binds it without, so after a replica dies its replacement cannot bind the port while a connection the
    dead one closed is in TIME_WAIT (60 s on Linux). SO_REUSEADDR still refuses a port something listens on."""
    import os
    import socket
    import types

    if os.environ.get("RAY_SERVE_ENABLE_DIRECT_INGRESS") != "1":
        return
    try:
        from ray.serve._private import http_util
    except ImportError:
        return
    if not hasattr(http_util, "socket") or getattr(http_util.socket, "reuse_address", False):
        return  # a Ray that binds otherwise (ray[serve] is pinned: checked against 2.60), or patched already

    class _Socket(socket.socket):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)

    shim = types.ModuleType("socket")
    shim.__dict__.update(vars(socket))
    shim.socket, shim.reuse_address = _Socket, True
    http_util.socket = shim


# How often Serve probes each replica (``check_health``: a stat of its files). Serve's default is 10 s;
# at 2 s a dead or tampered replica is replaced about 8 s sooner, for a call that costs microseconds.
HEALTH_CHECK_S = 2.0


def app(config: ServeConfig, cpus_per_replica: float | None = None, memory_bytes: int | None = None):
    """The Serve application for ``config`` (bind it with ``serve.run``)."""
    cpus = config.cpus_per_replica or cpus_per_replica or 1  # fractional when replicas outnumber CPUs
    actor = {"num_cpus": 0 if config.stages else cpus}
    if memory_bytes:  # a streamed model: Ray places a replica only on a node with room for its budget
        actor["memory"] = memory_bytes
    return SlimmlServer.options(
        num_replicas=config.replicas, max_ongoing_requests=config.max_ongoing_requests,
        max_queued_requests=config.max_queued_requests,
        ray_actor_options=actor, health_check_period_s=HEALTH_CHECK_S,
    ).bind(config.to_args())


def build(args: dict[str, Any]):
    """Application builder for ``serve run slimml.serve.app:build artifact=PATH [key=value ...]``
    and for a config YAML's ``import_path``; keys are :class:`ServeConfig`'s fields.

    The artifact's path is made absolute where it is built (a replica resolves a relative one from
    Ray's folder, not the one ``serve run`` started in), and its ``manifest.json`` pinned, as
    ``slimml serve`` pins it: every replica, and one that replaces a replica later, serves this
    artifact or refuses to start, never another one moved to the same path."""
    import dataclasses

    config = ServeConfig.from_args(args)
    path = Path(config.artifact)
    if not path.is_absolute() and not path.exists():
        raise ConfigError(f"the artifact {config.artifact!r} is a relative path, and {Path.cwd()} (where Ray builds "
                          "this Serve application) has no such folder; give its absolute path in the config's args "
                          "(the same path on every node).")
    manifest = read_manifest(path)
    return app(dataclasses.replace(config, artifact=str(path.resolve()), manifest_sha256=config.manifest_sha256
                                   or manifest.sha256))
