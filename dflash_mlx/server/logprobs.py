"""Log-probabilities as OpenAI reports them: each shown token's text, bytes and logprob, and
its top alternatives.

The engine scores every token it commits (`GenerationResponse.logprobs`: the target's
log-softmax after penalties, bias and grammar, before temperature and truncation); this
module keeps a request's scores in step with its text. A token is reported once the text it
starts is shown, so that tokens cut off with a stop string, and the end-of-sequence token,
are never reported, and a streamed chunk carries the tokens of its own text. Token text
and positions come from the tokenizer's vocabulary (`Pieces`), read as the engine's
detokenizer reads it.
"""

from __future__ import annotations

import codecs
import re
import threading
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from mlx_lm.tokenizer_utils import (
    BPEStreamingDetokenizer,
    SPMStreamingDetokenizer,
    _byte_decoder,
)

from ..engine.controls import TokenLogprob
from ..engine.generate import GenerationResponse

_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")


class Pieces:
    """The bytes each token id stands for, read once from the vocabulary."""

    def __init__(self, tokenizer: Any, lock: threading.Lock):
        with lock:  # the tokenizer is shared with the app's tokenizing thread
            n = len(tokenizer)
            names = tokenizer.convert_ids_to_tokens(list(range(n)))
            detok = tokenizer.detokenizer
            # Whether the engine's text drops the reply's leading space (mlx-lm's does).
            self.trims_space = isinstance(detok, BPEStreamingDetokenizer) or bool(
                getattr(detok, "trim_space", False)
            )
            if isinstance(detok, BPEStreamingDetokenizer):
                decoder = _byte_decoder()
                self.bytes = [self._bpe(name, decoder) for name in names]
            elif isinstance(detok, SPMStreamingDetokenizer):
                self.bytes = [self._spm(name) for name in names]
            else:
                self.bytes = [tokenizer.decode([i]).encode("utf-8") for i in range(n)]

    @staticmethod
    def _bpe(name: str | None, decoder: dict[str, int]) -> bytes:
        """As mlx-lm's BPE detokenizer reads it: byte by byte, a character that maps to no
        byte (an added token's), or to byte 0, as its own UTF-8."""
        out = bytearray()
        for c in name or "":
            byte = decoder.get(c)
            if byte:
                out.append(byte)
            else:
                out.extend(c.encode("utf-8"))
        return bytes(out)

    @staticmethod
    def _spm(name: str | None) -> bytes:
        if name is None:
            return b""
        byte = _BYTE_TOKEN.fullmatch(name)
        return bytes([int(byte.group(1), 16)]) if byte else name.replace("\u2581", " ").encode()

    def of(self, token: int) -> bytes:
        return self.bytes[token] if 0 <= token < len(self.bytes) else b""


def token_text(raw: bytes) -> str:
    """A token's text; a token holding part of a character is `bytes:\\xe2\\x80` (OpenAI's)."""
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{b:02x}" for b in raw)


@dataclass
class Scored:
    """One shown token: its text, bytes, logprob, top alternatives, and where its text
    starts in the reply (characters)."""

    token: str
    bytes: bytes
    logprob: float
    top: list[tuple[str, bytes, float]]
    offset: int


class Ledger:
    """One request's scores, released as the text they start is shown.

    A token starts at the characters its predecessors' bytes decode to (as the engine's
    detokenizer decodes them: UTF-8, a broken sequence one U+FFFD, an unfinished character
    not yet counted)."""

    def __init__(self, pieces: Pieces, eos_ids: Iterable[int]):
        self._pieces = pieces
        self._eos = frozenset(eos_ids)
        self._decoder = codecs.getincrementaldecoder("utf-8")("replace")
        self._chars = 0  # characters the tokens so far decode to
        self._held: list[Scored] = []
        self._shown = 0  # characters of text shown so far

    def _score(self, lp: TokenLogprob, offset: int) -> Scored:
        raw = self._pieces.of(lp.token)
        top = [(token_text(b := self._pieces.of(t)), b, v) for t, v in lp.top]
        return Scored(token_text(raw), raw, float(lp.logprob), top, offset)

    def add(self, r: GenerationResponse) -> list[Scored]:
        """The scores `r` shows (with its text), in order."""
        scores = list(r.logprobs or [])
        ended_by_eos = r.finish_reason == "stop" and r.stop is None
        for i, lp in enumerate(scores):
            if ended_by_eos and i == len(scores) - 1 and lp.token in self._eos:
                break  # the end of the reply, not a token of it
            self._held.append(self._score(lp, self._chars))
            text = self._decoder.decode(self._pieces.of(lp.token))
            if not self._chars and self._pieces.trims_space and text.startswith(" "):
                text = text[1:]
            self._chars += len(text)
        self._shown += len(r.text)
        if r.finish_reason is not None and r.stop is None:
            out, self._held = self._held, []
            return out
        n = 0
        while n < len(self._held) and self._held[n].offset < self._shown:
            n += 1
        out, self._held = self._held[:n], self._held[n:]
        if r.finish_reason is not None:
            self._held = []  # the text of a stop string: never shown
        return out


# -- OpenAI's shapes ---------------------------------------------------------------------


def chat_logprobs(scores: list[Scored]) -> dict[str, Any]:
    """`choices[].logprobs` of a chat completion (or of one chunk)."""
    return {
        "content": [
            {
                "token": s.token,
                "logprob": s.logprob,
                "bytes": list(s.bytes),
                "top_logprobs": [{"token": t, "logprob": v, "bytes": list(b)} for t, b, v in s.top],
            }
            for s in scores
        ],
        "refusal": None,
    }


def text_logprobs(scores: list[Scored]) -> dict[str, Any]:
    """`choices[].logprobs` of a text completion (or of one chunk): OpenAI's legacy shape,
    `text_offset` counting characters of the completion."""
    return {
        "tokens": [s.token for s in scores],
        "token_logprobs": [s.logprob for s in scores],
        "top_logprobs": [{t: v for t, _, v in s.top} for s in scores],
        "text_offset": [s.offset for s in scores],
    }
