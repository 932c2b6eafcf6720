"""How a replica refuses: slimml's errors, and FastAPI's own refusals, as OpenAI error bodies with the
status that fits; and which route serves each task method, so that a refusal names the one that works."""

# no `from __future__ import annotations`: FastAPI reads the handlers' annotations at run time

from typing import Any

from fastapi import FastAPI, Request
from starlette.exceptions import HTTPException as StarletteHTTPException

from slimml.errors import (ArtifactError, FeedError, IntegrityError, OutOfMemoryError, RequestError, SlimmlError,
                           StageError, TaskError, TooLargeError)
import slimml.serve.protocol as protocol
from slimml.serve.guard import error_response, log
from slimml.serve.llm import RETRY_AFTER_S
from slimml.runtime.tasks.limits import a_or_an


async def request_error(request: Request, e: RequestError):
    retry = {"Retry-After": str(RETRY_AFTER_S)} if e.status in (429, 503) else None
    return error_response(str(e), e.status, retry, e.param)


ROUTES = ("POST /v1/chat/completions, POST /v1/completions, POST /v1/responses, POST /v1/embeddings, POST /v1/rerank, "
          "POST /v1/entities, POST /v1/answer, POST /v1/classify, POST /v1/audio/transcriptions, POST /v1/generate, POST /v1/run, GET /health, GET /v1/models, "
          "GET /v1/models/{model}")


async def http_error(request: Request, e: StarletteHTTPException):
    # FastAPI's own refusals (no such route, a method the route does not take) in OpenAI's body
    where = f"{request.method} {request.url.path}"
    allow = (e.headers or {}).get("Allow") or (e.headers or {}).get("allow")
    if e.status_code == 405 and allow:
        message = f"{where} is not allowed; send {' or '.join(m.strip() for m in allow.split(','))} {request.url.path}."
    elif e.status_code == 404:
        message = f"there is no {where} here; this server answers {ROUTES}."
    else:
        message = f"{where}: {e.detail}."
    return error_response(message, e.status_code, dict(e.headers) if e.headers else None)


_MODEL_OPTIONS = frozenset(protocol.ENTITY_OPTIONS + protocol.ANSWER_OPTIONS + protocol.SEQ2SEQ_OPTIONS)  # a refusal naming one: its param


async def feed_error(request: Request, e: FeedError):
    if isinstance(e, OutOfMemoryError):  # the server's memory, not the request's fault: retry, or send less
        return error_response(str(e), 503, {"Retry-After": str(RETRY_AFTER_S)})
    first = str(e).split(" ", 1)[0]
    return error_response(str(e), 413 if isinstance(e, TooLargeError) else 400,
                          param=first if first in _MODEL_OPTIONS else None)


# the route that serves each task method, and the kind of model it needs
_ROUTES = {"encode_with_counts": ("/v1/embeddings", "a sentence-embedding one"), "generate": ("/v1/generate", "a decoder"),
           "rerank": ("/v1/rerank", "a cross-encoder (one relevance output)"),
           "entities": ("/v1/entities", "a token classifier (named entities)"),
           "answer": ("/v1/answer", "an extractive question-answering model"),
           "classify": ("/v1/classify", "a classifier"),
           "transcribe": ("/v1/audio/transcriptions", "a speech model")}
_SAME = {"encode": "encode_with_counts", "embed_texts": "encode_with_counts",
         "rerank_with_counts": "rerank"}  # methods behind one route


# the kinds /v1/classify serves: texts, images (data URLs), and images against candidate labels (CLIP)
_CLASSIFIED = ("text-classification", "image-classification", "zero-shot-image-classification")


def serving_routes(method: str, model: Any = None) -> str | None:
    """The routes that serve task ``method`` on ``model`` (None: on a model of the usual kind for it),
    or None where no route does: a language model's generation is OpenAI's chat and completions, a
    speech model's is transcription, and /v1/classify classifies texts only (an image classifier's
    classify reads images)."""
    method = _SAME.get(method, method)
    if method not in _ROUTES:
        return None
    kind = getattr(model, "kind", None)
    if method == "generate" and (model is None or kind == "text-generation"):
        return "POST /v1/chat/completions, POST /v1/completions"
    if method == "transcribe" or (method == "generate" and getattr(model, "speech", False)):
        return "POST /v1/audio/transcriptions"
    if method == "classify" and model is not None and kind not in _CLASSIFIED:
        return None
    return f"POST {_ROUTES[method][0]}"


def task_refusal(e: TaskError, model: Any = None) -> RequestError:
    """A task method the artifact (``model``, where known) lacks, as the 400 that names the routes that would work."""
    route = _ROUTES.get(_SAME.get(e.method, e.method))
    if route is None:  # a method no route serves
        return RequestError(str(e), 400)
    works = dict.fromkeys(r for r in (serving_routes(m, model) for m in e.alternatives) if r)
    use = ", ".join(works) + ", or POST /v1/run for its raw outputs" if works else "POST /v1/run for its raw outputs"
    return RequestError(f"this artifact is {a_or_an(repr(e.task))} model, not {route[1]}, so it has no {route[0]}; use {use}.", 400)


async def task_error(request: Request, e: TaskError):
    refusal = task_refusal(e)
    return error_response(str(refusal), refusal.status)


async def slimml_error(request: Request, e: SlimmlError):
    # a changed artifact or a lost stage: not ready, not the client's fault; a broken artifact: the
    # server's; anything else slimml refuses in a route is the request's (text for a model without
    # a tokenizer, a shape it does not take)
    status = 503 if isinstance(e, (IntegrityError, StageError)) else 500 if isinstance(e, ArtifactError) else 400
    message = str(e)
    if isinstance(e, StageError) and "will not come back" in message:  # the Python advice, in a server's terms
        message = message.split(" Check the node", 1)[0] + (" This server's health check fails meanwhile, and Serve "
                                                             "replaces the replica with new stages: retry shortly.")
    headers = None
    if isinstance(e, StageError):
        headers = {"Retry-After": str(RETRY_AFTER_S)}
    elif isinstance(e, IntegrityError):  # no retry helps: the openai client retries any 5xx unless told so
        headers = {"x-should-retry": "false"}
    return error_response(message, status, headers)


async def value_error(request: Request, e: Exception):
    # a request value past what a dependency takes (a number too long to convert, an id past int64)
    log.warning("slimml: a request value raised %s: %s", type(e).__name__, e)
    return error_response(f"the request holds a value this server cannot take ({type(e).__name__}); check the "
                          "numbers and ids it sends.", 400)


def install(api: FastAPI) -> None:
    """Answer each of slimml's errors (and FastAPI's 404 and 405) on ``api`` in OpenAI's error body."""
    for kind, handler in ((RequestError, request_error), (StarletteHTTPException, http_error), (FeedError, feed_error),
                          (TaskError, task_error), (SlimmlError, slimml_error), (ValueError, value_error),
                          (OverflowError, value_error)):
        api.add_exception_handler(kind, handler)
