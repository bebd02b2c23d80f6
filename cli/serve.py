"""`dflash-mlx serve`: options -> models -> `dflash_mlx.server` app -> uvicorn.

The library, FastAPI and uvicorn are imported inside `run`, so the command line starts
instantly. All terminal output goes through `serve_ui.py`.
"""

from __future__ import annotations

import signal
import socket
from pathlib import Path
from typing import Annotated

import typer

from dflash_mlx.errors import (
    EXIT_INTERRUPTED,
    EXIT_TERMINATED,
    EXIT_USER,
    BadArgument,
    UserError,
)

from . import options, serve_ui, ui
from .cache import DISK_GB, MAX_CACHE_GB, MEMORY_GB, prompt_cache_folder, prompt_store
from .errors import internal
from .pairs import check_sources, choose_draft, default_target

DEMO_ID = "dflash-mlx-demo"
DEFAULT_MAX_TOKENS = 2048  # for requests that do not say
DEFAULT_MAX_BATCH = 8  # requests decoded together
DEFAULT_MAX_BATCH_TOKENS = 32768  # positions (prompt + max tokens) the running ones hold
# The prompt store's folder flags, serve's and chat's.
PromptCacheDir = Annotated[
    Path | None,
    typer.Option(
        help="Folder of the prompt cache's blocks on disk, kept across restarts and shared "
        "by servers and chats of any model.",
        show_default="prompt-cache in the cache folder (dflash-mlx --version shows it)",
    ),
]
NoPromptCacheDir = Annotated[
    bool,
    typer.Option(
        "--no-prompt-cache-dir", help="Keep prompt prefixes in memory only, never on disk."
    ),
]


