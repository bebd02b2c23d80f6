"""Prompts in, text out: encoding the prompt forms the API takes, and stop strings.

`encode_prompt` turns text, token ids or chat messages into token ids. `StopMatcher` holds
back streamed text that could still become a stop string and says which one ended the reply.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

import mlx.core as mx

from ..errors import BadArgument

Prompt = str | Sequence[int] | Sequence[dict[str, Any]] | mx.array


def check_text(what: str, value: str) -> str:
    """`value` if it is valid Unicode, else a `BadArgument` naming `what` and the position.

    Bytes that are not UTF-8 reach Python as lone surrogates (U+DC80..U+DCFF: the command
    line and stdin decode with surrogateescape); a tokenizer can encode neither."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as e:
        code = ord(value[e.start])
        why = (
            f"byte 0x{code - 0xDC00:02x} is not UTF-8"
            if 0xDC80 <= code <= 0xDCFF
            else f"U+{code:04X} is a lone surrogate"
        )
        raise BadArgument(
            f"{what} is not valid Unicode: at character {e.start} (counting from 0), {why}; "
            "pass UTF-8 text"
        ) from None
    return value


# Markers a reply's text must keep even where a tokenizer flags them special: the chat and
# the server find thinking and tool calls by them (mlx-lm's `TokenizerWrapper` names them).
_MARKERS = ("think_start", "think_end", "tool_call_start", "tool_call_end")
_CONTROL = re.compile(r"<\|[^|<>]*\|>")


def special_token_ids(tokenizer: Any) -> frozenset[int]:
    """Ids of the tokenizer's special tokens (`<|im_start|>`, `<|endoftext|>`, …): control
    tokens that are never a reply's text, though a sampled reply may contain them (a draft
    trained with another eos, a model that runs on past its turn). Thinking and tool-call
    markers are kept even when flagged special."""
    ids: set[int] = set()
    try:
        ids.update(int(i) for i in getattr(tokenizer, "all_special_ids", None) or ())
        # Added tokens flagged special that are not in the special-tokens map count when
        # they look like control tokens (`<|eot_id|>`, `<|start_header_id|>`): a tokenizer
        # may also flag whole words or phrases special to keep them one token, and those
        # are text.
        added = getattr(tokenizer, "added_tokens_decoder", None) or {}
        ids.update(
            int(i)
            for i, t in added.items()
            if getattr(t, "special", False) and _CONTROL.fullmatch(str(t))
        )
    except Exception:  # a tokenizer without these tables: nothing to hide
        return frozenset()
    keep = {getattr(tokenizer, name, None) for name in _MARKERS} - {None}
    if keep:
        vocab = tokenizer.convert_tokens_to_ids(sorted(keep))
        ids -= {int(i) for i in vocab if i is not None}
    return frozenset(ids)


def encode_prompt(tokenizer, prompt: Prompt) -> list[int]:
    """Token ids of a prompt: text (BOS added unless it is there), token ids, an `mx.array`
    of ids, or chat messages (rendered with the tokenizer's chat template)."""
    if isinstance(prompt, mx.array):
        ids = prompt.reshape(-1).tolist()
    elif isinstance(prompt, str):
        check_text("the prompt", prompt)
        bos = getattr(tokenizer, "bos_token", None)
        add_special = bos is None or not prompt.startswith(bos)
        ids = tokenizer.encode(prompt, add_special_tokens=add_special)
    elif isinstance(prompt, Sequence) and prompt and all(isinstance(m, dict) for m in prompt):
        for i, m in enumerate(prompt):
            if "role" not in m or "content" not in m:
                raise BadArgument(f"message {i} needs 'role' and 'content', got keys {sorted(m)}")
            if isinstance(m["content"], str):
                check_text(f"message {i}'s content", m["content"])
        ids = tokenizer.apply_chat_template(list(prompt), add_generation_prompt=True)
        if isinstance(ids, dict) or hasattr(ids, "input_ids"):
            ids = ids["input_ids"]
        if isinstance(ids, str):
            ids = tokenizer.encode(ids, add_special_tokens=False)
    elif isinstance(prompt, Sequence) and all(isinstance(t, int) for t in prompt):
        ids = list(prompt)
    else:
        raise BadArgument(
            "prompt must be a string, a list of token ids or a list of chat messages, "
            f"got {type(prompt).__name__}"
        )
    if not ids:
        raise BadArgument("prompt is empty: at least one token is needed")
    return [int(t) for t in ids]


class StopMatcher:
    """Holds back text that could still become a stop string."""

    def __init__(self, stop: Sequence[str]):
        self.stop = [s for s in stop if s]
        self.hold = max((len(s) for s in self.stop), default=1) - 1
        self.buffer = ""

    def feed(self, text: str) -> tuple[str, str | None]:
        """Text safe to emit now, and the stop string found (the earliest; None: none)."""
        self.buffer += text
        if not self.stop:
            out, self.buffer = self.buffer, ""
            return out, None
        hits = [(i, s) for s in self.stop if (i := self.buffer.find(s)) >= 0]
        if hits:
            at, found = min(hits, key=lambda h: h[0])
            out = self.buffer[:at]
            self.buffer = ""
            return out, found
        cut = max(0, len(self.buffer) - self.hold)
        out, self.buffer = self.buffer[:cut], self.buffer[cut:]
        return out, None

    def flush(self) -> str:
        out, self.buffer = self.buffer, ""
        return out
