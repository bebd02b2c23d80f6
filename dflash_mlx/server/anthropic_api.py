"""Anthropic's Messages API: POST /v1/messages and /v1/messages/count_tokens.

The request (`anthropic_requests`) becomes a `core.Request`; `core`'s events become
content blocks (thinking, text, tool_use) or Anthropic's event stream (message_start,
ping, content_block_start / _delta / _stop, message_delta, message_stop). Errors are
`{"type": "error", "error": {type, message}}`.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from functools import partial
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response
from starlette.concurrency import run_in_threadpool

from . import core
from .anthropic_requests import CountTokensRequest, MessagesRequest
from .core import APIError, Finish, Reasoning, Text, ToolCall, new_id
from .limits import BoundedRoute
from .replies import sse, streamed, whole

_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
}


def error_body(err: APIError) -> dict[str, Any]:
    kind = _ERROR_TYPES.get(err.status)
    if kind is None:
        kind = "invalid_request_error" if err.status < 500 else "api_error"
    return {"type": "error", "error": {"type": kind, "message": err.message}}


_STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use"}


def _stop_reason(finish: Finish) -> str:
    if finish.stop_sequence is not None:
        return "stop_sequence"
    return _STOP_REASONS.get(finish.reason, "end_turn")


def _usage(u: core.Usage, output: bool = True) -> dict[str, Any]:
    return {
        "input_tokens": u.prompt_tokens - u.cached_tokens,
        "cache_read_input_tokens": u.cached_tokens,
        "cache_creation_input_tokens": 0,
        "output_tokens": u.completion_tokens if output else 0,
    }


def _input(arguments: str) -> dict[str, Any]:
    try:
        value = json.loads(arguments)
    except json.JSONDecodeError:
        return {"arguments": arguments}
    return value if isinstance(value, dict) else {"arguments": value}


def message(mid: str, model: str, events: list[core.Event]) -> dict[str, Any]:
    text, reasoning, calls, finish = core.merged(events)
    content: list[dict[str, Any]] = []
    if reasoning:
        content.append({"type": "thinking", "thinking": reasoning, "signature": ""})
    if text:
        content.append({"type": "text", "text": text})
    for c in calls:
        content.append(
            {"type": "tool_use", "id": c.id, "name": c.name, "input": _input(c.arguments)}
        )
    return {
        "id": mid,
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": content,
        "stop_reason": _stop_reason(finish),
        "stop_sequence": finish.stop_sequence,
        "usage": _usage(finish.usage),
        "timings": finish.usage.timings(),
    }


def _sse(kind: str, payload: dict[str, Any]) -> str:
    return sse({"type": kind, **payload}, kind)


async def event_stream(gen: core.Generation, mid: str, model: str) -> AsyncIterator[str]:
    index = -1
    open_kind: str | None = None

    def start(kind: str, block: dict[str, Any]) -> list[str]:
        nonlocal index, open_kind
        out = [_sse("content_block_stop", {"index": index})] if open_kind else []
        index += 1
        open_kind = kind
        return out + [_sse("content_block_start", {"index": index, "content_block": block})]

    started = False
    try:
        async for e in gen.events():
            if not started:  # after the prefill: the cached share of the prompt is known
                started = True
                head = {
                    "id": mid,
                    "type": "message",
                    "role": "assistant",
                    "model": model,
                    "content": [],
                    "stop_reason": None,
                    "stop_sequence": None,
                    "usage": _usage(gen.usage, output=False),
                }
                yield _sse("message_start", {"message": head})
                yield _sse("ping", {})
            if isinstance(e, Text):
                if open_kind != "text":
                    for s in start("text", {"type": "text", "text": ""}):
                        yield s
                yield _sse(
                    "content_block_delta",
                    {"index": index, "delta": {"type": "text_delta", "text": e.text}},
                )
            elif isinstance(e, Reasoning):
                if open_kind != "thinking":
                    for s in start(
                        "thinking", {"type": "thinking", "thinking": "", "signature": ""}
                    ):
                        yield s
                delta = {"type": "thinking_delta", "thinking": e.text}
                yield _sse("content_block_delta", {"index": index, "delta": delta})
            elif isinstance(e, ToolCall):
                block = {"type": "tool_use", "id": e.id, "name": e.name, "input": {}}
                for s in start("tool_use", block):
                    yield s
                delta = {
                    "type": "input_json_delta",
                    "partial_json": json.dumps(_input(e.arguments)),
                }
                yield _sse("content_block_delta", {"index": index, "delta": delta})
            elif isinstance(e, Finish):
                if open_kind:
                    yield _sse("content_block_stop", {"index": index})
                delta = {"stop_reason": _stop_reason(e), "stop_sequence": e.stop_sequence}
                yield _sse("message_delta", {"delta": delta, "usage": _usage(e.usage)})
                yield _sse("message_stop", {})
    except Exception as exc:  # headers are sent: the error travels as an event
        yield _sse("error", {"error": error_body(core.as_api_error(exc))["error"]})


def routes(service: core.Service, model_name) -> APIRouter:
    router = APIRouter(prefix="/v1", route_class=BoundedRoute)

    @router.post("/messages")
    async def messages(body: MessagesRequest, request: Request) -> Response:
        """Anthropic Messages (`stream: true` for its event stream); tools, thinking blocks."""
        model = model_name(body.model)
        gen = await service.start(await run_in_threadpool(body.core))
        mid = new_id("msg_")
        if body.stream:
            return streamed(event_stream(gen, mid, model))
        return await whole(gen, request, partial(message, mid, model))

    @router.post("/messages/count_tokens")
    async def count_tokens(body: CountTokensRequest) -> dict[str, int]:
        """Tokens the prompt (system, messages, tools) takes, as the model's template renders it."""
        model_name(body.model)
        return {"input_tokens": await service.count(await run_in_threadpool(body.core_request))}

    return router