def serve(
    model: options.Model = None,
    draft: options.Draft = None,
    no_draft: Annotated[
        bool, typer.Option("--no-draft", help="Serve the target alone (no speculation).")
    ] = False,
    demo: options.Demo = False,
    host: Annotated[
        str, typer.Option(help="Interface to listen on; other than loopback, set --api-key.")
    ] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="Port to listen on (0: any free port).")] = 8080,
    api_key: Annotated[
        str | None,
        typer.Option(
            envvar="DFLASH_MLX_API_KEY",
            help="Require 'Authorization: Bearer KEY' or 'x-api-key: KEY' on /v1 requests.",
            show_default=False,
        ),
    ] = None,
    max_queue: Annotated[
        int, typer.Option(help="Requests that may wait behind the running ones; more get 503.")
    ] = 16,
    max_batch: Annotated[
        int | None,
        typer.Option(
            help="Requests decoded together, joining and leaving between cycles (1: one at "
            "a time).",
            show_default=str(DEFAULT_MAX_BATCH),
        ),
    ] = None,
    max_batch_tokens: Annotated[
        int,
        typer.Option(
            help="Positions the running requests may hold in all (prompt + max tokens each); "
            "more wait in the queue (a request alone may exceed it)."
        ),
    ] = DEFAULT_MAX_BATCH_TOKENS,
    max_tokens: Annotated[
        int | None,
        options.option(
            "max_tokens",
            show_default=f"2048 ({options.DEMO_MAX_TOKENS} with --demo), for requests that "
            "do not say",
        ),
    ] = None,
    default_max_tokens: Annotated[
        int | None,
        typer.Option("--default-max-tokens", hidden=True, help="Deprecated: use --max-tokens."),
    ] = None,
    temp: Annotated[
        float | None,
        options.option("temperature", show_default="1 (the APIs'), for requests that do not say"),
    ] = None,
    top_p: Annotated[
        float | None, options.option("top_p", show_default="1, for requests that do not say")
    ] = None,
    top_k: Annotated[
        int | None, options.option("top_k", show_default="0, for requests that do not say")
    ] = None,
    min_p: Annotated[
        float | None, options.option("min_p", show_default="0, for requests that do not say")
    ] = None,
    seed: Annotated[
        int | None, options.option("seed", show_default="random, for requests that do not say")
    ] = None,
    presence_penalty: Annotated[
        float | None,
        options.option("presence_penalty", show_default="0, for requests that do not say"),
    ] = None,
    frequency_penalty: Annotated[
        float | None,
        options.option("frequency_penalty", show_default="0, for requests that do not say"),
    ] = None,
    repetition_penalty: Annotated[
        float | None,
        options.option("repetition_penalty", show_default="off, for requests that do not say"),
    ] = None,
    max_context: Annotated[
        int | None,
        typer.Option(
            help="Context length in tokens (default: the target's max_position_embeddings).",
            show_default=False,
        ),
    ] = None,
    prompt_cache_size: Annotated[
        int, typer.Option(help="Conversations whose prompt cache is kept between requests.")
    ] = 4,
    prompt_cache_dir: PromptCacheDir = None,
    no_prompt_cache_dir: NoPromptCacheDir = False,
    prompt_cache_gb: Annotated[
        float,
        typer.Option(
            help="Disk budget of the prompt cache in GB (least recently used blocks go first).",
            callback=options.finite,
        ),
    ] = DISK_GB,
    prompt_cache_memory_gb: Annotated[
        float,
        typer.Option(
            help="Memory budget of the prompt cache's shared blocks in GB.",
            callback=options.finite,
        ),
    ] = MEMORY_GB,
    verify_width: options.VerifyWidth = None,
    tree: options.Tree = None,
    block_size: options.BlockSize = None,
    draft_window: options.DraftWindow = None,
    draft_sink: options.DraftSink = None,
    cors_origin: Annotated[
        list[str] | None,
        typer.Option(
            help="Let web pages from this origin (e.g. http://example.com:3000) call the "
            "server; repeatable. Loopback origins are always allowed, others never by default.",
            show_default=False,
        ),
    ] = None,
    max_body_mb: Annotated[
        float,
        typer.Option(
            help="Largest request body in MB; larger ones get 413.", callback=options.finite
        ),
    ] = 32.0,
    shard: options.Shard = "auto",
) -> None:
    """Serve OpenAI (/v1/chat/completions, /v1/completions, /v1/responses) and Anthropic
    (/v1/messages) APIs locally, with tool calls and reasoning."""
    from dflash_mlx.distributed import session

    try:
        with session() as ranks:
            from . import shard as sharding

            sharding.check(shard)
            run(
                ranks=ranks,
                shard=shard,
                model=model,
                draft=draft,
                no_draft=no_draft,
                demo=demo,
                host=host,
                port=port,
                api_key=api_key,
                max_queue=max_queue,
                max_batch=max_batch,
                max_batch_tokens=max_batch_tokens,
                default_max_tokens=max_tokens_option(max_tokens, default_max_tokens),
                sampling={
                    name: value
                    for name, value in dict(
                        temperature=temp,
                        top_p=top_p,
                        top_k=top_k,
                        min_p=min_p,
                        seed=seed,
                        presence_penalty=presence_penalty,
                        frequency_penalty=frequency_penalty,
                        repetition_penalty=repetition_penalty,
                    ).items()
                    if value is not None
                },
                max_context=max_context,
                prompt_cache_size=prompt_cache_size,
                prompt_cache_dir=prompt_cache_folder(prompt_cache_dir, no_prompt_cache_dir),
                prompt_cache_gb=prompt_cache_gb,
                prompt_cache_memory_gb=prompt_cache_memory_gb,
                verify_width=options.verify_width(verify_width, block_size),
                tree=tree,
                draft_window=draft_window,
                draft_sink=draft_sink,
                cors_origins=tuple(cors_origin or ()),
                max_body_mb=max_body_mb,
            )
    except UserError as e:
        ui.error(str(e))
        raise typer.Exit(EXIT_USER) from None
    except KeyboardInterrupt:  # uvicorn re-raises Ctrl-C once it has shut down cleanly
        raise typer.Exit(EXIT_INTERRUPTED) from None
    except (typer.Exit, typer.Abort):
        raise
    except Exception as e:  # anything else is a bug of ours, not the user's input
        internal(e)


def max_tokens_option(max_tokens: int | None, old: int | None) -> int | None:
    """--max-tokens, or its deprecated name --default-max-tokens (with a note)."""
    if old is None:
        return max_tokens
    ui.note("note: --default-max-tokens is deprecated; use --max-tokens")
    if max_tokens is not None and max_tokens != old:
        raise BadArgument(f"--default-max-tokens {old} and --max-tokens {max_tokens} disagree")
    return old


def is_loopback(host: str, sock: socket.socket | None = None) -> bool:
    """The server's own rule (a host name other than localhost may resolve to anything),
    or, once bound, where `sock` listens (`--host 127.1` is 127.0.0.1)."""
    from dflash_mlx.server.security import is_loopback_host

    if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
        return is_loopback_host(sock.getsockname()[0])
    return is_loopback_host(host)


def exposure_warning(
    host: str, api_key: str | None, sock: socket.socket | None = None
) -> str | None:
    """A warning when the server is reachable from other machines without a key."""
    if api_key or is_loopback(host, sock):
        return None
    return (
        f"listening on {host} without --api-key: anyone who can reach this machine can use "
        "the server (set --api-key, or keep the default --host 127.0.0.1)"
    )


