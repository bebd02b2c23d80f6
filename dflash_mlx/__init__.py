"""dflash-mlx: lossless DFlash speculative decoding for mlx-lm models.

Public API: `load`, `load_draft`, `stream_generate`, `generate`.
"""

from .generate import GenerationResponse, GenerationResult, generate, stream_generate
from .loading import LoadError, load, load_draft
from .prompt_cache import PromptCache

__all__ = [
    "GenerationResponse",
    "GenerationResult",
    "LoadError",
    "PromptCache",
    "generate",
    "load",
    "load_draft",
    "stream_generate",
]
__version__ = "0.1.0"
