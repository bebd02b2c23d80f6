"""Whose fault an error is, and the exit codes that say so.

`UserError` and its subclasses are the caller's: a bad argument, a checkpoint that cannot
be used, a prompt longer than the context. The CLI shows their message and exits with
`EXIT_USER`; the server answers 4xx with it. Anything else raised inside the engine is
ours: the CLI exits with `EXIT_INTERNAL` and a short hint, the server answers 500 with a
generic message and logs the details.

`UserError` subclasses `ValueError` so that code written against the earlier
`ValueError`-only contract keeps catching it; the reverse is not true: a plain
`ValueError` is an internal error.
"""

from __future__ import annotations

EXIT_OK = 0
EXIT_INTERNAL = 1  # a bug of ours: short traceback hint, please report
EXIT_USER = 2  # bad input: options that do not fit, a model that cannot load
EXIT_INTERRUPTED = 130  # 128 + SIGINT, as shells report Ctrl-C
EXIT_TERMINATED = 143  # 128 + SIGTERM: `serve` stopped by `kill` (after a clean shutdown)


class UserError(ValueError):
    """The caller's mistake; the message names the value and what was expected."""


class BadArgument(UserError):
    """An argument out of range or of the wrong kind."""


class BadCheckpoint(UserError):
    """A model or draft folder that cannot be loaded or does not fit its target."""


class ContextTooLong(UserError):
    """A prompt (plus the requested tokens) that does not fit the model's context."""
