"""`GenerateOptions`: every setting of one generation, validated once.

The HTTP layer, the CLI, chat's `/set` and the Python API each build one, and it reaches the
decode loop unchanged (frozen: `replace` makes a changed copy). What depends on the pair (a
verify width the draft's block cannot hold, say) is checked by the `Pair` when it plans the
request. `OPTIONS` describes every field once, for help texts and `/set`.
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields
from types import MappingProxyType
from typing import Any

from .engine.sampling import SamplingParams
from .errors import BadArgument

# Old names that still work, with a DeprecationWarning.
ALIASES = {"block_size": "verify_width"}

# What each option means (one line each): the CLI's and chat's help read it.
OPTIONS = {
    "max_tokens": "tokens to generate at most",
    "temperature": "sampling temperature (0: greedy, token for token the target's own)",
    "top_p": "nucleus sampling: keep the smallest set of tokens holding this mass (1: off)",
    "top_k": "keep the k most likely tokens (0: off)",
    "min_p": "drop tokens below min_p times the top token's probability (0: off)",
    "seed": "random seed: the same seed replays the same output (None: random)",
    "verify_width": "tokens the target verifies per cycle, W (None: chosen per cycle; 1: plain)",
    "draft_block": "rows the draft runs per cycle, L (None: its trained block)",
    "draft_window": "positions a draft block sees (None: the draft's own window, else all)",
    "draft_sink": "under a draft window, the context's first positions a block sees too "
    "(None: the draft's default)",
    "stop": "strings that end the reply (never shown)",
    "prefill_step": "prompt tokens per prefill chunk",
    "presence_penalty": "subtract this from the logit of every token already generated (0: off)",
    "frequency_penalty": "subtract this times a token's count among the generated ones (0: off)",
    "repetition_penalty": "divide (multiply, if negative) the logits of recent tokens (None: off)",
    "repetition_context_size": "recent tokens (prompt included) the repetition penalty looks at",
    "logit_bias": "token id -> value added to its logit, before sampling ({id: bias}; None: off)",
    "logprobs": "report each token's log-probability and this many top alternatives (None: off)",
    "json_schema": "constrain the reply to JSON: a JSON schema, or True for any JSON object",
    "grammar": "constrain the reply to a grammar (llguidance's Lark syntax)",
    "tree": "verify a tree of drafts, verify_width tokens (None: chosen; False: chains)",
}

# Most top alternatives `logprobs` can ask for (OpenAI's limit).
MAX_TOP_LOGPROBS = 20


def _int(name: str, value: Any, low: int, what: str = "") -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise BadArgument(f"{name} {value!r} must be an integer >= {low}{what}")
    return value


def _number(name: str, value: Any, low: float, high: float, interval: str) -> float:
    """`value` as a float in `interval` ("[low, high]"; a round bracket leaves its end out:
    "[0, inf)" is every finite number from 0), else a `BadArgument` naming the field."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value):
        raise BadArgument(f"{name} {value!r} must be a number in {interval}")
    value = float(value)
    ok = low <= value <= high
    if (interval.startswith("(") and value == low) or (interval.endswith(")") and value == high):
        ok = False
    if not ok:
        finite = "a finite number " if math.isinf(value) else ""
        raise BadArgument(f"{name} {value!r} must be {finite}in {interval}")
    return value


