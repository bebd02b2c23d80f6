"""Issue 62: the habits of mlx_lm, ollama and llama.cpp users, met as they meet them (a
pseudo-terminal for what a terminal shows, the real command otherwise).

- mlx_lm's names: `--draft-model`, `--system-prompt` (and `generate` takes a system prompt);
  `train -m/--model` (`--target` its old name) and `--draft-block` (`--block-size` its old
  name there, while elsewhere it is the old name of `--verify-width`);
- usage errors (an unknown option, a value of the wrong type) are one `error:` line, not
  typer's boxed usage; errors come before notes; Ctrl-C in `generate` prints the stats of
  what it made;
- `ls` names a `--models-dir` model by the path `-m` loads; chat has ollama's `/show` and
  `/load`; serve logs one line per request; every command's help shows the default model;
- `train` shows no `loss nan` while the target reads the data and no `left ~0 s` during its
  final check.
"""

from __future__ import annotations

import io
import json
import os
import signal
import sys
from pathlib import Path

import httpx
import pytest

import dflash_mlx

from .test_cli_faults import run
from .test_cli_flags import chat_terminal, type_lines
from .test_cli_serve import dflash, exe, text
from .test_train import FakeClock

PROMPT = "def add(a, b):"
pty = pytest.mark.skipif(sys.platform == "win32", reason="pseudo-terminals are POSIX")


def terminal(*args: str, env: dict | None = None, timeout: int = 120) -> tuple[str, int]:
    """`dflash-mlx ARGS` in a pseudo-terminal to the end: what the terminal showed, the
    exit status."""
    pexpect = pytest.importorskip("pexpect")
    shown, status = pexpect.run(
        " ".join([exe()[0], *args]),
        timeout=timeout,
        withexitstatus=True,
        env={**os.environ, "COLUMNS": "100", "TERM": "xterm-256color", **(env or {})},
    )
    return shown.decode().replace("\r\n", "\n"), status


def plain(shown: str) -> str:
    """Terminal output without colour codes."""
    import re

    return re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", shown)


@pytest.fixture(scope="module")
def pair(models_dir) -> list[str]:
    return ["-m", str(models_dir / "qwen3"), "-d", str(models_dir / "draft")]


# -- usage errors, and errors before notes -------------------------------------------------


@pty
@pytest.mark.parametrize(
    "args, says",
    [
        (["generate", "--bogus"], "error: No such option: --bogus"),
        (["generate", "-n", "x"], "error: Invalid value for '--max-tokens' / '-n'"),
        (["train", "--data", "d.jsonl"], "error: Missing option '--out'"),
        (["nonsense"], "error: No such command 'nonsense'"),
    ],
)
def test_a_usage_error_is_one_error_line_in_a_terminal(args, says):
    shown, status = terminal(*args)
    lines = plain(shown).strip().splitlines()
    assert status == 2 and len(lines) == 1, shown
    assert lines[0].startswith(says) and "-h" in lines[0], lines
    assert "Usage:" not in shown and "╭" not in shown


@pty
def test_an_error_comes_before_any_note():
    """`generate --demo -n -5` printed the three-line demo note, then the error; an unknown
    Hub id printed the draft note first."""
    shown, status = terminal("generate", "--demo", "-n", "-5", "hi")
    assert status == 2 and plain(shown).strip() == "error: --max-tokens -5 must be an integer >= 1"
    shown, status = terminal(
        "generate", "-m", "nobody/no-such-model-62", "hi", env={"HF_HUB_OFFLINE": "1"}
    )
    said = [line for line in plain(shown).splitlines() if line.strip()]
    said = [line for line in said if "Loading target" not in line]  # the spinner
    assert status == 2 and said[0].startswith("error: could not fetch target"), said
    assert len(said) == 1, "a note came with the error"


# -- mlx_lm's names ---------------------------------------------------------------------


def test_draft_model_is_mlx_lms_name_of_draft(pair, models_dir):
    base = [*pair[:2], "--raw", "-n", "8", "--json", PROMPT]
    named = dflash("generate", *base, "--draft-model", str(models_dir / "draft"))
    short = dflash("generate", *base, "-d", str(models_dir / "draft"))
    assert named.returncode == 0, text(named)[1]
    got, want = json.loads(text(named)[0]), json.loads(text(short)[0])
    assert got["tokens"] == want["tokens"] and got["ran"]["draft"] == want["ran"]["draft"]
    assert got["ran"]["draft"] is not None, "the draft was used"


