"""dflash-mlx: lossless DFlash speculative decoding for mlx-lm models.

Public API: `load`, `load_draft`, `load_pair` and `Pair` (a target and its draft, bound once),
`GenerateOptions` (every generation setting, validated once), `stream_generate`, `generate`,
their `GenerationResponse` / `GenerationResult` and the one `Stats` value, `PromptCache`;
`batch_generate` and `BatchDecoder` for many requests decoded together.

The names load on first use (PEP 562), so that `dflash_mlx.cli` (the `dflash-mlx` command,
installed inside this package) answers `--help` and `--version` without importing MLX.
"""

from __future__ import annotations

import sys
from importlib import import_module
from types import ModuleType
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .cache.prompt_cache import PromptCache
    from .cache.prompt_store import PromptStore
    from .engine.batch import BatchDecoder
    from .engine.controls import TokenLogprob, check_grammar
    from .engine.generate import (
        GenerationResponse,
        GenerationResult,
        batch_generate,
        generate,
        stream_generate,
    )
    from .errors import BadArgument, BadCheckpoint, ContextTooLong, UserError
    from .models.loading import LoadError, load, load_draft
    from .options import GenerateOptions
    from .pair import Pair, load_pair
    from .stats import Stats

_API = {
    "BatchDecoder": ".engine.batch",
    "batch_generate": ".engine.generate",
    "BadArgument": ".errors",
    "BadCheckpoint": ".errors",
    "ContextTooLong": ".errors",
    "UserError": ".errors",
    "GenerateOptions": ".options",
    "Pair": ".pair",
    "load_pair": ".pair",
    "Stats": ".stats",
    "GenerationResponse": ".engine.generate",
    "GenerationResult": ".engine.generate",
    "generate": ".engine.generate",
    "stream_generate": ".engine.generate",
    "LoadError": ".models.loading",
    "load": ".models.loading",
    "load_draft": ".models.loading",
    "PromptCache": ".cache.prompt_cache",
    "PromptStore": ".cache.prompt_store",
    "TokenLogprob": ".engine.controls",
    "check_grammar": ".engine.controls",
}

__all__ = [
    "BadArgument",
    "BatchDecoder",
    "BadCheckpoint",
    "ContextTooLong",
    "GenerateOptions",
    "GenerationResponse",
    "GenerationResult",
    "LoadError",
    "Pair",
    "PromptCache",
    "PromptStore",
    "Stats",
    "TokenLogprob",
    "UserError",
    "batch_generate",
    "check_grammar",
    "generate",
    "load",
    "load_draft",
    "load_pair",
    "stream_generate",
]
__version__ = "0.1.0"


def __getattr__(name: str):
    module = _API.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(import_module(module, __name__), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_API))


class _Package(ModuleType):
    """Importing a submodule binds it on its package: `dflash_mlx.generate` the module must
    not hide `dflash_mlx.generate` the function (as the eager imports used to ensure)."""

    def __setattr__(self, name: str, value) -> None:
        if name in _API and isinstance(value, ModuleType):
            return
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package
