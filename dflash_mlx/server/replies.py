"""How every API replies: one JSON body once the reply is whole, or server-sent events as
it is written. The APIs build the bodies and the events; this is the HTTP around them."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from . import core

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def sse(data: dict[str, Any], event: str | None = None) -> str:
    """One server-sent event: `data: <json>`, after `event: <name>` when it has one."""
    head = f"event: {event}\n" if event else ""
    return f"{head}data: {json.dumps(data, ensure_ascii=False)}\n\n"


def streamed(events: AsyncIterator[str]) -> StreamingResponse:
    return StreamingResponse(events, media_type="text/event-stream", headers=SSE_HEADERS)


async def whole(
    gen: core.Generation, request: Request, build: Callable[[list[core.Event]], dict[str, Any]]
) -> Response:
    """The reply as one JSON body, `build` from the request's events; 499 when the client
    left before its end."""
    events = await core.collect(gen, request.receive)
    if not any(isinstance(e, core.Finish) for e in events):
        return Response(status_code=499)
    return JSONResponse(build(events))
