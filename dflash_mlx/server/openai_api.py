"""OpenAI's API: /v1/chat/completions (tools, reasoning) and /v1/completions.

The requests (`openai_requests`) become `core.Request`s; `core`'s events become the
responses and SSE chunks OpenAI sends, shaped so that unchanged clients read them, with
DFlash's statistics in `timings`. OpenAI's error shape is every API's but Anthropic's.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from contextlib import aclosing
from functools import partial
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response
from starlette.concurrency import run_in_threadpool

from . import core
from .core import APIError, Finish, Logprobs, Reasoning, Text, ToolCall, new_id
from .limits import BoundedRoute
from .logprobs import chat_logprobs, text_logprobs
from .openai_requests import ChatCompletionRequest, CompletionRequest
from .replies import sse, streamed, whole


def error_body(err: APIError) -> dict[str, Any]:
    return {
        "error": {"message": err.message, "type": err.kind, "param": err.param, "code": err.code}
    }


def _call(c: ToolCall, index: int | None = None) -> dict[str, Any]:
    out: dict[str, Any] = {
        "id": c.id,
        "type": "function",
        "function": {"name": c.name, "arguments": c.arguments},
    }
    return out if index is None else {"index": index, **out}


def _usage(finish: Finish) -> dict[str, Any]:
    u = finish.usage
    return {
        "prompt_tokens": u.prompt_tokens,
        "completion_tokens": u.completion_tokens,
        "total_tokens": u.prompt_tokens + u.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": u.cached_tokens},
    }


def _completion(
    rid: str, model: str, kind: str, choice: dict, finish: Finish, logprobs: dict | None
) -> dict:
    """A whole response of `kind` (its `object`), with its one choice."""
    return {
        "id": rid,
        "object": kind,
        "created": int(time.time()),
        "model": model,
        "choices": [{"index": 0, **choice, "logprobs": logprobs, "finish_reason": finish.reason}],
        "usage": _usage(finish),
        "timings": finish.usage.timings(),
    }


def chat_completion(
    rid: str, model: str, logprobs: bool, events: list[core.Event]
) -> dict[str, Any]:
    text, reasoning, calls, finish = core.merged(events)
    message: dict[str, Any] = {"role": "assistant", "content": text or (None if calls else "")}
    if reasoning:
        message["reasoning_content"] = reasoning
    if calls:
        message["tool_calls"] = [_call(c) for c in calls]
    scored = chat_logprobs(core.scores(events)) if logprobs else None
    out = _completion(rid, model, "chat.completion", {"message": message}, finish, scored)
    if finish.truncated_tool_call:
        out["choices"][0]["truncated_tool_call"] = True
    return out


def text_completion(
    rid: str, model: str, logprobs: bool, events: list[core.Event]
) -> dict[str, Any]:
    text, _, _, finish = core.merged(events)
    scored = text_logprobs(core.scores(events)) if logprobs else None
    return _completion(rid, model, "text_completion", {"text": text}, finish, scored)


class _Chunks:
    """The SSE chunks of one streamed response of `kind` (their `object`); with `logprobs`
    (its shape), each chunk carries the scores that came before it."""

    def __init__(self, rid: str, model: str, kind: str, logprobs=None):
        self.head = {"id": rid, "object": kind, "created": int(time.time()), "model": model}
        self.logprobs = logprobs
        self.scores: list = []

    def choice(self, choice: dict[str, Any], finish: str | None = None, **extra: Any) -> str:
        scored = None
        if self.logprobs is not None and self.scores:
            scored, self.scores = self.logprobs(self.scores), []
        choice = {"index": 0, **choice, "logprobs": scored, "finish_reason": finish}
        return sse({**self.head, "choices": [choice], **extra})

    def usage(self, finish: Finish) -> str:
        """The chunk after the last, when the client asked for usage."""
        return sse({**self.head, "choices": [], "usage": _usage(finish)})


async def _ended(chunks: AsyncIterator[str]) -> AsyncIterator[str]:
    """A stream's chunks then `[DONE]`; an error after the headers travels as an event."""
    try:
        async with aclosing(chunks):
            async for chunk in chunks:
                yield chunk
        yield "data: [DONE]\n\n"
    except Exception as exc:
        yield sse(error_body(core.as_api_error(exc)))


async def chat_stream(
    gen: core.Generation, rid: str, model: str, include_usage: bool, logprobs: bool
) -> AsyncIterator[str]:
    chunks = _Chunks(rid, model, "chat.completion.chunk", chat_logprobs if logprobs else None)
    calls = 0
    yield chunks.choice({"delta": {"role": "assistant", "content": ""}})
    async for e in gen.events():
        if isinstance(e, Logprobs):
            chunks.scores += e.scores
        elif isinstance(e, Text):
            yield chunks.choice({"delta": {"content": e.text}})
        elif isinstance(e, Reasoning):
            yield chunks.choice({"delta": {"reasoning_content": e.text}})
        elif isinstance(e, ToolCall):
            yield chunks.choice({"delta": {"tool_calls": [_call(e, calls)]}})
            calls += 1
        elif isinstance(e, Finish):
            extra: dict[str, Any] = {"timings": e.usage.timings()}
            if e.truncated_tool_call:
                extra["truncated_tool_call"] = True
            yield chunks.choice({"delta": {}}, e.reason, **extra)
            if include_usage:
                yield chunks.usage(e)


async def text_stream(
    gen: core.Generation, rid: str, model: str, include_usage: bool, logprobs: bool
) -> AsyncIterator[str]:
    chunks = _Chunks(rid, model, "text_completion", text_logprobs if logprobs else None)
    async for e in gen.events():
        if isinstance(e, Logprobs):
            chunks.scores += e.scores
        elif isinstance(e, Text):
            yield chunks.choice({"text": e.text})
        elif isinstance(e, Finish):
            yield chunks.choice({"text": ""}, e.reason, timings=e.usage.timings())
            if include_usage:
                yield chunks.usage(e)


def routes(service: core.Service, model_name) -> APIRouter:
    """The OpenAI routes; `model_name(requested)` checks a model name and returns the one
    to echo."""
    router = APIRouter(prefix="/v1", route_class=BoundedRoute)

    async def respond(chat: bool, body, request: Request) -> Response:
        model = model_name(body.model)
        gen = await service.start(await run_in_threadpool(body.core))
        rid = new_id("chatcmpl-" if chat else "cmpl-")
        logprobs = body.top_alternatives() is not None
        if body.stream:
            stream = chat_stream if chat else text_stream
            return streamed(_ended(stream(gen, rid, model, body.include_usage, logprobs)))
        build = chat_completion if chat else text_completion
        return await whole(gen, request, partial(build, rid, model, logprobs))

    @router.post("/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        """Chat completion with tools (`stream: true` for server-sent events); reasoning in
        `reasoning_content`, DFlash stats in `timings`."""
        return await respond(True, body, request)

    @router.post("/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        """Text completion of `prompt` (a string or token ids); DFlash stats in `timings`."""
        return await respond(False, body, request)

    return router
