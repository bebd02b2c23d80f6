"""`dflash-mlx serve`: an OpenAI- and Anthropic-compatible HTTP server over `stream_generate`.

`engine.py` is the one supervised worker thread that runs MLX; `core.py` the one internal
request and result stream (tool calls and reasoning split with mlx-lm's own parsers);
`openai_api.py` (chat and text completions), `anthropic_api.py` (Messages) and
`responses_api.py` (Responses) translate onto it; `security.py` guards every request;
`app.py` mounts them. Imported only by the serve command (it needs FastAPI).
"""

from .app import ServerSettings, create_app, create_server
from .engine import Engine, context_length

__all__ = ["Engine", "ServerSettings", "context_length", "create_app", "create_server"]
