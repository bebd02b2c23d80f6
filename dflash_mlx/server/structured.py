"""Structured output: the reply as JSON (`response_format`, Responses' `text.format`) and
forced tool calls (`tool_choice` required or named), as the engine's grammar options.

A JSON format becomes `GenerateOptions.json_schema` (a schema, or True for any JSON object).
A forced tool choice becomes a Lark grammar (`GenerateOptions.grammar`, llguidance's
syntax) that writes one call in the tool-call format this model's parser reads (mlx-lm's
parser, inferred from the chat template), the arguments following the tool's JSON schema
(`%json`); "required" lets the model pick any of the tools. Formats whose calls are not JSON
in known markers are refused (400) rather than pretended. Knows nothing about HTTP: the APIs
parse the request schemas below, `core.Service` calls `constrain` once the prompt is
tokenized, and an invalid schema is a 400 naming the field it came from.
"""

from __future__ import annotations

import json
import math
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any, Literal

from pydantic import Field

from ..errors import BadArgument
from ..grammar_cage import DeepPool
from .errors import APIError
from .refused import Strict, ToolSchema

# JSON as grammars write it: one space after ',' and ':' and no other whitespace (a weak
# model must not loop in blanks); the engine's `json_schema` does the same.
JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


class JSONSchemaFormat(Strict):
    name: str = Field("response", max_length=64)
    description: str | None = None
    schema_: ToolSchema | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(Strict):
    """OpenAI chat's `response_format`: text, any JSON object, or JSON following a schema."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaFormat | None = None

    def engine_schema(self, param: str) -> dict[str, Any] | bool | None:
        """The engine's `json_schema` (None: plain text)."""
        if self.type == "text":
            return None
        if self.type == "json_object":
            return True
        if self.json_schema is None:
            raise APIError(
                400,
                f"Missing required parameter: '{param}.json_schema'.",
                param=f"{param}.json_schema",
                code="missing_required_parameter",
            )
        return self.json_schema.schema_ or {}


class TextFormat(Strict):
    """The Responses API's `text.format`: the same three, the schema's fields inline."""

    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    description: str | None = None
    schema_: ToolSchema | None = Field(None, alias="schema")
    strict: bool | None = None

    def engine_schema(self) -> dict[str, Any] | bool | None:
        if self.type == "text":
            return None
        if self.type == "json_object":
            return True
        if self.schema_ is None:
            raise APIError(
                400,
                "Missing required parameter: 'text.format.schema'.",
                param="text.format.schema",
                code="missing_required_parameter",
            )
        return self.schema_


class TextOptions(Strict):
    format: TextFormat | None = None
    verbosity: str | None = None


# -- forced tool calls -------------------------------------------------------------------

# mlx-lm parser modules whose calls are `start {"name": ..., "arguments": {...}} end`.
_JSON_CALLS = {"json_tools"}


def call_format(tokenizer: Any) -> str | None:
    """The mlx-lm tool parser this model's replies are read with (its module's name)."""
    parser = getattr(tokenizer, "tool_parser", None)
    module = getattr(parser, "__module__", "") or ""
    return module.rsplit(".", 1)[-1] or None


def _lark_string(text: str) -> str:
    return json.dumps(text, ensure_ascii=False)


def _marker(tokenizer: Any, text: str) -> str:
    """A tool-call marker in Lark: the added token itself (`<tool_call>`), which llguidance
    knows by name, else its text."""
    added = getattr(tokenizer, "added_tokens_decoder", None) or {}
    if any(getattr(t, "content", None) == text for t in added.values()):
        return text
    return _lark_string(text)


def _arguments_schema(tool: dict[str, Any]) -> dict[str, Any]:
    schema = tool["function"].get("parameters") or {"type": "object"}
    # The arguments are an object, whatever else the schema's type allows.
    return {**schema, "type": "object", "x-guidance": JSON_STYLE}


