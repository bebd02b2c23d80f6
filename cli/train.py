"""`dflash-mlx train`: options -> `dflash_mlx.train.trainer` -> a rich progress bar and summary.

Nothing heavy is imported until the command runs.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
)

from dflash_mlx.errors import BadArgument

from . import train_dflash2, ui
from .paths import writable_folder
from .train_options import check_layer_ids, flag_message

MASK_NAMES = ("<|mask|>", "<mask>", "<|MASK|>", "[MASK]")


def default_mask_token(tokenizer) -> int:
    """A token the draft uses as MASK: a mask token if the vocabulary has one, else pad/eos."""
    vocab = tokenizer.get_vocab()
    for name in MASK_NAMES:
        if name in vocab:
            return vocab[name]
    for attr in ("pad_token_id", "eos_token_id"):
        value = getattr(tokenizer, attr, None)
        if isinstance(value, int):
            return value
    raise BadArgument("no mask token found in the tokenizer; pass --mask-token-id")


def check_data(data: Path, regenerate: bool) -> None:
    """Refuse `--data` that cannot train anything, before any model loads: missing, a
    folder without JSONL files, unreadable or not UTF-8, or without one line that could be
    an example (a JSON object with "text", "messages", or "prompt" with --regenerate).
    Lines are read up to the first such one; the rest are checked when tokenized."""
    if not data.exists():
        raise BadArgument(f"--data {data}: no such file or folder")
    files = sorted(data.glob("*.jsonl")) if data.is_dir() else [data]
    if not files:
        raise BadArgument(f"--data {data}: the folder holds no .jsonl file")
    keys = ("text", "messages", "prompt") if regenerate else ("text", "messages")
    lines = 0
    for f in files:
        try:
            with open(f, encoding="utf-8") as fh:
                for line in fh:
                    if not line.strip():
                        continue
                    lines += 1
                    try:
                        obj = json.loads(line)
                    except ValueError:
                        continue
                    if isinstance(obj, dict) and any(obj.get(k) for k in keys):
                        return
        except (OSError, UnicodeDecodeError) as e:
            raise BadArgument(f"--data {f}: cannot be read ({e})") from None
    if not lines:
        raise BadArgument(f"--data {data}: empty (no JSONL lines)")
    wanted = ", ".join(f'"{k}"' for k in keys)
    hint = "" if regenerate else ' ({"prompt"} lines need --regenerate)'
    raise BadArgument(
        f"--data {data}: none of its {lines} lines is a JSON object with {wanted}{hint}"
    )


def run(
    *,
    target: str,
    notes: list[str] = (),
    data: Path,
    out: Path,
    layers: int,
    block_size: int,
    target_layer_ids: str | None,
    mask_token_id: int | None,
    regenerate: bool,
    regen_tokens: int,
    resume: bool,
    force: bool,
    settings: dict,
    long_context: str | None = None,
    long_windows: int = 64,
    init: str | None = None,
    dflash2: bool = False,
    upgrade_from: str | None = None,
    continuations: int | None = None,
) -> None:
    # Before anything heavy loads: the numbers, where the draft goes, and data that can be
    # used at all.
    if layers < 1:
        raise BadArgument(f"--layers {layers} must be >= 1")
    if target_layer_ids is not None:
        check_layer_ids(target_layer_ids, 1 << 30)  # the form now, the range once it loads
    from dflash_mlx.train.trainer import TrainSettings

    try:
        TrainSettings(**settings)
    except ValueError as e:
        raise BadArgument(flag_message(str(e))) from None
    writable_folder(out, "--out")
    if out.exists() and any(out.iterdir()) and not (resume or force):
        raise BadArgument(f"output folder {out} is not empty; pass --resume or --force")
    if resume and not (out / "config.json").is_file():
        raise BadArgument(f"--resume: {out} holds no draft to resume (no config.json)")
    check_data(data, regenerate)
    if continuations is not None and continuations < 1:
        raise BadArgument(f"--continuations {continuations} must be >= 1")
    lengths = None
    if long_context is not None:  # before anything loads
        from dflash_mlx.train.long_context import parse_lengths

        lengths = parse_lengths(long_context)
        if long_windows < 1:
            raise BadArgument(f"--long-windows {long_windows} must be >= 1")
        settings = {**settings, "seq_len": max(settings["seq_len"], lengths[-1] + regen_tokens)}
    if init is not None and resume:
        raise BadArgument("pass either --init (a draft to start from) or --resume, not both")
    dflash2 = train_dflash2.check_options(
        dflash2=dflash2, upgrade_from=upgrade_from, init=init, resume=resume
    )
    for line in notes:  # the old names used, said once nothing above refused
        ui.note(f"note: {line}")
    import dflash_mlx
    from dflash_mlx.models.config import DraftConfig
    from dflash_mlx.models.draft import DFlashDraft
    from dflash_mlx.train.data import Growth, TargetWriter, auto_per_prompt, split_held
    from dflash_mlx.train.trainer import (
        TrainSettings,
        draft_config_for,
        init_draft,
        read_examples,
        train,
    )

    st = TrainSettings(**settings)
    with ui.loading("target", target):
        model, tokenizer = dflash_mlx.load(target)
    if target_layer_ids is not None and not (resume or init or upgrade_from):
        check_layer_ids(target_layer_ids, dflash_mlx.Pair(model).target.num_layers)
    regen = per_prompt = None
    if regenerate:
        regen = TargetWriter(model, tokenizer, regen_tokens, Growth(continuations, seed=st.seed))
        per_prompt = continuations or (lambda n: auto_per_prompt(n, st.steps, st.batch))
    what = "training data (the target writes the replies)" if regenerate else "training data"
    depth = None
    if lengths is not None:
        from dflash_mlx.train import long_context as lc

        what = f"long windows of the training data ({long_context} tokens; the target continues)"
        with ui.loading(what, str(data)):
            windows, depth = lc.cut_windows(
                lc.file_tokens(data, tokenizer, lengths[-1] + regen_tokens),
                lengths,
                long_windows,
                regen_tokens,
                st.seed,
            )
            examples = lc.long_examples(windows, _regenerator(model, tokenizer, regen_tokens))
            skipped = []
    else:
        with ui.loading(what, str(data)):
            examples, skipped = read_examples(
                data,
                tokenizer,
                seq_len=st.seq_len,
                regenerate=regen,
                reply_room=min(regen_tokens, st.seq_len // 2) if regenerate else 0,
                per_prompt=per_prompt or 1,
                branches=regen.branches if regen else None,
                seed=st.seed,
            )
    for line in skipped[:20]:
        ui.note(line)
    if len(skipped) > 20:
        ui.note(f"… and {len(skipped) - 20} more skipped lines")
    held_examples = None
    if depth:  # whole files held out: their windows
        held = [w for _, w in depth]
    else:
        examples, held_examples = split_held(examples, st.eval_prompts, st.seed)
        held = [e.tokens[: e.start or 16] for e in held_examples]

    if resume:
        config = json.loads((out / "config.json").read_text())
        pair = dflash_mlx.Pair(model, DFlashDraft(DraftConfig.from_dict(config)))
    elif upgrade_from is not None:
        with ui.loading("DFlash 1 draft to upgrade", upgrade_from):
            start = dflash_mlx.load_draft(upgrade_from)
        pair, config = train_dflash2.upgraded(model, start, st.seed)
        layers = start.config.num_hidden_layers
    elif init is not None:
        with ui.loading("draft to fine-tune", init):
            start = dflash_mlx.load_draft(init)
        pair = dflash_mlx.Pair(model, start)  # checks that it fits the target
        config = json.loads(json.dumps(start.config.raw))
        layers = start.config.num_hidden_layers
    else:
        ids = check_layer_ids(target_layer_ids, dflash_mlx.Pair(model).target.num_layers)
        mask = default_mask_token(tokenizer) if mask_token_id is None else mask_token_id
        config = draft_config_for(
            model, layers=layers, block_size=block_size, target_layer_ids=ids, mask_token_id=mask
        )
        pair = init_draft(model, config, seed=st.seed)
        if dflash2:  # the DFlash 1 start, with neutral conv and selector
            pair, config = train_dflash2.upgraded(model, pair.draft, st.seed)
    # The longest context a block saw: the default draft window (SPEC-like, long-context.md).
    trained = config["dflash_config"].get("training_context") or 0
    config["dflash_config"]["training_context"] = max(trained, st.seq_len)
    console = Console(stderr=True)
    before = None
    if depth:
        before = lc.tau_at_depth(pair, tokenizer, depth, st.eval_tokens)
    kind = "DFlash 2 " if pair.draft.config.is_dflash2 else ""
    console.print(
        f"training a {layers}-layer {kind}draft (block {config['dflash_config']['block_size']}, "
        f"target layers {config['dflash_config']['target_layer_ids']}) on "
        f"{len(examples)} sequences; {len(held)} held out for τ",
        style="dim",
    )
    begin = _resumed_step(out) if resume else 0
    with TrainProgress(
        console, st.steps, start=begin, eval_every=st.eval_every if held else None,
        save_every=st.save_every,
    ) as progress:  # fmt: skip
        log = train(
            pair,
            tokenizer,
            config,
            examples,
            st,
            out,
            held_out=held,
            held_examples=held_examples,
            resume=resume,
            progress=progress,
            loss_fn=train_dflash2.loss_for(pair.draft),
        )
    if depth:
        pair.draft.config.training_context = config["dflash_config"]["training_context"]
        after = lc.tau_at_depth(pair, tokenizer, depth, st.eval_tokens)
        (out / "long_context.json").write_text(
            json.dumps({"lengths": lengths, "tau_before": before, "tau_after": after}, indent=1)
        )
        console.print(
            "held-out τ at depth, before → after: "
            + " · ".join(f"{n} tokens {before[n]:.2f} → {after[n]:.2f}" for n in after),
            style="cyan",
        )
    last = log.steps[-1] if log.steps else {}
    console.print(
        f"saved {out} · final loss {last.get('loss', float('nan')):.3f}"
        + f" · log {out / 'training_log.json'}",
        style="green",
    )
    if log.evals:
        width = config["dflash_config"]["block_size"]
        console.print(
            f"held-out τ at W={width} (the width it was trained for): "
            f"{log.evals[-1]['tau']:.2f} on {len(held)} held-out prompts",
            style="bold cyan",
            soft_wrap=True,
        )
    if log.verdict:
        console.print(f"verdict: {log.verdict}", style="cyan", soft_wrap=True)


def _resumed_step(out: Path) -> int:
    try:
        return int(json.loads((out / "training_state" / "state.json").read_text())["step"])
    except (OSError, ValueError, KeyError):
        return 0


class TrainProgress:
    """`progress(entry)` of `dflash_mlx.train.trainer.train`: in a terminal a bar naming the phase
    (the target reading the data, training, held-out τ check, saving a checkpoint) with loss,
    speed, τ, elapsed time and the time left; on a pipe or in a log, plain lines: each phase
    change, and about every 5% of the steps, each with the time left.

    The time left is what is left of each kind of work at the speed it went so far: the
    steps to go at the median time of the recent steps, plus the held-out τ checks and
    checkpoints still to come at the time the last one took (none yet: not counted, and the
    line says so), not the elapsed time spread over the steps (which counted the one-off
    phases as if every step paid them)."""

    LINES = 20

    def __init__(
        self,
        console: Console,
        steps: int,
        start: int = 0,
        *,
        eval_every: int | None = None,
        save_every: int | None = None,
        clock=time.perf_counter,
    ):
        self.console, self.steps, self.start = console, steps, start
        self.eval_every, self.save_every = eval_every, save_every
        self.clock = clock
        self.tau = "–"
        self.phase = "training"
        self._tic = clock()
        self._since = self._tic  # when the current phase began
        self._step_s: list[float] = []
        self._phase_s: dict[str, float] = {}  # the last duration of each one-off phase
        self._bar: Progress | None = None
        self._task = None

    def __enter__(self) -> TrainProgress:
        if self.console.is_terminal:
            self._bar = Progress(
                TextColumn("train"),
                BarColumn(),
                MofNCompleteColumn(),
                TextColumn("{task.description}"),
                TextColumn("{task.fields[figures]}"),
                TimeElapsedColumn(),
                TextColumn("· {task.fields[left]}"),
                console=self.console,
            )
            self._bar.start()
            self._task = self._bar.add_task(
                "training",
                total=self.steps,
                completed=self.start,
                figures=self.figures(float("nan"), 0.0),
                left="left: –",
            )
        else:
            self.console.print(f"train: {self.steps - self.start} steps to go", style="dim")
        return self

    def __exit__(self, *exc) -> None:
        if self._bar is not None:
            self._bar.stop()

    def _to_come(self, step: int, every: int | None) -> int:
        """How many of a phase run after `step` (every `every` steps, and after the last)."""
        if not every or step >= self.steps:
            return 0
        return (self.steps // every - step // every) + (self.steps % every != 0)

    def figures(self, loss: float, tps: float) -> str:
        """The bar's loss, speed and τ; none before the first step (the target reading the
        data: no loss yet, not `loss nan`)."""
        if loss != loss:  # NaN: no step has run
            return "no step yet"
        return f"loss {loss:.3f} · {tps:.0f} tok/s · τ {self.tau}"

    def left(self, step: int) -> str:
        """The time left: the steps to go at the recent steps' median time, plus the held-out
        checks and checkpoints to come at what the last of each took, plus what is left of
        the one running now (the final check too: never `~0 s` while it runs)."""
        if not self._step_s:
            return "left: –"
        recent = sorted(self._step_s[-20:])
        seconds = recent[len(recent) // 2] * (self.steps - step)
        unknown = False
        for phase, every in (
            ("held-out τ check", self.eval_every),
            ("saving a checkpoint", self.save_every),
        ):
            n = self._to_come(step, every)
            if n and phase in self._phase_s:
                seconds += n * self._phase_s[phase]
            elif n:
                unknown = True
        if self.phase in ("held-out τ check", "saving a checkpoint"):  # running now
            took = self._phase_s.get(self.phase)
            if took is not None:
                seconds += max(0.0, took - (self.clock() - self._since))
            elif step >= self.steps:  # the last one, never timed: no figure to give
                return f"left: the final {self.phase.split()[-1]}, not timed yet"
            else:
                unknown = True
        return f"left ~{_clock(seconds)}" + (" + checks" if unknown else "")

    def __call__(self, entry: dict) -> None:
        phase = entry.get("phase", "training")
        now = self.clock()
        if phase != self.phase and self.phase != "training":
            self._phase_s[self.phase] = now - self._since  # the one-off phase just ended
        if phase == "training" and entry.get("step_s"):
            self._step_s.append(entry["step_s"])
        if "tau" in entry and phase == "training":
            self.tau = f"{entry['tau']:.2f}"
            self.console.print(f"step {entry['step']}: held-out τ {self.tau}", style="cyan")
        step = entry["step"]
        changed = phase != self.phase
        if changed:
            self._since = now
        self.phase = phase
        loss = entry.get("loss", float("nan"))
        if self._bar is not None:
            self._bar.update(
                self._task,
                completed=step,
                description=phase if phase != "training" else "",
                figures=self.figures(loss, entry.get("tokens_per_s", 0.0)),
                left=self.left(step),
            )
            return
        every = max(1, -(-self.steps // self.LINES))
        if (changed and phase != "training") or step % every == 0 or step == self.steps:
            elapsed = _clock(now - self._tic)
            said = f" · loss {loss:.3f}" if loss == loss else ""
            self.console.print(
                f"train: {step}/{self.steps} steps · {phase}{said} · {elapsed} · {self.left(step)}",
                soft_wrap=True,
                style="dim",
            )


def _clock(seconds: float) -> str:
    """`42 s`, `3 min 05 s`, `1 h 02 min`."""
    s = int(round(seconds))
    if s < 60:
        return f"{s} s"
    if s < 3600:
        return f"{s // 60} min {s % 60:02d} s"
    return f"{s // 3600} h {s % 3600 // 60:02d} min"


def _regenerator(model, tokenizer, max_tokens: int):
    """The target writes the responses (greedy, mlx-lm's batched decoding), as the paper's
    recipe does; the labels are the target's own next tokens anyway, computed in training."""
    from dflash_mlx.train.data import TargetWriter

    return TargetWriter(model, tokenizer, max_tokens).replies
