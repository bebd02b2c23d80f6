"""The internal request every API translates onto, and the checks on what a client sent.

`Request` is what any API asks for: chat messages in the chat template's own shape
(OpenAI's: `role`, `content`, `tool_calls`, `tool_call_id`) or a raw prompt, function
tools, a tool choice, sampling settings, stop strings and a token budget. `options` turns it
into the engine's one `GenerateOptions`.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from ..engine.text import check_text
from ..errors import BadArgument
from ..options import GenerateOptions
from .errors import APIError

try:  # Python's own regular-expression parser (3.11+; `sre_parse` before)
    import re._parser as _sre_parse
except ImportError:  # pragma: no cover (Python 3.10)
    import sre_parse as _sre_parse  # type: ignore[no-redef]
from _sre import MAXREPEAT as _MAXREPEAT

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


def _strings(value: Any, keys: bool) -> Iterator[str]:
    """The strings in a JSON value (object keys too, if `keys`), in order; iterative, so any
    nesting is safe."""
    stack = [value]
    while stack:
        v = stack.pop()
        if isinstance(v, str):
            yield v
        elif isinstance(v, dict):
            for k, item in reversed(v.items()):
                stack.append(item)
                if keys:
                    stack.append(k)
        elif isinstance(v, list):
            stack.extend(reversed(v))


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


JSON_TYPES = ("object", "array", "string", "number", "integer", "boolean", "null")
# The keywords whose values are schemas: one, a list of them, or an object of them.
_SUBSCHEMA = ("additionalProperties", "not", "if", "then", "else", "contains", "propertyNames",
              "additionalItems", "unevaluatedItems", "unevaluatedProperties")  # fmt: skip
_SUBSCHEMAS = ("allOf", "anyOf", "oneOf", "prefixItems")
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _children(prefix: str, node: dict[str, Any]) -> Iterator[tuple[str, Any]]:
    """The subschemas of a schema object, with where they are (well-formed ones only)."""
    for key in _SCHEMA_MAPS:
        if isinstance(node.get(key), dict):
            yield from ((f"{prefix}{key}.{name}", sub) for name, sub in node[key].items())
    for key in _SUBSCHEMAS:
        if isinstance(node.get(key), list):
            yield from ((f"{prefix}{key}[{i}]", sub) for i, sub in enumerate(node[key]))
    items = node.get("items")
    if isinstance(items, list):  # the tuple form of drafts 4 to 2019-09
        yield from ((f"{prefix}items[{i}]", sub) for i, sub in enumerate(items))
    elif "items" in node:
        yield f"{prefix}items", items
    yield from ((f"{prefix}{key}", node[key]) for key in _SUBSCHEMA if key in node)


def schema_problem(schema: Any) -> str | None:
    """What makes `schema` no JSON Schema, or None: a `type` that names no JSON type, a
    subschema that is neither an object nor a boolean, `properties` that is no object of
    schemas, `required` that is no list of names. Values (`enum`, `const`, `default`) are
    data and not looked into; iterative, so any nesting is safe."""
    stack: list[tuple[str, Any]] = [("", schema)]
    while stack:
        where, node = stack.pop()
        if isinstance(node, bool):
            continue
        if not isinstance(node, dict):
            at = f"'{where}'" if where else "the schema"
            return f"{at} is {_shown(node)}, not a schema (an object or a boolean)"
        prefix = where + "." if where else ""
        if "type" in node:
            kind = node["type"]
            kinds = kind if isinstance(kind, list) and kind else [kind]
            if not all(isinstance(k, str) and k in JSON_TYPES for k in kinds):
                return (
                    f"'{prefix}type' is {_shown(kind)}, not a JSON Schema type "
                    f"({', '.join(JSON_TYPES)}) or a list of them"
                )
        required = node.get("required", [])
        if not isinstance(required, list) or not all(isinstance(r, str) for r in required):
            return f"'{prefix}required' is {_shown(required)}, not a list of property names"
        for key in _SCHEMA_MAPS:
            if key in node and not isinstance(node[key], dict):
                return f"'{prefix}{key}' is {_shown(node[key])}, not an object of schemas"
        for key in _SUBSCHEMAS:
            if key in node and not isinstance(node[key], list):
                return f"'{prefix}{key}' is {_shown(node[key])}, not a list of schemas"
        stack.extend(_children(prefix, node))
    return None


# The longest string a JSON schema may hold (a property name, a `const` or `enum` value, a
# `pattern`, a description), and the most characters a `pattern`'s counted repetitions may
# multiply out to. llguidance builds such a string into one lexeme lazily: a longer one
# passes the grammar's build and fails when the reply enters it (a 1 MB `const`, the
# pattern ^a{1000000}$ or ^(x{1000}){1000}$); 300,000 was still served in tests.
MAX_SCHEMA_STRING = 65_536


def schema_too_large(schema: Any) -> str | None:
    """What in a JSON schema (one `schema_problem` accepts) is beyond `MAX_SCHEMA_STRING`:
    a string, or a pattern whose counted repetitions multiply out beyond it; or None."""
    for text in _strings(schema, keys=True):
        if len(text) > MAX_SCHEMA_STRING:
            return (
                f"it holds a string of {len(text):,} characters ({_shown(text)}); at most "
                f"{MAX_SCHEMA_STRING:,}"
            )
    stack: list[tuple[str, Any]] = [("", schema)]
    while stack:
        where, node = stack.pop()
        if not isinstance(node, dict):
            continue
        prefix = where + "." if where else ""
        patterns = [(f"{prefix}pattern", node.get("pattern"))]
        if isinstance(node.get("patternProperties"), dict):
            patterns += [(f"{prefix}patternProperties", p) for p in node["patternProperties"]]
        for at, pattern in patterns:
            if isinstance(pattern, str):
                size = pattern_size(pattern)
                if size > MAX_SCHEMA_STRING:
                    return (
                        f"'{at}' {_shown(pattern)} spells out more than "
                        f"{MAX_SCHEMA_STRING:,} characters (its counted repetitions multiplied)"
                    )
        stack.extend(_children(prefix, node))
    return None


def pattern_size(pattern: str) -> int:
    """The most characters a regular expression's counted repetitions spell out (`a{3}` 3,
    `(x{10}){10}` 100, `a|bc` 2; an open `{n,}`, `*` or `+` counts its least count + 1).
    A pattern Python cannot parse (another dialect) gets the product of all its counts."""
    try:
        parsed = _sre_parse.parse(pattern)
        return _sre_size(parsed)
    except RecursionError:
        return MAX_SCHEMA_STRING + 1  # nested beyond Python's recursion: refused as too large
    except Exception:
        size = 1
        for low, high in re.findall(r"\{(\d+)(?:,(\d*))?\}", pattern):
            count = high or low
            size *= int(count) + 1 if len(count) < 10 else MAX_SCHEMA_STRING + 1
            size = min(size, MAX_SCHEMA_STRING + 1)
        return size


def _sre_size(items: Any) -> int:
    total = 0
    for op, arg in items:
        name = str(op)
        if name in ("MAX_REPEAT", "MIN_REPEAT", "POSSESSIVE_REPEAT"):
            low, high, sub = arg
            count = low + 1 if high == _MAXREPEAT else high
            total += max(count, 1) * _sre_size(sub)
        elif name == "SUBPATTERN":
            total += _sre_size(arg[-1])
        elif name == "BRANCH":
            total += max((_sre_size(sub) for sub in arg[1]), default=0)
        elif name in ("ASSERT", "ASSERT_NOT"):
            total += _sre_size(arg[1])
        elif name == "ATOMIC_GROUP":
            total += _sre_size(arg)
        elif name == "GROUPREF_EXISTS":
            total += max(_sre_size(arg[1]), _sre_size(arg[2]) if arg[2] else 0)
        else:
            total += 1
        if total > MAX_SCHEMA_STRING:  # enough to refuse: stop multiplying
            return total
    return total
