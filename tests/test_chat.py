"""`dflash-mlx chat` on the tiny session models: the REPL driven through its real line
editor (prompt_toolkit on a pipe), piped stdin, a pseudo-terminal, the conversation's
state reuse across turns, and the target -> draft registry."""

from __future__ import annotations

import io
import json
import os
import re
import signal
import sys
import time

import pytest
from rich.console import Console
from typer.testing import CliRunner

import dflash_mlx
from dflash_mlx.chat import session as chat_session
from dflash_mlx.chat.session import CHAT_DEFAULTS, ChatSession
from dflash_mlx.cli import chat_repl
from dflash_mlx.cli.chat_input import history_path, make_reader
from dflash_mlx.cli.chat_ui import ChatUI, ReplyView
from dflash_mlx.cli.main import app
from dflash_mlx.models.registry import DEFAULT_TARGET, base_name, find_draft

MAX_TOKENS = 6
SETTING_NAMES = chat_repl.SET_NAMES


@pytest.fixture
def session(pair, target) -> ChatSession:
    return ChatSession(pair, target[1], options=CHAT_DEFAULTS.replace(max_tokens=MAX_TOKENS))


def drive(session: ChatSession, *lines: str, tmp_path) -> tuple[str, str]:
    """Type `lines` into the REPL (Enter after each, then Ctrl-D); (replies, stats+notes)."""
    from prompt_toolkit.input import create_pipe_input
    from prompt_toolkit.output import DummyOutput

    out, err = io.StringIO(), io.StringIO()
    view = ChatUI(Console(file=out, width=200), Console(file=err, width=200))
    with create_pipe_input() as keys:
        keys.send_text("".join(line + "\r" for line in lines) + "\x04")
        read = make_reader(
            commands={name: text for name, (_, text) in chat_repl.COMMANDS.items()},
            setting_names=SETTING_NAMES,
            history=tmp_path / "history",
            input=keys,
            output=DummyOutput(),
        )
        chat_repl.Repl(session, view, read).run()
    return out.getvalue(), err.getvalue()


def fresh(target, draft, messages, max_tokens=MAX_TOKENS):
    model, tok = target
    return dflash_mlx.generate(model, draft, tok, messages, max_tokens=max_tokens, temperature=0)


def cli(*args: str, input: str | None = None):
    return CliRunner().invoke(app, ["chat", *args], input=input)


# -- the REPL ---------------------------------------------------------------------------


def test_a_message_gets_a_streamed_reply_and_a_stats_line(session, target, draft, tmp_path):
    out, err = drive(session, "def add(a, b):", tmp_path=tmp_path)
    expected = fresh(target, draft, [{"role": "user", "content": "def add(a, b):"}])
    assert out == expected.text + "\n", "the reply is streamed to the output as it comes"
    stats = err.strip().splitlines()[-1]
    for part in (f"{MAX_TOKENS} tokens", "tok/s", "τ", "TTFT"):
        assert part in stats, f"stats line lacks {part!r}: {stats}"
    assert "prefill" not in stats and "W=" not in stats, "details only with -v or /stats"
    # The details, as /stats shows them:
    _, err = drive(session, "/stats", tmp_path=tmp_path)
    details = err[err.index("last reply") :].splitlines()[1]
    for part in (f"{MAX_TOKENS} tokens", "tok/s", "τ", "prefill", "TTFT", "peak"):
        assert part in details, f"detailed stats line lacks {part!r}: {details}"
    # What ran: the drafts' acceptance, trees (chosen per cycle), or (the width chooser
    # decoding plainly) no drafts.
    assert "accepted" in details or "trees" in details or "all plain" in details, details
    assert session.messages == [
        {"role": "user", "content": "def add(a, b):"},
        {"role": "assistant", "content": expected.text},
    ]


def test_system_sets_the_prompt_the_next_reply_sees(session, target, draft, tmp_path):
    _, err = drive(session, "/system You answer in code.", "/system", "hello", tmp_path=tmp_path)
    assert "system prompt: You answer in code." in err
    system = {"role": "system", "content": "You answer in code."}
    assert session.conversation()[0] == system
    expected = fresh(target, draft, [system, {"role": "user", "content": "hello"}])
    assert session.messages[-1]["content"] == expected.text
    drive(session, "/system none", tmp_path=tmp_path)
    assert session.system is None and session.conversation()[0]["role"] == "user"


