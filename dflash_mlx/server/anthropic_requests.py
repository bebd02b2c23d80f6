"""What an Anthropic Messages request may say, and its translation onto `core.Request`.

Content blocks (text, tool_use, tool_result; thinking blocks sent back are dropped: the
template renders the reply) become chat messages in the OpenAI shape chat templates
read; client tools become `core`'s function tools, `tool_choice` its tool choice. The
refused values (server tools, other content blocks) are in `refused.REFUSED`.
"""

from __future__ import annotations

from typing import Any, ClassVar, Literal

from pydantic import Field

from . import core
from .core import APIError
from .limits import MAX_MESSAGES, MAX_STOP_SEQUENCES, MAX_TOOLS
from .refused import Strict, ToolParameters, refuse


class ToolDef(Strict):
    name: str = Field(min_length=1)
    description: str | None = None
    input_schema: ToolParameters = Field(default_factory=lambda: {"type": "object"})
    type: str | None = None

    _refused = refuse("messages tools[]")


class ToolChoice(Strict):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool = False


class Message(Strict):
    role: Literal["user", "assistant"]
    content: str | list[dict[str, Any]]

    _refused = refuse("messages messages[]")


class CountTokensRequest(Strict):
    model: str | None = None
    messages: list[Message] = Field(min_length=1)
    system: str | list[dict[str, Any]] | None = None
    tools: list[ToolDef] | None = None
    tool_choice: ToolChoice | None = None

    limits: ClassVar[dict[str, int]] = {"messages": MAX_MESSAGES, "tools": MAX_TOOLS}

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
        used: set[str] = set()  # the ids of the previous message's tool_use blocks
        for i, m in enumerate(self.messages):
            where = f"messages[{i}].content"
            answerable, used = used, set()
            if isinstance(m.content, str):
                out.append({"role": m.role, "content": m.content})
                continue
            texts, calls = [], []
            for block in m.content:
                kind = block["type"]
                if kind == "text":
                    texts.append(_field(block, "text", str, where))
                elif kind == "tool_use" and m.role == "assistant":
                    used.add(_field(block, "id", str, where))
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
                    use_id = _field(block, "tool_use_id", str, where)
                    if use_id not in answerable:
                        raise APIError(
                            400,
                            f"Invalid '{where}': unexpected tool_use_id {use_id!r} in a "
                            "tool_result block: each tool_result must answer a tool_use block "
                            "of the message before it.",
                            param=where,
                        )
                    out.append({"role": "tool", "tool_call_id": use_id, "content": text})
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

    limits: ClassVar[dict[str, int]] = {
        **CountTokensRequest.limits,
        "stop_sequences": MAX_STOP_SEQUENCES,
    }

    def core(self) -> core.Request:
        return self.core_request(
            max_tokens=self.max_tokens,
            temperature=self.temperature,  # None: the server's default
            top_p=self.top_p,
            top_k=self.top_k,
            stop=[s for s in self.stop_sequences or [] if s],
        )