@pytest.mark.parametrize("flag", ["--system-prompt", "--system"])
def test_generate_takes_a_system_prompt(pair, target, draft, flag):
    done = dflash("generate", *pair, flag, "Answer in Python.", "-n", "8", "--json", PROMPT)
    assert done.returncode == 0, text(done)[1]
    data = json.loads(text(done)[0])
    model, tokenizer = target
    messages = [
        {"role": "system", "content": "Answer in Python."},
        {"role": "user", "content": PROMPT},
    ]
    want = dflash_mlx.generate(model, draft, tokenizer, messages, max_tokens=8, temperature=0)
    assert data["prompt_tokens"] == want.prompt_tokens and data["tokens"] == want.tokens
    raw = dflash("generate", *pair, flag, "x", "--raw", PROMPT)
    assert raw.returncode == 2 and "needs the chat template" in text(raw)[1]


def test_chat_takes_mlx_lms_system_prompt_too():
    import typer

    from dflash_mlx.cli.main import app

    chat = typer.main.get_command(app).commands["chat"]
    opts = {o for p in chat.params for o in p.opts}
    assert {"--system", "--system-prompt", "--draft", "--draft-model"} <= opts


# -- train: -m, --draft-block, and its user errors --------------------------------------


@pytest.fixture
def data(tmp_path) -> Path:
    from .test_train import CORPUS

    path = tmp_path / "t.jsonl"
    path.write_text("\n".join(json.dumps({"text": c}) for c in CORPUS[:6]) + "\n")
    return path


def test_train_takes_m_and_draft_block(models_dir, data, tmp_path):
    args = ["--data", str(data), "--steps", "1", "--batch", "2", "--seq-len", "48",
            "--eval-every", "1", "--save-every", "1"]  # fmt: skip
    done = run("train", "-m", str(models_dir / "qwen3"), *args, "--draft-block", "8",
               "--out", str(tmp_path / "new"))  # fmt: skip
    assert done.exit_code == 0, done.output
    assert "deprecated" not in done.stderr
    assert dflash_mlx.load_draft(tmp_path / "new").config.block_size == 8


def test_train_old_names_still_work_with_a_note():
    from dflash_mlx.cli.train_options import aliases
    from dflash_mlx.errors import BadArgument

    assert aliases("T", None, 8, None) == ("T", 8, [])
    target, block, notes = aliases(None, "T", None, 8)
    assert (target, block) == ("T", 8) and len(notes) == 2
    assert "--target is deprecated; use --model/-m" in notes[0]
    assert "--draft-block" in notes[1] and "--verify-width" in notes[1]
    assert aliases("T", None, None, None)[1] == 16
    for bad, says in [
        ((None, None, None, None), "missing option --model/-m"),
        (("A", "B", None, None), "--target B and --model A disagree"),
        (("T", None, 8, 4), "--block-size 4 and --draft-block 8 disagree"),
    ]:
        with pytest.raises(BadArgument, match=says):
            aliases(*bad)


# -- ls and -m ------------------------------------------------------------------------


def test_the_name_ls_prints_is_one_m_loads(tmp_path, models_dir, monkeypatch):
    import shutil

    monkeypatch.chdir(tmp_path)
    shutil.copytree(models_dir / "qwen3", tmp_path / "models" / "pair-target")
    env = {"HF_HUB_CACHE": str(tmp_path / "hub"), "HF_HUB_OFFLINE": "1"}
    done = dflash("ls", "--json", "--models-dir", "models", env=env)
    (name,) = [m["name"] for m in json.loads(text(done)[0])]
    assert name == "models/pair-target"
    done = dflash("generate", "-m", name, "--no-draft", "--raw", "-n", "2", PROMPT, env=env)
    assert done.returncode == 0, text(done)[1]
    rm = dflash("rm", "pair-target", "--models-dir", "models", "--yes", env=env)  # old name too
    assert rm.returncode == 0 and not (tmp_path / "models" / "pair-target").exists()


# -- Ctrl-C in generate ----------------------------------------------------------------


