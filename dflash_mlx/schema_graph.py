"""A JSON schema as the graph its grammar is built from: its subschemas and local `$ref`s.

llguidance builds a schema's grammar recursively, a few kB of stack per subschema on the
path it follows (`$ref`s included): a chain of 2,500 `$ref`s overflowed an 8 MB stack and
took the whole process down. `schema_graph_problem` bounds that path before anything is
built (`MAX_GRAPH_DEPTH` subschemas, a cycle counting every subschema in it), and refuses
the schemas whose grammar builds and then fails where the reply enters a part that can
never be written out: a `$ref` loop that reaches no value (`{"$ref": "#/$defs/a"}` where
`a` is `{"$ref": "#/$defs/b"}` and `b` refers back to `a`), or required properties or
items that nest a schema inside itself without end. Builds then run on a deep stack
(`grammar_cage`), deep enough for any graph within the bound. Every walk is iterative.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

# Subschemas on the longest path through the graph (a cycle counts all of its own). At
# about 5 kB of llguidance's stack each, 10,000 take ~50 MB: the cage's stack holds five
# times that, an 8 MB stack about 1,600.
MAX_GRAPH_DEPTH = 10_000

_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_LISTS = ("allOf", "anyOf", "oneOf", "prefixItems")
_ONE = ("additionalProperties", "not", "if", "then", "else", "contains", "propertyNames",
        "additionalItems", "unevaluatedItems", "unevaluatedProperties")  # fmt: skip
# The places a reply enters: a part of the reply is written following each.
_ENTERED = {"properties", "patternProperties", "allOf", "anyOf", "oneOf", "prefixItems",
            "items", "additionalProperties", "additionalItems", "$ref"}  # fmt: skip
_SCALARS = {"string", "number", "integer", "boolean", "null"}


class _Graph:
    """The schema objects of a schema (booleans too), by JSON pointer, with their edges."""

    def __init__(self, schema: Any):
        self.nodes: list[Any] = []
        self.where: list[str] = []  # a node's place, as the other checks name it
        self.by_pointer: dict[tuple[str, ...], int] = {}
        self.children: list[list[tuple[str, str | None, int]]] = []  # (keyword, name, child)
        stack: list[tuple[tuple[str, ...], str, Any, int, str, str | None]] = [
            ((), "", schema, -1, "", None)
        ]
        while stack:
            pointer, where, node, parent, keyword, name = stack.pop()
            index = len(self.nodes)
            self.nodes.append(node)
            self.where.append(where)
            self.by_pointer[pointer] = index
            self.children.append([])
            if parent >= 0:
                self.children[parent].append((keyword, name, index))
            if isinstance(node, dict):
                for key, sub_name, sub in _subschemas(node):
                    at = (*pointer, key) if sub_name is None else (*pointer, key, sub_name)
                    stack.append((at, _place(where, key, sub_name), sub, index, key, sub_name))
        self.refs: list[int | None] = [None] * len(self.nodes)
        for index, node in enumerate(self.nodes):
            if isinstance(node, dict) and isinstance(node.get("$ref"), str):
                self.refs[index] = self.by_pointer.get(_pointer(node["$ref"]))

    def edges(self, index: int, entered_only: bool = False) -> Iterator[int]:
        for key, _, child in self.children[index]:
            if not entered_only or key in _ENTERED:
                yield child
        if self.refs[index] is not None:
            yield self.refs[index]


def _place(where: str, key: str, name: str | None) -> str:
    """A subschema's place as the other checks write it: `properties.a`, `anyOf[0]`."""
    shown = f"{where}.{key}" if where else key
    if name is None:
        return shown
    return shown + (f"[{name}]" if key in _LISTS or key == "items" else f".{name}")


def _subschemas(node: dict) -> Iterator[tuple[str, str | None, Any]]:
    """(keyword, name or index within it, subschema) of a schema object."""
    for key in _MAPS:
        if isinstance(node.get(key), dict):
            yield from ((key, str(name), sub) for name, sub in node[key].items())
    for key in _LISTS:
        if isinstance(node.get(key), list):
            yield from ((key, str(i), sub) for i, sub in enumerate(node[key]))
    items = node.get("items")
    if isinstance(items, list):
        yield from (("items", str(i), sub) for i, sub in enumerate(items))
    elif isinstance(items, (dict, bool)):
        yield "items", None, items
    for key in _ONE:
        if isinstance(node.get(key), (dict, bool)):
            yield key, None, node[key]


def _pointer(ref: str) -> tuple[str, ...] | None:
    """A local `$ref` ("#", "#/$defs/a") as a pointer; None for any other (remote, anchor)."""
    if ref == "#":
        return ()
    if not ref.startswith("#/"):
        return None
    from urllib.parse import unquote

    return tuple(unquote(p).replace("~1", "/").replace("~0", "~") for p in ref[2:].split("/"))