@dataclass(frozen=True)
class GenerateOptions:
    """How to generate: budget, sampling, stop strings and the speculation knobs.

    `verify_width` is the verify width W (tokens the target checks per cycle; at most the
    draft's block; None: chosen per cycle from measured costs and acceptance; 1: plain
    decoding). `draft_block` is the draft block L (rows the draft runs), `draft_window` the
    positions a draft block sees. Invalid values raise `BadArgument` naming the field.
    """

    max_tokens: int = 256
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    verify_width: int | None = None
    draft_block: int | None = None
    draft_window: int | None = None
    draft_sink: int | None = None
    stop: tuple[str, ...] = ()
    prefill_step: int = 512
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float | None = None
    repetition_context_size: int = 20
    logit_bias: Mapping[int, float] | None = None
    logprobs: int | None = None
    json_schema: Mapping[str, Any] | bool | None = None
    grammar: str | None = None
    tree: bool | None = None

    def __post_init__(self) -> None:
        _int("max_tokens", self.max_tokens, 1)
        _number("temperature", self.temperature, 0, math.inf, "[0, inf)")
        _number("top_p", self.top_p, 0, 1, "(0, 1]")
        _int("top_k", self.top_k, 0, " (0 = off)")
        _number("min_p", self.min_p, 0, 1, "[0, 1]")
        if self.seed is not None and (
            isinstance(self.seed, bool) or not isinstance(self.seed, int)
        ):
            raise BadArgument(f"seed {self.seed!r} must be an integer or None")
        if self.verify_width is not None:
            _int("verify_width", self.verify_width, 1, " or None (chosen per cycle)")
        if self.draft_block is not None:
            _int("draft_block", self.draft_block, 2, " or None (the draft's trained block)")
        if self.draft_window is not None:
            _int(
                "draft_window",
                self.draft_window,
                2,
                " (the anchor and at least one position before it), or None for the draft's "
                "own window",
            )
        if self.draft_sink is not None:
            _int("draft_sink", self.draft_sink, 0, " (0: none), or None for the draft's default")
        if not isinstance(self.stop, tuple) or not all(isinstance(s, str) for s in self.stop):
            raise BadArgument(
                f"stop {self.stop!r} must be a tuple of strings (from_kwargs and replace also "
                "take a string or a list)"
            )
        _int("prefill_step", self.prefill_step, 1)
        _number("presence_penalty", self.presence_penalty, -2, 2, "[-2, 2]")
        _number("frequency_penalty", self.frequency_penalty, -2, 2, "[-2, 2]")
        if self.repetition_penalty is not None:
            _number("repetition_penalty", self.repetition_penalty, 0, math.inf, "(0, inf)")
        _int("repetition_context_size", self.repetition_context_size, 1)
        if self.logit_bias is not None:
            object.__setattr__(self, "logit_bias", _logit_bias(self.logit_bias))
        if self.logprobs is not None:
            _int("logprobs", self.logprobs, 0, f" in [0, {MAX_TOP_LOGPROBS}] or None (off)")
            if self.logprobs > MAX_TOP_LOGPROBS:
                raise BadArgument(
                    f"logprobs {self.logprobs!r} must be an integer in [0, {MAX_TOP_LOGPROBS}]"
                    " (the top alternatives reported per token) or None (off)"
                )
        if self.json_schema is not None and not (
            self.json_schema is True or isinstance(self.json_schema, Mapping)
        ):
            raise BadArgument(
                f"json_schema {self.json_schema!r} must be a JSON schema (a dict), True (any "
                "JSON object) or None"
            )
        if self.tree is not None and not isinstance(self.tree, bool):
            raise BadArgument(f"tree {self.tree!r} must be True, False or None (chosen)")
        if self.grammar is not None:
            if not isinstance(self.grammar, str) or not self.grammar.strip():
                raise BadArgument(f"grammar {self.grammar!r} must be a non-empty Lark grammar")
            if self.json_schema is not None:
                raise BadArgument("json_schema and grammar are both set: give one constraint")

    @classmethod
    def from_kwargs(cls, options: GenerateOptions | None = None, /, **kwargs: Any):
        """`options` (default: the defaults) with `kwargs` changed; `block_size` is the
        deprecated name of `verify_width`; an unknown name is a `BadArgument`."""
        for old, new in ALIASES.items():
            if old in kwargs:
                warnings.warn(
                    f"{old!r} is deprecated: use {new!r} (the verify width W)",
                    DeprecationWarning,
                    stacklevel=3,
                )
                value = kwargs.pop(old)
                if kwargs.get(new, value) != value:
                    raise BadArgument(f"{old} {value!r} and {new} {kwargs[new]!r} disagree")
                kwargs[new] = value
        if "stop" in kwargs:
            kwargs["stop"] = _stops(kwargs["stop"])
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise BadArgument(
                f"unknown generation option {unknown[0]!r}; expected one of "
                f"{', '.join(sorted(known))}"
            )
        base = options if options is not None else cls()
        return dataclasses.replace(base, **kwargs) if kwargs else base

    def replace(self, **kwargs: Any) -> GenerateOptions:
        """A copy with `kwargs` changed (validated again)."""
        return GenerateOptions.from_kwargs(self, **kwargs)

    def as_dict(self) -> dict[str, Any]:
        """Every field, mappings as plain dicts (JSON can write it)."""
        return {
            f.name: dict(v) if isinstance(v := getattr(self, f.name), Mapping) else v
            for f in fields(self)
        }

    @property
    def sampling(self) -> SamplingParams:
        return SamplingParams(self.temperature, self.top_p, self.top_k, self.min_p)

    @property
    def processes_logits(self) -> bool:
        """Whether the target's logits are changed before sampling (penalties, a bias, a
        grammar): `controls.Controls` does it, at every verified position."""
        return bool(
            self.presence_penalty
            or self.frequency_penalty
            or self.repetition_penalty is not None
            or self.logit_bias
            or self.constrained
        )

    @property
    def constrained(self) -> bool:
        """Whether a grammar (a JSON schema or a Lark grammar) constrains the reply."""
        return self.json_schema is not None or self.grammar is not None

    @property
    def block_size(self) -> int | None:
        """Deprecated name of `verify_width`."""
        warnings.warn(
            "'block_size' is deprecated: use 'verify_width'", DeprecationWarning, stacklevel=2
        )
        return self.verify_width


def _logit_bias(bias: Any) -> Mapping[int, float]:
    """`{token id: bias}` with int ids >= 0 (OpenAI's string keys are read as ids) and biases
    in [-100, 100], as a read-only mapping; anything else is a `BadArgument`."""
    if not isinstance(bias, Mapping):
        raise BadArgument(f"logit_bias {bias!r} must be a mapping of token id -> bias")
    out = {}
    for key, value in bias.items():
        tid = key
        if isinstance(key, str) and key.strip().isdigit():
            tid = int(key)
        if isinstance(tid, bool) or not isinstance(tid, int) or tid < 0:
            raise BadArgument(f"logit_bias key {key!r} must be a token id (an integer >= 0)")
        out[tid] = _number(f"logit_bias[{key!r}]", value, -100, 100, "[-100, 100]")
    return MappingProxyType(out)


def _stops(stop: Any) -> Any:
    """None, a string or a list of strings as a tuple (anything else is left to refuse)."""
    if stop is None:
        return ()
    if isinstance(stop, str):
        return (stop,)
    if isinstance(stop, Sequence) and all(isinstance(s, str) for s in stop):
        return tuple(stop)
    return stop
