"""What `dflash-mlx serve` shows on stderr: the demo warning and where the server listens.

Request logs come from uvicorn. Knows nothing about models: it prints what it is given.
"""

from __future__ import annotations

from pathlib import Path

from rich.console import Console
from rich.text import Text


def _err() -> Console:
    return Console(stderr=True, highlight=False, soft_wrap=True)


def demo_note(notice: str, folder: Path, max_tokens: int) -> None:
    _err().print(
        Text.assemble(
            ("demo: ", "bold yellow"),
            (
                f"serving {notice} ({folder}). Requests that do not say get at most "
                f"{max_tokens} tokens (--max-tokens). Each reply's `timings` report τ "
                "(`tau`) and acceptance (`draft_n_accepted` of `draft_n` drafted tokens).",
                "yellow",
            ),
        )
    )


def serving(
    host: str, port: int, model_id: str, context: int | None, keyed: bool, batch: int = 1
) -> None:
    """One line: the base URL clients use, the model name they send, and the limits."""
    shown = f"[{host}]" if ":" in host else host
    url = f"http://{shown}:{port}/v1"
    parts = [
        f"model '{model_id}'",
        f"context {context} tokens" if context else "no context limit",
        f"batches of up to {batch} requests" if batch > 1 else "one request at a time",
        "API key required" if keyed else "no API key",
        f"chat page http://{shown}:{port}/",
        f"docs http://{shown}:{port}/docs",
    ]
    _err().print(
        Text.assemble(("serving ", "bold green"), (url, "bold"), (" · " + " · ".join(parts), ""))
    )