def tool_grammar(tokenizer: Any, tools: list[dict[str, Any]], reasoning: bool) -> str:
    """A Lark grammar of one call of any of `tools`, as this model writes calls.

    `reasoning`: the prompt left the model inside its reasoning block, which it may go on
    with (and must close) before the call. `APIError` 400 when the model's tool-call format
    is not one this server can force."""
    fmt = call_format(tokenizer)
    if fmt not in _JSON_CALLS:
        raise APIError(
            400,
            "Forcing a tool call (tool_choice 'required' or a named function) is not "
            f"supported for this model: its tool-call format ({fmt or 'none known'}) is not "
            "one this server can constrain; use tool_choice 'auto'.",
            param="tool_choice",
            code="unsupported_value",
        )
    start = _marker(tokenizer, tokenizer.tool_call_start)
    end = _marker(tokenizer, tokenizer.tool_call_end)
    rules = []
    for i, tool in enumerate(tools):
        name = tool["function"]["name"]
        head = _lark_string("\n" + '{"name": ' + json.dumps(name) + ', "arguments": ')
        rules.append(f'call_{i}: {start} {head} args_{i} "}}\\n" {end}')
        rules.append(f"args_{i}: %json {json.dumps(_arguments_schema(tool))}")
    calls = " | ".join(f"call_{i}" for i in range(len(tools)))
    lines = [f"start: {'thought ' if reasoning else ''}({calls})"]
    if reasoning:
        think_end = _marker(tokenizer, tokenizer.think_end)
        lines.append(f'thought: THOUGHT {think_end} "\\n"*')
        lines.append(r"THOUGHT: /(.|\n)*/")
    return "\n".join(lines + rules) + "\n"


# Seconds a request's grammar may take to build. It is built once, here, off the engine's
# thread (the engine's own compile for the request is then a copy, `controls.compile_grammar`),
# so the streams running meanwhile never wait for it; one that takes longer is refused.
BUILD_SECONDS = 5.0
# Grammars built at once; a build refused for its time goes on in its thread until it ends
# (llguidance cannot be interrupted), so at most this many can be burning a core. Each
# builder runs on a deep stack (`grammar_cage`): no schema within the checks' bounds can
# overflow it and take the server down.
_BUILDS = DeepPool(2, "dflash-grammar")


def check(
    options: Any, tokenizer: Any, vocab: int | None, param: str, tools: list | None = None
) -> None:
    """Build `options`' grammar and refuse an invalid schema or grammar as a 400 naming
    `param`, before streaming; one that takes longer than `BUILD_SECONDS` to build is a 400
    too, and a 503 when the builds of earlier requests still hold every builder.

    `tools`: a forced call's tools, whose parameter schemas are each checked alone as well
    (within the same time): a schema that fails where the call's arguments start (a `$ref`
    loop) lets the call's grammar start, and would fail mid-reply."""
    from ..engine import controls

    builds = [(options, param)]
    for tool in tools or []:
        schema = tool["function"].get("parameters") or {"type": "object"}
        builds.append((options.replace(grammar=None, json_schema=schema), "tools"))
    building: list[str] = []  # the field whose grammar is being built

    def build_all() -> None:
        for each, at in builds:
            building[:] = [at]
            controls.check_grammar(each, tokenizer, vocab)

    try:
        build = _BUILDS.submit(build_all)
        try:
            build.result(timeout=BUILD_SECONDS)
        except FutureTimeout:
            if build.cancel():  # it never started: the builders are busy with others
                raise APIError(
                    503,
                    "The server is busy building other requests' grammars; retry shortly.",
                    code="grammar_builders_busy",
                    headers={"Retry-After": str(math.ceil(BUILD_SECONDS))},
                ) from None
            at = building[0] if building else param
            raise APIError(
                400,
                f"Invalid '{at}': its grammar takes longer than {BUILD_SECONDS:g} s to "
                "build; simplify it (fewer alternatives, shorter patterns, fewer properties)",
                param=at,
                code="invalid_value",
            ) from None
    except BadArgument as e:
        at = building[0] if building else param
        raise APIError(400, f"Invalid '{at}': {e}", param=at, code="invalid_value") from None
