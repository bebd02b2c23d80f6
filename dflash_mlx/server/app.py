"""The HTTP side: FastAPI routes, server-sent events and OpenAI-shaped errors.

A route validates its request (`protocol.py`), checks the model name and the context
length, tokenizes, queues the request on the engine worker and turns the
`GenerationResponse`s it streams back into OpenAI responses or SSE chunks. Every error
leaves through `error_response`, so clients always get `{"error": {message, type, param,
code}}` with the right status. Never touches MLX: the worker does.
"""

from __future__ import annotations

import asyncio
import copy
import hmac
import json
import threading
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any, Literal

import uvicorn
from fastapi import APIRouter, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, Response, StreamingResponse
from jinja2 import TemplateError
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException

from .. import __version__
from ..generate import encode_prompt
from .engine import Engine, EngineClosed, Job, QueueFull
from .protocol import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    Tally,
    chat_chunk,
    chat_completion,
    new_id,
    text_chunk,
    text_completion,
    usage_chunk,
)

Kind = Literal["chat", "text"]


@dataclass
class ServerSettings:
    model_id: str  # the name /v1/models lists
    aliases: set[str] = field(default_factory=set)  # other names requests may use for it
    draft_id: str | None = None
    api_key: str | None = None
    default_max_tokens: int = 2048
    context_length: int | None = None  # None: no limit checked

    def __post_init__(self) -> None:
        if self.default_max_tokens < 1:
            raise ValueError(f"default max tokens {self.default_max_tokens} must be >= 1")
        if self.context_length is not None and self.context_length < 2:
            raise ValueError(f"context length {self.context_length} must be >= 2")


# ---------------------------------------------------------------------------------------
# Errors: the one place where anything becomes an HTTP error response.


def as_api_error(exc: BaseException, request: Request | None = None) -> APIError:
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, RequestValidationError):
        return _validation_error(exc.errors())
    if isinstance(exc, StarletteHTTPException):
        kind = "invalid_request_error" if exc.status_code < 500 else "server_error"
        where = f"{request.method} {request.url.path}: " if request is not None else ""
        return APIError(exc.status_code, f"{where}{exc.detail}", type=kind)
    if isinstance(exc, QueueFull):
        return APIError(
            503,
            f"The server is busy: {exc}.",
            type="server_error",
            code="queue_full",
            headers={"Retry-After": str(exc.retry_after)},
        )
    if isinstance(exc, EngineClosed):
        return APIError(503, str(exc), type="server_error", code="shutting_down")
    if isinstance(exc, ValueError):
        return APIError(400, str(exc))
    return APIError(500, f"internal error: {type(exc).__name__}: {exc}", type="server_error")


def error_response(exc: BaseException, request: Request | None = None) -> JSONResponse:
    err = as_api_error(exc, request)
    return JSONResponse(err.body(), status_code=err.status, headers=err.headers)


def _param(loc: tuple) -> str | None:
    """pydantic's error location as OpenAI writes a param: messages[0].content."""
    out = ""
    for part in loc:
        if part == "body":
            continue
        if isinstance(part, int):
            out += f"[{part}]"
        elif part.isidentifier():  # skips union members such as "list[str]"
            if part in ("str", "int", "float", "bool", "list", "dict", "none"):
                continue
            out += f".{part}" if out else part
    return out or None


def _validation_error(errors: list[dict[str, Any]]) -> APIError:
    e = errors[0]
    kind, param, msg = e["type"], _param(tuple(e["loc"])), e["msg"]
    if kind == "json_invalid":
        detail = e.get("ctx", {}).get("error", msg)
        return APIError(400, f"We could not parse the JSON body of your request ({detail}).")
    if param is None:
        return APIError(400, f"The request body must be a JSON object: {msg}.")
    if kind == "missing":
        return APIError(
            400,
            f"Missing required parameter: '{param}'.",
            param=param,
            code="missing_required_parameter",
        )
    if kind == "unsupported_parameter":
        return APIError(400, f"Unsupported parameter '{param}': {msg}.", param=param, code=kind)
    if kind.endswith("_type") or kind.endswith("_parsing"):
        return APIError(
            400, f"Invalid type for '{param}': {msg}.", param=param, code="invalid_type"
        )
    return APIError(400, f"Invalid '{param}': {msg}.", param=param, code="invalid_value")


# ---------------------------------------------------------------------------------------
# Middleware (pure ASGI, so streaming and disconnects pass through untouched).