def test_set_changes_the_settings_and_refuses_bad_values(session, tmp_path):
    _, err = drive(
        session,
        "/set temp 0.5",
        "/set top_p 0.9",
        "/set max_tokens 3",
        "/set block_size 4",
        "/set seed 7",
        "/set draft_window 64",
        "/set block_size 99",
        "/set temp hot",
        "/set draft_window 1",
        "/set nonsense 1",
        tmp_path=tmp_path,
    )
    assert session.options == CHAT_DEFAULTS.replace(
        temperature=0.5, top_p=0.9, max_tokens=3, verify_width=4, seed=7, draft_window=64
    )
    assert "error: verify_width 99 exceeds the draft's trained block size 16" in err
    assert "error: draft_window 1 must be an integer >= 2" in err
    assert "error: temperature 'hot' must be a number" in err
    assert "error: unknown setting 'nonsense'" in err
    drive(session, "/set verify_width auto", "a b c", tmp_path=tmp_path)
    assert session.options.verify_width is None
    assert session.last.stats.generation_tokens == 3, "/set max_tokens applies to the next reply"


def test_set_confirms_each_change_and_shows_every_setting(session, tmp_path):
    _, err = drive(
        session,
        "/set draft_window 64",
        "/set top_k 5",
        "/set min_p 0.1",
        "/set",
        "/help",
        tmp_path=tmp_path,
    )
    assert "draft_window set to 64" in err and "top_k set to 5" in err
    assert (
        "temp 0 · top_p 1 · top_k 5 · min_p 0.1 · max_tokens 6 · verify_width auto · "
        "tree auto · seed none · draft_window 64 · draft_sink auto · presence_penalty 0 · "
        "frequency_penalty 0 · repetition_penalty off · thinking shown"
    ) in " ".join(err.split())  # wrapped at the console's width
    help_text = err.split("thinking shown")[-1]
    for name in ("top_k", "min_p", "verify_width", "seed", "draft_window", "thinking"):
        assert name in help_text, f"/help does not list {name}"
    assert "tree (on, off or auto)" in " ".join(help_text.split())


def test_set_tree_takes_on_off_and_auto(session, tmp_path):
    """`/set tree on|off|auto` sets `GenerateOptions.tree` True, False or None (chosen);
    another word is refused naming the words, and changes nothing."""
    _, err = drive(session, "/set tree on", tmp_path=tmp_path)
    assert session.options.tree is True and "tree set to on" in err, err
    _, err = drive(session, "/set tree maybe", tmp_path=tmp_path)
    assert session.options.tree is True and "tree 'maybe': one of on, off or auto" in err, err
    drive(session, "/set tree off", tmp_path=tmp_path)
    assert session.options.tree is False
    drive(session, "/set tree auto", tmp_path=tmp_path)
    assert session.options.tree is None


def test_set_block_size_is_the_deprecated_name_of_verify_width(session, tmp_path):
    _, err = drive(session, "/set block_size 4", tmp_path=tmp_path)
    assert session.options.verify_width == 4
    assert "block_size is deprecated: use verify_width" in err
    assert "verify_width set to 4" in err


def test_set_refuses_a_verify_width_the_draft_cannot_hold(session, target, draft, tmp_path):
    _, err = drive(session, "/set verify_width 99", tmp_path=tmp_path)
    block = draft.config.block_size
    assert f"error: verify_width 99 exceeds the draft's trained block size {block}" in err
    assert session.options.verify_width is None, "a refused value changes nothing"
    alone = ChatSession(dflash_mlx.Pair(target[0]), target[1])
    _, err = drive(alone, "/set verify_width 2", "/set verify_width 1", tmp_path=tmp_path)
    assert "error: verify_width 2 exceeds 1 (no draft given)" in err
    assert alone.options.verify_width == 1


def test_one_pair_serves_the_session_so_its_width_policy_learns_across_turns(session):
    list(session.send("one"))
    (policy,) = session.pair.policies.values()
    list(session.send("two"))
    assert list(session.pair.policies.values()) == [policy], "the same policy, not a new one"
    assert session.totals.requests == 2 and session.totals.tau > 0


def test_retry_replaces_the_last_reply(session, tmp_path):
    _, err = drive(session, "/retry", "import os", "/retry", tmp_path=tmp_path)
    assert "error: nothing to retry yet" in err
    assert [m["role"] for m in session.messages] == ["user", "assistant"]
    assert session.totals.requests == 2, "the reply was generated twice"
    assert err.count(f"{MAX_TOKENS} tokens ·") == 2, "two stats lines: the reply and its retry"
    assert "at temperature 0 the reply comes out the same" in err


def test_retry_at_temperature_samples_a_new_reply(session, tmp_path):
    drive(session, "/set temp 1.5", "/set seed 3", "The quick", tmp_path=tmp_path)
    first = session.messages[-1]["content"]
    drive(session, "/retry", tmp_path=tmp_path)
    assert len(session.messages) == 2
    assert session.messages[-1]["content"] != first, "each reply samples with its own seed"


