"""JSON schemas as requests and the command line give them, checked without a model.

The bounds a schema must keep before any grammar is built from it, shared by the server
(`serve`'s `response_format`, `text.format` and tools) and `generate --json-schema`: what
makes a value no JSON Schema (`schema_problem`), what makes one too large to serve
(`schema_too_large`: a string beyond `MAX_SCHEMA_STRING`, a `pattern` whose counted
repetitions multiply out beyond it or repeat parts of varying length beyond
`MAX_VARYING_REPEATS`) and arrays and objects nested beyond `MAX_DEPTH` (`too_deep`); the
graph of subschemas and `$ref`s is bounded in `schema_graph`. Every walk is iterative: any
nesting is safe.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

try:  # Python's own regular-expression parser (3.11+; `sre_parse` before)
    import re._parser as _sre_parse
except ImportError:  # pragma: no cover (Python 3.10)
    import sre_parse as _sre_parse  # type: ignore[no-redef]
from _sre import MAXREPEAT as _MAXREPEAT

# Arrays and objects within each other: templates, JSON encoders and validators recurse per
# level (Python's own limit is ~1000 frames); real schemas and arguments nest a few levels.
MAX_DEPTH = 64


def _items(value: dict | list) -> Iterator[tuple[str | int, Any]]:
    return iter(value.items()) if isinstance(value, dict) else enumerate(value)


def too_deep(value: Any, limit: int = MAX_DEPTH) -> list[str | int] | None:
    """The path to the first array or object nested more than `limit` levels deep, or None
    (iterative: any depth is safe)."""
    if not isinstance(value, (dict, list)):
        return None
    path: list[str | int] = []
    stack = [_items(value)]
    while stack:
        for key, child in stack[-1]:
            if isinstance(child, (dict, list)):
                path.append(key)
                if len(stack) >= limit:
                    return path
                stack.append(_items(child))
                break
        else:
            stack.pop()
            if path:
                path.pop()
    return None


def json_strings(value: Any, keys: bool) -> Iterator[str]:
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
    for text in json_strings(schema, keys=True):
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
                varying = varying_repeats(pattern)
                if varying > MAX_VARYING_REPEATS:
                    return (
                        f"'{at}' {_shown(pattern)} repeats parts of varying length "
                        f"{varying:,} times (as (a|aa){{1000}} does; counted repetitions "
                        f"multiplied); at most {MAX_VARYING_REPEATS}"
                    )
        stack.extend(_children(prefix, node))
    return None


# A counted repetition of a part that matches strings of different lengths (`(a|aa){n}`)
# leaves the lexer in one of ~n^2 states as it reads: llguidance's lexer gives up ("too
# many expressions constructed") from about 240 such repetitions, at the reply's first
# character or in the middle of it. Counted as `varying_repeats`.
MAX_VARYING_REPEATS = 128


def varying_repeats(pattern: str) -> int:
    """How many times a regular expression repeats parts of varying length, its counted
    repetitions multiplied (`(a|aa){10}` 10, `((a|aa){10}){20}` 200, `a{0,1000}` 0: `a` is
    one character). 0 for a pattern Python cannot parse."""
    try:
        return _sre_varying(_sre_parse.parse(pattern))
    except RecursionError:
        return MAX_VARYING_REPEATS + 1
    except Exception:
        return 0


def _sre_varying(items: Any) -> int:
    total = 0
    for op, arg in items:
        name = str(op)
        if name in ("MAX_REPEAT", "MIN_REPEAT", "POSSESSIVE_REPEAT"):
            low, high, sub = arg
            count = low + 1 if high == _MAXREPEAT else high
            inner = _sre_varying(sub)
            least, most = sub.getwidth()
            total += count * max(inner, 1) if inner or least != most else 0
        elif name == "SUBPATTERN":
            total += _sre_varying(arg[-1])
        elif name == "BRANCH":
            total += max((_sre_varying(sub) for sub in arg[1]), default=0)
        elif name in ("ASSERT", "ASSERT_NOT"):
            total += _sre_varying(arg[1])
        elif name == "ATOMIC_GROUP":
            total += _sre_varying(arg)
        if total > MAX_VARYING_REPEATS:
            return total
    return total


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
