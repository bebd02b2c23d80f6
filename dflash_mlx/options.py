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
from collections.abc import Sequence
from dataclasses import dataclass, fields
from typing import Any

from .errors import BadArgument
from .sampling import SamplingParams

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
    "stop": "strings that end the reply (never shown)",
    "prefill_step": "prompt tokens per prefill chunk",
}


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
    stop: tuple[str, ...] = ()
    prefill_step: int = 512

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
        if not isinstance(self.stop, tuple) or not all(isinstance(s, str) for s in self.stop):
            raise BadArgument(
                f"stop {self.stop!r} must be a tuple of strings (from_kwargs and replace also "
                "take a string or a list)"
            )
        _int("prefill_step", self.prefill_step, 1)

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
        return {f.name: getattr(self, f.name) for f in fields(self)}

    @property
    def sampling(self) -> SamplingParams:
        return SamplingParams(self.temperature, self.top_p, self.top_k, self.min_p)

    @property
    def block_size(self) -> int | None:
        """Deprecated name of `verify_width`."""
        warnings.warn(
            "'block_size' is deprecated: use 'verify_width'", DeprecationWarning, stacklevel=2
        )
        return self.verify_width


def _stops(stop: Any) -> Any:
    """None, a string or a list of strings as a tuple (anything else is left to refuse)."""
    if stop is None:
        return ()
    if isinstance(stop, str):
        return (stop,)
    if isinstance(stop, Sequence) and all(isinstance(s, str) for s in stop):
        return tuple(stop)
    return stop
