"""`dflash-mlx chat`: options -> the pair -> loaded models -> a REPL, or one answer for
piped stdin.

The conversation itself (messages, settings, state reuse across turns, statistics,
transcripts) is `dflash_mlx.chat.session.ChatSession`; the loop and its slash commands are
`chat_repl.py`; the screen is `chat_ui.py`; line editing is `chat_input.py`. The library
(and so mlx) and prompt_toolkit are imported inside the functions, so the command line
starts instantly.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer
from rich.console import Console

from dflash_mlx.errors import EXIT_INTERRUPTED, EXIT_USER, BadArgument, UserError

from . import cache, options, serve, ui
from .errors import internal

if TYPE_CHECKING:  # rich's Markdown, prompt_toolkit and mlx load only when chatting
    from dflash_mlx.cache.prompt_store import PromptStore
    from dflash_mlx.chat.session import ChatSession
    from dflash_mlx.options import GenerateOptions
    from dflash_mlx.pair import Pair as DFlashPair

    from .chat_ui import ChatUI

DEMO_MAX_TOKENS = options.DEMO_MAX_TOKENS  # the demo's gibberish rarely ends: short replies
DRAFT_FILES = ["*.json", "*.safetensors"]  # what dflash_mlx.load_draft fetches
MaxTokens = Annotated[
    int | None, options.option("max_tokens", show_default=f"1024; {DEMO_MAX_TOKENS} with --demo")
]


def command(
    model: options.Model = None,
    draft: options.Draft = None,
    no_draft: options.NoDraft = False,
    demo: Annotated[
        bool,
        typer.Option(
            "--demo", help="A tiny demonstration pair: works offline, writes Python-ish text."
        ),
    ] = False,
    system: options.System = None,
    max_tokens: MaxTokens = None,
    temp: options.Temp = 0.0,
    top_p: options.TopP = 1.0,
    top_k: options.TopK = 0,
    min_p: options.MinP = 0.0,
    seed: options.Seed = None,
    presence_penalty: options.PresencePenalty = 0.0,
    frequency_penalty: options.FrequencyPenalty = 0.0,
    repetition_penalty: options.RepetitionPenalty = None,
    verify_width: options.VerifyWidth = None,
    tree: options.Tree = None,
    block_size: options.BlockSize = None,
    draft_window: options.DraftWindow = None,
    draft_sink: options.DraftSink = None,
    json_out: Annotated[
        bool,
        typer.Option(
            "--json",
            help="Piped stdin: print the answer as one JSON object with text, tokens and stats.",
        ),
    ] = False,
    think: Annotated[
        bool | None,
        typer.Option(
            "--think/--no-think",
            help="Ask the chat template for thinking on or off (default: the model's, or "
            "what its draft was trained with).",
            show_default=False,
        ),
    ] = None,
    hide_thinking: Annotated[
        bool, typer.Option("--hide-thinking", help="Collapse <think> sections to one line.")
    ] = False,
    plain: Annotated[
        bool,
        typer.Option(
            "--plain",
            help="Show replies as plain text, exactly as written (no Markdown; also "
            "/set markdown off).",
        ),
    ] = False,
    prompt_cache_dir: serve.PromptCacheDir = None,
    no_prompt_cache_dir: serve.NoPromptCacheDir = False,
    verbose: options.Verbose = False,
    shard: Annotated[
        str,
        typer.Option(
            "--shard",
            metavar="KIND",
            help="Refused but none: chat runs in one process (serve shards across ranks; "
            "see docs/distributed.md).",
        ),
    ] = "auto",
) -> None:
    """Chat in the terminal, with DFlash speculative decoding.

    Each turn prefills only what is new: the conversation's state is kept across turns.
    Piped stdin (echo hi | dflash-mlx chat) is answered once.
    """
    try:
        from . import shard as sharding

        sharding.refuse_chat(shard)
        code = run(
            model=model,
            draft=draft,
            no_draft=no_draft,
            demo=demo,
            system=system,
            temp=temp,
            top_p=top_p,
            top_k=top_k,
            min_p=min_p,
            penalties=dict(
                presence_penalty=presence_penalty,
                frequency_penalty=frequency_penalty,
                repetition_penalty=repetition_penalty,
            ),
            max_tokens=max_tokens,
            verify_width=options.verify_width(verify_width, block_size),
            tree=tree,
            seed=seed,
            json_out=json_out,
            verbose=verbose,
            think=think,
            hide_thinking=hide_thinking,
            plain=plain,
            draft_window=draft_window,
            draft_sink=draft_sink,
            prompt_cache_dir=cache.prompt_cache_folder(prompt_cache_dir, no_prompt_cache_dir),
        )
    except UserError as e:  # LoadError included
        ui.error(str(e))
        raise typer.Exit(EXIT_USER) from None
    except KeyboardInterrupt:
        ui.interrupted()
        raise typer.Exit(EXIT_INTERRUPTED) from None
    except (typer.Exit, typer.Abort):
        raise
    except Exception as e:  # anything else is a bug of ours, not the user's input
        internal(e)
    if code:
        raise typer.Exit(code)


@options.flag_names()  # errors about generation options name their flags
def run(
    *,
    model: str | None = None,
    draft: str | None = None,
    no_draft: bool = False,
    demo: bool = False,
    system: str | None = None,
    temp: float = 0.0,
    top_p: float = 1.0,
    max_tokens: int | None = None,
    verify_width: int | None = None,
    tree: bool | None = None,
    seed: int | None = None,
    think: bool | None = None,
    hide_thinking: bool = False,
    plain: bool = False,
    draft_window: int | None = None,
    draft_sink: int | None = None,
    top_k: int = 0,
    min_p: float = 0.0,
    penalties: dict | None = None,
    json_out: bool = False,
    prompt_cache_dir: Path | None = None,
    verbose: bool = False,
) -> int:
    """Load the pair and chat; the exit code (`prompt_cache_dir`: the prompt store's folder,
    `DEFAULT_DIR` for the cache folder's, None: memory only)."""
    from . import chat_repl, chat_ui

    view = chat_ui.ChatUI(
        Console(highlight=False),
        Console(stderr=True, highlight=False),
        hide_thinking=hide_thinking,
        verbose=verbose,
        markdown=not plain,
    )
    from dflash_mlx.chat.session import CHAT_DEFAULTS

    default_max_tokens = DEMO_MAX_TOKENS if demo else CHAT_DEFAULTS.max_tokens
    settings = CHAT_DEFAULTS.replace(  # bad values fail now, before anything loads
        temperature=temp,
        top_p=top_p,
        top_k=top_k,
        min_p=min_p,
        max_tokens=max_tokens if max_tokens is not None else default_max_tokens,
        verify_width=verify_width,
        tree=tree,
        seed=seed,
        draft_window=draft_window,
        draft_sink=draft_sink,
        **(penalties or {}),
    )
    if system is not None:
        options.unicode_text("--system", system)
    piped = not sys.stdin.isatty()
    if json_out and not piped:
        raise BadArgument(
            "--json prints one answer as JSON: pipe the message on stdin "
            "(echo 'hello' | dflash-mlx chat --json)"
        )
    pair = resolve_pair(model, draft, no_draft=no_draft, demo=demo, think=think, view=view)
    message = None
    if piped:  # read and checked before anything loads
        message = read_stdin()
        if not message.strip():
            raise BadArgument("nothing on stdin to answer (e.g. echo 'hello' | dflash-mlx chat)")
        options.unicode_text("stdin", message)
    store = None
    if prompt_cache_dir is not None:  # the same store serve keeps, with serve's budgets
        store, _ = cache.prompt_store(prompt_cache_dir, cache.DISK_GB, cache.MEMORY_GB)
    session = load_session(pair, view, system=system, settings=settings, store=store)
    if piped:
        return chat_repl.answer_once(session, view, message, json_out=json_out)
    view.banner(pair.banner, session.options)
    from . import chat_input

    read = chat_input.make_reader(
        commands={name: text for name, (_, text) in chat_repl.COMMANDS.items()},
        setting_names=chat_repl.SET_NAMES,
        history=chat_input.history_path(),
        toolbar=lambda: chat_repl.toolbar(session, pair.label),
    )
    chat_repl.Repl(session, view, read).run()
    return 0


def read_stdin() -> str:
    """Piped stdin as text: bytes the locale's encoding cannot decode become lone surrogates
    (as on the command line), which `answer_once` names, instead of a UnicodeDecodeError."""
    if hasattr(sys.stdin, "reconfigure"):
        sys.stdin.reconfigure(errors="surrogateescape")
    return sys.stdin.read()


@dataclass
class PairSource:
    """Where the target and draft come from, and how to talk about them."""

    model: str  # what to load: Hub id or folder
    draft: str | None
    label: str  # how to name them on screen and in transcripts
    draft_label: str
    template_kwargs: dict = field(default_factory=dict)
    banner: list[tuple[str, str]] = field(default_factory=list)


def resolve_pair(
    model: str | None,
    draft: str | None,
    *,
    no_draft: bool,
    demo: bool,
    think: bool | None,
    view: ChatUI,
) -> PairSource:
    """The target and draft to load: --demo, the default pair, the registry or as given."""
    from dflash_mlx.models.registry import DEFAULT_TARGET

    if draft is not None and no_draft:
        raise BadArgument("pass either --draft or --no-draft, not both")
    if demo:
        if model is not None or draft is not None:
            raise BadArgument("--demo builds its own pair: pass it without --model and --draft")
        from dflash_mlx.demo import NOTICE, TRAINED, demo_pair

        with ui.loading("demo pair", "tiny models"):
            target_dir, draft_dir = demo_pair()
        view.demo_note(NOTICE)
        kind = "trained" if TRAINED else "random"
        pair = PairSource(
            str(target_dir),
            None if no_draft else str(draft_dir),
            f"demo target ({kind})",
            f"demo draft ({kind})",
        )
        pair.banner = [("target", pair.label), ("draft", "none" if no_draft else pair.draft_label)]
        return pair
    if draft is not None and model is None:
        raise BadArgument("--draft needs --model: the target it was trained for")
    from .pairs import choose_draft

    model = model or DEFAULT_TARGET
    choice = choose_draft(model, draft, no_draft)
    draft, entry = choice.draft, choice.entry
    how = f" (published for {entry.target})" if entry is not None else ""
    pair = PairSource(model, draft, model, draft or "none")
    if entry is not None:
        pair.template_kwargs = dict(entry.template_kwargs)
        if entry.note:
            how += f" · {entry.note}"
    if think is not None:
        pair.template_kwargs["enable_thinking"] = think
    pair.banner = [("target", model), ("draft", (draft or "none") + how)]
    if pair.template_kwargs.get("enable_thinking") is False and think is None:
        pair.banner.append(("thinking", "off, as the draft was trained (--think turns it on)"))
    if draft is None:  # --no-draft, or no draft known for the target: one note says which
        view.note(choice.note)
    return pair


def load_session(
    pair: PairSource,
    view: ChatUI,
    *,
    system: str | None,
    settings: GenerateOptions,
    store: PromptStore | None = None,
) -> ChatSession:
    """Download (with progress), load, check and calibrate the pair; a fresh ChatSession."""
    import dflash_mlx
    from dflash_mlx.chat.session import ChatSession

    fetch(pair.model, "target", None)
    with ui.loading("target", pair.label):
        target, tokenizer = dflash_mlx.load(pair.model)
    drafter = None
    if pair.draft is not None:
        fetch(pair.draft, "draft", DRAFT_FILES)
        with ui.loading("draft", pair.draft_label):
            drafter = dflash_mlx.load_draft(pair.draft)
    bound = prepare_draft(target, drafter, view, calibrate=settings.verify_width is None)
    return ChatSession(
        bound,
        tokenizer,
        system=system,
        options=settings,
        template_kwargs=pair.template_kwargs,
        model_id=pair.label,
        draft_id=pair.draft_label if pair.draft else None,
        store=store,
    )


def fetch(source: str, what: str, patterns: list[str] | None) -> None:
    """Download a Hub model not yet cached, showing the Hub's progress bars.

    Loading would download it too, but behind a spinner; failures are left to the loader,
    whose message says what to do.
    """
    if Path(source).expanduser().exists() or source.startswith((".", "/", "~")):
        return
    if source.count("/") != 1:
        return
    from huggingface_hub import snapshot_download

    try:
        snapshot_download(source, allow_patterns=patterns, local_files_only=True)
        return
    except Exception:  # not cached (yet): download below
        pass
    ui.note(f"downloading the {what} {source} from the Hugging Face Hub…")
    try:
        snapshot_download(source, allow_patterns=patterns)
    except Exception:
        pass


def prepare_draft(target, drafter, view: ChatUI, *, calibrate: bool) -> DFlashPair:
    """The Pair: a draft that does not fit the target fails now (LoadError), not at the
    first message; its costs are measured once (none to measure without a draft)."""
    import dflash_mlx

    pair = dflash_mlx.Pair(target, drafter)
    if calibrate:
        ui.calibrate(pair, None, view.err)
    return pair
