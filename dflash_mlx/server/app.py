"""The HTTP side: the app, its routes per API, errors and health.

`openai_api.py`, `anthropic_api.py` and `responses_api.py` each translate their API onto
`core` (one request type, one event stream) and back; this module mounts them behind the
`security.Guard`, renders every error in the shape of the API it belongs to, and serves
`/v1/models`, `/health` and an offline `/docs`. Never touches MLX: the engine worker does.
"""

from __future__ import annotations

import copy
import html
import logging
import time
from collections.abc import Iterator
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import (
    FileResponse,
    HTMLResponse,
    JSONResponse,
    PlainTextResponse,
    Response,
)
from fastapi.staticfiles import StaticFiles
from starlette.exceptions import HTTPException as StarletteHTTPException
from uvicorn.config import LOGGING_CONFIG

from .. import __version__
from . import anthropic_api, openai_api, responses_api
from .core import APIError, Service, as_api_error
from .engine import Engine
from .metrics import Counting, Metrics
from .request import SAMPLING_DEFAULTS
from .security import LOOPBACK_ORIGIN, Guard, H11Protocol, Policy, key_matches

# The chat page at `/`: plain files, no build step; they load nothing from elsewhere.
PAGE = Path(__file__).parent / "page"
PAGE_HEADERS = {
    "Content-Security-Policy": "default-src 'self'; img-src 'self' data:; "
    "frame-ancestors 'none'; base-uri 'none'; form-action 'none'",
    "X-Content-Type-Options": "nosniff",
    "Cache-Control": "no-cache",
}


class PageFiles(StaticFiles):
    """The page's own files (`/page/...`), with the headers `/` has: its CSP (no framing,
    nothing from elsewhere), nosniff."""

    async def get_response(self, path: str, scope) -> Response:
        response = await super().get_response(path, scope)
        response.headers.update(PAGE_HEADERS)
        return response


@dataclass
class ServerSettings:
    model_id: str  # the name /v1/models lists
    aliases: set[str] = field(default_factory=set)  # other names requests may use for it
    draft_id: str | None = None
    api_key: str | None = None
    default_max_tokens: int = 2048
    # Sampling for requests that leave a field out (GenerateOptions names: temperature,
    # top_p, top_k, min_p, seed); unset ones take the APIs' own (temperature 1, no seed).
    sampling: dict[str, Any] = field(default_factory=dict)
    context_length: int | None = None  # None: no limit checked
    loopback_only: bool = True  # bound to loopback: answer loopback Host names only
    cors_origins: tuple[str, ...] = ()  # origins allowed besides loopback ones
    max_body_mb: float = 32.0
    body_timeout: float = 30.0  # seconds for the whole request body to arrive
    header_timeout: float = 5.0  # seconds for the whole request headers (and idle keep-alive)

    def __post_init__(self) -> None:
        if self.default_max_tokens < 1:
            raise ValueError(f"default max tokens {self.default_max_tokens} must be >= 1")
        unknown = set(self.sampling) - set(SAMPLING_DEFAULTS)
        if unknown:
            raise ValueError(f"sampling defaults {sorted(unknown)}: not sampling settings")
        if self.context_length is not None and self.context_length < 2:
            raise ValueError(f"context length {self.context_length} must be >= 2")
        if not self.max_body_mb > 0:
            raise ValueError(f"max body size {self.max_body_mb} MB must be > 0")
        for name in ("body_timeout", "header_timeout"):
            if not 0 < getattr(self, name) < float("inf"):
                raise ValueError(f"{name} {getattr(self, name)} s must be > 0 and finite")


# ---------------------------------------------------------------------------------------
# Errors: the one place where anything becomes an HTTP error response.


def is_anthropic(path: str) -> bool:
    return path.startswith("/v1/messages")


def render_error(err: APIError, path: str) -> JSONResponse:
    body = anthropic_api.error_body(err) if is_anthropic(path) else openai_api.error_body(err)
    return JSONResponse(body, status_code=err.status, headers=err.headers)


def to_api_error(exc: BaseException, request: Request) -> APIError:
    if isinstance(exc, RequestValidationError):
        return _validation_error(exc.errors())
    if isinstance(exc, StarletteHTTPException):
        return APIError(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}")
    return as_api_error(exc)


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


