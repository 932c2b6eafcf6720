"""The replica's ASGI middleware: the API key, the hidden schema, the request deadline and the pool of body bytes.

Its settings are :data:`state`, set by the replica when it starts (one replica to a process).
"""

import asyncio
import hashlib
import hmac
import logging
from typing import Any

from fastapi.responses import JSONResponse

from slimml.errors import RequestError
import slimml.serve.protocol as protocol
from slimml.serve.openai import sse

log = logging.getLogger("ray.serve")
# what the middleware enforces, set by the replica: the API key's sha256, whether /openapi.json is
# served, the request timeout, and the body bytes all requests may hold at once
state: dict[str, Any] = {"key_sha256": None, "openapi": False, "timeout_s": 300.0, "bodies_bytes": 64 << 20,
                         "held": 0}  # held: body bytes of the requests in this replica now
OPEN = {"/health"}  # answered without the key: load balancers and Serve's probes


def error_response(message: str, status: int, headers: dict[str, str] | None = None,
                   param: str | None = None) -> JSONResponse:
    """``message`` in OpenAI's error body; one that names server paths, or a 5xx, is logged whole here."""
    if status >= 500 or message != protocol.public(message):
        log.warning("slimml: answered %d: %s", status, message)  # the whole message, paths included, stays here
    return JSONResponse(protocol.error_body(message, status, param), status_code=status, headers=headers)


class Guard:
    """ASGI middleware in front of every route: the API key, the hidden schema, and the request
    timeout. Plain ASGI rather than ``@api.middleware``: at the deadline the route itself is
    cancelled (a generate stops after its current pass), not only its answer abandoned."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope.get("path", "")
        if len(path) > 1 and path.endswith("/"):  # /v1/embeddings/ is /v1/embeddings (a 307 before, which clients
            path = path.rstrip("/") or "/"      # such as openai's do not follow for a POST)
            scope = {**scope, "path": path, "raw_path": path.encode("latin-1", "replace")}
        if path in ("/openapi.json", "/docs", "/redoc") and not state["openapi"]:
            return await error_response("no such endpoint.", 404)(scope, receive, send)
        if state["key_sha256"] is not None and path not in OPEN:
            headers = {k.lower(): v for k, v in scope.get("headers", [])}
            auth = headers.get(b"authorization", b"").decode("latin-1")
            given = auth[7:].strip() if auth[:7].lower() == "bearer " else headers.get(b"x-api-key", b"").decode("latin-1")
            digest = hashlib.sha256(given.encode("utf-8", "replace")).hexdigest()
            if not given or not hmac.compare_digest(digest, state["key_sha256"]):
                said = ("this server needs an API key: send the header `Authorization: Bearer KEY`." if not given else
                        "this API key is not the server's: send the key it was started with (--api-key or "
                        "SLIMML_API_KEY) in the header `Authorization: Bearer KEY`.")
                refused = error_response(said, 401, {"WWW-Authenticate": "Bearer"})
                return await refused(scope, receive, send)
        held = 0

        async def receiving():  # every body byte counts against the replica's pool until the request ends
            nonlocal held
            message = await receive()
            size = len(message.get("body", b"")) if message["type"] == "http.request" else 0
            if size and state["held"] + size > state["bodies_bytes"]:
                raise RequestError(f"this replica holds {state['bodies_bytes']} bytes of request bodies already; "
                                   "retry shortly, or raise the limit (slimml serve --max-bodies-bytes).", 503)
            state["held"] += size
            held += size
            return message

        started = ended = events = False

        async def sending(message):
            nonlocal started, ended, events
            if message["type"] == "http.response.start":
                started = True
                events = any(k.lower() == b"content-type" and v.startswith(b"text/event-stream")
                             for k, v in message.get("headers", []))
            elif message["type"] == "http.response.body":
                ended = not message.get("more_body", False)
            await send(message)

        try:
            await asyncio.wait_for(self.app(scope, receiving, sending), state["timeout_s"])
        except asyncio.TimeoutError:
            timeout = state["timeout_s"]
            message = (f"the request took longer than this server allows ({timeout:g} s), its own work or the "
                       "requests ahead of it; send smaller requests, retry when the server is less busy, or raise the "
                       "limit (slimml serve --request-timeout-s).")
            if not started:
                await error_response(message, 408)(scope, receive, send)
            elif events and not ended:  # a stream cut at its deadline says so and ends as streams end, not mid-air
                await send({"type": "http.response.body", "body": sse_timeout(message), "more_body": False})
        finally:
            state["held"] -= held


def sse_timeout(message: str) -> bytes:
    """The end of a stream cut at its deadline: OpenAI's error event, then ``[DONE]``."""
    return sse(protocol.error_body(message, 408)) + sse("[DONE]")
