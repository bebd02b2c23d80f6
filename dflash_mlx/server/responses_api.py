"""OpenAI's Responses API, stateless: POST /v1/responses.

`input` (a string, or items: messages, `function_call`, `function_call_output`; reasoning
items sent back are dropped) and `instructions` become `core.Request` chat messages;
`core`'s events become output items (reasoning, message, function_call), either in one
response object or as the Responses event stream (response.created, output_item.added,
content_part.added, output_text.delta, ..., response.completed). Nothing is stored:
`store: true` and `previous_response_id` are refused, the client sends the whole input.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from typing import Any, Literal

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, field_validator
from pydantic_core import PydanticCustomError

from . import core
from .core import APIError, Finish, Reasoning, Text, ToolCall, new_id
from .openai_api import SSE_HEADERS, error_body, template_call


def _unsupported(what: str) -> PydanticCustomError:
    return PydanticCustomError("unsupported_parameter", what)


_Strict = ConfigDict(strict=True, extra="ignore")


class FunctionTool(BaseModel):
    model_config = _Strict
    type: str
    name: str | None = None
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None

    @field_validator("type")
    @classmethod
    def _functions_only(cls, kind: str) -> str:
        if kind != "function":
            raise _unsupported(f"tool of type {kind!r}: only function tools are supported")
        return kind


class NamedChoice(BaseModel):
    model_config = _Strict
    type: Literal["function"]
    name: str


class ResponsesRequest(BaseModel):
    model_config = _Strict
    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["auto", "none", "required"] | NamedChoice | None = None
    parallel_tool_calls: bool = True
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, ge=0, le=1)
    stream: bool = False
    store: bool | None = None
    previous_response_id: str | None = None
    text: dict[str, Any] | None = None
    reasoning: dict[str, Any] | None = None  # reasoning models think as their template says
    metadata: dict[str, Any] | None = None

    @field_validator("store")
    @classmethod
    def _stateless(cls, store: bool | None) -> bool | None:
        if store:
            raise _unsupported(
                "this server is stateless: it stores no responses (send store: false, and "
                "the whole conversation as input)"
            )
        return store

    @field_validator("previous_response_id")
    @classmethod
    def _no_previous(cls, rid: str | None) -> str | None:
        if rid:
            raise _unsupported(
                "this server is stateless and keeps no responses: send the whole "
                "conversation as input instead of previous_response_id"
            )
        return rid

    @field_validator("text")
    @classmethod
    def _text_only(cls, text: dict | None) -> dict | None:
        fmt = (text or {}).get("format") or {}
        if fmt.get("type", "text") != "text":
            raise _unsupported(f"text.format {fmt.get('type')!r}: only plain text is supported")
        return text

    def core(self) -> core.Request:
        tools = None
        if self.tools:
            tools = []
            for i, t in enumerate(self.tools):
                if not t.name:
                    raise APIError(
                        400,
                        f"Missing required parameter: 'tools[{i}].name'.",
                        param=f"tools[{i}].name",
                        code="missing_required_parameter",
                    )
                tools.append(
                    {
                        "type": "function",
                        "function": t.model_dump(
                            include={"name", "description", "parameters"}, exclude_none=True
                        ),
                    }
                )
        choice: Any = self.tool_choice or "auto"
        if isinstance(choice, NamedChoice):
            choice = {"name": choice.name}
        return core.Request(
            messages=self.messages(),
            tools=tools,
            tool_choice=choice,
            parallel_tool_calls=self.parallel_tool_calls,
            max_tokens=self.max_output_tokens,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            param="input",
        )

    def messages(self) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        if self.instructions:
            out.append({"role": "system", "content": self.instructions})
        if isinstance(self.input, str):
            out.append({"role": "user", "content": self.input})
            return out
        for i, item in enumerate(self.input):
            where = f"input[{i}]"
            kind = item.get("type", "message" if "role" in item else None)
            if kind == "message":
                role = item.get("role")
                if role not in ("user", "assistant", "system", "developer"):
                    raise APIError(400, f"Invalid '{where}.role': {role!r}", param=f"{where}.role")
                role = "system" if role == "developer" else role
                out.append({"role": role, "content": _text(item.get("content"), where)})
            elif kind == "function_call":
                call = template_call(
                    _str(item, "call_id", where),
                    _str(item, "name", where),
                    item.get("arguments", "{}"),
                    where,
                )
                last = out[-1] if out else None
                if last is None or last["role"] != "assistant":
                    last = {"role": "assistant", "content": ""}
                    out.append(last)
                last.setdefault("tool_calls", []).append(call)
            elif kind == "function_call_output":
                output = item.get("output", "")
                content = output if isinstance(output, str) else _text(output, where)
                out.append(
                    {
                        "role": "tool",
                        "tool_call_id": _str(item, "call_id", where),
                        "content": content,
                    }
                )
            elif kind == "reasoning":
                continue  # the template does not render past reasoning
            else:
                raise APIError(
                    400,
                    f"Invalid '{where}': items of type {kind!r} are not supported (messages, "
                    "function_call, function_call_output and reasoning are)",
                    param=where,
                    code="unsupported_parameter",
                )
        if not out:
            raise APIError(400, "Invalid 'input': it holds no message", param="input")
        return out


def _str(item: dict, name: str, where: str) -> str:
    value = item.get(name)
    if not isinstance(value, str):
        raise APIError(400, f"Invalid '{where}.{name}': expected a string", param=f"{where}.{name}")
    return value


def _text(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            kind = part.get("type") if isinstance(part, dict) else None
            if kind not in ("input_text", "output_text", "text") or not isinstance(
                part.get("text"), str
            ):
                raise APIError(
                    400,
                    f"Invalid '{where}.content': parts of type {kind!r} are not supported "
                    "(input_text and output_text are)",
                    param=f"{where}.content",
                    code="unsupported_parameter",
                )
            parts.append(part["text"])
        return "".join(parts)
    raise APIError(
        400, f"Invalid '{where}.content': expected a string or text parts", param=f"{where}.content"
    )


# ---------------------------------------------------------------------------------------
# Output


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
            "text": {"format": {"type": "text"}},
            "truncation": "disabled",
            "metadata": b.metadata or {},
            "usage": usage,
        }
        if finish is not None:
            out["timings"] = finish.usage.timings()
        return out

    def _event(self, kind: str, **payload: Any) -> str:
        data = {"type": kind, "sequence_number": self.seq, **payload}
        self.seq += 1
        return f"event: {kind}\ndata: {json.dumps(data, ensure_ascii=False)}\n\n"

    def start(self) -> list[str]:
        head = self.response("in_progress")
        return [
            self._event("response.created", response=head),
            self._event("response.in_progress", response=head),
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
                self._event(
                    "response.output_text.done",
                    item_id=item["id"],
                    output_index=i,
                    content_index=0,
                    text=part["text"],
                    logprobs=[],
                )
            )
            out.append(
                self._event(
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
                self._event(
                    "response.reasoning_text.done",
                    item_id=item["id"],
                    output_index=i,
                    content_index=0,
                    text=text,
                )
            )
        return out + [self._event("response.output_item.done", output_index=i, item=item)]

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
        out.append(self._event("response.output_item.added", output_index=i, item=shown))
        if item["type"] == "message":
            out.append(
                self._event(
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
                self._event(
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
                self._event(
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
                self._event(
                    "response.function_call_arguments.delta",
                    item_id=item["id"],
                    output_index=i,
                    delta=e.arguments,
                )
            )
            out.append(
                self._event(
                    "response.function_call_arguments.done",
                    item_id=item["id"],
                    output_index=i,
                    name=e.name,
                    arguments=e.arguments,
                )
            )
        elif isinstance(e, Finish):
            out += self._close()
            status = "incomplete" if e.reason == "length" else "completed"
            out.append(self._event(f"response.{status}", response=self.response(status, e)))
        return out


def routes(service: core.Service, model_name) -> APIRouter:
    router = APIRouter(prefix="/v1")

    @router.post("/responses")
    async def responses(body: ResponsesRequest, request: Request) -> Response:
        """OpenAI Responses, stateless (`stream: true` for its event stream); function tools."""
        model = model_name(body.model)
        gen = await service.start(body.core())
        builder = Builder(new_id("resp_"), model, body)
        if body.stream:

            async def stream() -> AsyncIterator[str]:
                for s in builder.start():
                    yield s
                try:
                    async for e in gen.events():
                        for s in builder.add(e):
                            yield s
                except Exception as exc:  # headers are sent: the error travels as an event
                    err = error_body(core.as_api_error(exc))["error"]
                    yield builder._event("error", **err)

            return StreamingResponse(stream(), media_type="text/event-stream", headers=SSE_HEADERS)
        events = await core.collect(gen, request.receive)
        finish = next((e for e in events if isinstance(e, Finish)), None)
        if finish is None:  # the client left
            return Response(status_code=499)
        for e in events:
            builder.add(e)
        status = "incomplete" if finish.reason == "length" else "completed"
        return JSONResponse(builder.response(status, finish))

    return router