class Failures:
    """Any exception a route lets out becomes its error response here, and goes no further:
    Starlette would log it again (with a traceback) after its handler answered. Expected
    refusals (4xx, 503 queue_full / shutting_down / engine_restarting) are not logged at all
    beyond the access log; our own failures once, with their traceback (`as_api_error`)."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        started = False

        async def sending(message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, sending)
        except Exception as exc:
            if started:  # too late for an error response: uvicorn logs it, drops the client
                raise
            err = to_api_error(exc, Request(scope))
            await render_error(err, scope["path"])(scope, receive, send)


# ---------------------------------------------------------------------------------------
# The application.


def create_app(engine: Engine, settings: ServerSettings) -> FastAPI:
    """The app over `engine`; starting it starts the engine worker."""

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        engine.start()
        yield
        engine.close()

    app = FastAPI(
        title="dflash-mlx",
        version=__version__,
        description="OpenAI- and Anthropic-compatible API over lossless DFlash speculative "
        "decoding.",
        lifespan=lifespan,
        docs_url=None,  # FastAPI's pages load their scripts from a CDN: /docs is local
        redoc_url=None,
    )
    app.add_exception_handler(
        Exception, lambda request, exc: render_error(to_api_error(exc, request), request.url.path)
    )
    for exc_type in (APIError, RequestValidationError, StarletteHTTPException):
        app.add_exception_handler(
            exc_type,
            lambda request, exc: render_error(to_api_error(exc, request), request.url.path),
        )
    policy = Policy(
        loopback_only=settings.loopback_only,
        cors_origins=tuple(settings.cors_origins),
        api_key=settings.api_key,
        max_body_bytes=int(settings.max_body_mb * 1e6),
        body_timeout=settings.body_timeout,
    )
    metrics = Metrics()
    app.state.metrics = metrics
    app.add_middleware(Failures)  # innermost: its responses pass the CORS grants too
    app.add_middleware(Guard, policy=policy, render=render_error)
    # Outside the guard: its refusals are counted too (/metrics).
    app.add_middleware(Counting, metrics=metrics)
    # Added last, so a browser's preflight (which carries no key) is answered first; only
    # the allowed origins get a grant.
    app.add_middleware(
        CORSMiddleware,
        allow_origins=[o for o in settings.cors_origins if o != "*"],
        allow_origin_regex=".*" if "*" in settings.cors_origins else LOOPBACK_ORIGIN,
        allow_methods=["*"],
        allow_headers=["*"],
    )

    names = {settings.model_id, *settings.aliases}
    created = int(time.time())
    service = Service(
        engine,
        context_length=settings.context_length,
        default_max_tokens=settings.default_max_tokens,
        sampling=settings.sampling,
    )

    def model_card() -> dict[str, Any]:
        return {
            "id": settings.model_id,
            "object": "model",
            "created": created,
            "owned_by": "dflash-mlx",
            "draft": settings.draft_id,
            "context_length": settings.context_length,
        }

    def model_name(name: str | None, strict: bool = False) -> str:
        """The name a reply carries: the one asked for when it is the served model's (or an
        alias), else the served model's. A request naming another model is served by the
        loaded one, as mlx-lm's server and llama-server do (clients hard-code names);
        `strict` (retrieving a model by name) refuses it."""
        if name and name in names:
            return name
        if name and strict:
            raise APIError(
                404,
                f"The model '{name}' does not exist: this server serves '{settings.model_id}'.",
                param="model",
                code="model_not_found",
            )
        return settings.model_id

    @app.get("/v1/models")
    async def list_models() -> dict[str, Any]:
        """The served model."""
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{name:path}")
    async def retrieve_model(name: str) -> dict[str, Any]:
        model_name(name, strict=True)
        return model_card()

    app.include_router(openai_api.routes(service, model_name))
    app.include_router(anthropic_api.routes(service, model_name))
    app.include_router(responses_api.routes(service, model_name))

    def public_model(request: Request) -> str:
        """The served model's name as pages without the key show it: a model folder's
        name, not its path (which tells where the user keeps files), unless the request
        carries the key (or none is set)."""
        headers = dict(request.scope["headers"])
        folder = Path(settings.model_id).expanduser()
        if key_matches(settings.api_key, headers) or not (folder.is_absolute() or folder.is_dir()):
            return settings.model_id  # a hub name (org/name) is no path
        return folder.name

    @app.get("/health")
    async def health(request: Request) -> JSONResponse:
        """`ok` once the worker is warm; 503 while it warms up or restarts after a failure."""
        if engine.error:
            status = "error"
        elif engine.down is not None:
            status = "restarting"
        else:
            status = "ok" if engine.ready else "loading"
        payload = {"status": status, "model": public_model(request), **engine.status()}
        if engine.error or engine.down:
            payload["error"] = engine.error or engine.down
        return JSONResponse(payload, status_code=200 if status == "ok" else 503)

    # HEAD: the same status and headers, no body (uvicorn sends none for HEAD).
    app.add_api_route("/health", health, methods=["HEAD"], include_in_schema=False)

    info = {"model": settings.model_id, "draft": settings.draft_id or "", "version": __version__}

    @app.get("/metrics", include_in_schema=False)
    async def metrics_text() -> PlainTextResponse:
        """Prometheus' text format: requests, tokens, tau, widths, latencies, queue."""
        return PlainTextResponse(
            metrics.render(engine.status(), info), media_type="text/plain; version=0.0.4"
        )

    @app.get("/", include_in_schema=False)
    async def chat_page() -> FileResponse:
        """The chat page: static files of the package, talking to this server's API."""
        return FileResponse(PAGE / "index.html", headers=PAGE_HEADERS)

    @app.get("/favicon.ico", include_in_schema=False)
    async def favicon() -> FileResponse:
        """The page's icon (an SVG; browsers ask /favicon.ico whatever the page says)."""
        return FileResponse(PAGE / "favicon.svg", media_type="image/svg+xml", headers=PAGE_HEADERS)

    app.mount("/page", PageFiles(directory=PAGE), name="page")

    @app.get("/docs", include_in_schema=False)
    async def docs(request: Request) -> HTMLResponse:
        """The routes and their summaries, from the OpenAPI schema; no external assets."""
        rows = []
        for path, ops in app.openapi()["paths"].items():
            for method, op in ops.items():
                doc = html.escape(op.get("description") or op.get("summary") or "")
                rows.append(
                    f"<tr><td><code>{method.upper()} {html.escape(path)}</code></td>"
                    f"<td>{doc}</td></tr>"
                )
        page = (
            "<!doctype html><meta charset=utf-8><title>dflash-mlx API</title>"
            "<style>body{font-family:sans-serif;margin:2em}td{padding:4px 12px;"
            "vertical-align:top;border-bottom:1px solid #ddd}</style>"
            f"<h1>dflash-mlx {html.escape(__version__)}</h1><p>Model <code>"
            f"{html.escape(public_model(request))}</code>. The machine-readable schema is "
            "<a href=/openapi.json>/openapi.json</a>.</p><table>" + "".join(rows) + "</table>"
        )
        return HTMLResponse(page)

    return app