class _AuthAndJson:
    """`--api-key`: a Bearer token on /v1; a body sent without a JSON content type is JSON.

    `curl -d '{...}'` sends `application/x-www-form-urlencoded`; OpenAI-style servers read
    the body as JSON anyway, so the header is corrected before FastAPI parses it.
    """

    def __init__(self, app, api_key: str | None):
        self.app = app
        self.api_key = api_key

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope["headers"])
        if self.api_key and scope["path"].startswith("/v1"):
            scheme, _, token = headers.get(b"authorization", b"").decode("latin-1").partition(" ")
            if scheme.lower() != "bearer" or not hmac.compare_digest(
                token.strip().encode(), self.api_key.encode()
            ):
                given = "no API key" if not token.strip() else "an incorrect API key"
                err = APIError(
                    401,
                    f"You provided {given}: pass it as 'Authorization: Bearer KEY' "
                    "(the server's --api-key).",
                    code="invalid_api_key",
                    headers={"WWW-Authenticate": "Bearer"},
                )
                return await error_response(err)(scope, receive, send)
        if scope["method"] == "POST":
            ctype = headers.get(b"content-type", b"").split(b";")[0].strip().lower()
            if ctype in (b"", b"application/x-www-form-urlencoded", b"text/plain"):
                headers[b"content-type"] = b"application/json"
                scope = {**scope, "headers": list(headers.items())}
        return await self.app(scope, receive, send)


# ---------------------------------------------------------------------------------------
# The application.