def test_save_writes_json_and_markdown(session, tmp_path):
    _, err = drive(
        session,
        "/system Be brief.",
        "for i in range(10):",
        f"/save {tmp_path / 'chat.json'}",
        f"/save {tmp_path / 'chat.md'}",
        f"/save {tmp_path / 'plain'}",
        f"/save {tmp_path / 'chat.txt'}",
        "/save",
        tmp_path=tmp_path,
    )
    data = json.loads((tmp_path / "chat.json").read_text())
    assert data["messages"] == session.conversation()
    assert [m["role"] for m in data["messages"]] == ["system", "user", "assistant"]
    assert data["settings"]["max_tokens"] == MAX_TOKENS
    assert data["replies"][0]["generation_tokens"] == MAX_TOKENS
    markdown = (tmp_path / "chat.md").read_text()
    for heading in ("## System", "## User", "## Assistant"):
        assert heading in markdown
    assert "for i in range(10):" in markdown
    assert json.loads((tmp_path / "plain.json").read_text()) == data, "no suffix: JSON"
    assert "error: chat.txt: save as .json or .md" in err
    assert "error: /save needs a file name" in err


def test_reset_starts_a_new_conversation_keeping_the_system_prompt(session, tmp_path):
    drive(session, "/system Be brief.", "hello", tmp_path=tmp_path)
    assert session.context_tokens > 0
    _, err = drive(session, "/reset", tmp_path=tmp_path)
    assert session.messages == [] and session.context_tokens == 0
    assert session.system == "Be brief."
    assert "new conversation" in err


def test_unknown_command_gets_help_not_a_crash(session, tmp_path):
    _, err = drive(session, "/bogus", "/help", "hello", tmp_path=tmp_path)
    assert "error: unknown command /bogus" in err
    for name in ("/reset", "/system", "/set", "/stats", "/save", "/retry", "/exit"):
        assert name in err
    assert len(session.messages) == 2, "the REPL kept going after the unknown command"


def test_double_slash_sends_a_message_beginning_with_a_slash(session, tmp_path):
    drive(session, "//usr/bin is a folder", tmp_path=tmp_path)
    assert session.messages[0]["content"] == "/usr/bin is a folder"


def test_exit_and_ctrl_d_leave(session, tmp_path):
    drive(session, "/exit", "never sent", tmp_path=tmp_path)
    assert session.messages == [], "/exit left before the next line"
    drive(session, "hello", tmp_path=tmp_path)  # drive() ends with Ctrl-D
    assert len(session.messages) == 2


def test_stats_shows_session_totals(session, tmp_path):
    _, err = drive(session, "one", "two", "/stats", tmp_path=tmp_path)
    assert "replies    2" in err
    assert f"{2 * MAX_TOKENS} tokens @" in err
    assert "reused" in err and "context" in err and "τ" in err
    before, _, after = err.partition("last reply")
    assert "prefill" not in before, "the stats line after a reply is the short one"
    assert "prefill" in after and "accepted" in after, "/stats shows the details"


def test_inputs_span_lines_and_are_remembered_across_sessions(session, tmp_path):
    from prompt_toolkit.input import create_pipe_input
    from prompt_toolkit.output import DummyOutput

    drive(session, "remember me", tmp_path=tmp_path)
    with create_pipe_input() as keys:
        keys.send_text("\x1b[A\r")  # Up, Enter
        keys.send_text("first line\x1b\rsecond line\r")  # Esc Enter adds a line
        read = make_reader(
            commands={"/exit": "leave"},
            setting_names=SETTING_NAMES,
            history=tmp_path / "history",
            input=keys,
            output=DummyOutput(),
        )
        assert read() == "remember me"
        assert read() == "first line\nsecond line"


def test_history_file_follows_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("DFLASH_MLX_HISTORY", str(tmp_path / "h"))
    assert history_path() == tmp_path / "h"
    monkeypatch.delenv("DFLASH_MLX_HISTORY")
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path))
    assert history_path() == tmp_path / "dflash-mlx" / "chat_history"


# -- state across turns -----------------------------------------------------------------