class _Server(uvicorn.Server):
    engine: Engine
    # The signal that stopped it (SIGINT, SIGTERM), or None: the command's exit code says
    # which (130 / 143) instead of uvicorn raising it again once it has shut down (which
    # exits 0 where SIGINT is ignored, as in a shell's background job, and lets SIGTERM
    # kill the process without a status of ours).
    stopped_by: int | None = None

    @contextmanager
    def capture_signals(self) -> Iterator[None]:
        with super().capture_signals():
            yield
            captured = getattr(self, "_captured_signals", None) or []
            if captured:
                self.stopped_by = captured[0]
                captured.clear()  # not raised again: the caller exits by `stopped_by`

    async def shutdown(self, sockets=None) -> None:
        # End running and queued requests now (503 / an error event) rather than letting
        # uvicorn wait for them and then cancel them mid-flight.
        self.engine.close(timeout=0)
        await super().shutdown(sockets)


# The requests the engine logs itself (`request completed: …`): their access line would be
# a second line for the same request. Refusals (4xx, 5xx) keep their access line: the engine
# never saw them.
GENERATING = frozenset({"/v1/chat/completions", "/v1/completions", "/v1/messages", "/v1/responses"})


class OneLinePerRequest(logging.Filter):
    """uvicorn's access log without the line of a request that generated (the engine's own
    line says more: tokens, speed, τ, how it ended)."""

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args
        if not (isinstance(args, tuple) and len(args) == 5):
            return True
        _, method, path, _, status = args
        generated = method == "POST" and str(path).split("?", 1)[0] in GENERATING
        return not (generated and isinstance(status, int) and status < 400)


def create_server(
    engine: Engine, settings: ServerSettings, *, log_level: str = "info"
) -> uvicorn.Server:
    """A uvicorn server for the app; `.run(sockets=[sock])` serves until SIGINT/SIGTERM."""
    # uvicorn's logging, plus the engine's one line per request at the same level (and no
    # access line for a request that has it).
    log_config = copy.deepcopy(LOGGING_CONFIG)
    log_config["loggers"]["dflash_mlx"] = {"handlers": ["default"], "level": log_level.upper()}
    log_config.setdefault("filters", {})["one_line"] = {"()": OneLinePerRequest}
    log_config["handlers"]["access"]["filters"] = ["one_line"]
    config = uvicorn.Config(
        create_app(engine, settings),
        log_level=log_level,
        log_config=log_config,
        timeout_graceful_shutdown=5,
        http=H11Protocol,  # drops clients that never finish their request headers
        timeout_keep_alive=settings.header_timeout,  # seconds, not rounded to whole ones
    )
    server = _Server(config)
    server.engine = engine
    return server
