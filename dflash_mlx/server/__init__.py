"""`dflash-mlx serve`: an OpenAI-compatible HTTP server over `stream_generate`.

`protocol.py` holds OpenAI's wire format, `engine.py` the one worker thread that runs MLX,
`app.py` the FastAPI routes. Imported only by the serve command (it needs FastAPI).
"""

from .app import ServerSettings, create_app, create_server
from .engine import Engine, context_length

__all__ = ["Engine", "ServerSettings", "context_length", "create_app", "create_server"]
