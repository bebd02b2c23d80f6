"""What an OpenAI request may say, and its translation onto `core.Request`.

The schemas of /v1/chat/completions (messages, tools, a tool choice) and /v1/completions
(a prompt, text or token ids), strict like OpenAI's; the fields they refuse are in
`refused.REFUSED`. `template_call` puts a call of a history message in the chat
template's shape (the Responses API's input uses it too).
"""

from __future__ import annotations

import json
from typing import Any, ClassVar, Literal

from pydantic import Field, field_validator

from . import core
from .core import APIError, new_id
from .limits import MAX_MESSAGES, MAX_STOP, MAX_TOOLS, nested_too_deep, too_deep
from .refused import Strict, ToolParameters, refuse, unsupported, unsupported_value
from .structured import ResponseFormat

MAX_TOP_LOGPROBS = 20  # OpenAI's limit (the engine's too)


# The most digits a `logit_bias` key may have (its range is checked against the vocabulary).
MAX_TOKEN_ID_DIGITS = 9


class StreamOptions(Strict):
    include_usage: bool = False


class _Request(Strict):
    """What both endpoints share: sampling, stop strings, the token budget, streaming."""

    model: str | None = None
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, ge=0, le=1)
    top_k: int | None = Field(None, ge=-1, description="0 or -1 disables")
    min_p: float | None = Field(None, ge=0, le=1)
    seed: int | None = None
    stop: str | list[str] | None = Field(None, validate_default=True)  # -> a list
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    logit_bias: dict[str, float] | None = None  # token id (as text) -> bias in [-100, 100]
    # mlx-lm's extension: divide the logits of the recent tokens' (prompt included).
    repetition_penalty: float | None = Field(None, gt=0)
    repetition_context_size: int | None = Field(None, ge=1)
    response_format: ResponseFormat | None = None
    # dflash-mlx's extension: verify a tree of drafts (true) or chains only (false); null
    # or left out: the server's default (`serve --tree/--no-tree`, else chosen per cycle).
    tree: bool | None = None

    limits: ClassVar[dict[str, int]] = {"stop": MAX_STOP}  # arrays' lengths (`limits.py`)

    @field_validator("logit_bias")
    @classmethod
    def _token_ids(cls, bias: dict[str, float] | None) -> dict[str, float] | None:
        for key, value in (bias or {}).items():
            # ASCII decimal only ("²" is a digit to `isdigit`, not to `int`), and short: no
            # vocabulary has 10 digits of ids (Python refuses to parse 4300).
            if not (key.isascii() and key.isdigit()) or len(key) > MAX_TOKEN_ID_DIGITS:
                raise unsupported_value(
                    f"key {key[:40]!r} is not a token id (an integer >= 0, in ASCII digits)"
                )
            if not -100 <= value <= 100:
                raise unsupported_value(f"the bias of token {key} is {value}, not in [-100, 100]")
        return bias

    @field_validator("stop")
    @classmethod
    def _stop_list(cls, value: str | list[str] | None) -> list[str]:
        if value is None:
            return []
        return [value] if isinstance(value, str) else value

    def core_request(self, **kw: Any) -> core.Request:
        fmt = self.response_format
        return core.Request(
            max_tokens=self.requested_max_tokens(),
            temperature=self.temperature,  # None: the server's default
            top_p=self.top_p,
            top_k=self.top_k,
            min_p=self.min_p,
            seed=self.seed,
            stop=self.stop,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            repetition_penalty=self.repetition_penalty,
            repetition_context_size=self.repetition_context_size,
            logit_bias=self.logit_bias,
            logprobs=self.top_alternatives(),
            json_schema=fmt.engine_schema("response_format") if fmt else None,
            tree=self.tree,
            **kw,
        )

    def top_alternatives(self) -> int | None:
        """The engine's `logprobs`: None (off), or the top alternatives per token."""
        return None

    def requested_max_tokens(self) -> int | None:
        return self.max_tokens

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class FunctionDef(Strict):
    name: str = Field(min_length=1)
    description: str | None = None
    parameters: ToolParameters | None = None
    strict: bool | None = None


class Tool(Strict):
    type: Literal["function"]
    function: FunctionDef


class CalledFunction(Strict):
    name: str
    arguments: str | dict[str, Any] = "{}"