def test_second_turn_prefills_only_the_new_tokens_and_equals_a_fresh_conversation(
    session, target, draft
):
    model, tok = target
    first = [{"role": "user", "content": "The quick brown fox"}]
    reply1 = list(session.send(first[0]["content"]))
    ids1 = tok.apply_chat_template(first, add_generation_prompt=True)
    tokens1 = [t for r in reply1 for t in r.tokens]
    text1 = session.messages[-1]["content"]
    assert session.last.finish_reason == "length", "premise: no EOS in the history"
    assert tok.encode(text1, add_special_tokens=False) == tokens1, (
        "premise: the tiny target's reply re-tokenizes to itself; if the tiny models "
        "changed, pick another first message"
    )
    list(session.send("jumps over"))
    history = first + [
        {"role": "assistant", "content": text1},
        {"role": "user", "content": "jumps over"},
    ]
    ids2 = tok.apply_chat_template(history, add_generation_prompt=True)
    assert ids2[: len(ids1) + len(tokens1)] == ids1 + tokens1
    new = len(ids2) - len(ids1) - len(tokens1)
    stats = session.last.stats
    # The engine never feeds the last generated token, so it is prefilled with the new ones.
    assert stats.prefilled_tokens == new + 1, "turn 2 re-prefilled part of turn 1"
    assert stats.cached_tokens == len(ids1) + len(tokens1) - 1
    expected = fresh(target, draft, history)
    assert session.messages[-1]["content"] == expected.text
    assert session.replies[-1].stats.generation_tokens == len(expected.tokens)


def test_hybrid_target_keeps_its_history_and_stays_exact(models_dir, draft):
    model, tok = dflash_mlx.load(str(models_dir / "qwen35"))
    s = ChatSession(model, draft, tok, options=CHAT_DEFAULTS.replace(max_tokens=MAX_TOKENS))
    list(s.send("def add(a, b):"))
    first_prompt = s.last.stats.prompt_tokens
    list(s.send("print(i * i)"))
    assert s.last.stats.cached_tokens >= first_prompt - 1, "the history before the reply is kept"
    expected = fresh((model, tok), draft, s.conversation()[:-1])
    assert s.messages[-1]["content"] == expected.text


def test_ten_turns_prefill_only_what_the_previous_prompt_did_not_hold(session):
    prompts, prefilled = [], []
    for i in range(10):
        list(session.send(f"and then? {i}"))
        prompts.append(session.last.stats.prompt_tokens)
        prefilled.append(session.last.stats.prefilled_tokens)
    for n in range(1, 10):
        # New to turn n: the previous reply as the template renders it, and the new message.
        assert prefilled[n] <= prompts[n] - prompts[n - 1], (
            f"turn {n + 1} prefilled part of the history: {prefilled}, prompts {prompts}"
        )
    assert prompts[-1] > 4 * max(prefilled[1:]), "the history outgrew what a turn prefills"


def interrupt_after(n: int, monkeypatch):
    """Make the engine raise KeyboardInterrupt after `n` responses, as Ctrl-C does."""
    real = chat_session.stream_generate

    def stream(*args, **kwargs):
        responses = real(*args, **kwargs)
        try:
            for i, r in enumerate(responses):
                if i == n:
                    raise KeyboardInterrupt
                yield r
        finally:
            responses.close()

    monkeypatch.setattr(chat_session, "stream_generate", stream)


def test_ctrl_c_keeps_the_partial_reply_and_the_next_turn_stays_exact(
    session, target, draft, monkeypatch, tmp_path
):
    session.set("max_tokens", 40)
    session.set("verify_width", 1)  # one token per response: a predictable cut
    monkeypatch.setattr("dflash_mlx.engine.plain.STRETCH_TOKENS", 1)  # no plain stretches
    full = fresh(target, draft, [{"role": "user", "content": "import os"}], max_tokens=40)
    interrupt_after(5, monkeypatch)
    out, err = drive(session, "import os", tmp_path=tmp_path)
    monkeypatch.undo()
    partial = session.messages[-1]["content"]
    assert session.messages[-1]["role"] == "assistant"
    assert 0 < len(partial) < len(full.text) and full.text.startswith(partial)
    assert out == partial + "\n", "what was shown is what the conversation keeps"
    assert session.last.finish_reason == "interrupted" and "interrupted" in err
    session.set("max_tokens", MAX_TOKENS)
    _, err = drive(session, "print(1)", tmp_path=tmp_path)
    expected = fresh(target, draft, session.conversation()[:-1])
    assert session.messages[-1]["content"] == expected.text
    assert session.last.stats.cached_tokens > 0


def test_ctrl_c_before_the_first_token_drops_the_message(session, monkeypatch, tmp_path):
    interrupt_after(0, monkeypatch)
    _, err = drive(session, "hello", tmp_path=tmp_path)
    monkeypatch.undo()
    # The engine's state may stay cached (it is consistent, and reused only by prefix).
    assert session.messages == []
    assert "the message was not kept" in err
    drive(session, "hello", tmp_path=tmp_path)
    assert len(session.messages) == 2


