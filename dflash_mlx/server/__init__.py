"""`dflash-mlx serve`: an OpenAI- and Anthropic-compatible HTTP server over `stream_generate`.

`engine.py` is the one supervised worker thread that runs MLX and serves one `Pair`
(its prompt caches in `prompt_pool.py`, request limits in `limits.py`);
`core.py` the service every API calls, over `request.py` (the one internal request and its
`GenerateOptions`), `events.py` (the result stream, tool calls and reasoning split with
mlx-lm's own parsers, and its usage) and `errors.py`. `openai_api.py` (chat and text
completions), `anthropic_api.py` (Messages) and `responses_api.py` (Responses) translate
onto it, each with its request schemas apart (`*_requests.py`) and one table of refused
fields (`refused.py`); `replies.py` is the one SSE/JSON reply path; `security.py` guards
every request; `app.py` mounts them. Imported only by the serve command (it needs FastAPI).
"""

from .app import ServerSettings, create_app, create_server
from .engine import Engine

__all__ = ["Engine", "ServerSettings", "create_app", "create_server"]


def __getattr__(name: str):
    """`context_length(model)`, deprecated: `Pair(model).context_limit`."""
    if name == "context_length":
        import warnings

        from ..models.target import TargetAdapter

        warnings.warn(
            "dflash_mlx.server.context_length is deprecated: use Pair.context_limit",
            DeprecationWarning,
            stacklevel=2,
        )
        return lambda model: TargetAdapter(model).context_limit
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