def create_app(engine: Engine, settings: ServerSettings) -> FastAPI:
    """The OpenAI-compatible app over `engine`; starting it starts the engine worker."""

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        engine.start()
        yield
        engine.close()

    app = FastAPI(
        title="dflash-mlx",
        version=__version__,
        description="OpenAI-compatible API over lossless DFlash speculative decoding.",
        lifespan=lifespan,
    )
    handled = (APIError, RequestValidationError, StarletteHTTPException, QueueFull, EngineClosed)
    for exc_type in (*handled, ValueError, Exception):
        app.add_exception_handler(exc_type, lambda request, exc: error_response(exc, request))
    app.add_middleware(_AuthAndJson, api_key=settings.api_key)
    # Browser clients call local servers from other origins, as with llama-server and
    # mlx_lm.server; added last, so preflight requests are answered before the key check.
    app.add_middleware(
        CORSMiddleware, allow_origins=["*"], allow_methods=["*"], allow_headers=["*"]
    )

    names = {settings.model_id, *settings.aliases}
    created = int(time.time())
    # The app tokenizes on its own copy (off the event loop, one at a time): the worker
    # detokenizes with the original, and HF tokenizers are not safe to share across threads.
    tokenizer = copy.deepcopy(engine.tokenizer)
    tokenizer_lock = threading.Lock()

    def model_card() -> dict[str, Any]:
        return {
            "id": settings.model_id,
            "object": "model",
            "created": created,
            "owned_by": "dflash-mlx",
            "draft": settings.draft_id,
            "context_length": settings.context_length,
        }

    def check_model(name: str | None) -> None:
        if name and name not in names:
            raise APIError(
                404,
                f"The model '{name}' does not exist: this server serves '{settings.model_id}'.",
                param="model",
                code="model_not_found",
            )

    def encode(prompt: Any) -> list[int]:
        with tokenizer_lock:
            return encode_prompt(tokenizer, prompt)

    async def tokenize(prompt: Any, param: str) -> list[int]:
        try:
            ids = await run_in_threadpool(encode, prompt)
        except (ValueError, TemplateError) as e:
            raise APIError(400, f"Invalid '{param}': {e}", param=param) from None
        vocab = engine.vocab_size
        bad = [t for t in ids if t < 0 or (vocab is not None and t >= vocab)]
        if bad:  # token id prompts: an id past the embedding would read garbage
            valid = f"0..{vocab - 1}" if vocab is not None else ">= 0"
            raise APIError(
                400,
                f"Invalid '{param}': token id {bad[0]} is outside the vocabulary ({valid})",
                param=param,
                code="invalid_value",
            )
        return ids

    def budget(body: ChatCompletionRequest | CompletionRequest, n: int, param: str) -> int:
        """max_tokens for this request: asked for (or the default), cut to the context left."""
        limit = settings.context_length
        if limit is not None and n >= limit:
            raise APIError(
                400,
                f"This model's maximum context length is {limit} tokens. However, your "
                f"{param} resulted in {n} tokens. Please reduce the length of the {param}.",
                param=param,
                code="context_length_exceeded",
            )
        wanted = body.requested_max_tokens() or settings.default_max_tokens
        return wanted if limit is None else min(wanted, limit - n)

    async def respond(
        kind: Kind, body: ChatCompletionRequest | CompletionRequest, ids: list[int], request
    ) -> Response:
        param = "messages" if kind == "chat" else "prompt"
        params = body.sampling(budget(body, len(ids), param))
        job = engine.submit(ids, **params)
        rid, model = new_id(kind), body.model or settings.model_id
        if body.stream:
            return StreamingResponse(
                _events(kind, job, rid, model, body.include_usage),
                media_type="text/event-stream",
                headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
            )
        text, tally = await _collect(job, request)
        if tally.last is None:  # the client left before anything was generated
            return Response(status_code=499)
        build = chat_completion if kind == "chat" else text_completion
        return JSONResponse(build(rid, model, text, tally))

    router = APIRouter(prefix="/v1")

    @router.get("/models")
    async def list_models() -> dict[str, Any]:
        return {"object": "list", "data": [model_card()]}

    @router.get("/models/{name:path}")
    async def retrieve_model(name: str) -> dict[str, Any]:
        check_model(name)
        return model_card()

    @router.post("/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        """Chat completion (`stream: true` for server-sent events); DFlash stats in `timings`."""
        check_model(body.model)
        if not getattr(tokenizer, "has_chat_template", False):
            raise APIError(
                400,
                "This model's tokenizer has no chat template: use /v1/completions with a prompt.",
                param="messages",
            )
        ids = await tokenize(body.template_messages(), "messages")
        return await respond("chat", body, ids, request)

    @router.post("/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        """Text completion of `prompt` (a string or token ids); DFlash stats in `timings`."""
        check_model(body.model)
        ids = await tokenize(body.prompt, "prompt")
        return await respond("text", body, ids, request)

    app.include_router(router)

    @app.get("/health")
    async def health() -> JSONResponse:
        """`ok` once the worker is warm (503 while it warms up), and the queue's state."""
        status = "error" if engine.error else "ok" if engine.ready else "loading"
        payload = {"status": status, "model": settings.model_id, **engine.status()}
        if engine.error:
            payload["error"] = engine.error
        return JSONResponse(payload, status_code=200 if status == "ok" else 503)

    return app


class _Server(uvicorn.Server):
    engine: Engine

    async def shutdown(self, sockets=None) -> None:
        # End running and queued requests now (503 / an error event) rather than letting
        # uvicorn wait for them and then cancel them mid-flight.
        self.engine.close(timeout=0)
        await super().shutdown(sockets)


def create_server(
    engine: Engine, settings: ServerSettings, *, log_level: str = "info"
) -> uvicorn.Server:
    """A uvicorn server for the app; `.run(sockets=[sock])` serves until SIGINT/SIGTERM."""
    config = uvicorn.Config(
        create_app(engine, settings), log_level=log_level, timeout_graceful_shutdown=5
    )
    server = _Server(config)
    server.engine = engine
    return server


def _event(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


async def _events(
    kind: Kind, job: Job, rid: str, model: str, include_usage: bool
) -> AsyncIterator[str]:
    """The SSE stream of one request. Leaving it early (client gone) cancels the job."""
    created = int(time.time())
    tally = Tally()
    try:
        if kind == "chat":
            yield _event(chat_chunk(rid, model, created, {"role": "assistant", "content": ""}))
        async for r in job.responses():
            tally.add(r)
            if r.text:
                if kind == "chat":
                    yield _event(chat_chunk(rid, model, created, {"content": r.text}))
                else:
                    yield _event(text_chunk(rid, model, created, r.text))
        if kind == "chat":
            last = chat_chunk(rid, model, created, {}, tally.finish_reason)
        else:
            last = text_chunk(rid, model, created, "", tally.finish_reason)
        yield _event({**last, "timings": tally.timings()})
        if include_usage:
            yield _event(usage_chunk(rid, model, created, kind, tally))
        yield "data: [DONE]\n\n"
    except Exception as e:  # headers are sent: the error travels as an event
        yield _event(as_api_error(e).body())
    finally:
        job.cancel()


async def _collect(job: Job, request: Request) -> tuple[str, Tally]:
    """All of a request's text; a client that disconnects meanwhile cancels the job."""

    async def watch() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass
        job.cancel()

    watcher = asyncio.create_task(watch())
    tally, parts = Tally(), []
    try:
        async for r in job.responses():
            tally.add(r)
            parts.append(r.text)
    finally:
        watcher.cancel()
        job.cancel()
    return "".join(parts), tally
