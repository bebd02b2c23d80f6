"""OpenAI's API: /v1/chat/completions (tools, reasoning) and /v1/completions.

Request schemas (pydantic, strict like OpenAI: what a request may say, the fields refused
because they would change its meaning), their translation onto `core.Request`, and the
responses and SSE chunks built from `core`'s events, shaped as OpenAI sends them so that
unchanged clients read them. Generation, parsing and errors live in `core`.
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


def error_body(err: APIError) -> dict[str, Any]:
    return {
        "error": {"message": err.message, "type": err.kind, "param": err.param, "code": err.code}
    }


def _unsupported(what: str) -> PydanticCustomError:
    return PydanticCustomError("unsupported_parameter", what)


class StreamOptions(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    include_usage: bool = False


class _Request(BaseModel):
    # Strict: "max_tokens": "5" is a type error, as with OpenAI. Unknown fields are ignored
    # (clients send vendor extras), except those that would change the result, refused below.
    model_config = ConfigDict(strict=True, extra="ignore")

    model: str | None = None
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, ge=0, le=1)
    top_k: int | None = Field(None, ge=-1, description="0 or -1 disables")
    min_p: float | None = Field(None, ge=0, le=1)
    seed: int | None = None
    stop: str | list[str] | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, Any] | None = None

    @field_validator("n")
    @classmethod
    def _one_choice(cls, n: int) -> int:
        if n != 1:
            raise _unsupported(f"n={n}: this server returns one choice per request (n=1)")
        return n

    @field_validator("presence_penalty", "frequency_penalty")
    @classmethod
    def _no_penalty(cls, value: float | None) -> float | None:
        if value:
            raise _unsupported(
                "penalties are not supported: decoding is lossless, the output follows the "
                "model's own distribution (send 0 or leave it out)"
            )
        return value

    @field_validator("logit_bias")
    @classmethod
    def _no_bias(cls, value: dict | None) -> dict | None:
        if value:
            raise _unsupported("logit_bias is not supported")
        return value

    @field_validator("stop")
    @classmethod
    def _stop_list(cls, value: str | list[str] | None) -> list[str]:
        if value is None:
            return []
        return [value] if isinstance(value, str) else value

    def core_request(self, **kw: Any) -> core.Request:
        return core.Request(
            max_tokens=self.requested_max_tokens(),
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=self.top_k or 0,
            min_p=self.min_p or 0.0,
            seed=self.seed,
            stop=self.stop,
            **kw,
        )

    def requested_max_tokens(self) -> int | None:
        return self.max_tokens

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class FunctionDef(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    type: Literal["function"]
    function: FunctionDef


class CalledFunction(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    name: str
    arguments: str | dict[str, Any] = "{}"


class ToolCallIn(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    id: str | None = None
    type: Literal["function"] = "function"
    function: CalledFunction


class ChatMessage(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")

    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: str | list[dict[str, Any]] | None = None
    tool_calls: list[ToolCallIn] | None = None
    tool_call_id: str | None = None
    name: str | None = None

    @field_validator("role")
    @classmethod
    def _no_function_role(cls, role: str) -> str:
        if role == "function":
            raise _unsupported("role 'function' (deprecated): use 'tool' messages")
        return role

    @field_validator("content")
    @classmethod
    def _text_parts(cls, content):
        if isinstance(content, list):
            for part in content:
                if part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise _unsupported(
                        f"content part of type {part.get('type')!r}: only text parts "
                        '({"type": "text", "text": ...}) are supported'
                    )
        return content

    def as_template_message(self, index: int) -> dict[str, Any]:
        """The message as chat templates expect it (text parts joined, developer = system,
        tool-call arguments as objects)."""
        content = self.content
        if isinstance(content, list):
            content = "\n".join(part["text"] for part in content)
        role = "system" if self.role == "developer" else self.role
        out: dict[str, Any] = {"role": role, "content": content or ""}
        if self.tool_calls:
            out["tool_calls"] = [
                template_call(c.id, c.function.name, c.function.arguments, f"messages[{index}]")
                for c in self.tool_calls
            ]
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        if self.name is not None:
            out["name"] = self.name
        return out


def template_call(call_id: str | None, name: str, arguments: Any, param: str) -> dict[str, Any]:
    """A call in a history message, arguments parsed (templates render them as JSON)."""
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except json.JSONDecodeError as e:
            raise APIError(
                400,
                f"Invalid '{param}': the arguments of the call to {name!r} are not JSON ({e})",
                param=param,
                code="invalid_value",
            ) from None
    return {
        "id": call_id or new_id("call_"),
        "type": "function",
        "function": {"name": name, "arguments": arguments},
    }


class NamedFunction(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    name: str


class NamedToolChoice(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    type: Literal["function"]
    function: NamedFunction


class ChatCompletionRequest(_Request):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    tools: list[Tool] | None = None
    tool_choice: Literal["auto", "none", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    functions: list[Any] | None = None
    function_call: Any = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    response_format: dict[str, Any] | None = None

    @field_validator("functions", "function_call")
    @classmethod
    def _no_functions(cls, value: Any) -> Any:
        if value:
            raise _unsupported("'functions' / 'function_call' are deprecated: use 'tools'")
        return value

    @field_validator("logprobs")
    @classmethod
    def _no_logprobs(cls, logprobs: bool | None) -> bool | None:
        if logprobs:
            raise _unsupported("logprobs are not supported")
        return logprobs

    @field_validator("top_logprobs")
    @classmethod
    def _no_top_logprobs(cls, n: int | None) -> int | None:
        if n:
            raise _unsupported("top_logprobs are not supported")
        return n

    @field_validator("response_format")
    @classmethod
    def _text_only(cls, fmt: dict | None) -> dict | None:
        if fmt is not None and fmt.get("type", "text") != "text":
            raise _unsupported(
                f"response_format {fmt.get('type')!r}: only plain text output is supported"
            )
        return fmt

    def requested_max_tokens(self) -> int | None:
        # max_completion_tokens is OpenAI's current name; max_tokens the deprecated one.
        return self.max_completion_tokens or self.max_tokens

    def core(self) -> core.Request:
        choice: Any = self.tool_choice or "auto"
        if isinstance(choice, NamedToolChoice):
            choice = {"name": choice.function.name}
        return self.core_request(
            messages=[m.as_template_message(i) for i, m in enumerate(self.messages)],
            tools=[t.model_dump(exclude_none=True) for t in self.tools] if self.tools else None,
            tool_choice=choice,
            parallel_tool_calls=self.parallel_tool_calls,
            param="messages",
        )


class CompletionRequest(_Request):
    prompt: str | list[str] | list[int] | list[list[int]]
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None
    logprobs: int | None = None

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, prompt):
        if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
            if len(prompt) != 1:
                raise _unsupported(
                    f"{len(prompt)} prompts in one request: send one prompt per request"
                )
            prompt = prompt[0]
        return prompt

    @field_validator("echo")
    @classmethod
    def _no_echo(cls, echo: bool) -> bool:
        if echo:
            raise _unsupported("echo is not supported")
        return echo

    @field_validator("suffix")
    @classmethod
    def _no_suffix(cls, suffix: str | None) -> str | None:
        if suffix:
            raise _unsupported("suffix (insertion) is not supported")
        return suffix

    @field_validator("best_of")
    @classmethod
    def _no_best_of(cls, best_of: int | None) -> int | None:
        if best_of not in (None, 1):
            raise _unsupported(f"best_of={best_of}: one completion per request is supported")
        return best_of

    @field_validator("logprobs")
    @classmethod
    def _no_logprobs(cls, logprobs: int | None) -> int | None:
        if logprobs is not None:
            raise _unsupported("logprobs are not supported")
        return logprobs

    def core(self) -> core.Request:
        return self.core_request(prompt=self.prompt, param="prompt")


# ---------------------------------------------------------------------------------------
# Responses


def _sse(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


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


def chat_completion(rid: str, model: str, events: list[core.Event]) -> dict[str, Any]:
    text, reasoning, calls, finish = core.merged(events)
    message: dict[str, Any] = {"role": "assistant", "content": text or (None if calls else "")}
    if reasoning:
        message["reasoning_content"] = reasoning
    if calls:
        message["tool_calls"] = [_call(c) for c in calls]
    choice: dict[str, Any] = {
        "index": 0,
        "message": message,
        "logprobs": None,
        "finish_reason": finish.reason,
    }
    if finish.truncated_tool_call:
        choice["truncated_tool_call"] = True
    return {
        "id": rid,
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": [choice],
        "usage": _usage(finish),
        "timings": finish.usage.timings(),
    }


def text_completion(rid: str, model: str, events: list[core.Event]) -> dict[str, Any]:
    text, _, _, finish = core.merged(events)
    return {
        "id": rid,
        "object": "text_completion",
        "created": int(time.time()),
        "model": model,
        "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish.reason}],
        "usage": _usage(finish),
        "timings": finish.usage.timings(),
    }


async def chat_stream(
    gen: core.Generation, rid: str, model: str, include_usage: bool
) -> AsyncIterator[str]:
    created = int(time.time())

    def chunk(delta: dict, finish: str | None = None, **extra) -> str:
        choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
        return _sse(
            {
                "id": rid,
                "object": "chat.completion.chunk",
                "created": created,
                "model": model,
                "choices": [choice],
                **extra,
            }
        )

    calls = 0
    try:
        yield chunk({"role": "assistant", "content": ""})
        async for e in gen.events():
            if isinstance(e, Text):
                yield chunk({"content": e.text})
            elif isinstance(e, Reasoning):
                yield chunk({"reasoning_content": e.text})
            elif isinstance(e, ToolCall):
                yield chunk({"tool_calls": [_call(e, calls)]})
                calls += 1
            elif isinstance(e, Finish):
                extra = {"timings": e.usage.timings()}
                if e.truncated_tool_call:
                    extra["truncated_tool_call"] = True
                yield chunk({}, e.reason, **extra)
                if include_usage:
                    yield _sse(
                        {
                            "id": rid,
                            "object": "chat.completion.chunk",
                            "created": created,
                            "model": model,
                            "choices": [],
                            "usage": _usage(e),
                        }
                    )
        yield "data: [DONE]\n\n"
    except Exception as exc:  # headers are sent: the error travels as an event
        yield _sse(error_body(core.as_api_error(exc)))


async def text_stream(
    gen: core.Generation, rid: str, model: str, include_usage: bool
) -> AsyncIterator[str]:
    created = int(time.time())

    def chunk(text: str, finish: str | None = None, **extra) -> str:
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
        return _sse(
            {
                "id": rid,
                "object": "text_completion",
                "created": created,
                "model": model,
                "choices": [choice],
                **extra,
            }
        )

    try:
        async for e in gen.events():
            if isinstance(e, Text):
                yield chunk(e.text)
            elif isinstance(e, Finish):
                yield chunk("", e.reason, timings=e.usage.timings())
                if include_usage:
                    yield _sse(
                        {
                            "id": rid,
                            "object": "text_completion",
                            "created": created,
                            "model": model,
                            "choices": [],
                            "usage": _usage(e),
                        }
                    )
        yield "data: [DONE]\n\n"
    except Exception as exc:
        yield _sse(error_body(core.as_api_error(exc)))


SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def routes(service: core.Service, model_name) -> APIRouter:
    """The OpenAI routes; `model_name(requested)` checks a model name and returns the one
    to echo."""
    router = APIRouter(prefix="/v1")

    async def respond(kind: str, body, request: Request) -> Response:
        model = model_name(body.model)
        gen = await service.start(body.core())
        rid = new_id("chatcmpl-" if kind == "chat" else "cmpl-")
        if body.stream:
            stream = chat_stream if kind == "chat" else text_stream
            return StreamingResponse(
                stream(gen, rid, model, body.include_usage),
                media_type="text/event-stream",
                headers=SSE_HEADERS,
            )
        events = await core.collect(gen, request.receive)
        if not any(isinstance(e, Finish) for e in events):  # the client left
            return Response(status_code=499)
        build = chat_completion if kind == "chat" else text_completion
        return JSONResponse(build(rid, model, events))

    @router.post("/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        """Chat completion with tools (`stream: true` for server-sent events); reasoning in
        `reasoning_content`, DFlash stats in `timings`."""
        return await respond("chat", body, request)

    @router.post("/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        """Text completion of `prompt` (a string or token ids); DFlash stats in `timings`."""
        return await respond("text", body, request)

    return router