def test_ctrl_c_inside_a_verify_pass_keeps_the_conversations_cache(
    session, target, draft, monkeypatch, tmp_path
):
    """A real SIGINT landing inside the engine (mid verify pass), as a user's Ctrl-C does:
    the reply stops at the next response, the tokens committed so far stay in the cache,
    and the next turn reuses the whole conversation."""
    # Python's own Ctrl-C handler, as in a terminal (a runner in the background, or a
    # worker process, may have SIGINT ignored).
    old = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        _ctrl_c_mid_pass(session, target, draft, monkeypatch, tmp_path)
    finally:
        signal.signal(signal.SIGINT, old)


def _ctrl_c_mid_pass(session, target, draft, monkeypatch, tmp_path):
    session.set("max_tokens", 40)
    drive(session, "import os", tmp_path=tmp_path)
    held = session.context_tokens
    assert held > 0
    engine = session.pair.target
    real, calls = engine.forward, []

    def forward(*args, **kwargs):
        calls.append(1)
        if len(calls) == 4:  # the prefill and a few cycles in: Ctrl-C mid-pass
            os.kill(os.getpid(), signal.SIGINT)
        return real(*args, **kwargs)

    monkeypatch.setattr(engine, "forward", forward)
    out, err = drive(session, "print(1)", tmp_path=tmp_path)
    monkeypatch.undo()
    assert session.last.finish_reason == "interrupted" and "interrupted" in err
    assert session.messages[-1]["role"] == "assistant", "the partial reply is kept"
    assert session.context_tokens > held, "the cache holds the conversation and the reply"
    drive(session, "x = 1", tmp_path=tmp_path)
    assert session.last.stats.cached_tokens > held, "the next turn reuses it all"
    expected = fresh(target, draft, session.conversation()[:-1], max_tokens=40)
    assert session.messages[-1]["content"] == expected.text


# -- the command ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def pair_args(models_dir) -> list[str]:
    return ["--model", str(models_dir / "qwen3"), "--draft", str(models_dir / "draft")]


def test_piped_stdin_is_answered_once(pair_args, target, draft):
    result = cli(*pair_args, "--max-tokens", str(MAX_TOKENS), input="def add(a, b):\n")
    assert result.exit_code == 0, result.output
    expected = fresh(target, draft, [{"role": "user", "content": "def add(a, b):"}])
    assert result.stdout == expected.text + "\n", "stdout holds the reply only"
    assert "τ" in result.stderr and f"{MAX_TOKENS} tokens" in result.stderr


def test_empty_stdin_is_an_error(pair_args):
    result = cli(*pair_args, input="")
    assert result.exit_code == 2 and "nothing on stdin" in result.stderr


def test_no_draft_says_it_runs_without_speculation(models_dir, target):
    args = ["--model", str(models_dir / "qwen3"), "--no-draft", "--max-tokens", "4"]
    result = cli(*args, input="hello")
    assert result.exit_code == 0, result.output
    assert "without speculation" in result.stderr and "no draft" in result.stderr
    assert (
        result.stdout == fresh(target, None, [{"role": "user", "content": "hello"}], 4).text + "\n"
    )


def test_draft_and_no_draft_together_are_refused(models_dir):
    result = cli("--model", str(models_dir / "qwen3"), "--draft", "d", "--no-draft", input="hi")
    assert result.exit_code == 2
    assert result.stderr.startswith("error: pass either --draft or --no-draft")


def test_bad_options_fail_before_anything_loads(models_dir):
    result = cli("--model", "org/not-downloaded", "--no-draft", "--temp", "-1")
    assert result.exit_code == 2 and "temp" in result.stderr
    result = cli("--demo", "--model", "x")
    assert result.exit_code == 2 and "--demo builds its own pair" in result.stderr
    result = cli("--draft", "x")
    assert result.exit_code == 2 and "--draft needs --model" in result.stderr


@pytest.mark.slow  # end to end: the trained demo pair, calibrated
def test_demo_works_offline_and_says_what_the_pair_is():
    from dflash_mlx.demo import NOTICE

    result = cli("--demo", "--max-tokens", "5", input="hello")
    assert result.exit_code == 0, result.output
    said = " ".join(result.stderr.split())
    assert "not a useful" in said and NOTICE in said
    assert "5 tokens" in result.stderr


