"""Anthropic's Messages API: POST /v1/messages and /v1/messages/count_tokens.

Content blocks (text, tool_use, tool_result; thinking blocks sent back are dropped: the
template renders the reply) become `core.Request` chat messages in the OpenAI shape chat
templates read; `core`'s events become content blocks (thinking, text, tool_use) or
Anthropic's event stream (message_start, ping, content_block_start / _delta / _stop,
message_delta, message_stop). Errors are `{"type": "error", "error": {type, message}}`.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any, Literal

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, field_validator
from pydantic_core import PydanticCustomError

from . import core
from .core import APIError, Finish, Reasoning, Text, ToolCall, new_id

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


def _unsupported(what: str) -> PydanticCustomError:
    return PydanticCustomError("unsupported_parameter", what)


_Strict = ConfigDict(strict=True, extra="ignore")


class ToolDef(BaseModel):
    model_config = _Strict
    name: str = Field(min_length=1)
    description: str | None = None
    input_schema: dict[str, Any] = Field(default_factory=lambda: {"type": "object"})
    type: str | None = None

    @field_validator("type")
    @classmethod
    def _custom_only(cls, kind: str | None) -> str | None:
        if kind not in (None, "custom"):
            raise _unsupported(f"server tool {kind!r}: only client (custom) tools are supported")
        return kind


class ToolChoice(BaseModel):
    model_config = _Strict
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool = False


class Message(BaseModel):
    model_config = _Strict
    role: Literal["user", "assistant"]
    content: str | list[dict[str, Any]]

    @field_validator("content")
    @classmethod
    def _known_blocks(cls, content):
        if isinstance(content, list):
            for block in content:
                kind = block.get("type")
                if kind not in ("text", "tool_use", "tool_result", "thinking", "redacted_thinking"):
                    raise _unsupported(
                        f"content block of type {kind!r}: text, tool_use and tool_result "
                        "blocks are supported"
                    )
        return content


class CountTokensRequest(BaseModel):
    model_config = _Strict
    model: str | None = None
    messages: list[Message] = Field(min_length=1)
    system: str | list[dict[str, Any]] | None = None
    tools: list[ToolDef] | None = None
    tool_choice: ToolChoice | None = None

    def core_request(self, **kw: Any) -> core.Request:
        choice = self.tool_choice
        parallel = True
        if choice is None or choice.type == "auto":
            tool_choice: Any = "auto"
        elif choice.type == "any":
            tool_choice = "required"
        elif choice.type == "none":
            tool_choice = "none"
        else:
            if not choice.name:
                raise APIError(
                    400, "tool_choice of type 'tool' needs a 'name'", param="tool_choice"
                )
            tool_choice = {"name": choice.name}
        if choice is not None:
            parallel = not choice.disable_parallel_tool_use
        tools = None
        if self.tools:
            tools = [
                {
                    "type": "function",
                    "function": {
                        "name": t.name,
                        **({"description": t.description} if t.description else {}),
                        "parameters": t.input_schema,
                    },
                }
                for t in self.tools
            ]
        return core.Request(
            messages=self.template_messages(),
            tools=tools,
            tool_choice=tool_choice,
            parallel_tool_calls=parallel,
            param="messages",
            **kw,
        )

    def template_messages(self) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        if self.system:
            out.append({"role": "system", "content": _text_of(self.system, "system")})
        for i, m in enumerate(self.messages):
            where = f"messages[{i}].content"
            if isinstance(m.content, str):
                out.append({"role": m.role, "content": m.content})
                continue
            texts, calls = [], []
            for block in m.content:
                kind = block["type"]
                if kind == "text":
                    texts.append(_field(block, "text", str, where))
                elif kind == "tool_use" and m.role == "assistant":
                    calls.append(
                        {
                            "id": _field(block, "id", str, where),
                            "type": "function",
                            "function": {
                                "name": _field(block, "name", str, where),
                                "arguments": _field(block, "input", dict, where),
                            },
                        }
                    )
                elif kind == "tool_result" and m.role == "user":
                    content = block.get("content", "")
                    text = _text_of(content, where)
                    if block.get("is_error"):
                        text = f"Error: {text}"
                    out.append(
                        {
                            "role": "tool",
                            "tool_call_id": _field(block, "tool_use_id", str, where),
                            "content": text,
                        }
                    )
                elif kind in ("tool_use", "tool_result"):
                    raise APIError(
                        400,
                        f"Invalid '{where}': a {kind} block belongs in a "
                        f"{'assistant' if kind == 'tool_use' else 'user'} message",
                        param=where,
                    )
                # thinking blocks: the template does not render past reasoning
            if texts or calls or not m.content:
                msg: dict[str, Any] = {"role": m.role, "content": "".join(texts)}
                if calls:
                    msg["tool_calls"] = calls
                out.append(msg)
        return out


def _field(block: dict, name: str, kind: type, where: str) -> Any:
    value = block.get(name)
    if not isinstance(value, kind):
        raise APIError(
            400,
            f"Invalid '{where}': a {block.get('type')} block needs '{name}' "
            f"({kind.__name__}), got {type(value).__name__}",
            param=where,
        )
    return value


def _text_of(content: Any, where: str) -> str:
    """A string, or text blocks joined."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for block in content:
            if not isinstance(block, dict) or block.get("type") != "text":
                kind = block.get("type") if isinstance(block, dict) else type(block).__name__
                raise APIError(
                    400, f"Invalid '{where}': only text blocks are supported here, got {kind!r}"
                )
            parts.append(_field(block, "text", str, where))
        return "\n".join(parts)
    raise APIError(400, f"Invalid '{where}': expected a string or text blocks")


class MessagesRequest(CountTokensRequest):
    model: str
    max_tokens: int = Field(ge=1)
    stop_sequences: list[str] | None = None
    stream: bool = False
    temperature: float | None = Field(None, ge=0, le=1)
    top_p: float | None = Field(None, ge=0, le=1)
    top_k: int | None = Field(None, ge=0)
    thinking: dict[str, Any] | None = None  # reasoning models think as their template says

    def core(self) -> core.Request:
        return self.core_request(
            max_tokens=self.max_tokens,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=self.top_k or 0,
            stop=[s for s in self.stop_sequences or [] if s],
        )


# ---------------------------------------------------------------------------------------
# Responses

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
    return f"event: {kind}\ndata: {json.dumps({'type': kind, **payload}, ensure_ascii=False)}\n\n"


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
    router = APIRouter(prefix="/v1")

    @router.post("/messages")
    async def messages(body: MessagesRequest, request: Request) -> Response:
        """Anthropic Messages (`stream: true` for its event stream); tools, thinking blocks."""
        model = model_name(body.model)
        gen = await service.start(body.core())
        mid = new_id("msg_")
        if body.stream:
            return StreamingResponse(
                event_stream(gen, mid, model),
                media_type="text/event-stream",
                headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
            )
        events = await core.collect(gen, request.receive)
        if not any(isinstance(e, Finish) for e in events):  # the client left
            return Response(status_code=499)
        return JSONResponse(message(mid, model, events))

    @router.post("/messages/count_tokens")
    async def count_tokens(body: CountTokensRequest) -> dict[str, int]:
        """Tokens the prompt (system, messages, tools) takes, as the model's template renders it."""
        model_name(body.model)
        return {"input_tokens": await service.count(body.core_request())}

    return router
