"""Tool calls as the model writes them: where a call ends, and what of one reaches a client.

mlx-lm's `TextStateMachine` ends a call at the first end marker in the decoded text; a call
whose arguments hold that marker (`{"code": "print('</tool_call>')"}`) was cut there, its
rest shown as text and the call lost. `CallSplitter` splits the same way, except that an
end marker inside a call whose JSON is still open (an unclosed string, object or array) is
part of the call. `clean_call` turns a parsed call into what every renderer can write: its
arguments a JSON object (no NaN or Infinity), no lone surrogates anywhere, its id a
non-empty string; or None when it cannot be one.
"""

from __future__ import annotations

import json
import math
import re
from typing import Any

from mlx_lm.generate import TextStateMachine

_SURROGATE = re.compile("[\ud800-\udfff]")


def json_open(text: str) -> bool:
    """Whether `text` begins a JSON object or array (after blanks) that has not closed:
    a string, object or array still open."""
    body = text.lstrip()
    if not body.startswith(("{", "[")):
        return False
    depth, in_string, escaped = 0, False, False
    for ch in body:
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
        elif ch == '"':
            in_string = True
        elif ch in "{[":
            depth += 1
        elif ch in "}]":
            depth -= 1
            if depth == 0:
                return False
    return True


def _markers(states: dict) -> dict[tuple[str, str | None], str]:
    """(from, to) -> the marker text of each transition of a text state machine."""
    out: dict[tuple[str, str | None], str] = {}
    for src, (trie, dsts) in states.items():
        stack = [trie]
        while stack:
            node = stack.pop()
            match = node.get("__match__")
            if match is not None:
                out.setdefault((src, dsts[match[1]]), "".join(match[0]))
            stack.extend(v for k, v in node.items() if not k.startswith("__"))
    return out


class CallSplitter:
    """`TextStateMachine.split` over one reply, a call ending only where its JSON closes."""

    def __init__(self, state: tuple, tool: str = "tool"):
        self.state = state
        self.tool = tool
        self._markers = _markers(state[2])
        self._call = ""  # the open call's text so far

    def split(self, text: str) -> list[tuple[str | None, str]]:
        """(state, text) segments of `text`, as `TextStateMachine.split` gives them."""
        self.state, segments = TextStateMachine.split(self.state, text)
        out: list[tuple[str | None, str]] = []
        for i, (state, piece) in enumerate(segments):
            if state != self.tool:
                out.append((state, piece))
                continue
            self._call += piece
            if i + 1 == len(segments):  # still in the call
                out.append((state, piece))
                continue
            following = segments[i + 1][0]
            if not json_open(self._call):  # the call's end
                self._call = ""
                out.append((state, piece))
                continue
            # The end marker is inside the call's JSON: it is the call's text, and so is
            # what the machine split after it, split again from inside the call.
            marker = self._markers[(self.tool, following)]
            rest = self._raw(segments[i + 1 :]) + self.state[3]
            self._call += marker
            out.append((state, piece + marker))
            states = self.state[2]
            self.state = (self.tool, states[self.tool][0], states, "")
            more = self.split(rest)
            if more and more[0][0] == self.tool:  # one segment of the call, not two
                out[-1] = (self.tool, out[-1][1] + more.pop(0)[1])
            return out + more
        return out

    def _raw(self, segments: list[tuple[str | None, str]]) -> str:
        """The text that `segments` were split from (markers put back), pending text aside."""
        text = segments[0][1]
        for (before, _), (after, piece) in zip(segments, segments[1:]):
            text += self._markers.get((before, after), "") + piece
        return text


def _no_surrogates(text: str) -> str:
    return _SURROGATE.sub("\ufffd", text)


def _finite(value: Any) -> bool:
    """Whether a parsed JSON value holds no NaN or infinite number (iterative)."""
    stack = [value]
    while stack:
        v = stack.pop()
        if isinstance(v, float) and not math.isfinite(v):
            return False
        if isinstance(v, dict):
            stack.extend(v.values())
        elif isinstance(v, list):
            stack.extend(v)
    return True


def clean_call(call: Any, new_id: str) -> tuple[str, str, str] | str:
    """A parsed call's (id, name, arguments as a JSON object's text), or why it is refused.
    Its id: the model's when a non-empty string, else `new_id`."""
    if not isinstance(call, dict) or not isinstance(call.get("name"), str) or not call["name"]:
        return "no function name"
    args = call.get("arguments", {})
    if isinstance(args, str):
        try:
            args = json.loads(args) if args.strip() else {}
        except ValueError:
            return "arguments that are no JSON"
    if not isinstance(args, dict):
        return f"arguments that are a JSON {type(args).__name__}, not an object"
    if not _finite(args):
        return "arguments with NaN or an infinite number (no JSON)"
    ident = call.get("id")
    ident = ident if isinstance(ident, str) and ident.strip() else new_id
    text = json.dumps(args, ensure_ascii=False, allow_nan=False)
    return _no_surrogates(ident), _no_surrogates(call["name"]), _no_surrogates(text)
