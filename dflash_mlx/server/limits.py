"""Bounded requests: how big and how deep a body may be, checked before any model parses it,
and the routes that parse bodies off the event loop.

A body (at most `--max-body-mb`, enforced by `security.Guard`) is parsed in a worker thread:
its commas and brackets are counted first (a bound on its JSON values, so that no single
C-level parse holds the interpreter long), then it is decoded, its nesting measured
iteratively, the counts its schema bounds (messages, stop strings, tools, a tool's size)
checked, and only then validated into the route's pydantic model. Each refusal is a 4xx
naming the field; nothing a client sends reaches a recursive walk past `MAX_DEPTH`, and
`/health` answers while any one body is parsed.
"""

from __future__ import annotations

import json
import math
import typing
from collections.abc import Callable
from typing import Any

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from fastapi.routing import APIRoute
from pydantic import BaseModel, ValidationError
from starlette.concurrency import run_in_threadpool

from ..json_schema import MAX_DEPTH, too_deep
from .errors import APIError

# JSON values in a body, bounded by its commas and brackets (those in strings count too):
# more than any context holds, and few enough that parsing them never stalls the server.
MAX_VALUES = 1_000_000
MAX_MESSAGES = 10_000  # chat messages, Anthropic messages, Responses input items
MAX_TOOLS = 512
MAX_TOOL_VALUES = 10_000  # JSON values in one tool's definition (its schema, mostly)
MAX_STOP = 4  # OpenAI's limit on `stop`
MAX_STOP_SEQUENCES = 16  # Anthropic's `stop_sequences` (each is searched after every token)


def field_name(path: list[str | int], parts: int = 8) -> str:
    """A JSON path as OpenAI writes a param (`messages[0].content`), its first `parts` steps."""
    out = ""
    for step in path[:parts]:
        if isinstance(step, int):
            out += f"[{step}]"
        else:
            step = step if len(step) <= 40 else step[:40] + "..."
            out += f".{step}" if out else step
    return out


def count_values(value: Any, limit: int) -> int:
    """How many JSON values `value` holds (itself included), counting up to `limit` + 1."""
    n, stack = 0, [value]
    while stack and n <= limit:
        v = stack.pop()
        n += 1
        if isinstance(v, dict):
            stack.extend(v.values())
        elif isinstance(v, list):
            stack.extend(v)
    return n


def nested_too_deep(what: str, param: str | None) -> APIError:
    """`what` ("the request body nests") nested past `MAX_DEPTH`, as the client's error."""
    text = f"{what} arrays and objects more than {MAX_DEPTH} levels deep (this server's limit)."
    message = f"Invalid '{param}': {text}" if param else text[0].upper() + text[1:]
    return APIError(400, message, param=param, code="invalid_value")


def too_long(param: str, n: int, limit: int) -> APIError:
    return APIError(
        400,
        f"Invalid '{param}': array too long. Expected an array with maximum length {limit}, "
        f"but got an array with length {n} instead.",
        param=param,
        code="array_above_max_length",
    )


def check_counts(body: dict[str, Any], limits: dict[str, int]) -> None:
    """The arrays a schema bounds (`limits`: field -> most items), and each tool's size."""
    for name, limit in limits.items():
        value = body.get(name)
        if isinstance(value, list) and len(value) > limit:
            raise too_long(name, len(value), limit)
    tools = body.get("tools") if "tools" in limits else None
    for i, tool in enumerate(tools if isinstance(tools, list) else ()):
        if count_values(tool, MAX_TOOL_VALUES) > MAX_TOOL_VALUES:
            raise APIError(
                400,
                f"Invalid 'tools[{i}]': the tool's definition holds more than "
                f"{MAX_TOOL_VALUES:,} JSON values, this server's limit.",
                param=f"tools[{i}]",
                code="invalid_value",
            )


def _not_a_number(error: dict[str, Any]) -> dict[str, Any]:
    """pydantic's "should be a finite number", as JSON spells what was sent."""
    value = error.get("input")
    if error["type"] != "finite_number" or not isinstance(value, float):
        return error
    shown = "NaN" if math.isnan(value) else ("-Infinity" if value < 0 else "Infinity")
    what = "not a number" if math.isnan(value) else "not a finite number"
    return {**error, "msg": f"{shown} is {what}"}


def parse(raw: bytes, schema: type[BaseModel]) -> BaseModel:
    """`raw` as `schema`, bounded: the checks above, then pydantic's. A worker thread's job.

    The errors are the ones FastAPI raises (`RequestValidationError`, locations under
    "body"), so the app renders them as before, or `APIError`s naming the limit."""
    if not raw:  # as FastAPI: no body is a missing one
        raise RequestValidationError(
            [{"type": "missing", "loc": ("body",), "msg": "Field required"}]
        )
    if len(raw) > MAX_VALUES:  # else it cannot hold that many
        n = raw.count(b",") + raw.count(b"[") + raw.count(b"{")
        if n > MAX_VALUES:
            raise APIError(
                413,
                f"The request body has {n:,} commas and brackets: more JSON values than the "
                f"{MAX_VALUES:,} this server parses in one request.",
                kind="request_too_large",
                code="request_too_large",
            )
    try:
        body = json.loads(raw)
    except json.JSONDecodeError as e:
        error = {"type": "json_invalid", "loc": ("body", e.pos), "msg": "JSON decode error",
                 "input": {}, "ctx": {"error": e.msg}}  # fmt: skip
        raise RequestValidationError([error]) from None
    except RecursionError:  # past Python's own limit, far past ours
        raise nested_too_deep("the request body nests", None) from None
    except ValueError as e:  # not UTF-8 (nor UTF-16/32)
        raise APIError(400, f"We could not parse the JSON body of your request ({e}).") from None
    path = too_deep(body)
    if path is not None:
        raise nested_too_deep("the request body nests", field_name(path))
    if isinstance(body, dict):
        check_counts(body, getattr(schema, "limits", {}))
    try:
        # As FastAPI validates a body: a JSON body that is no object "should be a valid
        # dictionary or object to extract fields from" (the app's message says the rest).
        return schema.model_validate(body, from_attributes=True)
    except ValidationError as e:
        first = e.errors(include_url=False)[0]  # the app reports the first
        raise RequestValidationError(
            [_not_a_number({**first, "loc": ("body", *first["loc"])})]
        ) from None


class BoundedRoute(APIRoute):
    """A route whose JSON body is parsed and validated by `parse`, in a worker thread.

    FastAPI would parse and validate a body on the event loop, where a big one holds every
    other request (`/health` too) until it is done. The endpoint declares its body as usual
    (`body: Schema`, so /openapi.json documents it) and may take `request: Request`; this
    route calls it with the parsed body and renders a dict it returns as JSON."""

    def get_route_handler(self) -> Callable[[Request], Any]:
        endpoint = self.endpoint
        hints = typing.get_type_hints(endpoint)
        if "body" not in hints:  # no body to parse: FastAPI's own handler
            return super().get_route_handler()
        schema, wants_request = hints["body"], "request" in hints

        async def handle(request: Request) -> Response:
            body = await run_in_threadpool(parse, await request.body(), schema)
            kwargs = {"request": request} if wants_request else {}
            out = await endpoint(body=body, **kwargs)
            return out if isinstance(out, Response) else JSONResponse(out)

        return handle