def _depth(graph: _Graph) -> int:
    """The subschemas on the longest path from the root, a cycle counting all of its own
    (strongly connected parts found by an iterative Tarjan, then the longest path over
    them, each weighing its size)."""
    n = len(graph.nodes)
    order, low, on_stack = [-1] * n, [0] * n, [False] * n
    comp = [-1] * n
    sizes: list[int] = []
    stack: list[int] = []
    counter = 0
    work = [(0, iter(list(graph.edges(0))))]
    order[0] = low[0] = counter
    counter += 1
    stack.append(0)
    on_stack[0] = True
    while work:
        v, it = work[-1]
        advanced = False
        for w in it:
            if order[w] == -1:
                order[w] = low[w] = counter
                counter += 1
                stack.append(w)
                on_stack[w] = True
                work.append((w, iter(list(graph.edges(w)))))
                advanced = True
                break
            if on_stack[w]:
                low[v] = min(low[v], order[w])
        if advanced:
            continue
        work.pop()
        if work:
            low[work[-1][0]] = min(low[work[-1][0]], low[v])
        if low[v] == order[v]:
            size = 0
            while True:
                w = stack.pop()
                on_stack[w] = False
                comp[w] = len(sizes)
                size += 1
                if w == v:
                    break
            sizes.append(size)
    # Tarjan finds a part after every part it reaches: the longest path, in that order.
    longest = [0] * len(sizes)
    members: list[list[int]] = [[] for _ in sizes]
    for v in range(n):
        if comp[v] >= 0:
            members[comp[v]].append(v)
    for c, size in enumerate(sizes):
        reach = [longest[comp[w]] for v in members[c] for w in graph.edges(v) if comp[w] != c]
        longest[c] = size + max(reach, default=0)
    return longest[comp[0]]


def _finite(graph: _Graph) -> tuple[list[bool], list[list[tuple[int, ...]]]]:
    """Whether each node has a finite value (a least fixed point: a node is finite once
    what it requires is: its `$ref`, every `allOf`, one of its `anyOf` / `oneOf`, and a
    type it allows with its required properties or its first `minItems` items)."""
    n = len(graph.nodes)
    needs: list[list[tuple[int, ...]]] = [[] for _ in range(n)]  # all of: one of
    finite = [False] * n
    for v, node in enumerate(graph.nodes):
        if isinstance(node, bool):
            finite[v] = node
            continue
        if not isinstance(node, dict):
            finite[v] = True
            continue
        kids: dict[str, list[int]] = {}
        named: dict[str | None, int] = {}
        for key, name, child in graph.children[v]:
            kids.setdefault(key, []).append(child)
            if key == "properties":
                named[name] = child
        if graph.refs[v] is not None:
            needs[v].append((graph.refs[v],))
        needs[v].extend((c,) for c in kids.get("allOf", []))
        for key in ("anyOf", "oneOf"):
            if kids.get(key):
                needs[v].append(tuple(kids[key]))
        kinds = node.get("type")
        kinds = set(kinds) if isinstance(kinds, list) else {kinds} if kinds else None
        if kinds is None or kinds & _SCALARS:
            continue
        if kinds == {"object"}:
            extra = kids.get("additionalProperties", [])
            for name in node.get("required", []) if isinstance(node.get("required"), list) else []:
                if name in named:
                    needs[v].append((named[name],))
                elif extra:
                    needs[v].append((extra[0],))
        elif kinds == {"array"}:
            least = node.get("minItems", 0)
            least = least if isinstance(least, int) and not isinstance(least, bool) else 0
            prefix = kids.get("prefixItems") or (
                kids.get("items", []) if isinstance(node.get("items"), list) else []
            )
            needs[v].extend((c,) for c in prefix[:least])
            rest = kids.get("items", []) if not isinstance(node.get("items"), list) else []
            rest = rest or kids.get("additionalItems", [])
            if least > len(prefix) and rest:
                needs[v].append((rest[0],))
    dependents: list[list[int]] = [[] for _ in range(n)]
    for v in range(n):
        for group in needs[v]:
            for w in group:
                dependents[w].append(v)
    done = [0] * n  # the groups of `needs[v]` known to hold, in order
    queue = [v for v in range(n) if not finite[v]]
    while queue:
        v = queue.pop()
        if finite[v]:
            continue
        groups = needs[v]
        while done[v] < len(groups) and any(finite[w] for w in groups[done[v]]):
            done[v] += 1
        if done[v] == len(groups):
            finite[v] = True
            queue.extend(u for u in dependents[v] if not finite[u])
    return finite, needs


def _loop(graph: _Graph, v: int, finite: list[bool], needs: list[list[tuple[int, ...]]]) -> str:
    """Why node `v` has no finite value: the places it needs, up to the first needed again."""
    path = [v]
    while isinstance(graph.nodes[v], dict):
        group = next(g for g in needs[v] if not any(finite[w] for w in g))
        v = min(group, key=lambda w: not isinstance(graph.nodes[w], dict))  # an object first
        seen = v in path
        path.append(v)
        if seen:
            break
    names = [f"'{graph.where[w]}'" if graph.where[w] else "the schema" for w in path]
    if len(names) > 7:
        names = [*names[:5], "...", names[-1]]
    return " -> ".join(names)


def schema_graph_problem(schema: Any) -> str | None:
    """What makes `schema` (one `json_schema.schema_problem` accepts) unsafe to build a
    grammar from, naming the place: a path through its subschemas and `$ref`s longer than
    `MAX_GRAPH_DEPTH`, or a part the reply can enter that has no finite value. None when
    it is fine."""
    if not isinstance(schema, dict):
        return None
    graph = _Graph(schema)
    depth = _depth(graph)
    if depth > MAX_GRAPH_DEPTH:
        return (
            f"its subschemas and $refs chain {depth:,} deep (following each $ref; a loop "
            f"counts all of its members); at most {MAX_GRAPH_DEPTH:,}"
        )
    finite, needs = _finite(graph)
    seen = {0}
    queue = [0]
    for v in queue:  # breadth first: the shallowest such place is named
        if isinstance(graph.nodes[v], dict) and not finite[v]:
            return (
                f"{_loop(graph, v, finite, needs)}: never written out, as each needs the next "
                "before its value is complete (a $ref loop, or required properties or items "
                "nesting a schema inside itself forever)"
            )
        for w in graph.edges(v, entered_only=True):
            if w not in seen:
                seen.add(w)
                queue.append(w)
    return None