@pty
@pytest.mark.slow  # the demo pair streaming in a pseudo-terminal
def test_ctrl_c_in_generate_prints_the_stats_of_what_it_made():
    pexpect = pytest.importorskip("pexpect")
    child = pexpect.spawn(
        exe()[0],
        ["generate", "--demo", "--raw", "-n", "100000", "--verify-width", "4", "class Stack:"],
        env={**os.environ, "TERM": "xterm-256color"},
        encoding="utf-8",
        timeout=120,
        dimensions=(30, 160),
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    try:
        child.expect("Loading draft")
        child.expect(r"\x1b\[\?25h")  # the spinner gone: the reply streams next
        child.expect(r"[\s\S]{300}")  # some of it streamed
        child.sendintr()
        child.expect(r"(\d+) tokens? · .*interrupted")
        made = int(child.match.group(1))
        child.expect(pexpect.EOF)
    finally:
        child.close()
    assert child.exitstatus == 130 and made > 0, child.before


# -- train's progress in a terminal ----------------------------------------------------


def test_train_progress_shows_no_nan_loss_and_never_zero_left_in_the_final_check():
    from rich.console import Console

    from dflash_mlx.cli.train import TrainProgress
    from dflash_mlx.train.trainer import FEATURES, HELD_OUT, SAVING, TRAINING

    clock, buf = FakeClock(), io.StringIO()
    console = Console(file=buf, force_terminal=True, width=200)
    p = TrainProgress(console, 4, eval_every=2, save_every=4, clock=clock)
    with p:
        p({"step": 0, "loss": float("nan"), "tokens_per_s": 0, "phase": FEATURES})
        assert p.figures(float("nan"), 0.0) == "no step yet"
        p._bar.refresh()
        assert "nan" not in buf.getvalue(), "loss nan while the target reads the data"
        clock.now += 85
        for step in range(1, 5):
            clock.now += 2
            entry = {"step": step, "loss": 1.0, "tokens_per_s": 1, "step_s": 2.0}
            if step == 4:  # the final check: the one at step 2 took 30 s
                p({**entry, "phase": HELD_OUT})
                clock.now += 10
                assert p.left(4) == "left ~20 s", p.left(4)
                clock.now += 20
                p({**entry, "phase": SAVING})
                assert p.left(4) == "left: the final checkpoint, not timed yet"
                clock.now += 5
            elif step == 2:
                p({**entry, "phase": HELD_OUT})
                clock.now += 30
            p({**entry, "phase": TRAINING})


# -- serve's log: one line per request -------------------------------------------------


def test_serve_logs_one_line_per_request():
    """A reply was logged twice: uvicorn's access line and the engine's `request
    completed` line. Now the engine's alone; a refusal keeps its access line (the engine
    never saw it), and other routes theirs."""
    from .test_cli_serve import serve

    body = {"messages": [{"role": "user", "content": "def"}], "max_tokens": 3}
    # A fixed width: no calibration at start (minutes on a busy machine).
    with serve("--demo", "--verify-width", "4") as server:
        server.post("/v1/chat/completions", body)
        bad = httpx.post(f"{server.base}/v1/chat/completions", json={"messages": []}, timeout=60)
        assert bad.status_code == 400
        httpx.get(f"{server.base}/v1/models", timeout=60)
    log = "".join(server.log)
    assert log.count("request completed: 3 tokens") == 1, log
    posts = [line for line in log.splitlines() if "POST /v1/chat/completions" in line]
    assert len(posts) == 1 and "400" in posts[0], posts
    assert "GET /v1/models" in log


# -- chat: ollama's /show and /load ----------------------------------------------------


@pty
@pytest.mark.slow  # the chat REPL in a pseudo-terminal
def test_chat_show_and_load_as_in_ollama(tmp_path, pair):
    pytest.importorskip("pexpect")
    saved = tmp_path / "before.json"
    messages = [
        {"role": "system", "content": "You write Python."},
        {"role": "user", "content": "def add(a, b):"},
        {"role": "assistant", "content": "    return a + b"},
    ]
    saved.write_text(json.dumps({"model": "x", "messages": messages}))
    (tmp_path / "bad.json").write_text('{"messages": [{"role": "robot"}]}')
    child = chat_terminal(
        tmp_path, *pair, "--max-tokens", "4", "--verify-width", "4", "--no-prompt-cache-dir",
        columns=200,
    )  # fmt: skip
    type_lines(
        child,
        [
            (f"/load {tmp_path / 'bad.json'}", r"error: .*bad\.json: not a conversation"),
            (f"/load {saved}", "loaded 3 messages"),
            ("/show", r"model .*qwen3 · draft .*draft · context \d+ tokens held.* · 2 messages"),
            ("/show system", "system prompt: You write Python."),
            ("/show settings", r"temp 0 · "),
            ("/show nonsense", r"error: /show nonsense: info, system or settings"),
            ("hello", r"4 tokens"),
            (f"/save {tmp_path / 'after.json'}", "saved 5 messages"),
        ],
    )
    after = json.loads((tmp_path / "after.json").read_text())["messages"]
    assert after[:3] == messages and after[3] == {"role": "user", "content": "hello"}


def test_every_command_shows_the_same_default_model_in_its_help():
    """The default target was shown by two commands' --help, not the other two."""
    from dflash_mlx.cli.options import DEFAULT_MODEL
    from dflash_mlx.models.registry import DEFAULT_TARGET

    assert DEFAULT_MODEL == DEFAULT_TARGET
    for command in ("generate", "chat", "serve", "bench"):
        out = text(dflash(command, "--help"))[0]
        assert f"[default: ({DEFAULT_TARGET})]" in " ".join(out.split()), command
