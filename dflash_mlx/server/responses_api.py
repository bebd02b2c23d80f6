"""OpenAI's Responses API, stateless: POST /v1/responses.

The request (`responses_requests`) becomes a `core.Request`; `core`'s events become
output items (reasoning, message, function_call), either in one response object or as
the Responses event stream (response.created, output_item.added, content_part.added,
output_text.delta, ..., response.completed). Errors are in OpenAI's shape.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response
from starlette.concurrency import run_in_threadpool

from . import core
from .core import Finish, Reasoning, Text, ToolCall, new_id
from .limits import BoundedRoute
from .openai_api import error_body
from .replies import sse, streamed, whole
from .responses_requests import NamedChoice, ResponsesRequest


def _format(body: ResponsesRequest) -> dict[str, Any]:
    """`text.format` as the request set it (plain text when it did not)."""
    fmt = body.text.format if body.text else None
    return fmt.model_dump(by_alias=True, exclude_none=True) if fmt else {"type": "text"}


def _status(finish: Finish) -> str:
    return "incomplete" if finish.reason == "length" else "completed"


class Builder:
    """Turns core events into output items, and (for streams) into the events that build
    them. One path for both: a whole response is the stream's final state."""

    def __init__(self, rid: str, model: str, body: ResponsesRequest):
        self.rid, self.model, self.body = rid, model, body
        self.created = int(time.time())
        self.output: list[dict[str, Any]] = []
        self.open: dict[str, Any] | None = None  # the item being written
        self.seq = 0

    def response(self, status: str, finish: Finish | None = None) -> dict[str, Any]:
        usage = None
        incomplete = None
        if finish is not None:
            u = finish.usage
            usage = {
                "input_tokens": u.prompt_tokens,
                "input_tokens_details": {"cached_tokens": u.cached_tokens},
                "output_tokens": u.completion_tokens,
                "output_tokens_details": {"reasoning_tokens": 0},
                "total_tokens": u.prompt_tokens + u.completion_tokens,
            }
            if finish.reason == "length":
                incomplete = {"reason": "max_output_tokens"}
        b = self.body
        out = {
            "id": self.rid,
            "object": "response",
            "created_at": self.created,
            "status": status,
            "error": None,
            "incomplete_details": incomplete,
            "instructions": b.instructions,
            "max_output_tokens": b.max_output_tokens,
            "model": self.model,
            "output": self.output,
            "parallel_tool_calls": b.parallel_tool_calls,
            "temperature": b.temperature,
            "top_p": b.top_p,
            "tool_choice": b.tool_choice.model_dump()
            if isinstance(b.tool_choice, NamedChoice)
            else (b.tool_choice or "auto"),
            "tools": [t.model_dump(exclude_none=True) for t in b.tools or []],
            "store": False,
            "text": {"format": _format(b)},
            "truncation": "disabled",
            "metadata": b.metadata or {},
            "usage": usage,
        }
        if finish is not None:
            out["timings"] = finish.usage.timings()
        return out

    def whole(self, events: list[core.Event]) -> dict[str, Any]:
        """The response once all its events are in (and `Finish` is)."""
        for e in events:
            self.add(e)
        finish = next(e for e in events if isinstance(e, Finish))
        return self.response(_status(finish), finish)

    def event(self, kind: str, **payload: Any) -> str:
        data = {"type": kind, "sequence_number": self.seq, **payload}
        self.seq += 1
        return sse(data, kind)

    def start(self) -> list[str]:
        head = self.response("in_progress")
        return [
            self.event("response.created", response=head),
            self.event("response.in_progress", response=head),
        ]

    def _close(self) -> list[str]:
        item, self.open = self.open, None
        if item is None:
            return []
        i = len(self.output) - 1
        item["status"] = "completed"
        out = []
        if item["type"] == "message":
            part = item["content"][0]
            out.append(
                self.event(
                    "response.output_text.done",
                    item_id=item["id"],
                    output_index=i,
                    content_index=0,
                    text=part["text"],
                    logprobs=[],
                )
            )
            out.append(
                self.event(
                    "response.content_part.done",
                    item_id=item["id"],
                    output_index=i,
                    content_index=0,
                    part=part,
                )
            )
        elif item["type"] == "reasoning":
            text = item["content"][0]["text"]
            out.append(
                self.event(
                    "response.reasoning_text.done",
                    item_id=item["id"],
                    output_index=i,
                    content_index=0,
                    text=text,
                )
            )
        return out + [self.event("response.output_item.done", output_index=i, item=item)]

    def _begin(self, item: dict[str, Any]) -> list[str]:
        out = self._close()
        self.output.append(item)
        self.open = item
        i = len(self.output) - 1
        shown = json.loads(json.dumps(item))  # as it was when it started
        if item["type"] == "message":
            shown["content"] = []
        elif item["type"] == "reasoning":
            shown["content"] = []
        out.append(self.event("response.output_item.added", output_index=i, item=shown))
        if item["type"] == "message":
            out.append(
                self.event(
                    "response.content_part.added",
                    item_id=item["id"],
                    output_index=i,
                    content_index=0,
                    part=dict(item["content"][0]),
                )
            )
        return out

    def add(self, e: core.Event) -> list[str]:
        out: list[str] = []
        i = len(self.output) - 1
        if isinstance(e, Text):
            if self.open is None or self.open["type"] != "message":
                part = {"type": "output_text", "text": "", "annotations": []}
                out += self._begin(
                    {
                        "id": new_id("msg_"),
                        "type": "message",
                        "role": "assistant",
                        "status": "in_progress",
                        "content": [part],
                    }
                )
                i = len(self.output) - 1
            self.open["content"][0]["text"] += e.text
            out.append(
                self.event(
                    "response.output_text.delta",
                    item_id=self.open["id"],
                    output_index=i,
                    content_index=0,
                    delta=e.text,
                    logprobs=[],
                )
            )
        elif isinstance(e, Reasoning):
            if self.open is None or self.open["type"] != "reasoning":
                out += self._begin(
                    {
                        "id": new_id("rs_"),
                        "type": "reasoning",
                        "summary": [],
                        "content": [{"type": "reasoning_text", "text": ""}],
                    }
                )
                i = len(self.output) - 1
            self.open["content"][0]["text"] += e.text
            out.append(
                self.event(
                    "response.reasoning_text.delta",
                    item_id=self.open["id"],
                    output_index=i,
                    content_index=0,
                    delta=e.text,
                )
            )
        elif isinstance(e, ToolCall):
            item = {
                "id": new_id("fc_"),
                "type": "function_call",
                "call_id": e.id,
                "name": e.name,
                "arguments": "",
                "status": "in_progress",
            }
            out += self._begin(item)
            i = len(self.output) - 1
            item["arguments"] = e.arguments
            out.append(
                self.event(
                    "response.function_call_arguments.delta",
                    item_id=item["id"],
                    output_index=i,
                    delta=e.arguments,
                )
            )
            out.append(
                self.event(
                    "response.function_call_arguments.done",
                    item_id=item["id"],
                    output_index=i,
                    name=e.name,
                    arguments=e.arguments,
                )
            )
        elif isinstance(e, Finish):
            out += self._close()
            status = _status(e)
            out.append(self.event(f"response.{status}", response=self.response(status, e)))
        return out


def routes(service: core.Service, model_name) -> APIRouter:
    router = APIRouter(prefix="/v1", route_class=BoundedRoute)

    @router.post("/responses")
    async def responses(body: ResponsesRequest, request: Request) -> Response:
        """OpenAI Responses, stateless (`stream: true` for its event stream); function tools."""
        model = model_name(body.model)
        gen = await service.start(await run_in_threadpool(body.core))
        builder = Builder(new_id("resp_"), model, body)
        if not body.stream:
            return await whole(gen, request, builder.whole)

        async def stream() -> AsyncIterator[str]:
            for s in builder.start():
                yield s
            try:
                async for e in gen.events():
                    for s in builder.add(e):
                        yield s
            except Exception as exc:  # headers are sent: the error travels as an event
                # OpenAI's `error` event: its own `type`, the error's code, message, param.
                err = error_body(core.as_api_error(exc))["error"]
                yield builder.event(
                    "error", code=err["code"], message=err["message"], param=err["param"]
                )

        return streamed(stream())

    return router