class ToolCallIn(Strict):
    id: str | None = None
    type: Literal["function"] = "function"
    function: CalledFunction


class ChatMessage(Strict):
    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: str | list[dict[str, Any]] | None = None
    tool_calls: list[ToolCallIn] | None = None
    tool_call_id: str | None = None
    name: str | None = None

    _refused = refuse("chat/completions messages[]")

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
        except RecursionError:  # nested past Python's own limit
            raise nested_too_deep(f"the arguments of the call to {name!r} nest", param) from None
        if too_deep(arguments) is not None:
            raise nested_too_deep(f"the arguments of the call to {name!r} nest", param)
    return {
        "id": call_id or new_id("call_"),
        "type": "function",
        "function": {"name": name, "arguments": arguments},
    }


class NamedFunction(Strict):
    name: str


class NamedToolChoice(Strict):
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
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)

    limits: ClassVar[dict[str, int]] = {
        **_Request.limits,
        "messages": MAX_MESSAGES,
        "tools": MAX_TOOLS,
    }
    _refused = refuse("chat/completions")

    def top_alternatives(self) -> int | None:
        if self.top_logprobs is not None and not self.logprobs:
            raise APIError(
                400,
                "Invalid 'top_logprobs': it needs 'logprobs' set to true.",
                param="top_logprobs",
                code="invalid_value",
            )
        return (self.top_logprobs or 0) if self.logprobs else None

    def requested_max_tokens(self) -> int | None:
        # max_completion_tokens is OpenAI's current name; max_tokens the deprecated one.
        return self.max_completion_tokens or self.max_tokens

    def core(self) -> core.Request:
        choice: Any = self.tool_choice or "auto"
        if isinstance(choice, NamedToolChoice):
            choice = {"name": choice.function.name}
        return self.core_request(
            messages=self.template_messages(),
            tools=[t.model_dump(exclude_none=True) for t in self.tools] if self.tools else None,
            tool_choice=choice,
            parallel_tool_calls=self.parallel_tool_calls,
            param="messages",
        )

    def template_messages(self) -> list[dict[str, Any]]:
        """The messages in the template's shape; each tool message answers a call of the
        assistant message before it (tool messages between them aside), as OpenAI's do."""
        out = []
        calls: set[str | None] | None = None  # the ids the next tool message may answer
        for i, m in enumerate(self.messages):
            if m.role == "tool":
                answer_call(m.tool_call_id, calls, f"messages[{i}]")
            elif m.role == "assistant" and m.tool_calls:
                calls = {c.id for c in m.tool_calls}
            else:
                calls = None
            out.append(m.as_template_message(i))
        return out


def answer_call(call_id: str | None, calls: set[str | None] | None, where: str) -> None:
    """Refuse a tool message answering no call: none before it (`calls` None), no
    `tool_call_id`, or an id not among `calls` (an id-less call may be the one answered)."""
    if call_id is None:
        raise APIError(
            400,
            f"Missing required parameter: '{where}.tool_call_id'.",
            param=f"{where}.tool_call_id",
            code="missing_required_parameter",
        )
    if calls is None:
        raise APIError(
            400,
            f"Invalid '{where}': a message with role 'tool' must answer a call of the "
            "assistant message before it (one with 'tool_calls').",
            param=where,
            code="invalid_value",
        )
    if call_id not in calls and None not in calls:
        ids = ", ".join(repr(c) for c in sorted(calls))
        raise APIError(
            400,
            f"Invalid '{where}.tool_call_id': {call_id!r} is not the id of a call of the "
            f"assistant message before it ({ids}).",
            param=f"{where}.tool_call_id",
            code="invalid_value",
        )


class CompletionRequest(_Request):
    prompt: str | list[str] | list[int] | list[list[int]]
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None
    logprobs: int | None = Field(None, ge=0, le=5)  # the legacy API's top alternatives

    _refused = refuse("completions")

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, prompt):
        if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
            if len(prompt) != 1:
                raise unsupported(
                    f"{len(prompt)} prompts in one request: send one prompt per request"
                )
            prompt = prompt[0]
        return prompt

    def top_alternatives(self) -> int | None:
        return self.logprobs

    def core(self) -> core.Request:
        return self.core_request(prompt=self.prompt, param="prompt")
