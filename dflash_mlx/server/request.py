"""The internal request every API translates onto, and the checks on what a client sent.

`Request` is what any API asks for: chat messages in the chat template's own shape
(OpenAI's: `role`, `content`, `tool_calls`, `tool_call_id`) or a raw prompt, function
tools, a tool choice, sampling settings, stop strings and a token budget. `options` turns it
into the engine's one `GenerateOptions`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from ..engine.text import check_text
from ..errors import BadArgument
from ..json_schema import json_strings as _strings
from ..options import GenerateOptions
from .errors import APIError

# Below this, a temperature is greedy decoding: 1/T overflows float32 long before T = 0.
MIN_TEMPERATURE = 1e-3
SEED_MODULUS = 2**64  # seeds are any integer; the engine's key takes an unsigned 64-bit one
# What a request that leaves a sampling field out gets, unless the server sets its own
# (`serve --temp ...`): the APIs' defaults (OpenAI's and Anthropic's temperature is 1).
SAMPLING_DEFAULTS: dict[str, Any] = {
    "temperature": 1.0,
    "top_p": 1.0,
    "top_k": 0,
    "min_p": 0.0,
    "seed": None,
    # Logits processing, off unless the request or the server (`serve --presence-penalty`)
    # sets it.
    "presence_penalty": 0.0,
    "frequency_penalty": 0.0,
    "repetition_penalty": None,
    "repetition_context_size": 20,
}
PROCESSING = (
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "repetition_context_size",
)


@dataclass
class Request:
    messages: list[dict[str, Any]] | None = None  # chat, in the template's shape
    prompt: str | list[int] | None = None  # a raw completion prompt instead
    tools: list[dict[str, Any]] | None = None  # [{"type": "function", "function": {...}}]
    tool_choice: str | dict[str, Any] = "auto"  # auto | none | required | {"name": ...}
    parallel_tool_calls: bool = True  # False: the first call of a reply only
    max_tokens: int | None = None  # None: the server's default
    # None: the server's default (`serve --temp` ...), else the APIs' (SAMPLING_DEFAULTS).
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    param: str = "messages"  # the request field errors about the prompt name
    # Logits processing (None: the server's default, else off).
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    repetition_context_size: int | None = None
    logit_bias: dict[str, float] | None = None  # OpenAI's: token id (as text) -> bias
    logprobs: int | None = None  # None: none; k: each token's logprob and k alternatives
    # The reply as JSON: a schema, or True for any JSON object; `format_param` names the
    # request field it came from, for errors about it.
    json_schema: dict[str, Any] | bool | None = None
    format_param: str = "response_format"
    # Verify a tree of drafts (True) or chains only (False); None: the server's default.
    tree: bool | None = None

    def options(
        self,
        defaults: GenerateOptions,
        max_tokens: int,
        sampling: Mapping[str, Any] | None = None,
    ) -> GenerateOptions:
        """The engine's options for this request: the server's defaults with what the
        request sets, in the engine's terms (a near-zero temperature is greedy, top_p 0 is
        the top token alone, seeds taken modulo 2^64). A sampling field the request leaves
        out is the server's `sampling` default, else the APIs' own (`SAMPLING_DEFAULTS`);
        `tree` left out is the server's (`defaults.tree`)."""
        fallback = {**SAMPLING_DEFAULTS, **(sampling or {})}

        def get(name: str) -> Any:
            value = getattr(self, name)
            return fallback[name] if value is None else value

        temperature, top_p, top_k, seed = (
            get("temperature"),
            get("top_p"),
            get("top_k"),
            get("seed"),
        )
        top_k = max(top_k, 0)
        if top_p == 0:  # the smallest set holding mass 0 is the top token alone
            top_p, top_k = 1.0, 1
        return defaults.replace(
            max_tokens=max_tokens,
            temperature=temperature if temperature >= MIN_TEMPERATURE else 0.0,
            top_p=top_p,
            top_k=top_k,
            min_p=get("min_p"),
            seed=None if seed is None else seed % SEED_MODULUS,
            stop=tuple(self.stop or ()),
            **{name: get(name) for name in PROCESSING},
            logit_bias=self.logit_bias or None,
            logprobs=self.logprobs,
            json_schema=self.json_schema,
            tree=defaults.tree if self.tree is None else self.tree,
        )

    @property
    def forced_tool(self) -> bool:
        """Whether the reply must be a tool call (tool_choice required, or a named one)."""
        return bool(self.tools) and (
            self.tool_choice == "required" or isinstance(self.tool_choice, dict)
        )

    def template_tools(self) -> list[dict[str, Any]] | None:
        """The tools the chat template shows the model (tool_choice none: none)."""
        if not self.tools or self.tool_choice == "none":
            return None
        if isinstance(self.tool_choice, dict):
            name = self.tool_choice["name"]
            chosen = [t for t in self.tools if t["function"].get("name") == name]
            if not chosen:
                raise APIError(
                    400,
                    f"tool_choice names the function {name!r}, which is not among the tools "
                    f"({', '.join(repr(t['function'].get('name')) for t in self.tools)})",
                    param="tool_choice",
                    code="invalid_value",
                )
            return chosen
        return self.tools


def check_unicode(value: Any, param: str) -> None:
    """Refuse lone surrogates (valid JSON escapes, invalid Unicode) before any tokenizer,
    by the library's one rule (`check_text`), as the client's error naming `param`."""
    for text in _strings(value, keys=True):
        try:
            check_text("the text", text)
        except BadArgument as e:
            raise APIError(
                400, f"Invalid '{param}': {e}", param=param, code="invalid_value"
            ) from None


def _text_bytes(value: Any) -> int:
    return sum(len(text.encode("utf-8")) for text in _strings(value, keys=False))
