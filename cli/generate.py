"""`dflash-mlx generate`: options -> the prompt -> the pair -> a streamed completion and one
stats line (or one JSON object).

The prompt is read before any model loads (an argument, --prompt/-p, or stdin). The library
(and so mlx) is imported inside `run`, so the command line starts instantly; all terminal
output goes through `ui.py`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from dflash_mlx.errors import EXIT_INTERRUPTED, BadArgument

from . import options, ui
from . import shard as sharding
from .compare import compared
from .errors import user_errors


def command(
    prompt_arg: Annotated[
        str | None,
        typer.Argument(
            metavar="PROMPT",
            help="The prompt text (or --prompt); - or none with piped stdin: read stdin.",
            show_default=False,
        ),
    ] = None,
    prompt: Annotated[
        str | None,
        typer.Option("--prompt", "-p", help="The prompt text; - reads stdin.", show_default=False),
    ] = None,
    model: options.Model = None,
    draft: options.Draft = None,
    no_draft: options.NoDraft = False,
    system: options.System = None,
    max_tokens: options.MaxTokens = 256,
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
    json_schema: Annotated[
        Path | None,
        typer.Option(
            "--json-schema",
            metavar="FILE",
            help="Constrain the reply to JSON following the JSON schema in FILE "
            "(e.g. schema.json); the reply ends when the JSON does.",
            show_default=False,
        ),
    ] = None,
    chat: Annotated[
        bool | None,
        typer.Option(
            "--chat/--raw",
            help="Wrap the prompt in the chat template (default: if the tokenizer has one).",
            show_default=False,
        ),
    ] = None,
    json_out: options.Json = False,
    verbose: options.Verbose = False,
    compare: Annotated[
        bool,
        typer.Option(
            "--compare",
            help="Then decode the same prompt plainly (the target alone, same settings, "
            "same engine) and show both speeds; at temperature 0 the tokens must match.",
        ),
    ] = False,
    demo: options.Demo = False,
    shard: options.Shard = "auto",
) -> None:
    """Stream a completion of the prompt, then one line of statistics.

    The prompt: an argument, --prompt/-p, or stdin (--prompt -, or none with stdin piped).
    """
    from dflash_mlx.distributed import session

    with user_errors(), options.flag_names(), session() as ranks:
        sharding.check(shard)
        code = run(
            prompt=prompt_text(prompt_arg, prompt),
            system=None if system is None else options.unicode_text("--system", system),
            shard=(shard, ranks),
            model=model,
            draft=draft,
            no_draft=no_draft,
            chat=chat,
            json_out=json_out,
            verbose=verbose,
            compare=compare,
            demo=demo,
            schema_file=json_schema,
            settings=dict(
                max_tokens=max_tokens,
                temperature=temp,
                top_p=top_p,
                top_k=top_k,
                min_p=min_p,
                seed=seed,
                presence_penalty=presence_penalty,
                frequency_penalty=frequency_penalty,
                repetition_penalty=repetition_penalty,
                verify_width=options.verify_width(verify_width, block_size),
                tree=tree,
                draft_window=draft_window,
                draft_sink=draft_sink,
                json_schema=read_schema(json_schema),
            ),
        )
    if code:
        raise typer.Exit(code)


def run(
    *,
    prompt: str,
    model: str | None,
    draft: str | None,
    no_draft: bool,
    chat: bool | None,
    json_out: bool,
    demo: bool,
    settings: dict,
    compare: bool = False,
    schema_file: Path | None = None,
    verbose: bool = False,
    shard: tuple = ("none", None),
    system: str | None = None,
) -> int:
    """Generate; the exit code (1: --compare found plain decoding's tokens differ).
    `shard`: `--shard` and the `distributed.session` that joins the ranks."""
    import dflash_mlx

    if system is not None and chat is False:
        raise BadArgument(
            "--system/--system-prompt: a system prompt needs the chat template; not with --raw"
        )
    opts = dflash_mlx.GenerateOptions(**settings)  # a bad setting before any note
    if demo:
        if model is not None or draft is not None:
            raise BadArgument("--demo brings its own pair: pass it without --model/--draft")
        if compare and no_draft:
            raise BadArgument(
                "--compare measures DFlash against plain decoding: not with --no-draft"
            )
        from dflash_mlx.demo import NOTICE, demo_pair

        target_dir, draft_dir = demo_pair()
        kind = sharding.plan(str(target_dir), shard[0])  # a bad --shard before any note
        ui.note(f"demo: {NOTICE}")
        model, draft = str(target_dir), None if no_draft else str(draft_dir)
        chat = False if chat is None else chat
    from .pairs import choose_draft, default_target

    model = default_target(model, draft)
    if not demo:
        kind = sharding.plan(model, shard[0])
    choice = choose_draft(model, draft, no_draft)  # names only: nothing loads yet
    if compare and choice.draft is None:
        raise BadArgument(
            "--compare measures DFlash against plain decoding: it needs a draft "
            "(--draft DRAFT, or a target whose draft is known)"
        )
    pair, tokenizer = sharding.load_for(model, choice, kind, shard[1]) or load(model, choice)
    if opts.verify_width is not None:
        pair.plan(opts)  # a width the draft cannot hold fails before anything runs
    if settings.get("json_schema") is not None:  # a schema no grammar can be made of fails now
        from dflash_mlx.grammar_cage import run_deep

        try:  # on a deep stack, over the logits the engine masks: its own build is a copy
            run_deep(dflash_mlx.check_grammar, opts, tokenizer, pair.target.logits_width)
        except BadArgument as e:
            raise BadArgument(f"--json-schema {schema_file}: {e}") from None
    request = prompt_form(tokenizer, prompt, chat, system)
    ui.calibrate(pair, opts.verify_width)  # once per pair and device: said, with a bar
    marks: list[tuple[int, float]] = []  # (tokens so far, time): --compare's clock
    if json_out:
        from dflash_mlx.engine.generate import collect

        responses = dflash_mlx.stream_generate(pair, tokenizer, request, opts)
        result = collect(collecting(responses, [], marks))
        plain = compared(pair, tokenizer, request, opts, result, marks) if compare else None
        ui.result_json(result, plain=plain)
        return EXIT_DIFFERENT if plain and plain["same_tokens"] is False else 0
    progress = ui.PromptProgress()
    tokens: list[int] = []
    seen: list = []  # the last response so far: Ctrl-C's stats
    try:
        responses = dflash_mlx.stream_generate(
            pair, tokenizer, request, opts, prompt_progress=progress
        )
        last = ui.stream(collecting(responses, tokens, marks, seen))
    except KeyboardInterrupt:
        progress.close()
        if not seen:  # nothing made yet: just `interrupted`
            raise
        ui.stats(seen[-1], verbose=verbose, finish_reason="interrupted")  # what it made
        return EXIT_INTERRUPTED
    finally:
        progress.close()
    ui.stats(last, verbose=verbose)
    if not compare:
        return 0
    plain = compared(pair, tokenizer, request, opts, (tokens, last.stats), marks)
    ui.comparison(plain, last.stats.generation_tokens, last.stats.tau)
    return EXIT_DIFFERENT if plain["same_tokens"] is False else 0


EXIT_DIFFERENT = 1  # --compare: plain decoding's tokens differ from DFlash's (a bug of ours)


def collecting(
    responses, tokens: list[int], marks: list[tuple[int, float]] | None = None, seen=None
):
    """`responses`, passed on, their tokens appended to `tokens`, (`marks`) the count of
    tokens so far with the time each response arrived and (`seen`) each response; closing
    it closes them."""
    import time

    try:
        for r in responses:
            tokens.extend(r.tokens)
            if marks is not None:
                marks.append((len(tokens), time.perf_counter()))
            if seen is not None:
                seen[:] = [r]
            yield r
    finally:
        responses.close()


def load(model: str, choice):
    """`(Pair, tokenizer)`: the target and the draft `choice` names (`pairs.choose_draft`:
    as given, none with --no-draft, else the registry's published one; none known: plain
    decoding, with its note once the target loaded), behind spinners, checked against each
    other."""
    import dflash_mlx

    with ui.loading("target", model):  # a target that cannot load: its error, no note
        target, tokenizer = dflash_mlx.load(model)
    if choice.note:
        ui.note(choice.note)
    if choice.draft is None:
        return dflash_mlx.Pair(target), tokenizer
    with ui.loading("draft", choice.draft):
        drafter = dflash_mlx.load_draft(choice.draft)
    return dflash_mlx.Pair(target, drafter), tokenizer


NO_PROMPT = (
    'no prompt: pass it as an argument (dflash-mlx generate "..."), with --prompt/-p, '
    "or on stdin (echo ... | dflash-mlx generate, or --prompt - to read stdin)"
)


def read_schema(path: Path | None) -> dict | None:
    """The JSON schema in `path` (None: none); a file that cannot be read, is not JSON or
    holds no schema object is a `BadArgument` naming it, and so is one beyond the server's
    bounds (`dflash_mlx.json_schema`: nesting, no JSON Schema, a string or a pattern's
    counted repetitions beyond 65,536 characters), all before any model loads."""
    if path is None:
        return None
    import json

    from dflash_mlx.json_schema import MAX_DEPTH, schema_problem, schema_too_large, too_deep
    from dflash_mlx.schema_graph import schema_graph_problem

    deep = f"--json-schema {path}: nests arrays and objects more than {MAX_DEPTH} levels deep"
    try:
        schema = json.loads(path.read_text(encoding="utf-8"))
    except OSError as e:
        raise BadArgument(f"--json-schema {path}: cannot read it ({e.strerror or e})") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise BadArgument(f"--json-schema {path}: not JSON ({e})") from None
    except RecursionError:  # past Python's own limit, far past ours
        raise BadArgument(deep) from None
    if not isinstance(schema, dict):
        raise BadArgument(
            f"--json-schema {path}: a JSON schema is an object, not {type(schema).__name__}"
        )
    where = too_deep(schema)
    if where is not None:
        raise BadArgument(f"{deep} (at {'/'.join(map(str, where[:8]))}/...)")
    problem = schema_problem(schema)
    if problem is not None:
        raise BadArgument(f"--json-schema {path}: not a JSON Schema: {problem}")
    problem = schema_too_large(schema)
    if problem is not None:
        raise BadArgument(f"--json-schema {path}: too large to constrain a reply: {problem}")
    problem = schema_graph_problem(schema)
    if problem is not None:
        raise BadArgument(f"--json-schema {path}: no reply can follow it: {problem}")
    return schema


def prompt_text(positional: str | None, option: str | None) -> str:
    """The prompt from the argument, --prompt or stdin ("-", or neither with stdin piped),
    checked as Unicode; read before any model loads."""
    if positional is not None and option is not None:
        raise BadArgument("pass the prompt either as PROMPT or with --prompt, not both")
    name, text = ("PROMPT", positional) if positional is not None else ("--prompt", option)
    if text is None:
        if options.stdin_is_terminal():
            raise BadArgument(NO_PROMPT)
        text = "-"
    if text == "-":
        name, text = "stdin", options.read_stdin()
    if not text.strip():
        where = "stdin held nothing" if name == "stdin" else f"{name} is empty"
        raise BadArgument(f"no prompt: {where}; give the text to complete")
    return options.unicode_text(name, text)


def prompt_form(
    tokenizer, prompt: str, chat: bool | None, system: str | None = None
) -> str | list[dict[str, str]]:
    """The prompt as chat messages (template applied by the library; `system` first) or as
    raw text."""
    has_template = bool(getattr(tokenizer, "has_chat_template", False))
    if chat is None:
        chat = has_template
    if chat and not has_template:
        raise BadArgument("--chat: this tokenizer has no chat template; pass --raw")
    if system is not None and not chat:
        raise BadArgument(
            "--system/--system-prompt: this tokenizer has no chat template to put it in"
        )
    if not chat:
        return prompt
    head = [{"role": "system", "content": system}] if system is not None else []
    return [*head, {"role": "user", "content": prompt}]