@pytest.mark.slow  # end to end: the real command in a pseudo-terminal
@pytest.mark.skipif(sys.platform == "win32", reason="pseudo-terminals are POSIX")
def test_the_real_command_in_a_terminal(tmp_path):
    """Banner, prompt, a streamed reply stopped by a real Ctrl-C, the prompt again, /exit."""
    pexpect = pytest.importorskip("pexpect")
    env = {
        **os.environ,
        "DFLASH_MLX_HISTORY": str(tmp_path / "history"),
        "PROMPT_TOOLKIT_NO_CPR": "1",
        "TERM": "xterm-256color",
        "DFLASH_MLX_DEMO": "random",  # the random pair never stops by itself: room to Ctrl-C
    }
    exe = [sys.executable, "-c", "from dflash_mlx.cli.main import app; app()"]
    child = pexpect.spawn(
        exe[0],
        [*exe[1:], "chat", "--demo", "--max-tokens", "100000"],
        env=env,
        encoding="utf-8",
        codec_errors="replace",  # the tty echoes ^C wherever it lands, mid-character too
        timeout=60,
        dimensions=(30, 120),
        # A shell that runs the tests in the background has SIGINT ignored, and children
        # inherit that: give the command the default Ctrl-C a user's terminal gives it.
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    try:
        child.expect("RANDOM")
        child.expect("›")
        # Ctrl-C typed while the line editor still holds the terminal is read as input, not
        # sent as SIGINT: let the reply stream for a moment first. How long that takes
        # depends on the machine (the first request calibrates the pair), so the verdict
        # must not: a Ctrl-C that came too early (the message dropped before its reply
        # began or never sent, or the key read as input while the reply streams on) is
        # simply followed by another one, later.
        kept, dropped, read = "the reply so far is kept", "before the reply began", "/exit leaves"
        child.send("hello\r")
        child.expect("hello")
        for wait in (0.5, 1.0, 2.0, 4.0, 8.0, 16.0):
            time.sleep(wait)
            child.sendintr()
            got = child.expect([kept, dropped, read, pexpect.TIMEOUT], timeout=5)
            if got == 0:
                break
            if got in (1, 2):  # the message was dropped, or never sent: send it again
                child.expect("›")
                child.send("hello\r")
                child.expect("hello")
        else:
            raise AssertionError("no Ctrl-C stopped a streaming reply")
        child.expect("interrupted")  # the stats line says how the reply ended
        child.expect("›")
        child.send(f"/save {tmp_path / 'chat.json'}\r")
        child.expect("saved 2 messages")
        child.send("/exit\r")
        child.expect(pexpect.EOF)
    finally:
        child.close()
    assert child.exitstatus == 0, child.before
    saved = json.loads((tmp_path / "chat.json").read_text())
    assert saved["messages"][1]["role"] == "assistant" and saved["messages"][1]["content"]
    assert saved["replies"][0]["finish_reason"] == "interrupted"


@pytest.mark.slow  # end to end: the trained demo pair in a pseudo-terminal
@pytest.mark.skipif(sys.platform == "win32", reason="pseudo-terminals are POSIX")
def test_ctrl_c_in_a_terminal_keeps_the_conversation_for_the_next_turn(tmp_path):
    """A real Ctrl-C stops a streaming reply; /stats then shows the conversation still held,
    and the next turn reuses it instead of prefilling it all again (issue 41, item 2)."""
    pexpect = pytest.importorskip("pexpect")
    env = {
        **os.environ,
        "DFLASH_MLX_HISTORY": str(tmp_path / "history"),
        "PROMPT_TOOLKIT_NO_CPR": "1",
        "TERM": "xterm-256color",
    }
    exe = [sys.executable, "-c", "from dflash_mlx.cli.main import app; app()"]
    args = ["chat", "--demo", "--max-tokens", "100000", "--verify-width", "4"]
    child = pexpect.spawn(
        exe[0],
        [*exe[1:], *args, "--no-prompt-cache-dir"],  # what is reused is this conversation's
        env=env,
        encoding="utf-8",
        codec_errors="replace",
        timeout=60,
        dimensions=(30, 120),
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    gap = r"(?:\s|\x1b\[[0-9;]*m)+"  # spaces and the table's colour codes
    try:
        child.expect("›")
        child.send("class Stack:\r")
        child.expect("class Stack:")
        for wait in (1.0, 2.0, 4.0, 8.0):  # let the reply stream first (see above)
            time.sleep(wait)
            child.sendintr()
            if child.expect(["the reply so far is kept", pexpect.TIMEOUT], timeout=10) == 0:
                break
        else:
            raise AssertionError("no Ctrl-C stopped a streaming reply")
        child.expect("›")
        child.send("/stats\r")
        child.expect(rf"context{gap}([1-9][0-9]*) tokens held")
        held = int(child.match.group(1))
        child.expect("›")
        child.send("/set max_tokens 4\r")
        child.expect("›")
        child.send("def pop(self):\r")
        child.expect(r"\d+ tokens · .* · TTFT \d+ ms")
        child.expect("›")
        child.send("/stats\r")
        child.expect(rf"reused{gap}([0-9]+) prompt tokens")
        reused = int(child.match.group(1))
        child.expect("›")
        child.send("/exit\r")
        child.expect(pexpect.EOF)
    finally:
        child.close()
    # What can be reused: the held tokens up to where the kept reply, rendered again as the
    # conversation's text, tokenizes otherwise (a model's tokens need not be the canonical
    # ones: here from the reply's 89th token on), less the few tokens the streaming
    # detokenizer had not shown yet when Ctrl-C came. Worked out on the same greedy reply.
    reusable = min(held, _rerendered_prefix("class Stack:", held + 50)) - 8
    assert reused >= reusable > 20, f"the second turn reused {reused} of the {held} tokens held"


def _rerendered_prefix(user: str, tokens: int) -> int:
    """How many tokens of the demo pair's first turn (its prompt and a greedy reply of
    `tokens`, W = 4) the conversation rendered again with that reply shares with them."""
    import dflash_mlx
    from dflash_mlx.chat.session import ChatSession
    from dflash_mlx.demo import demo_pair

    t, d = demo_pair()
    model, tok = dflash_mlx.load(str(t))
    pair = dflash_mlx.Pair(model, dflash_mlx.load_draft(str(d)))
    opts = dflash_mlx.GenerateOptions(max_tokens=tokens, verify_width=4)
    chat = ChatSession(pair, tok, options=opts)
    generated = [t for r in chat.send(user) for t in r.tokens]
    reply = chat.messages.pop()
    first = chat._render()  # the first turn's prompt
    chat.messages.append(reply)
    again = chat._render()
    held = first + generated
    n = 0
    while n < min(len(held), len(again)) and held[n] == again[n]:
        n += 1
    return n


# -- rendering ------------------------------------------------------------------------

REPLY = ["<thi", "nk>weigh it", " up\n</th", "ink>\n\nUse **this**:\n\n```python\nx = 1\n```\n"]


def render(chunks, *, terminal: bool, hide: bool) -> str:
    out = io.StringIO()
    view = ReplyView(
        Console(file=out, width=60, force_terminal=terminal, color_system="truecolor"),
        hide_thinking=hide,
    )
    for chunk in chunks:
        view.feed(chunk)
    view.close()
    return out.getvalue()


def test_plain_output_is_the_reply_as_streamed_or_without_its_thinking():
    assert render(REPLY, terminal=False, hide=False) == "".join(REPLY)
    assert render(REPLY, terminal=False, hide=True) == "Use **this**:\n\n```python\nx = 1\n```\n"


def test_terminal_output_is_markdown_with_thinking_dimmed_or_collapsed():
    shown = render(REPLY, terminal=True, hide=False)
    assert "weigh it up" in shown and "\x1b[2;3m" in shown, "thinking is dim italic"
    assert "**" not in shown and "```" not in shown, "Markdown is rendered, not echoed"
    assert "this" in shown and "x" in shown
    hidden = render(REPLY, terminal=True, hide=True)
    assert "weigh it up" not in hidden and "thought for" in hidden and "3 words" in hidden


def test_a_reply_inside_an_open_think_block_is_thinking_until_it_closes():
    out = io.StringIO()
    view = ReplyView(Console(file=out, width=60, force_terminal=False), hide_thinking=True)
    view.begin_thinking()  # the prompt ended with <think>
    for chunk in ["still thinking", "</think>", "\n\nAnswer."]:
        view.feed(chunk)
    view.close()
    assert out.getvalue() == "Answer.\n"


CODE_REPLY = (
    "Here it is:\n\nclass Vec:\n    def __init__(self, other):\n        self.x = other.x\n"
    "        return None\n\n    def __add__(self, o):\n        return Vec(o)\n\n"
    "The __init__ method copies snake_case fields.\nOne line each.\n"
)
ANSI_CODES = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")


def screen(chunks, *, markdown: bool = True, width: int = 60) -> list[str]:
    """What a terminal shows of a reply streamed in `chunks`: its lines, without colours
    and trailing blanks."""
    out = io.StringIO()
    view = ReplyView(
        Console(file=out, width=width, force_terminal=True, color_system="truecolor"),
        markdown=markdown,
    )
    for chunk in chunks:
        view.feed(chunk)
    view.close()
    return [line.rstrip() for line in ANSI_CODES.sub("", out.getvalue()).splitlines()]


@pytest.mark.parametrize("step", [1, 7, len(CODE_REPLY)])
def test_code_in_a_markdown_reply_is_shown_exactly_as_written(step):
    """Dunders are not bold, lines are not joined, indentation is kept: streamed in pieces
    of any size, the code's lines appear on screen as written (inside a code panel)."""
    chunks = [CODE_REPLY[i : i + step] for i in range(0, len(CODE_REPLY), step)]
    shown = screen(chunks)
    code = CODE_REPLY.split("\n\n")[1:3]
    lines = [line for block in code for line in block.splitlines()]
    found = [next((s for s in shown if s.strip() == line.strip()), None) for line in lines]
    assert None not in found, (lines, shown)
    indent = [
        len(f) - len(f.lstrip()) - (len(line) - len(line.lstrip())) for f, line in zip(found, lines)
    ]
    assert len(set(indent)) == 1, f"indentation kept: {found}"
    assert "The __init__ method copies snake_case fields." in shown, "prose keeps underscores"
    assert "One line each." in shown, "and its line breaks"


def test_plain_mode_shows_the_reply_as_written_in_a_terminal():
    shown = screen([CODE_REPLY], markdown=False)
    assert "\n".join(shown) + "\n" == CODE_REPLY


def test_set_markdown_off_and_on(session, tmp_path, monkeypatch):
    _, err = drive(session, "/set markdown off", "/set", "/set markdown maybe", tmp_path=tmp_path)
    assert "markdown set to off (plain text)" in err and "markdown off" in err
    assert "error: /set markdown 'maybe': on or off" in err


def test_plain_flag_is_offered_and_refuses_nothing(pair_args):
    result = cli(*pair_args, "--plain", "--max-tokens", str(MAX_TOKENS), input="hi\n")
    assert result.exit_code == 0, result.output
    assert "--plain" in cli("-h").stdout


# -- the registry -----------------------------------------------------------------------


@pytest.mark.parametrize(
    "model, draft",
    [
        ("Qwen/Qwen3-4B", "z-lab/Qwen3-4B-DFlash-b16"),
        ("Qwen/Qwen3-8B", "z-lab/Qwen3-8B-DFlash-b16"),
        ("meta-llama/Llama-3.1-8B-Instruct", "z-lab/LLaMA3.1-8B-Instruct-DFlash-UltraChat"),
        ("Qwen/Qwen3.5-9B", "z-lab/Qwen3.5-9B-DFlash"),
        ("Qwen/Qwen3.6-35B-A3B", "z-lab/Qwen3.6-35B-A3B-DFlash"),
        ("openai/gpt-oss-20b", "z-lab/gpt-oss-20b-DFlash"),
        ("Qwen/Qwen3-Coder-30B-A3B-Instruct", "z-lab/Qwen3-Coder-30B-A3B-DFlash"),
    ],
)
def test_registry_finds_drafts_by_exact_id(model, draft):
    assert find_draft(model).draft == draft


@pytest.mark.parametrize(
    "model, draft",
    [
        ("mlx-community/Qwen3-4B-4bit", "z-lab/Qwen3-4B-DFlash-b16"),
        ("mlx-community/Qwen3-4B-4bit-DWQ-053125", "z-lab/Qwen3-4B-DFlash-b16"),
        ("Qwen/Qwen3-8B-MLX-8bit", "z-lab/Qwen3-8B-DFlash-b16"),
        (
            "mlx-community/Meta-Llama-3.1-8B-Instruct-4bit",
            "z-lab/LLaMA3.1-8B-Instruct-DFlash-UltraChat",
        ),
        ("lmstudio-community/Qwen3.5-4B-MLX-8-bit", "z-lab/Qwen3.5-4B-DFlash"),
        ("mlx-community/gpt-oss-120b-MXFP4-Q8", "z-lab/gpt-oss-120b-DFlash"),
        ("~/models/Qwen3-4B-bf16/", "z-lab/Qwen3-4B-DFlash-b16"),
        (
            "/Users/me/.cache/huggingface/hub/models--mlx-community--Qwen3-8B-6bit/snapshots/0ab",
            "z-lab/Qwen3-8B-DFlash-b16",
        ),
    ],
)
def test_registry_matches_quantized_community_conversions(model, draft):
    assert find_draft(model).draft == draft, base_name(model)


@pytest.mark.parametrize(
    "model",
    [
        "mlx-community/Qwen3-4B-Instruct-2507-4bit",  # another model than Qwen3-4B
        "mlx-community/Qwen3-14B-4bit",
        "mlx-community/Llama-3.2-3B-Instruct-4bit",
        "some/folder",
        "",
    ],
)
def test_registry_knows_no_draft_for_other_models(model):
    assert find_draft(model) is None


def test_default_target_has_a_published_draft_trained_without_thinking():
    entry = find_draft(DEFAULT_TARGET)
    assert entry.draft == "z-lab/Qwen3-4B-DFlash-b16"
    assert entry.template_kwargs == {"enable_thinking": False}
