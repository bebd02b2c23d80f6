"""`APIError`: the one error type the APIs render, each in its own shape, and how any
exception becomes one (the caller's with its message, ours generic and logged)."""

from __future__ import annotations

import logging

from ..errors import UserError
from .engine import EngineClosed, EngineDown, QueueFull

log = logging.getLogger("dflash_mlx.server")


class APIError(Exception):
    """An error the client must know about: HTTP status, message, OpenAI's type/param/code.

    The APIs render it in their own shapes; `kind` is the OpenAI `type`.
    """

    def __init__(
        self,
        status: int,
        message: str,
        *,
        kind: str | None = None,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ):
        super().__init__(message)
        self.status = status
        self.message = message
        self.kind = kind or ("invalid_request_error" if status < 500 else "server_error")
        self.param = param
        self.code = code
        self.headers = headers or {}


def as_api_error(exc: BaseException) -> APIError:
    """Any exception as the error a client sees: the caller's with its message, ours generic."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, QueueFull):
        return APIError(
            503,
            f"The server is busy: {exc}.",
            code="queue_full",
            headers={"Retry-After": str(exc.retry_after)},
        )
    if isinstance(exc, EngineDown):
        return APIError(503, str(exc), code="engine_restarting", headers={"Retry-After": "1"})
    if isinstance(exc, EngineClosed):
        return APIError(503, str(exc), code="shutting_down")
    if isinstance(exc, UserError):
        return APIError(400, str(exc), code="invalid_value")
    log.error("internal error", exc_info=(type(exc), exc, exc.__traceback__))
    return APIError(500, "The server had an internal error; its log has the details.")
