"""What a Responses request may say, and its translation onto `core.Request`.

`input` (a string, or items: messages, `function_call`, `function_call_output`; reasoning
items sent back are dropped) and `instructions` become chat messages in the template's
shape; function tools become `core`'s tools; `text.format` (json_schema, json_object) the
reply's JSON schema. The refused fields (`store`,
`previous_response_id`: nothing is stored, the client sends the whole input) are in
`refused.REFUSED`.
"""

from __future__ import annotations

from typing import Any, ClassVar, Literal

from pydantic import Field

from . import core
from .core import APIError
from .limits import MAX_MESSAGES, MAX_TOOLS
from .openai_requests import template_call
from .refused import Strict, ToolParameters, refuse
from .structured import TextOptions


class FunctionTool(Strict):
    type: str
    name: str | None = None
    description: str | None = None
    parameters: ToolParameters | None = None
    strict: bool | None = None

    _refused = refuse("responses tools[]")


class NamedChoice(Strict):
    type: Literal["function"]
    name: str


class ResponsesRequest(Strict):
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
    text: TextOptions | None = None
    reasoning: dict[str, Any] | None = None  # reasoning models think as their template says
    metadata: dict[str, Any] | None = None

    limits: ClassVar[dict[str, int]] = {"input": MAX_MESSAGES, "tools": MAX_TOOLS}
    _refused = refuse("responses")

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
            temperature=self.temperature,  # None: the server's default
            top_p=self.top_p,
            param="input",
            json_schema=fmt.engine_schema() if (fmt := self.text and self.text.format) else None,
            format_param="text.format",
        )

    def messages(self) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        called: set[str] = set()  # the call_ids of the function calls so far
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
                called.add(call["id"])
                last = out[-1] if out else None
                if last is None or last["role"] != "assistant":
                    last = {"role": "assistant", "content": ""}
                    out.append(last)
                last.setdefault("tool_calls", []).append(call)
            elif kind == "function_call_output":
                output = item.get("output", "")
                content = output if isinstance(output, str) else _text(output, where)
                call_id = _str(item, "call_id", where)
                if call_id not in called:
                    raise APIError(
                        400,
                        f"Invalid '{where}.call_id': no function_call before it in the input "
                        f"has the call_id {call_id!r} (a function_call_output answers one).",
                        param=f"{where}.call_id",
                        code="invalid_value",
                    )
                out.append({"role": "tool", "tool_call_id": call_id, "content": content})
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