def listen(host: str, port: int) -> socket.socket:
    """A socket bound to (host, port), or a ValueError naming why not (e.g. port in use)."""
    if not 0 <= port <= 65535:
        raise BadArgument(f"--port {port} must be in 0..65535")
    host = host.strip("[]")
    try:
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
        # proto IPPROTO_TCP: asyncio then sets TCP_NODELAY on accepted connections (with
        # proto 0 it does not, and each response on a kept-alive connection waited ~40 ms
        # for the client's delayed ACK).
        sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        # Listening from here on, not only once uvicorn's loop starts: a client that
        # connects as soon as the banner says "serving" waits in the backlog instead of
        # being refused (seen on a loaded machine).
        sock.listen(2048)
    except (OSError, UnicodeError) as e:  # UnicodeError: a host name IDNA cannot encode
        reason = getattr(e, "strerror", None) or e
        raise BadArgument(f"cannot listen on {host}:{port}: {reason}") from None
    return sock


@options.flag_names()  # errors about generation options name their flags
def run(
    *,
    model: str | None,
    draft: str | None,
    demo: bool,
    host: str,
    port: int,
    api_key: str | None,
    max_queue: int,
    default_max_tokens: int | None,
    max_context: int | None,
    prompt_cache_size: int,
    verify_width: int | None = None,
    tree: bool | None = None,
    no_draft: bool = False,
    cors_origins: tuple[str, ...] = (),
    max_body_mb: float = 32.0,
    draft_window: int | None = None,
    draft_sink: int | None = None,
    sampling: dict | None = None,
    prompt_cache_dir: Path | None = None,
    prompt_cache_gb: float = DISK_GB,
    prompt_cache_memory_gb: float = MEMORY_GB,
    max_batch: int | None = None,
    max_batch_tokens: int = DEFAULT_MAX_BATCH_TOKENS,
    shard: str = "none",
    ranks=None,
) -> None:
    """Load the pair, bind the port and serve until Ctrl-C.

    `shard`: `--shard`; under mlx.launch `ranks` (a `distributed.session`) joins the others:
    rank 0 serves, the others follow its steps (docs/distributed.md).

    `sampling`: GenerateOptions fields (temperature, top_p, top_k, min_p, seed, the
    penalties) for requests that leave them out, as are `verify_width`, `draft_window` and
    `tree` (a request's `tree` field overrides it); `default_max_tokens` None: 2048.
    `max_batch` None: 8."""
    if demo and (model is not None or draft is not None):
        raise BadArgument("--demo builds its own pair: pass it without --model and --draft")
    if draft is not None and no_draft:
        raise BadArgument("pass either --draft or --no-draft, not both")
    if not demo and model is None and draft is not None:
        raise BadArgument("--draft needs --model: the target it was trained for")
    check_sources(model, draft)
    if max_queue < 0:
        raise BadArgument(f"--max-queue {max_queue} must be >= 0")
    if max_batch is None:
        max_batch = DEFAULT_MAX_BATCH
    if max_batch < 1:
        raise BadArgument(f"--max-batch {max_batch} must be >= 1 (1: one request at a time)")
    if max_batch_tokens < 1:
        raise BadArgument(f"--max-batch-tokens {max_batch_tokens} must be >= 1")
    if default_max_tokens is None:  # the demo's replies are capped as chat --demo's are
        default_max_tokens = options.DEMO_MAX_TOKENS if demo else DEFAULT_MAX_TOKENS
    if max_context is not None and max_context < 2:
        raise BadArgument(f"--max-context {max_context} must be >= 2")
    if prompt_cache_size < 1:
        raise BadArgument(f"--prompt-cache-size {prompt_cache_size} must be >= 1")
    for name, gb in [
        ("--prompt-cache-gb", prompt_cache_gb),
        ("--prompt-cache-memory-gb", prompt_cache_memory_gb),
    ]:
        if not 0 <= gb <= MAX_CACHE_GB:  # 1e300 GB is no budget: bytes overflow
            raise BadArgument(f"{name} {gb:g} must be between 0 and {MAX_CACHE_GB:,} (GB)")
    from dflash_mlx import GenerateOptions

    # The requests' defaults, checked by the engine's own rules before anything loads.
    sampling = dict(sampling or {})
    defaults = GenerateOptions(
        max_tokens=default_max_tokens,
        verify_width=verify_width,
        draft_window=draft_window,
        draft_sink=draft_sink,
        tree=tree,
    )
    defaults.replace(**sampling)
    if not max_body_mb > 0:
        raise BadArgument(f"--max-body-mb {max_body_mb} must be > 0")
    texts = [("--host", host), ("--api-key", api_key or "")]
    for name, text in texts + [("--cors-origin", origin) for origin in cors_origins]:
        options.unicode_text(name, text)
    for origin in cors_origins:
        if origin != "*" and not origin.startswith(("http://", "https://")):
            raise BadArgument(
                f"--cors-origin {origin!r} must be an origin such as http://host:port (or *)"
            )
    if api_key is not None and not api_key.strip():
        raise BadArgument("--api-key is empty: give a key, or leave the option out")

    from dflash_mlx import distributed
    from dflash_mlx.server import Engine, ServerSettings, create_server

    from . import shard as sharding

    model_id, aliases = model, set()
    if demo:
        from dflash_mlx.demo import NOTICE, demo_pair

        with ui.loading("demo pair", "tiny models"):
            target_dir, draft_dir = demo_pair()
    else:
        model = default_target(model, draft)
    kind = sharding.plan(str(target_dir) if demo else model, shard)
    cluster = ranks.join(kind) if kind is not None and ranks is not None else None
    if cluster is not None and max_batch == 1:
        raise BadArgument(
            "--max-batch 1: across ranks the server runs its batching engine (the other "
            "ranks replay its steps); use --max-batch 2 or more"
        )
    follower = cluster is not None and cluster.rank != 0
    # Across ranks each rank keeps its own shard's blocks, in a folder of its own.
    folder = sharding.store_folder(prompt_cache_dir, cluster)
    store, store_note = prompt_store(folder, prompt_cache_gb, prompt_cache_memory_gb)
    # First: a busy port fails before a long model load (only rank 0 listens).
    sock = None if follower else listen(host, port)
    if demo:
        serve_ui.demo_note(NOTICE, target_dir.parent, default_max_tokens)
        model, model_id = str(target_dir), DEMO_ID
        draft = None if no_draft else str(draft_dir)
    else:
        model_id = model
        choice = choose_draft(model, draft, no_draft)
        if choice.note:
            ui.note(choice.note)
        draft = choice.draft
        if Path(model).exists():  # a local folder: its name works too
            aliases.add(Path(model).resolve().name)
    if cluster is not None:
        from .pairs import DraftChoice

        pair, tokenizer = sharding.load(model, DraftChoice(draft, None, None), kind)
    else:
        from .generate import load as load_pair
        from .pairs import DraftChoice

        # The target and the draft behind spinners, the draft refused here when it does not fit.
        pair, tokenizer = load_pair(model, DraftChoice(draft, None, None))
    ui.calibrate(pair, defaults.verify_width)  # before it listens: said, with a bar
    pair.plan(defaults.replace(seed=0))  # ... and a width its block cannot hold
    if cluster is not None:
        from dflash_mlx.server.batching import batch_size

        distributed.freeze_calibration(pair)  # measured now, with every rank, or never
        batch = batch_size(pair, max_batch)
        if batch == 1:
            raise BadArgument(
                f"this target cannot decode in a batch, which serving across ranks needs "
                f"(--max-batch {max_batch} fell to 1)"
            )
        if follower:
            distributed.follow(pair, tokenizer, batch, prompt_cache_size, store)
            return
        distributed.lead()

    limit = pair.context_limit
    if max_context is not None and limit is not None and max_context > limit:
        raise BadArgument(
            f"--max-context {max_context} is more than this model holds: its context is "
            f"{limit} tokens (leave the option out to serve all of it)"
        )
    settings = ServerSettings(
        model_id=model_id,
        aliases=aliases,
        draft_id=DEMO_ID + "-draft" if demo and draft else draft,
        api_key=api_key,
        default_max_tokens=default_max_tokens,
        sampling=sampling,
        context_length=max_context or pair.context_limit,
        loopback_only=is_loopback(host, sock),
        cors_origins=cors_origins,
        max_body_mb=max_body_mb,
    )
    engine = Engine(
        pair,
        tokenizer,
        options=defaults,
        max_queue=max_queue,
        prompt_cache_slots=prompt_cache_size,
        prompt_store=store,
        max_batch=max_batch,
        max_batch_tokens=max_batch_tokens,
        # Across ranks, a warm-up generation on rank 0 alone would wait for the others.
        warm_up=cluster is None,
    )
    if cluster is not None:
        # A failure on any rank ends every rank: first the requests in flight are answered
        # (503, the failure named) and new ones refused (docs/distributed.md).
        distributed.when_aborting(
            lambda why: engine.close(timeout=0, why=f"the server is ending: {why}")
        )
    server = create_server(engine, settings)
    serve_ui.serving(
        host,
        sock.getsockname()[1],
        model_id,
        settings.context_length,
        api_key is not None,
        engine.max_batch,
    )
    if store_note:
        ui.note(store_note)
    warning = exposure_warning(host, api_key, sock)
    if warning:
        ui.note(f"warning: {warning}")
    if api_key is not None and not api_key.isascii():
        ui.note(
            "note: --api-key holds non-ASCII characters; clients must send it UTF-8 encoded "
            "(many HTTP clients only send ASCII header values)"
        )
    server.run(sockets=[sock])
    # uvicorn shut down cleanly on a signal: exit as the shell reports that signal.
    if server.stopped_by == signal.SIGTERM:
        raise typer.Exit(EXIT_TERMINATED)
    if server.stopped_by == signal.SIGINT:
        raise typer.Exit(EXIT_INTERRUPTED)
