"""OpenAI's wire format: request schemas (pydantic), response bodies and the error type.

Owns what a request may say (types, ranges, the fields refused because they would change
the meaning of a request) and how responses and errors are shaped, so that unchanged
OpenAI clients read them. Knows nothing about models, queues or HTTP routing.
"""

from __future__ import annotations

import time
import uuid
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator
from pydantic_core import PydanticCustomError

if TYPE_CHECKING:
    from ..generate import GenerationResponse

# Seeds are any integer (OpenAI: int64); the engine's key takes an unsigned 64-bit one.
SEED_MODULUS = 2**64


class APIError(Exception):
    """An error the client caused or must know about; the app renders it as OpenAI JSON."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ):
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
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

    def sampling(self, max_tokens: int) -> dict[str, Any]:
        """`stream_generate` keyword arguments; `max_tokens` is already resolved."""
        top_p = 1.0 if self.top_p is None else self.top_p
        top_k = max(self.top_k or 0, 0)
        if top_p == 0:  # the smallest set holding mass 0 is the top token alone
            top_p, top_k = 1.0, 1
        return {
            "max_tokens": max_tokens,
            "temperature": 1.0 if self.temperature is None else self.temperature,
            "top_p": top_p,
            "top_k": top_k,
            "min_p": self.min_p or 0.0,
            "seed": None if self.seed is None else self.seed % SEED_MODULUS,
            "stop": self.stop,
        }

    def requested_max_tokens(self) -> int | None:
        return self.max_tokens

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class ChatMessage(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")

    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: str | list[dict[str, Any]] | None = None
    tool_calls: list[Any] | None = None

    @field_validator("role")
    @classmethod
    def _no_tool_role(cls, role: str) -> str:
        if role in ("tool", "function"):
            raise _unsupported(f"role {role!r}: tool calling is not supported yet")
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

    @field_validator("tool_calls")
    @classmethod
    def _no_tool_calls(cls, calls: list | None) -> list | None:
        if calls:
            raise _unsupported("tool_calls: tool calling is not supported yet")
        return calls

    def as_template_message(self) -> dict[str, str]:
        """{"role", "content"} as chat templates expect (text parts joined, developer = system)."""
        content = self.content
        if isinstance(content, list):
            content = "\n".join(part["text"] for part in content)
        role = "system" if self.role == "developer" else self.role
        return {"role": role, "content": content or ""}


class ChatCompletionRequest(_Request):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    tools: list[Any] | None = None
    tool_choice: Any = None
    functions: list[Any] | None = None
    function_call: Any = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    response_format: dict[str, Any] | None = None

    @field_validator("tools", "functions")
    @classmethod
    def _no_tools(cls, tools: list | None) -> list | None:
        if tools:
            raise _unsupported("tool calling is not supported yet: send the request without tools")
        return tools

    @field_validator("tool_choice", "function_call")
    @classmethod
    def _no_tool_choice(cls, choice: Any) -> Any:
        if choice not in (None, "none", "auto"):
            raise _unsupported("tool calling is not supported yet")
        return choice

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

    def template_messages(self) -> list[dict[str, str]]:
        return [m.as_template_message() for m in self.messages]


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


class Tally:
    """Running totals of one request's `GenerationResponse`s: usage and DFlash timings."""

    def __init__(self) -> None:
        self.last: GenerationResponse | None = None
        self.drafted = 0  # tokens the target verified beyond each cycle's anchor
        self.accepted = 0

    def add(self, r: GenerationResponse) -> None:
        self.last = r
        self.drafted += max(r.width - 1, 0)
        self.accepted += r.accepted

    @property
    def finish_reason(self) -> str | None:
        return self.last.finish_reason if self.last else None

    def usage(self) -> dict[str, Any]:
        r = self.last
        prompt, completion = r.prompt_tokens, r.generation_tokens
        return {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": r.cached_tokens},
        }

    def timings(self) -> dict[str, Any]:
        """llama-server's `timings` keys, plus DFlash's: tau, cycles, verify width, memory."""
        r = self.last
        prefilled = r.prompt_tokens - r.cached_tokens
        prompt_ms = r.time_to_first_token * 1000
        # generation_tps counts the tokens after the first over their own time.
        predicted_ms = (
            (r.generation_tokens - 1) / r.generation_tps * 1000 if r.generation_tps else 0
        )
        return {
            "cache_n": r.cached_tokens,
            "prompt_n": prefilled,
            "prompt_ms": prompt_ms,
            "prompt_per_second": r.prompt_tps,
            "predicted_n": r.generation_tokens,
            "predicted_ms": predicted_ms,
            "predicted_per_second": r.generation_tps,
            "draft_n": self.drafted,
            "draft_n_accepted": self.accepted,
            "tau": r.mean_acceptance,
            "cycles": r.cycles,
            "verify_width": r.block_size,  # None: chosen per cycle
            "peak_memory_gb": r.peak_memory,
        }


def new_id(kind: Literal["chat", "text"]) -> str:
    return ("chatcmpl-" if kind == "chat" else "cmpl-") + uuid.uuid4().hex[:24]


def chat_chunk(
    rid: str, model: str, created: int, delta: dict, finish: str | None = None
) -> dict[str, Any]:
    return {
        "id": rid,
        "object": "chat.completion.chunk",
        "created": created,
        "model": model,
        "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}],
    }


def text_chunk(
    rid: str, model: str, created: int, text: str, finish: str | None = None
) -> dict[str, Any]:
    return {
        "id": rid,
        "object": "text_completion",
        "created": created,
        "model": model,
        "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish}],
    }


def usage_chunk(rid: str, model: str, created: int, kind: str, tally: Tally) -> dict[str, Any]:
    """The last chunk with `stream_options.include_usage`: no choices, the usage."""
    obj = "chat.completion.chunk" if kind == "chat" else "text_completion"
    return {
        "id": rid,
        "object": obj,
        "created": created,
        "model": model,
        "choices": [],
        "usage": tally.usage(),
        "timings": tally.timings(),
    }


def chat_completion(rid: str, model: str, text: str, tally: Tally) -> dict[str, Any]:
    return {
        "id": rid,
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": text},
                "logprobs": None,
                "finish_reason": tally.finish_reason,
            }
        ],
        "usage": tally.usage(),
        "timings": tally.timings(),
    }


def text_completion(rid: str, model: str, text: str, tally: Tally) -> dict[str, Any]:
    return {
        "id": rid,
        "object": "text_completion",
        "created": int(time.time()),
        "model": model,
        "choices": [
            {"index": 0, "text": text, "logprobs": None, "finish_reason": tally.finish_reason}
        ],
        "usage": tally.usage(),
        "timings": tally.timings(),
    }
