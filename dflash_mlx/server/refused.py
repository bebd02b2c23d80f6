"""What a request may not say: one table of the refused fields of every API, and the one
validator that refuses them.

Request schemas are `Strict`: "max_tokens": "5" is a type error (as with OpenAI), and the
fields a schema does not know are ignored (clients send vendor extras). The exceptions
are the fields in `REFUSED`: a client sends them to change the result in a way this
server does not honour (one reply per request; nothing kept between requests). A schema
refuses its group with `_refused = refuse("<group>")`; `app` renders the error as a 400
`unsupported_parameter` whose `param` is the field: "Unsupported parameter 'n': n=2:
this server returns ...".
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Annotated, Any

from pydantic import AfterValidator, BaseModel, ConfigDict, ValidationInfo, field_validator
from pydantic_core import PydanticCustomError

from ..json_schema import schema_problem, schema_too_large
from ..schema_graph import schema_graph_problem


class Strict(BaseModel):
    """A request schema: strict types, unknown fields ignored, no NaN or infinite numbers."""

    model_config = ConfigDict(strict=True, extra="ignore", allow_inf_nan=False)


def unsupported(reason: str) -> PydanticCustomError:
    """The error refusing a value: a 400 `unsupported_parameter` naming its field."""
    return PydanticCustomError("unsupported_parameter", reason)


def unsupported_value(reason: str) -> PydanticCustomError:
    """The error refusing a value of a supported field: a 400 `invalid_value` naming it."""
    return PydanticCustomError("value_error", reason)


def _json_schema(schema: dict[str, Any]) -> dict[str, Any]:
    problem = schema_problem(schema)
    if problem is not None:
        raise PydanticCustomError(
            "invalid_schema", "not a JSON Schema: {problem}", {"problem": problem}
        )
    problem = schema_too_large(schema)
    if problem is not None:
        raise PydanticCustomError(
            "invalid_schema", "a JSON Schema too large to serve: {problem}", {"problem": problem}
        )
    problem = schema_graph_problem(schema)
    if problem is not None:
        raise PydanticCustomError(
            "invalid_schema", "a JSON Schema no reply can follow: {problem}", {"problem": problem}
        )
    return schema


# A JSON Schema object, its `type`s JSON types (`"type": 5` is refused).
ToolSchema = Annotated[dict[str, Any], AfterValidator(_json_schema)]


def _object_schema(schema: dict[str, Any]) -> dict[str, Any]:
    kind = schema.get("type", "object")
    if kind != "object" and not (isinstance(kind, list) and "object" in kind):
        raise PydanticCustomError(
            "invalid_schema",
            "a tool's parameters must be a JSON Schema of type 'object' (its arguments are "
            "a JSON object), not of type {kind}",
            {"kind": json.dumps(kind)},
        )
    return schema


# A tool's parameters: a JSON Schema of objects (OpenAI and Anthropic refuse any other).
ToolParameters = Annotated[
    dict[str, Any], AfterValidator(_json_schema), AfterValidator(_object_schema)
]


def _unset(value: Any) -> bool:
    return not value  # null, false, 0, "", [], {}: what says "none of that"


@dataclass(frozen=True)
class Refused:
    """Why a field is refused, and the values of it accepted all the same.

    `reason` is formatted with `value`, the value refused, and `type`: its "type" when it
    is an object (a content part, a format), else the value itself.
    """

    reason: str
    accepts: Callable[[Any], bool] = _unset


_OPENAI = {  # both /v1/chat/completions and /v1/completions
    "n": Refused("n={value}: this server returns one choice per request (n=1)", lambda n: n == 1),
}

_BLOCKS = ("text", "tool_use", "tool_result", "thinking", "redacted_thinking")

# group -> field -> why. A group is the schema of one place in a request body: the
# endpoint, then the list its items are in. A field is a schema's field name, or "name[]"
# (each item of the list it holds), or "name.key" (a key of the object it holds).
REFUSED: dict[str, dict[str, Refused]] = {
    "chat/completions": {
        **_OPENAI,
        **dict.fromkeys(
            ("functions", "function_call"),
            Refused("'functions' / 'function_call' are deprecated: use 'tools'"),
        ),
    },
    "chat/completions messages[]": {
        "role": Refused(
            "role 'function' (deprecated): use 'tool' messages", lambda role: role != "function"
        ),
        "content[]": Refused(
            "content part of type {type!r}: only text parts "
            '({{"type": "text", "text": ...}}) are supported',
            lambda part: part.get("type") == "text" and isinstance(part.get("text"), str),
        ),
    },
    "completions": {
        **_OPENAI,
        "echo": Refused("echo is not supported"),
        "suffix": Refused("suffix (insertion) is not supported"),
        "best_of": Refused(
            "best_of={value}: one completion per request is supported", lambda n: n in (None, 1)
        ),
    },
    "responses": {
        "store": Refused(
            "this server is stateless: it stores no responses (send store: false, and the "
            "whole conversation as input)"
        ),
        "previous_response_id": Refused(
            "this server is stateless and keeps no responses: send the whole conversation "
            "as input instead of previous_response_id"
        ),
    },
    "responses tools[]": {
        "type": Refused(
            "tool of type {value!r}: only function tools are supported",
            lambda kind: kind == "function",
        ),
    },
    "messages tools[]": {
        "type": Refused(
            "server tool {value!r}: only client (custom) tools are supported",
            lambda kind: kind in (None, "custom"),
        ),
    },
    "messages messages[]": {
        "content[]": Refused(
            "content block of type {type!r}: text, tool_use and tool_result blocks are supported",
            lambda block: block.get("type") in _BLOCKS,
        ),
    },
}

_FIELD = re.compile(r"(\w+)(\[\]|\.\w+)?")


def _within(value: Any, rest: str) -> list[Any]:
    """What a field's `rest` ("", "[]" or ".key") names in its value."""
    if not rest:
        return [value]
    if rest == "[]":
        return value if isinstance(value, list) else []
    return [value.get(rest[1:]) if isinstance(value, dict) else None]


def refuse(group: str) -> Any:
    """The validator refusing the fields of `REFUSED[group]`, for the schema of that place."""
    rules: dict[str, list[tuple[str, Refused]]] = {}
    for field, rule in REFUSED[group].items():
        name, rest = _FIELD.fullmatch(field).groups()
        rules.setdefault(name, []).append((rest or "", rule))

    def check(cls, value: Any, info: ValidationInfo) -> Any:
        for rest, rule in rules[info.field_name]:
            for v in _within(value, rest):
                if not rule.accepts(v):
                    kind = v.get("type") if isinstance(v, dict) else v
                    raise unsupported(rule.reason.format(value=v, type=kind))
        return value

    return field_validator(*rules)(check)
